"""Trace-driven benchmark: replays a prefix-cache trace (Mooncake's FAST'25 format: JSON lines of `timestamp`
in ms, `input_length`, `output_length`, `hash_ids`, one id per 512-token block) through a real daemon, over
a sweep of L2 capacities, and sets the hit rates it gets beside offline caches on the same requests.

Each capacity gets a fresh daemon (a subprocess; one page size, no slots held ahead, L3 none unless
`--l3 file`) and N engine processes, the trace's requests spread among them as a router would (by the
first block's id, so that a prefix goes to one engine, or round-robin). Per request an engine looks its
pages up (`Client.exists`), loads the leading hits (`Client.load`; every byte checked: a page's bytes are
a function of its block id) and stores the rest (`Client.store`). One page a block, its key the SHA-256
of the block id. As fast as it goes by default; `--speedup F` keeps the trace's arrival times F times
faster, `--prefill-rate T` holds an engine T tokens/s for the tokens it did not load, before it stores.

Per capacity: L2 hit rate (the daemon's `lookup.l2_hits` over the trace's blocks), L2+L3 (plus
`lookup.l3_hits`), the engines' own (pages loaded), the theoretical maximum, an offline LRU and Belady of
the same capacity on the trace's order (bench/trace_sim.py says exactly what they model; with one engine
and no L3 the daemon's L2 hits equal the LRU's), pages dropped before L3 (`backup.dropped`), stores
refused, request latency (lookup + load + store, not the pacing) p50/p99, blocks/s (all blocks over the
replay's wall time, the engines' own page making and checking included).

    python bench/bench_trace.py TRACE [--capacities 2000,5859,10240,20000] [--engines 1]
        [--route prefix|round-robin] [--page-bytes 16384] [--l3 none|file] [--speedup F]
        [--prefill-rate T] [--limit N] [--json OUT] [--sim-only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import trace_sim

from hicached import Client
from hicached.daemon.l2.slabs import slot_size
from hicached.engine.client import control

NS = "bench.trace"
BLOCK_TOKENS = 512  # tokens a block id stands for in the trace format
_MIX = np.uint64(0x9E3779B97F4A7C15)

CONFIG = """\
[server]
socket = "run/hicached.sock"
[pool]
capacity = {capacity}
slab_size = {slab}
reserve_per_connection = 0  # no slots held ahead: a store evicts when it stores (trace_sim models that)
eviction = "{eviction}"
[storage]
backend = "{backend}"
[storage.file]
root = "{root}"
[shutdown]
flush_timeout = "120s"
[warmup]
enabled = false
[logging]
level = "warning"
"""


def key_of(block: int) -> str:
    return hashlib.sha256(block.to_bytes(8, "little", signed=True)).hexdigest()


def page_base(page_bytes: int) -> np.ndarray:
    """The words every page is made from (fixed): a page is these, XORed with a word of its block id."""
    return np.random.default_rng(20251127).integers(0, 1 << 63, page_bytes // 8, dtype=np.uint64)


def pages_of(blocks: np.ndarray, base: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The pages of `blocks` (uint64 ids) into out[: len(blocks)]: a pure function of each id."""
    np.bitwise_xor(base[None, :], (blocks * _MIX)[:, None], out=out[: len(blocks)])
    return out[: len(blocks)]


def route(trace: list[trace_sim.TraceRequest], engines: int, rule: str) -> list[list[int]]:
    """The requests (indices into the trace) each engine serves, in trace order."""
    out: list[list[int]] = [[] for _ in range(engines)]
    for i, r in enumerate(trace):
        if rule == "round-robin" or not r.hash_ids:
            e = i % engines
        else:  # a fixed hash of the first block: requests that share a prefix go to one engine
            e = (r.hash_ids[0] * 2654435761 % (1 << 32)) % engines
        out[e].append(i)
    return out


@dataclass
class EngineJob:
    index: int
    sock: str
    page_bytes: int
    requests: list[tuple[float, int, list[int]]]  # (timestamp ms, input tokens, block ids)
    speedup: float
    prefill_rate: float


def engine_main(job: EngineJob, start: Any, go: Any, out: Any) -> None:
    """One engine process: says it is ready on `out`, waits for `go`, replays its requests from the time in
    `start`, then puts its counts (or the error) on `out`."""
    try:
        out.put(("ok", job.index, _replay(job, start, go, out)))
    except BaseException:
        out.put(("error", job.index, traceback.format_exc()))


def _replay(job: EngineJob, start: Any, go: Any, out: Any) -> dict[str, Any]:
    now = time.monotonic
    keys = [[key_of(b) for b in ids] for _, _, ids in job.requests]
    blocks = [np.array(ids, dtype=np.uint64) for _, _, ids in job.requests]
    longest = max((len(ids) for _, _, ids in job.requests), default=1)
    words = job.page_bytes // 8
    base = page_base(job.page_bytes)
    buf, src, want = (np.empty((longest, words), np.uint64) for _ in range(3))
    buf_rows, src_rows = list(buf), list(src)
    c = dict(requests=0, blocks=0, exists_hits=0, loaded=0, stored=0, refused=0, wrong_pages=0, wrong_bytes=0)
    latency: list[float] = []
    in_calls = late = 0.0
    with Client(job.sock, NS, job.page_bytes) as client:
        out.put(("ready", job.index, None))
        if not go.wait(300):
            raise RuntimeError("no start within 300 s")
        t0 = start.value
        while now() < t0:
            time.sleep(t0 - now())
        for (ts, tokens, ids), ks, bl in zip(job.requests, keys, blocks, strict=True):
            if job.speedup:
                due = t0 + ts / 1000 / job.speedup
                if (wait := due - now()) > 0:
                    time.sleep(wait)
                else:
                    late = max(late, -wait)
            buf[: len(ids)] = 0  # nothing a load did not write passes the check
            t1 = now()
            n = client.exists(ks)
            got = client.load(ks[:n], buf_rows[:n]) if n else 0
            t2 = now()
            if got and not np.array_equal(buf[:got], pages_of(bl[:got], base, want)):
                bad = buf[:got].view(np.uint8) != want[:got].view(np.uint8)
                c["wrong_bytes"] += int(np.count_nonzero(bad))
                c["wrong_pages"] += int(np.count_nonzero(bad.any(axis=1)))
            if job.prefill_rate:
                time.sleep(max(0, tokens - got * BLOCK_TOKENS) / job.prefill_rate)
            t3 = t4 = now()
            if got < len(ids):
                pages_of(bl[got:], base, src)
                t3 = now()
                ok = client.store(ks[got:], src_rows[: len(ids) - got])
                t4 = now()
                stored = sum(ok)
                c["stored"] += stored
                c["refused"] += len(ok) - stored
            latency.append(t2 - t1 + t4 - t3)
            in_calls += t2 - t1 + t4 - t3
            c["requests"] += 1
            c["blocks"] += len(ids)
            c["exists_hits"] += n
            c["loaded"] += got
    return c | {"latency": latency, "in_calls": in_calls, "end": now(), "late": late}


def config_text(capacity: int, page_bytes: int, l3: str, root: Path, eviction: str = "lru") -> str:
    slot = slot_size(page_bytes)  # one slot a slab: the pool holds exactly `capacity` pages
    backend = "file" if l3 == "file" else "none"
    return CONFIG.format(capacity=capacity * slot, slab=slot, backend=backend, root=root, eviction=eviction)


def run_engines(jobs: list[EngineJob], timeout: float) -> tuple[list[dict[str, Any]], float]:
    """Runs the engines together from one start; their results and the start time (time.monotonic)."""
    ctx = multiprocessing.get_context("fork")  # the engines start at once, their modules loaded
    start, go, out = ctx.Value("d", 0.0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=engine_main, args=(job, start, go, out), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    ready: set[int] = set()
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while len(results) + len(errors) < len(jobs):
            try:
                kind, i, what = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"engine process exited with {dead[0].exitcode}")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"not done after {timeout:g}s" if go.is_set() else "engines not ready")
                    break
                continue
            if kind == "ready":
                ready.add(i)
                if len(ready) == len(jobs):  # all connected: they start together
                    start.value = time.monotonic() + 0.01
                    go.set()
                    deadline = time.monotonic() + timeout
            elif kind == "ok":
                results[i] = what
            else:
                errors.append(f"engine {i}:\n{what}")
                break
    finally:
        for p in procs:
            if errors or len(results) < len(jobs):  # a failure, or Ctrl-C: the others stop too
                p.kill()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[i] for i in range(len(jobs))], start.value


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def replay(
    trace: list[trace_sim.TraceRequest],
    capacity: int,
    work: Path,
    engines: int = 1,
    rule: str = "prefix",
    page_bytes: int = 16384,
    l3: str = "none",
    speedup: float = 0.0,
    prefill_rate: float = 0.0,
    timeout: float = 3600.0,
    eviction: str = "lru",
) -> dict[str, Any]:
    """The trace through a fresh daemon of `capacity` pages: the daemon's counters and the engines' counts."""
    if page_bytes % 8 or page_bytes <= 0:
        raise ValueError("page bytes must be a positive multiple of 8")
    work.mkdir(parents=True, exist_ok=True)
    root = work / "l3"
    d = benchlib.Daemon(work, config_text(capacity, page_bytes, l3, root, eviction))
    try:
        d.__enter__()
    except RuntimeError:
        print(d.log_path.read_text()[-3000:], file=sys.stderr)
        raise
    with d:
        jobs = [
            EngineJob(
                e,
                d.sock,
                page_bytes,
                [(trace[i].timestamp_ms, trace[i].input_length, trace[i].hash_ids) for i in mine],
                speedup,
                prefill_rate,
            )
            for e, mine in enumerate(route(trace, engines, rule))
        ]
        results, t0 = run_engines(jobs, timeout)
        counters = control(d.sock, "stats", timeout=60)["counters"]
    shutil.rmtree(root, ignore_errors=True)
    blocks = sum(r["blocks"] for r in results)
    sums = {k: sum(r[k] for r in results) for k in ("requests", "exists_hits", "loaded", "stored", "refused")}
    latency = [x for r in results for x in r["latency"]]
    wall = max(r["end"] for r in results) - t0
    l2, l3_hits = counters.get("lookup.l2_hits", 0), counters.get("lookup.l3_hits", 0)
    return {
        "capacity": capacity,
        "eviction": eviction,
        "engines": engines,
        "route": rule,
        "l3": l3,
        "blocks": blocks,
        **sums,
        "l2_hits": l2,
        "l3_hits": l3_hits,
        "l2_hit_rate": l2 / blocks if blocks else 0.0,
        "l2l3_hit_rate": (l2 + l3_hits) / blocks if blocks else 0.0,
        "engine_hit_rate": sums["loaded"] / blocks if blocks else 0.0,
        "dropped": counters.get("backup.dropped", 0),
        "backed_up": counters.get("backup.pages", 0),
        "no_space": counters.get("store.no_space", 0),
        "busy": counters.get("store.busy", 0),
        "wrong_pages": sum(r["wrong_pages"] for r in results),
        "wrong_bytes": sum(r["wrong_bytes"] for r in results),
        "p50_ms": pct(latency, 0.50) * 1e3,
        "p99_ms": pct(latency, 0.99) * 1e3,
        "wall_s": wall,
        "blocks_per_s": blocks / wall if wall > 0 else 0.0,
        "blocks_per_s_in_calls": blocks * engines / max(1e-9, sum(r["in_calls"] for r in results)),
        "late_max_s": max(r["late"] for r in results),
    }


@dataclass
class Offline:
    capacity: int
    max: float
    lru: float
    belady: float
    belady_bypass: float  # MIN that may decline to cache a block: a bound for admission policies too
    lru_hits: int
    lru_refused: int


def offline(requests: trace_sim.Requests, capacity: int, maximum: trace_sim.SimResult) -> Offline:
    a, b = trace_sim.lru(requests, capacity), trace_sim.belady(requests, capacity)
    by = trace_sim.belady(requests, capacity, bypass=True)
    return Offline(capacity, maximum.hit_rate, a.hit_rate, b.hit_rate, by.hit_rate, a.hits, a.refused)


HEAD = (
    "| L2 pages | eviction | L2 hit | L2+L3 hit | max | offline LRU | Belady | dropped before L3 "
    "| stores refused | p50 ms | p99 ms | blocks/s |"
)


def row(r: dict[str, Any], o: Offline) -> str:
    l2l3 = f"{r['l2l3_hit_rate']:.3f}" if r["l3"] != "none" else "-"
    dropped = str(r["dropped"]) if r["l3"] != "none" else "-"
    return (
        f"| {r['capacity']:,} | {r['eviction']} | {r['l2_hit_rate']:.3f} | {l2l3} | {o.max:.3f} "
        f"| {o.lru:.3f} | {o.belady:.3f} | {dropped} | {r['refused']} | {r['p50_ms']:.2f} "
        f"| {r['p99_ms']:.2f} | {r['blocks_per_s']:,.0f} |"
    )


def describe(path: str, trace: list[trace_sim.TraceRequest]) -> str:
    blocks = sum(len(r.hash_ids) for r in trace)
    distinct = len({b for r in trace for b in r.hash_ids})
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = "?"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{Path(path).name}: {len(trace):,} requests, {blocks:,} blocks, {distinct:,} distinct; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, commit {commit}, {os.cpu_count()} CPUs, load {load}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the trace (JSON lines); bench/make_trace.py writes a synthetic one")
    p.add_argument("--capacities", default="2000,5859,10240,20000", help="L2 capacities in pages, a sweep")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--route", choices=("prefix", "round-robin"), default="prefix")
    p.add_argument("--page-bytes", type=int, default=16384)
    p.add_argument("--l3", choices=("none", "file"), default="none", help="file: a root in a temporary dir")
    p.add_argument("--speedup", type=float, default=0.0, help="the trace's times, F times faster")
    p.add_argument("--prefill-rate", type=float, default=0.0, help="tokens/s an engine prefills misses")
    p.add_argument("--limit", type=int, default=0, help="the first N requests only")
    p.add_argument("--json", help="write every figure here too")
    p.add_argument("--sim-only", action="store_true", help="the offline caches alone: no daemon")
    p.add_argument("--dir", help="where the daemons' directories go (default: a temporary one)")
    p.add_argument("--eviction", default="lru", help="pool.eviction: lru, slru, auto, or several: lru,auto")
    a = p.parse_args()
    trace = trace_sim.read_trace(a.trace)
    if a.limit:
        trace = trace[: a.limit]
    capacities = [int(x) for x in a.capacities.split(",") if x.strip()]
    requests = [r.hash_ids for r in trace]
    print(describe(a.trace, trace))
    if not trace_sim.check_prefix_closed(requests):
        print("note: some block ids have more than one parent; Belady may then count hits after a miss")
    maximum = trace_sim.max_hits(requests)
    sims = {c: offline(requests, c, maximum) for c in capacities}
    figures: list[dict[str, Any]] = []
    if a.sim_only:
        print("| pages | max | offline LRU | Belady | Belady, bypass |\n|---|---|---|---|---|")
        for o in sims.values():
            print(f"| {o.capacity:,} | {o.max:.3f} | {o.lru:.3f} | {o.belady:.3f} | {o.belady_bypass:.3f} |")
        figures = [asdict(o) for o in sims.values()]
    else:
        pace = f"speedup {a.speedup:g}" if a.speedup else "as fast as possible"
        if a.prefill_rate:
            pace += f", prefill {a.prefill_rate:g} tokens/s"
        print(
            f"{a.engines} engine(s), route {a.route}, pages of {a.page_bytes} bytes, L3 {a.l3}, {pace}\n"
            f"\n{HEAD}\n|{'---|' * 12}"
        )
        with tempfile.TemporaryDirectory(prefix="bench-trace-", dir=a.dir) as tmp:
            for c, ev in [(c, ev) for c in capacities for ev in a.eviction.split(",")]:
                r = replay(
                    trace, c, Path(tmp) / f"c{c}{ev}", a.engines, a.route, a.page_bytes, a.l3, a.speedup,
                    a.prefill_rate, eviction=ev,
                )  # fmt: skip
                print(row(r, sims[c]), flush=True)
                if a.speedup and r["late_max_s"] > 0.1:
                    print(f"  the engines fell up to {r['late_max_s']:.1f} s behind the trace's times")
                if r["wrong_bytes"]:
                    print(f"  WRONG BYTES: {r['wrong_bytes']} in {r['wrong_pages']} loaded pages")
                if a.engines == 1 and a.l3 == "none" and ev == "lru" and r["l2_hits"] != sims[c].lru_hits:
                    sim = sims[c].lru_hits
                    print(f"  the daemon's L2 hits ({r['l2_hits']}) differ from the offline LRU's ({sim})")
                figures.append(r | {"offline": asdict(sims[c])})
    if a.json:
        Path(a.json).write_text(json.dumps({"trace": describe(a.trace, trace), "rows": figures}, indent=1))
    bad = sum(f.get("wrong_bytes", 0) for f in figures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
