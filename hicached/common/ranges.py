"""Copies of a region's pages between its memory and the pool's slots, as planned byte ranges
(hicached.common.geometry.Plan): the daemon's copy threads use them for engines' regions, and the client
for memory of its own process (local regions). In one C call with the GIL released where
hicached.common._pageio is built, else with numpy; into the pool, each page's checksum is taken as it is
copied (what its bytes must hash to from the moment it enters L2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from hicached.common.geometry import Plan

try:  # the compiled part (setup.py); without it, ranges are copied with numpy
    from hicached.common import _pageio
    from hicached.common._pageio import copy_ranges as _copy_ranges

    # Checksums taken in the copy itself from API 6 on; an older build copies, and the pages are hashed after.
    COPY_HASHES = getattr(_pageio, "API", 0) >= 6
    # Guarded copies (a fault in a region whose file shrank raises this instead of killing the process)
    # where the build has them.
    RegionShrunk: type[Exception] | None = getattr(_pageio, "RegionShrunk", None)
    # Fenced copies (hicached.common.fence) where the build has them.
    COPY_FENCES = getattr(_pageio, "FENCES", 0) >= 1
except ImportError:
    _copy_ranges = None
    COPY_HASHES = False
    RegionShrunk = None
    COPY_FENCES = False

# Without the C module: ranges this small cost more in Python (a slice and a call each, ~1.5 us) than in
# memcpy: when there are many of one length (per-layer slices), they move with one numpy gather and one
# scatter instead. That moves the bytes twice; measured here it wins up to 4 KiB (1 KiB ranges: 2.5x), and
# loses from 8 KiB.
GATHER_MAX_BYTES = 4 << 10
GATHER_MIN_RANGES = 32


def can_guard() -> bool:
    """Whether copies can be guarded here: only they may touch memory that can shrink under the process."""
    return _copy_ranges is not None and RegionShrunk is not None


def copy_ranges(
    pool: np.ndarray,
    region: np.ndarray,
    p: Plan,
    to_pool: bool,
    sums: tuple[int, np.ndarray] | None = None,
    guard: bool = False,
    fence: tuple[Any, int] | None = None,
) -> bool:
    """Copy the plan's ranges between `pool` and `region` (1-D uint8 arrays), blocking: in one C call with
    the GIL released where hicached.common._pageio is built (streaming stores into the pool, ~20 ns a
    range), else with numpy. With `sums` (page_bytes, a uint64 array of one item a page), the plan is of
    whole pages, page-major, and each page's xxh3-64 is taken as it is copied (in C, from the source while
    it is in the cache) or right after (numpy path, from the slots). With `guard`, `region` is memory that
    may shrink meanwhile: a fault in it raises RegionShrunk (C only: RuntimeError where copies cannot be
    guarded). With `fence` (a board and a slot, hicached.common.fence), the copy counts itself in and out of
    the slot, and copies nothing if the engine cancelled it (C only). Returns whether it copied."""
    if guard and not can_guard():
        raise RuntimeError("this build cannot guard copies (hicached.common._pageio is not built)")
    if fence is not None and not COPY_FENCES:
        raise RuntimeError("this build cannot fence copies (hicached.common._pageio is not built, or older)")
    if _copy_ranges is not None:
        args: list[Any] = [pool, region]
        args += (np.ascontiguousarray(a, dtype=np.int64) for a in (p.pool_off, p.region_off, p.length))
        args.append(to_pool)
        hashed = sums is not None and COPY_HASHES
        if hashed or guard or fence is not None:
            args += sums if hashed else (0, None)
        if guard or fence is not None:
            args.append(guard)  # only then: a build without guards takes no such argument
        if fence is not None:
            args += fence
        copied = _copy_ranges(*args) is not False
        if sums is not None and not hashed and copied:
            hash_pages(pool, p, *sums)
        return copied
    _copy_ranges_numpy(pool, region, p, to_pool)
    if sums is not None:
        hash_pages(pool, p, *sums)
    return True


def hash_pages(pool: np.ndarray, p: Plan, page_bytes: int, sums: np.ndarray) -> None:
    """Each page's xxh3-64 from the slots a page-major plan of whole pages filled (xxh3 drops the GIL)."""
    within = 0
    page = 0
    start = 0
    for q, n in zip(p.pool_off.tolist(), p.length.tolist(), strict=True):
        while n:
            if within == 0:
                start = q
            take = min(n, page_bytes - within)
            within += take
            q += take
            n -= take
            if within == page_bytes:
                sums[page] = xxhash.xxh3_64_intdigest(pool[start : start + page_bytes])
                page += 1
                within = 0


def _rows(buf: np.ndarray, offs: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`buf` seen as rows of `length` bytes starting every g bytes (g: gcd of `offs`), and the rows that
    start at `offs`. as_strided checks nothing, so the bounds are checked here."""
    if len(offs) and (int(offs.min()) < 0 or int(offs.max()) + length > buf.size):
        raise IndexError(f"a range of {length} bytes falls outside a buffer of {buf.size}")
    g = int(np.gcd.reduce(offs)) or length
    nrows = (buf.size - length) // g + 1
    return np.lib.stride_tricks.as_strided(buf, (nrows, length), (g, 1)), offs // g


def _copy_ranges_numpy(pool: np.ndarray, region: np.ndarray, p: Plan, to_pool: bool) -> None:
    small = p.length <= GATHER_MAX_BYTES
    if small.sum() >= GATHER_MIN_RANGES:
        for length in np.unique(p.length[small]).tolist():
            pick = p.length == length
            if pick.sum() < GATHER_MIN_RANGES:
                continue
            small &= ~pick
            src, dst = (region, pool) if to_pool else (pool, region)
            s_off, d_off = (p.region_off, p.pool_off) if to_pool else (p.pool_off, p.region_off)
            src_rows, si = _rows(src, s_off[pick], length)
            dst_rows, di = _rows(dst, d_off[pick], length)
            dst_rows[di] = src_rows[si]
        rest = ~(p.length <= GATHER_MAX_BYTES) | small
    else:
        rest = np.ones(len(p), dtype=bool)
    r_off, p_off, lens = p.region_off[rest].tolist(), p.pool_off[rest].tolist(), p.length[rest].tolist()
    if to_pool:
        for r, q, n in zip(r_off, p_off, lens, strict=True):
            np.copyto(pool[q : q + n], region[r : r + n])
    else:
        for r, q, n in zip(r_off, p_off, lens, strict=True):
            np.copyto(region[r : r + n], pool[q : q + n])
