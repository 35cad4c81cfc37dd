"""vLLM 0.33 secondary KV-offload tier backed by the hicached daemon: `HicachedTier`, loaded by vLLM's
SecondaryTierFactory from `"module_path": "hicached.engine.vllm"` (launch flags: docs/engines.md, "vLLM")."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicached.engine.vllm.daemon import Daemon
from hicached.engine.vllm.lookup import Answer, Lookups, Touches
from hicached.engine.vllm.rows import check_prefix, region_file, row_fields

__all__ = ["HicachedTier"]

logger = logging.getLogger("hicached.engine.vllm")

DEFAULT_TIMEOUT_S = 30.0  # a request's answer; a cold load waits for L3 up to the daemon's request_timeout
DEFAULT_RECONNECT_S = 1.0  # first wait after a failed connect; doubles up to 30 s
DEFAULT_IO_THREADS = 4  # jobs in flight at once (the daemon copies on its own threads)
# How long a key is answered RETRY while the daemon's answer is on its way, then MISS: ~2.5x the longest wait
# measured for a lookup batch under load (2,048 keys in a step, steps 0.5-5 ms apart, 2 vCPUs shared with
# other work: 0.12-0.27 s, 0.38 s with no gap between steps; bench_vllm.py --step-ms). Longer than that, the
# daemon is stuck or overloaded, and the prefill is likely cheaper than the wait.
DEFAULT_LOOKUP_WAIT_S = 1.0

L2_LOADED = "vllm:kv_offload_hicached_l2_loaded_chunks"
L3_LOADED = "vllm:kv_offload_hicached_l3_loaded_chunks"
LATE_LOOKUPS = "vllm:kv_offload_hicached_late_lookups"
CONNECTS = "vllm:kv_offload_hicached_connects"
DROPPED_TOUCHES = "vllm:kv_offload_hicached_dropped_touches"
REACHABLE = "vllm:kv_offload_hicached_daemon_reachable"

_ANSWERS = {Answer.HIT: LookupResult.HIT, Answer.MISS: LookupResult.MISS, Answer.RETRY: LookupResult.RETRY}
_LOAD, _STORE, _STOP = 0, 1, 2
Keys = tuple[OffloadKey, ...]  # queue priorities: promotions first, they hold a request back


@dataclass(frozen=True)
class _Job:
    job_id: int
    load: bool
    keys: tuple[OffloadKey, ...]
    chunk_ids: np.ndarray


class HicachedTier(SecondaryTierManager):
    """A `SecondaryTierManager` over a hicached daemon.

    vLLM's CPU primary tier is a tmpfs file (/dev/shm/vllm_offload_<engine>.mmap) of rows, one a chunk. The
    tier registers that file with the daemon once, by fd, and a store or load job is one `store_pages` /
    `load_pages` request: the daemon copies between vLLM's rows and its L2 on its own threads, checksummed,
    and backs them up to L3. Every method runs under vLLM's manager lock and returns at once: jobs run on a
    few I/O threads, and lookups go to the daemon in one batch a step on a thread of their own (a key is
    RETRY until its answer is back, for `lookup_wait_s` at most, then a MISS, counted). No method raises:
    with the daemon down, lookups miss at once and jobs fail, and the daemon is used again once it is back.

    Tier config keys: `socket` (required: the daemon's socket path), `namespace_prefix` (a tenant's
    prefix, default none), `timeout_s`, `reconnect_s`, `io_threads`, `lookup_wait_s`, `locality` (default
    LOCAL), `enable_kv_events` (BlockStored events for what it stored, when vLLM's KV events are on).

    `medium` is CPU: what the daemon serves comes out of its host-memory L2 (a block only in L3 is read
    into L2 by the daemon first), so vLLM counts these hits as host hits; get_stats splits them by tier.
    Rows larger than the daemon's largest page (pool.slab_size) are split into equal parts with a key each.
    """

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        socket: str,
        namespace_prefix: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reconnect_s: float = DEFAULT_RECONNECT_S,
        io_threads: int = DEFAULT_IO_THREADS,
        lookup_wait_s: float = DEFAULT_LOOKUP_WAIT_S,
        locality: str | None = None,
        enable_kv_events: bool = False,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(socket, str) or not socket:
            raise ValueError("the hicached tier needs 'socket': the daemon's socket path")
        if min(timeout_s, reconnect_s, lookup_wait_s) <= 0 or int(io_threads) < 1:
            raise ValueError(
                "timeout_s, reconnect_s and lookup_wait_s must be positive, io_threads at least 1"
            )
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning(
                    "hicached: enable_kv_events is set but vLLM's KV cache events are off; no events"
                )
        num_rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        prefix, fields = check_prefix(namespace_prefix), row_fields(offloading_spec, self.block_size_bytes)
        region = region_file(offloading_spec, primary_kv_view)  # last: its fd is ours to close from here
        self._daemon = Daemon(
            socket,
            region,
            num_rows,
            self.block_size_bytes,
            fields,
            prefix,
            float(timeout_s),
            float(reconnect_s),
        )
        self._lookups = Lookups(
            self._daemon.present,
            lambda: self._daemon.reachable,
            f"hicached_lookup_{tier_type}",
            float(lookup_wait_s),
        )
        self._touches = Touches(
            self._daemon.touch, lambda: self._daemon.reachable, f"hicached_touch_{tier_type}"
        )
        self._jobs: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        # A finished job: its result, the keys a failed load marks missed, the keys a store put in the tier.
        self._finished: queue.SimpleQueue[tuple[JobResult, Keys, Keys]] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._outstanding = 0  # jobs submitted whose result is not yet queued
        self._counts = {L2_LOADED: 0, L3_LOADED: 0}
        self._counts_lock = threading.Lock()
        self._reported = {LATE_LOOKUPS: 0, CONNECTS: 0, DROPPED_TOUCHES: 0}
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"hicached_io_{tier_type}_{i}", daemon=True)
            for i in range(int(io_threads))
        ]
        for t in self._workers:
            t.start()
        self._daemon.client()  # connect now: a wrong socket path shows in the log at start-up

    @property
    def namespace(self) -> str:
        """The daemon namespace of this engine's rows ('' until the daemon was reached once)."""
        return self._daemon.namespace

    # -- under vLLM's lock: nothing here waits on the daemon -------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            return _ANSWERS[self._lookups.lookup(key, req_context.req_id)]
        except Exception:
            logger.exception("hicached: lookup failed; answering a miss")
            return LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The blocks become the most recently used in the daemon's L2 (so that its eviction follows vLLM's
        use): queued here, sent in one batch by a thread of the tier; dropped while the daemon is down."""
        try:
            self._touches.add(keys)
        except Exception:
            logger.exception("hicached: queueing a touch failed")

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            self._lookups.cleanup(req_context.req_id)
        except Exception:
            logger.exception("hicached: releasing request %s's lookups failed", req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookups.flush()
        except Exception:
            logger.exception("hicached: posting the step's lookups failed")

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job: TransferJob, load: bool) -> None:
        with self._cv:
            self._outstanding += 1
        keys: tuple[OffloadKey, ...] = ()
        try:
            # Copies: vLLM may reuse its lists once this returns; the I/O thread reads them later.
            keys = tuple(job.keys)
            item = _Job(job.job_id, load, keys, np.array(job.chunk_ids, dtype=np.int64))
            if self._closed:
                raise RuntimeError("the tier was shut down")
            self._jobs.put((_LOAD if load else _STORE, next(self._seq), item))
        except Exception as e:
            logger.error("hicached: job %s could not be queued (%s); it fails", job.job_id, e)
            self._done(JobResult(job.job_id, False, transfer_bytes=0), keys if load else ())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                result, missed, stored = self._finished.get_nowait()
            except queue.Empty:
                return results
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(list(stored), self.medium, False, self.locality))
            if missed:
                try:
                    self._lookups.mark_miss(missed)
                except Exception:
                    logger.exception("hicached: marking failed loads as misses failed")
            results.append(result)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """BlockStored events for the blocks this tier stored (with enable_kv_events, as the fs tier)."""
        if self._events:
            events, self._events = self._events, []
            yield from events

    def has_pending_work(self) -> bool:
        with self._cv:
            if self._outstanding:
                return True
        try:
            return self._lookups.pending()
        except Exception:
            return False

    def drain_jobs(self) -> None:
        """Returns once no job of this tier runs: the daemon copies no row of vLLM's any more (a request in
        flight ends with its answer, or with its connection closed after timeout_s)."""
        with self._cv:
            self._cv.wait_for(lambda: self._outstanding == 0)

    def shutdown(self) -> None:
        """Waits for the jobs in flight, stops the threads and lets go of the daemon's mapping of vLLM's
        region and of the fd. The tier never takes a lasting export of vLLM's view, so vLLM can unmap it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain_jobs()
            for _ in self._workers:
                self._jobs.put((_STOP, next(self._seq), None))
            for t in self._workers:
                t.join()
            self._lookups.shutdown()
            self._touches.shutdown()
            self._daemon.close()
        except Exception:
            logger.exception("hicached: shutting the tier down failed")
        finally:
            self._daemon.release_fd()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            L2_LOADED: OffloadingCounterMetadata(
                documentation="Chunks the hicached tier loaded from the daemon's host-memory L2."
            ),
            L3_LOADED: OffloadingCounterMetadata(
                documentation="Chunks the hicached tier loaded that the daemon read from L3 storage first."
            ),
            LATE_LOOKUPS: OffloadingCounterMetadata(
                documentation=(
                    "Chunk lookups the hicached tier answered as misses because the daemon's answer had "
                    "not come within lookup_wait_s (the tier answers RETRY until then), or a batch asked "
                    "longer ago was still unanswered."
                )
            ),
            CONNECTS: OffloadingCounterMetadata(
                documentation="Daemon connections the hicached tier made (at start, and after one went).",
            ),
            DROPPED_TOUCHES: OffloadingCounterMetadata(
                documentation=(
                    "Chunk touches the hicached tier dropped (the daemon down, or more queued than it "
                    "sends) instead of making them the most recently used in the daemon's L2."
                )
            ),
            REACHABLE: OffloadingGaugeMetadata(
                documentation="1 while the hicached tier holds a connection to the daemon, else 0."
            ),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        try:
            stats = OffloadingConnectorStats()
            with self._counts_lock:
                counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            now = {
                LATE_LOOKUPS: self._lookups.late,
                CONNECTS: self._daemon.connects,
                DROPPED_TOUCHES: self._touches.dropped,
            }
            for name, n in now.items():
                counts[name] = n - self._reported[name]
            self._reported = now
            for name, n in counts.items():
                if n:
                    stats.increase_counter(name, n)
            stats.set_gauge(REACHABLE, 1 if self._daemon.reachable else 0)
            return stats
        except Exception:
            logger.exception("hicached: collecting the tier's stats failed")
            return None

    # -- I/O threads ----------------------------------------------------------------------------------

    def _done(self, result: JobResult, missed: Keys = (), stored: Keys = ()) -> None:
        self._finished.put((result, missed, stored))
        with self._cv:
            self._outstanding -= 1
            if not self._outstanding:
                self._cv.notify_all()

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            result, missed = JobResult(job.job_id, False, transfer_bytes=0), job.keys if job.load else ()
            try:
                result, missed = self._run(job)
            except Exception:  # a bug: the job still ends, once, as a failure
                logger.exception("hicached: job %s failed", job.job_id)
            finally:
                stored = job.keys if result.success and not job.load else ()
                self._done(result, missed, stored)

    def _run(self, job: _Job) -> tuple[JobResult, Keys]:
        start = time.perf_counter()
        row = self.block_size_bytes
        if not job.load:
            stored = self._daemon.store(job.keys, job.chunk_ids)
            ok = stored is not None and stored[0] == len(job.keys)
            # The bytes the daemon copied: a block it held already (another engine's) cost no copy.
            nbytes = stored[1] if stored is not None else 0
            return JobResult(job.job_id, ok, None, time.perf_counter() - start, nbytes), ()
        from_l2, from_l3 = self._daemon.load(job.keys, job.chunk_ids)
        n = from_l2 + from_l3
        with self._counts_lock:
            self._counts[L2_LOADED] += from_l2
            self._counts[L3_LOADED] += from_l3
        seconds = time.perf_counter() - start
        if n == len(job.keys):
            return JobResult(job.job_id, True, None, seconds, n * row), ()
        # The rows before the first missing block are loaded and kept; the rest are misses from now on.
        kept = job.keys[:n] or None
        return JobResult(job.job_id, False, kept, seconds, n * row), job.keys[n:]
