"""The copy executor: moves page bytes between engine regions and L2 pool slots, never on the event loop.

One interface (`Copier.copy`), two implementations chosen per region: host regions are copied by a small
bounded pool of threads, in one C call a job (hicached.common._pageio.copy_ranges, GIL released; numpy
`copyto` where it is not built; a region whose memory may shrink only in C, guarded against the SIGBUS
of memory that is gone); CUDA regions by one thread per device that owns a CUDA stream
(`hicached.daemon.regions.cuda`). Every job is timed from start to end (`hicached.daemon.regions.jobs`), so
the daemon's watchdog can tell a copy that hangs from one that is merely busy.

A copy may be fenced (hicached.common.fence): each of its jobs counts itself in and out of the engine's
fence word, and copies nothing once the engine has cancelled the request. A host job does so in the same C
call as the copy; a CUDA job counts in before it enqueues a copy and out once its stream's event has been
waited for (hicached.daemon.regions.cuda).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hicached.common.errors import UNSUPPORTED, HicachedError
from hicached.common.geometry import Geometry, Plan, plan, split
from hicached.common.ranges import RegionShrunk, copy_ranges
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions.jobs import Batch, Tracker

log = logging.getLogger("hicached.copier")

# A thread hop costs ~100-150 us (NOTES), about what 1 MiB of memcpy costs: a request is only cut into
# several jobs when each gets at least this much.
SPLIT_MIN_BYTES = 4 << 20


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
        self,
        region: Any,
        to_pool: bool,
        geom: Geometry,
        pages: list[int],
        slots: list[int],
        fence: tuple[Any, int] | None = None,
    ) -> asyncio.Future[list[int] | None]:
        """Copy pages `pages` of `region` into (or, with to_pool False, out of) the slots at `slots`. Into
        the pool, the future's result is each page's checksum (xxh3-64, as a page header keeps it), taken
        as it is copied: what the page's bytes must hash to from the moment it enters L2. A host region
        that `may_shrink` is copied guarded: if its memory is gone, the future fails with RegionGone. With
        `fence` (the engine's board and slot), a job that finds the request cancelled
        copies nothing, and the future fails with CopyCancelled once every job has ended."""
        loop = asyncio.get_running_loop()
        self.requests += 1
        if region.kind == "cuda":
            cuda = self.cuda()
            if not to_pool:
                batch = Batch(loop, 1)
                cuda.copy(region, False, geom, pages, slots, batch, fence)
                return batch.future
            # The copy job, and a checksum job a part (taken as each part's copies end, on other threads).
            cuda_sums = np.zeros(len(pages), dtype=np.uint64)
            batch = Batch(loop, 1 + sum(len(part) for part in cuda.parts(len(pages), geom.page_bytes)))
            cuda.copy(region, True, geom, pages, slots, batch, fence, cuda_sums)
            cuda_out: asyncio.Future[list[int] | None] = loop.create_future()
            batch.future.add_done_callback(lambda f: _settle(cuda_out, f, cuda_sums))
            return cuda_out
        if not to_pool:
            jobs = split(plan(geom, pages, slots), self.threads, SPLIT_MIN_BYTES) if pages else []
            batch = Batch(loop, len(jobs))
            if not jobs:
                batch.future.set_result(None)
            for job in jobs:
                self._host.submit(
                    self._host_job, batch, region.array, False, job, None, region.may_shrink, fence
                )
            return batch.future
        # Into the pool: whole pages a job, so that each job takes its pages' checksums as it copies them.
        n = len(pages)
        parts = max(1, min(self.threads, n, n * geom.page_bytes // SPLIT_MIN_BYTES))
        cuts = [slice(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
        sums = np.zeros(n, dtype=np.uint64)
        batch = Batch(loop, len(cuts))
        for cut in cuts:
            job = plan(geom, pages[cut], slots[cut])
            job_sums = (geom.page_bytes, sums[cut])
            self._host.submit(
                self._host_job, batch, region.array, True, job, job_sums, region.may_shrink, fence
            )
        out: asyncio.Future[list[int] | None] = loop.create_future()
        batch.future.add_done_callback(lambda f: _settle(out, f, sums))
        return out

    def _host_job(
        self,
        batch: Batch,
        region: np.ndarray,
        to_pool: bool,
        p: Plan,
        sums: tuple[int, np.ndarray] | None = None,
        guard: bool = False,
        fence: tuple[Any, int] | None = None,
    ) -> None:
        """On a copy thread."""
        pool = self._pool_arr
        jid = self.tracker.start()
        error = gone = None
        copied = True
        try:
            if pool is None:
                raise RuntimeError("the copier is closed")
            copied = copy_ranges(pool, region, p, to_pool, sums, guard, fence) is not False
        except Exception as e:
            # A string, not the exception: its traceback would keep views of the region alive, and the
            # region could not be unmapped.
            error = f"{type(e).__name__}: {e}"
            if RegionShrunk is not None and isinstance(e, RegionShrunk):
                gone = e.strerror
        self.tracker.end(jid, p.nbytes if copied else 0, error is None)
        batch.job_done(error, gone, not copied)

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
            "cuda_pinned_bytes": self._cuda.pinned_bytes if self._cuda is not None else 0,
        }
