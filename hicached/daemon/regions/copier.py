"""The copy executor: moves page bytes between engine regions and L2 pool slots, never on the event loop.

One interface (`Copier.copy`), two implementations chosen per region: host regions are copied by a small
bounded pool of threads, in one C call a job (hicached.common._pageio.copy_ranges, GIL released; numpy
`copyto` where it is not built); CUDA regions by one thread per device that owns a CUDA stream
(`hicached.daemon.regions.cuda`). Every job is timed from start to end (`hicached.daemon.regions.jobs`), so
the daemon's watchdog can tell a copy that hangs from one that is merely busy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from hicached.common.errors import UNSUPPORTED, HicachedError
from hicached.common.geometry import Geometry, Plan, plan, split
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions.jobs import Batch, Tracker

try:  # the compiled part (setup.py); without it, ranges are copied with numpy
    from hicached.common import _pageio
    from hicached.common._pageio import copy_ranges as _copy_ranges

    # Checksums taken in the copy itself from API 6 on; an older build copies, and the pages are hashed after.
    _COPY_HASHES = getattr(_pageio, "API", 0) >= 6
except ImportError:
    _copy_ranges = None
    _COPY_HASHES = False


log = logging.getLogger("hicached.copier")

# A thread hop costs ~100-150 us (NOTES), about what 1 MiB of memcpy costs: a request is only cut into
# several jobs when each gets at least this much.
SPLIT_MIN_BYTES = 4 << 20
# Without the C module: ranges this small cost more in Python (a slice and a call each, ~1.5 us) than in
# memcpy: when there are many of one length (per-layer slices), they move with one numpy gather and one
# scatter instead. That moves the bytes twice; measured here it wins up to 4 KiB (1 KiB ranges: 2.5x), and
# loses from 8 KiB.
GATHER_MAX_BYTES = 4 << 10
GATHER_MIN_RANGES = 32


def _rows(buf: np.ndarray, offs: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`buf` seen as rows of `length` bytes starting every g bytes (g: gcd of `offs`), and the rows that
    start at `offs`. as_strided checks nothing, so the bounds are checked here."""
    if len(offs) and (int(offs.min()) < 0 or int(offs.max()) + length > buf.size):
        raise IndexError(f"a range of {length} bytes falls outside a buffer of {buf.size}")
    g = int(np.gcd.reduce(offs)) or length
    nrows = (buf.size - length) // g + 1
    return np.lib.stride_tricks.as_strided(buf, (nrows, length), (g, 1)), offs // g


def copy_ranges(
    pool: np.ndarray, region: np.ndarray, p: Plan, to_pool: bool, sums: tuple[int, np.ndarray] | None = None
) -> None:
    """Copy the plan's ranges between `pool` and `region` (1-D uint8 arrays); on a copy thread. In one C
    call with the GIL released where hicached.common._pageio is built (streaming stores into the pool, ~20 ns
    a range), else with numpy. With `sums` (page_bytes, a uint64 array of one item a page), the plan is of
    whole pages, page-major, and each page's xxh3-64 is taken as it is copied (in C, from the source while
    it is in the cache) or right after (numpy path, from the slots)."""
    if _copy_ranges is not None:
        offs = (np.ascontiguousarray(a, dtype=np.int64) for a in (p.pool_off, p.region_off, p.length))
        if sums is not None and _COPY_HASHES:
            _copy_ranges(pool, region, *offs, to_pool, *sums)
            return
        _copy_ranges(pool, region, *offs, to_pool)
        if sums is not None:
            _hash_pages(pool, p, *sums)
        return
    _copy_ranges_numpy(pool, region, p, to_pool)
    if sums is not None:
        _hash_pages(pool, p, *sums)


def _hash_pages(pool: np.ndarray, p: Plan, page_bytes: int, sums: np.ndarray) -> None:
    """Each page's xxh3-64 from the slots a page-major plan of whole pages filled (xxh3 drops the GIL)."""
    within = 0
    page = 0
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


def _settle(out: asyncio.Future[list[int] | None], done: asyncio.Future[None], sums: np.ndarray) -> None:
    """`out` takes the outcome of `done`: its error, or the checksums its jobs took."""
    if out.done():
        return
    if done.exception() is not None:
        out.set_exception(done.exception())
    else:
        out.set_result(sums.tolist())


class Copier:
    """Copies pages for regions of any kind; `progress` and `oldest_age()` feed the watchdog."""

    def __init__(self, pool: Pool, threads: int) -> None:
        self.pool = pool
        self.threads = threads
        self.tracker = Tracker()
        self._pool_arr: np.ndarray | None = np.frombuffer(pool.mm, dtype=np.uint8)
        self._host = ThreadPoolExecutor(threads, thread_name_prefix="hicached-copy")
        self._cuda: Any = None  # cuda.CudaCopier, built for the first CUDA region
        self._cuda_lock = threading.Lock()
        self.requests = 0

    @property
    def progress(self) -> int:
        return self.tracker.progress

    def oldest_age(self) -> float:
        return self.tracker.oldest_age()

    def cuda(self) -> Any:
        """The CUDA side, started on first use; HicachedError(unsupported) without CUDA. Blocking the first
        time (it imports torch and initialises CUDA): call it off the event loop."""
        with self._cuda_lock:
            if self._cuda is None:
                from hicached.daemon.regions import cuda as cuda_copier

                why = cuda_copier.unavailable()
                if why:
                    raise HicachedError(UNSUPPORTED, f"CUDA regions are not supported here: {why}")
                self._cuda = cuda_copier.CudaCopier(self.pool, self.tracker)
            return self._cuda

    def copy(
        self, region: Any, to_pool: bool, geom: Geometry, pages: list[int], slots: list[int]
    ) -> asyncio.Future[list[int] | None]:
        """Copy pages `pages` of `region` into (or, with to_pool False, out of) the slots at `slots`. Into
        the pool, the future's result is each page's checksum (xxh3-64, as a page header keeps it), taken
        as it is copied: what the page's bytes must hash to from the moment it enters L2."""
        loop = asyncio.get_running_loop()
        self.requests += 1
        if region.kind == "cuda":
            batch = Batch(loop, 1)
            self.cuda().copy(region, to_pool, geom, pages, slots, batch)
            return self._checksums(batch.future, slots, geom.page_bytes) if to_pool else batch.future
        if not to_pool:
            jobs = split(plan(geom, pages, slots), self.threads, SPLIT_MIN_BYTES) if pages else []
            batch = Batch(loop, len(jobs))
            if not jobs:
                batch.future.set_result(None)
            for job in jobs:
                self._host.submit(self._host_job, batch, region.array, False, job)
            return batch.future
        # Into the pool: whole pages a job, so that each job takes its pages' checksums as it copies them.
        n = len(pages)
        parts = max(1, min(self.threads, n, n * geom.page_bytes // SPLIT_MIN_BYTES))
        cuts = [slice(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
        sums = np.zeros(n, dtype=np.uint64)
        batch = Batch(loop, len(cuts))
        for cut in cuts:
            job = plan(geom, pages[cut], slots[cut])
            self._host.submit(self._host_job, batch, region.array, True, job, (geom.page_bytes, sums[cut]))
        out: asyncio.Future[list[int] | None] = loop.create_future()
        batch.future.add_done_callback(lambda f: _settle(out, f, sums))
        return out

    def _checksums(
        self, copied: asyncio.Future[None], slots: list[int], size: int
    ) -> asyncio.Future[list[int] | None]:
        """`copied` (a CUDA copy into the pool), followed by the checksums of the slots it filled, hashed on
        the copy threads once it ended (xxh3 drops the GIL)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[list[int] | None] = loop.create_future()
        sums = np.zeros(len(slots), dtype=np.uint64)
        batch = Batch(loop, 1)

        def after_copy(f: asyncio.Future[None]) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            batch.future.add_done_callback(lambda h: _settle(out, h, sums))
            self._host.submit(self._hash_job, batch, slots, size, sums)

        copied.add_done_callback(after_copy)
        return out

    def _hash_job(self, batch: Batch, slots: list[int], size: int, sums: np.ndarray) -> None:
        """On a copy thread."""
        pool = self._pool_arr
        jid = self.tracker.start()
        error = None
        try:
            if pool is None:
                raise RuntimeError("the copier is closed")
            for i, o in enumerate(slots):
                sums[i] = xxhash.xxh3_64_intdigest(pool[o : o + size])
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self.tracker.end(jid, 0, error is None)  # bytes: those copied; this job copies none
        batch.job_done(error)

    def _host_job(
        self,
        batch: Batch,
        region: np.ndarray,
        to_pool: bool,
        p: Plan,
        sums: tuple[int, np.ndarray] | None = None,
    ) -> None:
        """On a copy thread."""
        pool = self._pool_arr
        jid = self.tracker.start()
        error = None
        try:
            if pool is None:
                raise RuntimeError("the copier is closed")
            copy_ranges(pool, region, p, to_pool, sums)
        except Exception as e:
            # A string, not the exception: its traceback would keep views of the region alive, and the
            # region could not be unmapped.
            error = f"{type(e).__name__}: {e}"
        self.tracker.end(jid, p.nbytes, error is None)
        batch.job_done(error)

    def release(self, region: Any) -> None:
        """Let go of a region's device memory (CUDA) once no copy uses it."""
        if region.kind == "cuda" and self._cuda is not None:
            self._cuda.release(region)

    def close(self) -> None:
        """Blocking (run it in a thread): waits for running jobs, stops the threads, unpins the pool."""
        self._host.shutdown(wait=True)
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None
        self._pool_arr = None  # the pool can be unmapped now

    def stats(self) -> dict[str, Any]:
        t = self.tracker
        return {
            "threads": self.threads,
            "requests": self.requests,
            "jobs_done": t.progress,
            "jobs_failed": t.failed,
            "jobs_running": t.running,
            "bytes": t.bytes,
            "oldest_running_s": round(t.oldest_age(), 3),
            "cuda_devices": sorted(self._cuda.devices) if self._cuda is not None else [],
        }
