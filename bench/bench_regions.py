"""Benchmark of engine memory regions: host region -> L2 (store_pages) and L2 -> host region (load_pages)
through a real daemon, against a raw copy of the same bytes between the same two mappings in this process
(numpy copyto; the faster of 1 thread and as many threads as the daemon's copier has), for contiguous and
segmented layouts. Usage: python bench/bench_regions.py [--quick]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
import torch

from hicached.common.geometry import Geometry, Segment, plan
from hicached.engine.client import Client, _NoReply, shared_buffer

MiB = 1 << 20
COPY_THREADS = 2
CONFIG = """\
[server]
socket = "run/hicached.sock"
[pool]
capacity = "{pool_mib}MiB"
slab_size = "32MiB"
[storage]
backend = "none"
[regions]
copy_threads = {threads}
[logging]
level = "warning"
"""

now = time.perf_counter
Row = tuple[str, float, float, str]  # figure, hicached GB/s, raw GB/s, target


def layouts(page: int, n: int) -> dict[str, list[tuple[int, int, int]] | None]:
    half, layers = page // 2, 32
    piece = page // (2 * layers)
    return {
        "contiguous": None,
        "K/V halves": [(0, half, half), (n * half, half, half)],
        f"{layers} layers x K/V": [
            ((2 * lay + kv) * n * piece, piece, piece) for lay in range(layers) for kv in (0, 1)
        ],
    }


class Daemon(benchlib.Daemon):
    """No L3: the copy path alone."""

    def __init__(self, work: Path, pool_bytes: int) -> None:
        super().__init__(work, CONFIG.format(pool_mib=pool_bytes // MiB, threads=COPY_THREADS))


def slot_offsets(c: Client, keys: list[str]) -> list[int]:
    """Where the daemon put these pages in the pool (acquire, then release at once)."""

    def op() -> Any:
        ans = yield {"op": "acquire", "keys": keys, "fetch": False}
        yield _NoReply(op="release", lease=ans["lease"])
        return ans["offsets"]

    return c._run(op())


def raw_copy(pieces: list[tuple[np.ndarray, np.ndarray]], ex: ThreadPoolExecutor | None) -> float:
    def job(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for dst, src in part:
            np.copyto(dst, src)

    t0 = now()
    if ex is None:
        job(pieces)
    else:
        k = COPY_THREADS
        list(ex.map(job, [pieces[i::k] for i in range(k)]))
    return now() - t0


def pieces_of(
    geom: Geometry, region: np.ndarray, pool: np.ndarray, pages: list[int], slots: list[int], to_pool: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    p = plan(geom, pages, slots)
    out = []
    for r, q, n in zip(p.region_off.tolist(), p.pool_off.tolist(), p.length.tolist(), strict=True):
        a, b = pool[q : q + n], region[r : r + n]
        out.append((a, b) if to_pool else (b, a))
    return out


def bench(
    c: Client, page: int, name: str, segs: list[tuple[int, int, int]] | None, a: argparse.Namespace, ex: Any
) -> list[Row]:
    n = a.rep_bytes // page
    batch = max(1, min(n, a.batch_bytes // page))
    seg_list = segs or [(0, page, page)]
    geom = Geometry(page, n, tuple(Segment(*s) for s in seg_list))
    src = shared_buffer(geom.extent)
    src.copy_(torch.from_numpy(np.random.default_rng(page).integers(0, 256, geom.extent, dtype=np.uint8)))
    dst = shared_buffer(geom.extent)
    hs = c.register_region(src, page, segments=segs, num_pages=n)
    hd = c.register_region(dst, page, segments=segs, num_pages=n)
    rng = random.Random(page)
    order = list(range(n))
    pool = c._ops._pool
    pool[:: mmap.PAGESIZE].sum()  # fault our mapping of the pool in: the daemon's is prefaulted too
    kinds = ("store", "load", "raw_store", "raw_load", "plain", "plain_load")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    plain = segs is None  # the same pages through Client.store/load: the same bookkeeping, the client copies
    for rep in range(a.reps + 1):  # the first repetition warms up (page tables, slabs) and is dropped
        rng.shuffle(order)
        keys = [f"{page:08x}{rep:08x}{i:048x}" for i in range(n)]
        t0 = now()
        for i in range(0, n, batch):
            assert all(c.store_pages(hs, order[i : i + batch], keys[i : i + batch]))
        t_store = now() - t0
        slots = slot_offsets(c, keys)
        assert len(slots) == n, "the pool must hold a whole repetition"
        back = order[::-1]
        t0 = now()
        for i in range(0, n, batch):
            assert c.load_pages(hd, back[i : i + batch], keys[i : i + batch]) == len(keys[i : i + batch])
        t_load = now() - t0
        src_np, dst_np = src.numpy(), dst.numpy()
        raw_store = min(raw_copy(pieces_of(geom, src_np, pool, order, slots, True), e) for e in (None, ex))
        raw_load = min(raw_copy(pieces_of(geom, dst_np, pool, back, slots, False), e) for e in (None, ex))
        t_plain = t_plain_load = 0.0
        if plain:
            pkeys = [f"{page:08x}{rep:08x}{i:047x}p" for i in range(n)]
            t0 = now()
            for i in range(0, n, batch):
                pages = [src_np[j * page : (j + 1) * page] for j in order[i : i + batch]]
                assert all(c.store(pkeys[i : i + batch], pages))
            t_plain = now() - t0
            t0 = now()
            for i in range(0, n, batch):
                bufs = [dst_np[j * page : (j + 1) * page] for j in back[i : i + batch]]
                assert c.load(pkeys[i : i + batch], bufs) == len(bufs)
            t_plain_load = now() - t0
        if rep:
            got = (t_store, t_load, raw_store, raw_load, t_plain, t_plain_load)
            for k, v in zip(kinds, got, strict=True):
                times[k].append(v)
    check = random.Random(1).sample(range(n), 4)
    for i in check:
        j = back[order.index(i)]
        for off, ln, st in seg_list:
            assert np.array_equal(
                src_np[off + i * st : off + i * st + ln], dst_np[off + j * st : off + j * st + ln]
            )
    c.unregister_region(hs)
    c.unregister_region(hd)
    gb = n * page / 1e9
    g = {k: gb / statistics.median(v) if statistics.median(v) else 0.0 for k, v in times.items()}
    label = f"{page >> 10} KiB, {name}"
    print(
        f"  {label:34} store {g['store']:6.2f} GB/s (raw {g['raw_store']:6.2f})   "
        f"load {g['load']:6.2f} GB/s (raw {g['raw_load']:6.2f})"
        + (f"   plain client: store {g['plain']:5.2f}, load {g['plain_load']:5.2f}" if plain else "")
    )
    return [
        (f"region -> L2, {label}", g["store"], g["raw_store"], ">=0.8"),
        (f"L2 -> region, {label}", g["load"], g["raw_load"], ">=0.8"),
    ]


def print_table(rows: list[Row]) -> None:
    print(f"\n{'figure':46} {'hicached':>11} {'raw':>11} {'ratio':>7} {'target':>7}  result")
    for name, val, raw, target in rows:
        ratio = val / raw
        ok = ratio >= float(target[2:])
        verdict = "PASS" if ok else "MISS"
        print(f"{name:46} {val:6.2f} GB/s {raw:6.2f} GB/s {ratio:6.2f}x {target + 'x':>7}  {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer repetitions")
    a = parser.parse_args()
    a.sizes = (256 * 1024, 2 * MiB) if a.quick else (64 * 1024, 256 * 1024, 2 * MiB, 16 * MiB)
    a.rep_bytes, a.reps = (64 * MiB, 3) if a.quick else (256 * MiB, 7)
    a.batch_bytes = 32 * MiB  # bytes per store_pages/load_pages request
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="hicached-bench-regions-"))
    cpus = len(os.sched_getaffinity(0))
    print(f"hicached bench_regions: python {platform.python_version()}, numpy {np.__version__}, {cpus} CPUs")
    print(
        f"daemon: no L3 (the copy path alone), pool {2 * a.rep_bytes >> 20} MiB, regions.copy_threads="
        f"{COPY_THREADS}; {a.rep_bytes >> 20} MiB per repetition, requests of up to "
        f"{a.batch_bytes >> 20} MiB, pages in shuffled order"
    )
    started = now()
    rows: list[Row] = []
    try:
        with ThreadPoolExecutor(COPY_THREADS) as ex:
            for page in a.sizes:  # a daemon per page size: each starts with the whole pool free
                with Daemon(work, 2 * a.rep_bytes) as d, Client(d.sock, f"bench.p{page}", page) as c:
                    for name, segs in layouts(page, a.rep_bytes // page).items():
                        rows += bench(c, page, name, segs, a, ex)
        print_table(rows)
        print(f"\nGB = 1e9 bytes; medians of {a.reps} repetitions; whole run {now() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
