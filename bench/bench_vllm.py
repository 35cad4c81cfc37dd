"""Benchmark of HicachedTier beside vLLM 0.33's own fs tier, both driven through vLLM's real offloading
classes (TieringOffloadingSpec, TieringOffloadingManager, SharedOffloadRegion) on the same blocks.

Per run (implementations in an order that rotates): 512 MiB of 256 KiB blocks in 32 requests, stored by one
engine (the cascade from its primary tier), then loaded by a second engine, another process with a fresh
primary tier (lookups, promotions, until every block is a primary hit). Reported min / median / max: store
and load throughput, time inside the tier's lookup a key (under vLLM's lock), and scheduler-thread time
inside the tier a job. Targets (ratios in one run): store and load >= 2x the fs tier; scheduler time a job
no more than the fs tier's. The GPU worker's copy is played by writing and reading the rows (not timed).

With --step-ms, each run also has a second engine per interval (another process, fresh primary tier) whose
scheduler steps have a model-execution window of that many ms between them (the scheduler thread sleeps, as
it waits for the GPU): each step looks every waiting request up and takes those settled, as vLLM's
scheduler does (a MISS ends a request's prefix; the rest would be recomputed). Reported: the blocks it found
as hits, and how long the tier answered RETRY for a key (its first lookup to its first HIT or MISS)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = ROOT / "tests" / "support"
sys.path.append(str(SUPPORT))
sys.path.append(str(ROOT / "bench"))

from benchlib import Daemon  # noqa: E402

BLOCK = 256 << 10
REQUESTS = 32
# An engine serves long after its start: what a tier does at start-up in the background (hicached's client
# maps the daemon's pool, the fs tier starts its threads) ends before anything is timed.
STARTED_S = 1.0
TIER_CALLS = ("submit_store", "submit_load", "get_finished_jobs", "on_schedule_end", "has_pending_work")


def config(pool_bytes: int) -> str:
    return (
        f'[server]\nsocket = "run/hicached.sock"\n[pool]\ncapacity = {pool_bytes}\nslab_size = "32MiB"\n'
        '[storage]\nbackend = "file"\n[storage.file]\nroot = "data"\nio_threads = 8\n'
        '[warmup]\nenabled = false\n[logging]\nlevel = "warning"\n'
    )


def tier_config(impl: str, sock: str, fs_root: str) -> dict[str, Any]:
    from vllm_rig import fs_tier, hicached_tier

    return (
        hicached_tier(sock, timeout_s=120)
        if impl == "hicached"
        else fs_tier(fs_root)
        | {
            "n_read_threads": 16,
            "n_write_threads": 16,
        }
    )


def request_keys(tag: str, blocks: int) -> list[list[bytes]]:
    from vllm_rig import chain_keys

    per = blocks // REQUESTS
    return [chain_keys(f"{tag}-{i}", per) for i in range(REQUESTS)]


def fill(row: np.ndarray, key: bytes, base: np.ndarray) -> None:
    """A block's bytes: one of 64 random rows, with the key at its head (rows differ, quickly made)."""
    row[:] = base[key[0] % len(base)]
    row[: len(key)] = np.frombuffer(key, dtype=np.uint8)


def base_rows(row_bytes: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (64, row_bytes), dtype=np.uint8)


def timers(tier: Any, names: tuple[str, ...]) -> dict[str, float]:
    """Seconds spent inside each of the tier's methods `names` (what the scheduler thread waits on), and
    the calls made, by wrapping them on the instance; the real methods run."""
    spent: dict[str, float] = {"calls": 0.0, **dict.fromkeys(names, 0.0)}
    for name in names:
        real = getattr(tier, name)

        def timed(*args: Any, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            t0 = time.perf_counter()
            try:
                return _real(*args)
            finally:
                spent[_name] += time.perf_counter() - t0
                spent["calls"] += _name == "lookup"

        setattr(tier, name, timed)
    return spent


def wait_idle(engine: Any) -> None:
    while True:
        engine.step()
        with engine.manager.lock:
            if not engine.manager.has_pending_work():
                return
        time.sleep(0.001)


def store(impl: str, sock: str, fs_root: str, tag: str, blocks: int) -> dict[str, float]:
    """Engine A: its rows written as the GPU worker would (not timed), then the cascade into the tier
    (complete_store -> submit_store) until every job ended."""
    from vllm_rig import Engine

    engine = Engine(f"bench-a-{impl}-{os.getpid()}", [tier_config(impl, sock, fs_root)], chunks=blocks + 64,
                    worker_bytes=BLOCK)  # fmt: skip
    try:
        spent = timers(engine.tier, TIER_CALLS)
        base = base_rows(engine.row)
        time.sleep(STARTED_S)
        prepared = []
        for i, keys in enumerate(request_keys(tag, blocks)):
            ctx = engine.request(f"store-{i}")
            with engine.manager.lock:
                out = engine.manager.prepare_store(keys, ctx)
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
                fill(engine.rows[chunk], key, base)
            prepared.append((ctx, out.keys_to_store))
        t0 = time.perf_counter()
        for ctx, keys in prepared:
            with engine.manager.lock:
                engine.manager.complete_store(keys, ctx)
        wait_idle(engine)
        secs = time.perf_counter() - t0
        jobs = engine.job_results
        assert len(jobs) == REQUESTS and all(j.success for j in jobs), f"{impl}: a store failed"
        for ctx, _ in prepared:
            engine.finish(ctx)
        sched = sum(spent[n] for n in TIER_CALLS)
        return {
            "store MiB/s": blocks * engine.row / secs / 2**20,
            "sched us/job store": sched / len(jobs) * 1e6,
        }
    finally:
        engine.close()


READER = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import bench_vllm as b
args = (*sys.argv[3:7], int(sys.argv[7]))
print(json.dumps(b.load_paced(*args, float(sys.argv[8])) if len(sys.argv) > 8 else b.load(*args)))
"""


def load(impl: str, sock: str, fs_root: str, tag: str, blocks: int) -> dict[str, float]:
    """Engine B (run in a process of its own, fresh primary tier): every request's blocks looked up each
    step until all are primary hits (RETRY, then the promotion, then HIT), then checked."""
    from vllm_rig import Engine, prefix_lookup

    engine = Engine(f"bench-b-{impl}-{os.getpid()}", [tier_config(impl, sock, fs_root)], chunks=blocks + 64,
                    worker_bytes=BLOCK)  # fmt: skip
    try:
        spent = timers(engine.tier, (*TIER_CALLS, "lookup"))
        reqs = request_keys(tag, blocks)
        time.sleep(STARTED_S)
        ctxs = [engine.request(f"load-{i}") for i in range(len(reqs))]
        todo = set(range(len(reqs)))
        t0 = time.perf_counter()
        while todo:
            with engine.manager.lock:
                for i in list(todo):
                    if prefix_lookup(engine.manager, reqs[i], ctxs[i]) == len(reqs[i]):
                        todo.discard(i)
            if todo:
                wait_idle(engine)
                time.sleep(0.001)  # the fs tier's lookup thread (not in has_pending_work) gets the GIL
        secs = time.perf_counter() - t0
        base = base_rows(engine.row)
        expect = np.empty(engine.row, dtype=np.uint8)
        for i, keys in enumerate(reqs):
            rows = engine.read(ctxs[i], keys)
            for key, got in zip(keys[::7], rows[::7], strict=True):  # a sample: checking is not timed
                fill(expect, key, base)
                assert got == expect.tobytes(), f"{impl}: wrong bytes loaded"
            engine.finish(ctxs[i])
        jobs = engine.job_results
        assert jobs and all(j.success for j in jobs), f"{impl}: a load failed"
        sched = sum(spent[n] for n in TIER_CALLS)
        return {
            "load MiB/s": blocks * engine.row / secs / 2**20,
            "lookup us/key": spent["lookup"] / max(1, spent["calls"]) * 1e6,
            "sched us/job load": sched / len(jobs) * 1e6,
        }
    finally:
        engine.close()


def load_paced(impl: str, sock: str, fs_root: str, tag: str, blocks: int, step_ms: float) -> dict[str, float]:
    """Engine B with a model-execution window of `step_ms` between scheduler steps (vllm_rig's
    paced_lookups: a request settles with the leading hits it has, as vLLM's scheduler would schedule it).
    The hits are then read and checked."""
    from vllm.v1.kv_offload.base import LookupResult
    from vllm_rig import Engine

    engine = Engine(f"bench-p-{impl}-{os.getpid()}", [tier_config(impl, sock, fs_root)], chunks=blocks + 64,
                    worker_bytes=BLOCK)  # fmt: skip
    try:
        reqs = request_keys(tag, blocks)
        time.sleep(STARTED_S)
        ctxs = [engine.request(f"paced-{i}") for i in range(len(reqs))]
        hits = engine.paced_lookups(list(zip(ctxs, reqs, strict=True)), step_ms / 1000, timeout=300)
        base = base_rows(engine.row)
        expect = np.empty(engine.row, dtype=np.uint8)
        for i, keys in enumerate(reqs):
            rows = engine.read(ctxs[i], keys[: hits[i]]) if hits[i] else []
            for key, got in zip(keys[::7], rows[::7], strict=False):
                fill(expect, key, base)
                assert got == expect.tobytes(), f"{impl}: wrong bytes loaded"
            engine.finish(ctxs[i])
        # How long the tier answered RETRY for a key: its first answer to its first HIT or MISS.
        waits = []
        for key, answers in engine.tier_answers.items():
            times = engine.tier_times[key]
            settled = [t for r, t in zip(answers, times, strict=True) if r is not LookupResult.RETRY]
            if settled:
                waits.append((settled[0] - times[0]) * 1e3)
        waits.sort()
        label = f"{step_ms:g} ms steps"
        out = {f"hits, {label}": float(sum(hits))}
        for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
            out[f"RETRY ms {name}, {label}"] = waits[min(len(waits) - 1, int(q * len(waits)))] if waits else 0
        return out
    finally:
        engine.close()


def load_elsewhere(
    impl: str, sock: str, fs_root: str, tag: str, blocks: int, step_ms: float | None = None
) -> dict[str, float]:
    args = [str(SUPPORT), str(ROOT / "bench"), impl, sock, fs_root, tag, str(blocks)]
    args += [] if step_ms is None else [str(step_ms)]
    out = subprocess.run([sys.executable, "-c", READER, *args], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the reading engine failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_run(work: Path, blocks: int, run: int, steps: list[float]) -> dict[str, dict[str, float]]:
    order = ["fs", "hicached"][run % 2 :] + ["fs", "hicached"][: run % 2]
    root = work / f"d{run}"
    root.mkdir()
    fs_root = str(work / f"fs{run}")
    out: dict[str, dict[str, float]] = {impl: {} for impl in order}
    try:
        daemon = Daemon(root, config(2 * blocks * BLOCK + (256 << 20))).__enter__()
    except RuntimeError:
        print((root / "daemon.log").read_text()[-3000:], file=sys.stderr)
        raise
    with daemon as d:
        for impl in order:
            out[impl] |= store(impl, d.sock, fs_root, f"{impl}{run}", blocks)
            d.flush()  # no step pays for another's backups
            os.sync()
        for impl in order:
            out[impl] |= load_elsewhere(impl, d.sock, fs_root, f"{impl}{run}", blocks)
        for step_ms in steps:
            for impl in order:
                out[impl] |= load_elsewhere(impl, d.sock, fs_root, f"{impl}{run}", blocks, step_ms)
    return out


# (row, figure, target, higher is better)
RATIOS = [
    ("store throughput, hicached / fs", "store MiB/s", 2.0, True),
    ("load throughput (2nd engine), hicached / fs", "load MiB/s", 2.0, True),
    ("scheduler time a store job, hicached / fs", "sched us/job store", 1.0, False),
    ("scheduler time a load job, hicached / fs", "sched us/job load", 1.0, False),
    ("lookup time a key (under the lock), hicached / fs", "lookup us/key", None, False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mib", type=int, default=512, help="MiB of blocks a run")
    parser.add_argument(
        "--step-ms",
        type=float,
        nargs="*",
        default=[],
        help="step intervals (ms) of paced second engines, e.g. 0.5 1 5: their hits and RETRY times",
    )
    a = parser.parse_args()
    try:
        import torch
        import vllm_rig  # noqa: F401  (vLLM's offloading classes)
    except ImportError as e:
        print(f"bench_vllm: vLLM's offloading classes do not import here ({e}); see .ci/run for the install")
        return 0
    blocks = (a.mib << 20) // BLOCK // REQUESTS * REQUESTS
    py = sys.version.split()[0]
    print(f"hicached bench_vllm: python {py}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{blocks} blocks of {BLOCK >> 10} KiB ({blocks * BLOCK >> 20} MiB) in {REQUESTS} requests a run, "
          f"{a.runs} runs; files in {tempfile.gettempdir()}")  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for run in range(a.runs):
            runs.append(one_run(Path(tmp), blocks, run, a.step_ms))
    print(f"\nmin / median / max over {a.runs} runs" + (f" (hits: of {blocks} blocks)" if a.step_ms else ""))
    for impl in ("fs", "hicached"):
        for name in runs[0][impl]:
            vals = [r[impl][name] for r in runs]
            print(
                f"  {impl:9s} {name:28s} {min(vals):10.1f} {statistics.median(vals):10.1f} {max(vals):10.1f}"
            )
    print(f"\n  {'ratio':52s} {'min':>6s} {'median':>6s} {'max':>6s}  target")
    for label, name, target, higher in RATIOS:
        vals = [r["hicached"][name] / r["fs"][name] for r in runs]
        med = statistics.median(vals)
        verdict = ""
        if target is not None:
            sign = ">=" if higher else "<="
            verdict = f"{sign}{target}x {'PASS' if (med >= target if higher else med <= target) else 'MISS'}"
        print(f"  {label:52s} {min(vals):6.2f} {med:6.2f} {max(vals):6.2f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
