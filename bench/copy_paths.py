"""The copies that move page bytes into and out of L2, in one process, against a raw numpy `copyto` of the
same bytes between the same two shared mappings: the client's `copy_pages` (store and load) and the
daemon's host-region copier (`copy_ranges`, contiguous pages and pages of many segments), each with
streaming stores into the pool (the client's also taking each page's checksum, as its stores do), with a
plain memcpy, and (the copier) with the numpy loop used where the C
module is not built. Usage: python bench/copy_paths.py [--reps N]
"""

from __future__ import annotations

import argparse
import mmap
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from hicached.common import _pageio
from hicached.common.geometry import Geometry, Segment, plan
from hicached.daemon.regions import copier

MiB = 1 << 20
TOTAL = 256 * MiB  # bytes moved per repetition
BATCH = 32  # pages per copy_pages call, as bench_core's stores


def shared(nbytes: int) -> np.ndarray:
    arr = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED), dtype=np.uint8)
    arr.fill(1)  # faulted in
    return arr


def timed(fn: Callable[[], None], reps: int) -> float:
    """GB/s of the median repetition (the first is a warm-up, not kept)."""
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        if r:
            times.append(time.perf_counter() - t0)
    return TOTAL / statistics.median(times) / 1e9


def with_stream(name: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        before = _pageio.stream_impl(name)
        try:
            fn()
        finally:
            _pageio.stream_impl(before)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    a = parser.parse_args()
    best = _pageio.stream_impl()
    print(f"copy_paths: python {platform.python_version()}, streaming stores here: {best or 'none'}")
    pool, region = shared(2 * TOTAL), shared(TOTAL)
    rows: list[tuple[str, float, float]] = []
    for page in (256 << 10, 2 * MiB):
        n = TOTAL // page
        slots = [k * page for k in range(n)]
        random.Random(page).shuffle(slots)  # slots all over the pool, as an engine's pages land
        pages = [region[i * page : (i + 1) * page] for i in range(n)]
        dsts = [pool[q : q + page] for q in slots]

        def raw(into: bool, pages=pages, dsts=dsts) -> None:
            for src, dst in zip(pages, dsts, strict=True):
                np.copyto(dst, src) if into else np.copyto(src, dst)

        def client(into: bool, sums: bool = False, page=page, n=n, slots=slots, pages=pages) -> None:
            out = (
                np.empty(BATCH, dtype=np.uint64) if sums else None
            )  # the store's checksums, as it takes them
            for i in range(0, n, BATCH):
                _pageio.copy_pages(pool, slots[i : i + BATCH], page, pages[i : i + BATCH], into, out)

        lb = f"{page >> 10} KiB" if page < MiB else f"{page >> 20} MiB"
        raw_in, raw_out = timed(lambda: raw(True), a.reps), timed(lambda: raw(False), a.reps)
        if best:
            rows.append(
                (
                    f"client store {lb}, streaming",
                    timed(with_stream(best, lambda: client(True)), a.reps),
                    raw_in,
                )
            )
        if best:
            store_sums = timed(with_stream(best, lambda: client(True, True)), a.reps)
            rows.append((f"client store {lb}, streaming, with checksums", store_sums, raw_in))
        rows.append(
            (f"client store {lb}, memcpy", timed(with_stream("", lambda: client(True)), a.reps), raw_in)
        )
        rows.append((f"client load {lb}", timed(lambda: client(False), a.reps), raw_out))
        for nseg in (1, 64):
            seg = page // nseg
            geom = Geometry(page, n, tuple(Segment(j * n * seg, seg, seg) for j in range(nseg)))
            p = plan(geom, list(range(n)), slots)
            native = copier._copy_ranges

            def ranges(into: bool, impl=native, p=p, native=native) -> None:
                copier._copy_ranges = impl
                try:
                    copier.copy_ranges(pool, region, p, into)
                finally:
                    copier._copy_ranges = native

            # The raw baseline for segmented pages: the same ranges, a numpy copyto each.
            spans = list(zip(p.region_off.tolist(), p.pool_off.tolist(), p.length.tolist(), strict=True))

            def raw_ranges(into: bool, spans=spans) -> None:
                for r, q, k in spans:
                    np.copyto(pool[q : q + k], region[r : r + k]) if into else np.copyto(
                        region[r : r + k], pool[q : q + k]
                    )

            what = f"{lb}, {'contiguous' if nseg == 1 else f'{nseg} segments of {seg >> 10} KiB'}"
            r_in = timed(lambda: raw_ranges(True), a.reps)
            r_out = timed(lambda: raw_ranges(False), a.reps)
            if best:
                rows.append(
                    (
                        f"copier store {what}, streaming",
                        timed(with_stream(best, lambda: ranges(True)), a.reps),
                        r_in,
                    )
                )
            rows.append(
                (f"copier store {what}, memcpy", timed(with_stream("", lambda: ranges(True)), a.reps), r_in)
            )
            rows.append((f"copier store {what}, numpy loop", timed(lambda: ranges(True, None), a.reps), r_in))
            rows.append((f"copier load {what}", timed(lambda: ranges(False), a.reps), r_out))
            rows.append(
                (f"copier load {what}, numpy loop", timed(lambda: ranges(False, None), a.reps), r_out)
            )
    print(f"\n{'copy':58} {'GB/s':>6} {'raw':>6} {'ratio':>6}")
    for name, got, raw_gbps in rows:
        print(f"{name:58} {got:6.2f} {raw_gbps:6.2f} {got / raw_gbps:5.2f}x")
    print(f"\nGB = 1e9 bytes; {TOTAL >> 20} MiB a repetition, medians of {a.reps}; raw: a numpy copyto each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
