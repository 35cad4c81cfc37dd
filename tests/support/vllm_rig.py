"""vLLM's real offloading classes on CPU, driven as its scheduler drives them: an OffloadingConfig built by
hand, TieringOffloadingSpec / TieringOffloadingManager / SharedOffloadRegion, secondary tiers built by vLLM's
own SecondaryTierFactory (HicachedTier through module_path, vLLM's fs tier as the oracle).

The one stand-in is the GPU worker's copy: vLLM's worker (spec.get_worker) needs CUDA, so `Engine.store`
writes the rows that prepare_store assigned, and `Engine.load` reads the rows that prepare_load names,
through a worker-side SharedOffloadRegion of the same file (rank 0), as the worker's swap_blocks would."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

MODULE = "hicached.engine.vllm"


def hicached_tier(socket: str, **extra: Any) -> dict[str, Any]:
    return {"type": "HicachedTier", "module_path": MODULE, "socket": socket, "reconnect_s": 0.05, **extra}


def fs_tier(root: str) -> dict[str, Any]:
    return {"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}


def offloading_config(
    engine_id: str,
    tiers: list[dict[str, Any]],
    *,
    chunks: int = 64,
    worker_bytes: int = 64 * 1024,
    world_size: int = 1,
    model: str = "org/model-x",
    dtype: str = "bfloat16",
    tokens: int = 16,
    groups: int = 1,
    events: bool = False,
) -> OffloadingConfig:
    row = worker_bytes * world_size
    aligned = -(-row // 4096) * 4096
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=tokens, layer_names=(f"layers.{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * aligned, "secondary_tiers": [dict(t) for t in tiers]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def chain_keys(seed: str, n: int, group: int = 0, hash_len: int = 32) -> list[bytes]:
    """OffloadKeys of a prefix of n blocks, each hash chained on the one before (as vLLM's block hashes)."""
    keys, parent = [], seed.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()[:hash_len]
        keys.append(make_offload_key(parent, group))
    return keys


def prefix_lookup(manager: Any, keys: Sequence[bytes], ctx: ReqContext) -> int | None:
    """As vLLM's scheduler looks a request up (OffloadingConnectorScheduler._maximal_prefix_lookup): every
    key until a miss, so that the tiers start every lookup at once; the leading hits once none is pending
    (None while a key is RETRY or HIT_PENDING: the request waits for a later step)."""
    hits, deferred = 0, False
    for key in keys:
        result = manager.lookup(key, ctx)
        if result is LookupResult.MISS:
            break
        hits += result in (LookupResult.HIT, LookupResult.HIT_PENDING)
        deferred |= result in (LookupResult.RETRY, LookupResult.HIT_PENDING)
    return None if deferred else hits


def row_bytes_of(key: bytes, nbytes: int) -> bytes:
    """The bytes a block's row holds: the same for a key wherever it is computed."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class Engine:
    """One engine's scheduler-side offloading, with the GPU worker's copy played by the test."""

    def __init__(self, engine_id: str, tiers: list[dict[str, Any]], **config: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(engine_id, tiers, **config))
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0] if self.manager.secondary_tiers else None
        self.worker = SharedOffloadRegion(
            engine_id=engine_id,
            num_chunks=self.spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=self.spec.kv_bytes_per_chunk,
            cpu_page_size=self.spec.cpu_page_size_per_worker,
        )
        self.row = self.spec.kv_bytes_per_chunk
        self.rows = self.worker.base_tensor.view(self.spec.num_chunks, self.row).numpy().view(np.uint8)
        self.tier_answers: dict[bytes, list[LookupResult]] = {}
        self.tier_times: dict[bytes, list[float]] = {}  # time.monotonic() of each answer in tier_answers
        self.step_starts: list[float] = []  # time.monotonic() of each step of paced_lookups
        self.job_results: list[JobResult] = []
        if self.tier is not None:
            self._spy_on_tier_lookups()
        self._closed = False

    def _spy_on_tier_lookups(self) -> None:
        # Records what the tier itself answered (the manager turns a tier HIT into HIT_PENDING) and the jobs
        # it reported; the real methods answer.
        real_lookup, real_finished = self.tier.lookup, self.tier.get_finished_jobs

        def lookup(key: bytes, req_context: ReqContext) -> LookupResult:
            result = real_lookup(key, req_context)
            self.tier_answers.setdefault(key, []).append(result)
            self.tier_times.setdefault(key, []).append(time.monotonic())
            return result

        def get_finished_jobs() -> list[JobResult]:
            results = list(real_finished())
            self.job_results += results
            return results

        self.tier.lookup = lookup
        self.tier.get_finished_jobs = get_finished_jobs

    def request(self, req_id: str) -> ReqContext:
        ctx = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 60.0) -> None:
        """Steps until the manager and its tiers have nothing in flight (the model-execution window, made as
        long as the tiers need)."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the offloading manager still has work in flight")
            time.sleep(0.002)

    def store(self, ctx: ReqContext, keys: Sequence[bytes]) -> list[bytes]:
        """GPU -> primary -> (cascade) secondary: the rows of `keys` written where prepare_store put them.
        Returns the keys written (those not in the primary tier already)."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None, "the primary tier has no room"
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
            self.rows[chunk] = np.frombuffer(row_bytes_of(key, self.row), dtype=np.uint8)
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        return list(out.keys_to_store)

    def lookups(self, ctx: ReqContext, keys: Sequence[bytes], timeout: float = 60.0) -> list[LookupResult]:
        """The scheduler's lookups of `keys`, a step apart, until each is HIT or MISS in the primary tier
        (a promotion from the secondary tier ends as HIT once loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return results
            if time.monotonic() > deadline:
                raise AssertionError(f"lookups did not settle in {timeout}s: {results}")
            self.settle()
            # The model-execution window: the fs tier's lookup thread, which has_pending_work does not
            # cover, gets the GIL to answer.
            time.sleep(0.005)

    def paced_lookups(
        self, requests: Sequence[tuple[ReqContext, Sequence[bytes]]], step_s: float, timeout: float = 120.0
    ) -> list[int]:
        """vLLM's scheduler over steps with a model-execution window of `step_s` between them (the scheduler
        thread sleeps, as it waits for the GPU): each step looks up every request not yet settled, then ends
        (on_schedule_end). A request settles once none of its keys is RETRY or HIT_PENDING, with its leading
        hits (a MISS ends its prefix: vLLM computes the rest). Returns each request's hits."""
        hits: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(hits) < len(requests):
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still deferred after {timeout}s: {len(hits)} settled")
            self.step_starts.append(time.monotonic())
            with self.manager.lock:
                for i, (ctx, keys) in enumerate(requests):
                    if i not in hits and (n := prefix_lookup(self.manager, keys, ctx)) is not None:
                        hits[i] = n
                self.manager.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(step_s)
        return [hits[i] for i in range(len(requests))]

    def read(self, ctx: ReqContext, keys: Sequence[bytes]) -> list[bytes]:
        """primary -> GPU: the rows prepare_load names, read as the worker would copy them."""
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
        out = [self.rows[c].tobytes() for c in spec.chunk_ids.tolist()]
        with self.manager.lock:
            self.manager.complete_load(list(keys), ctx)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.rows = None
        self.manager.shutdown()
        self.worker.cleanup()
