"""Copy jobs as both copy executors (host threads, CUDA streams) run them: a request's batch of jobs, whose
future completes on the event loop once every job has ended, the tracker of running jobs that the
daemon's watchdog reads, and the errors of a copy that found its region's memory gone or its request
cancelled by the engine (its fence)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from typing import Any

from hicached.common.errors import COPY_FAILED, HicachedError


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Hands a copy's outcome from a copy thread to the event loop; a closed loop has nobody waiting."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


class RegionGone(HicachedError):
    """A copy found its region's memory gone (its file shrank under the daemon): copy_failed, and the region
    cannot be copied from again."""

    def __init__(self, message: str) -> None:
        super().__init__(COPY_FAILED, message)


class CopyCancelled(HicachedError):
    """The engine cancelled the request (its fence, hicached.common.fence) before some of its copy jobs
    entered its memory: those copied nothing, so the request failed as a whole (a store commits nothing).
    Nobody reads the answer: the engine gave up on it."""

    def __init__(self, jobs: int) -> None:
        super().__init__(COPY_FAILED, f"copy cancelled by the engine ({jobs} copy jobs skipped)")
        self.jobs = jobs


class Tracker:
    """Jobs started and not yet finished, with their start times, and how many have finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}
        self._ids = itertools.count()
        self.progress = 0  # jobs finished, whatever their outcome
        self.failed = 0
        self.bytes = 0

    def start(self) -> int:
        with self._lock:
            jid = next(self._ids)
            self._running[jid] = time.monotonic()
            return jid

    def end(self, jid: int, nbytes: int, ok: bool) -> None:
        with self._lock:
            self._running.pop(jid, None)
            self.progress += 1
            if ok:
                self.bytes += nbytes
            else:
                self.failed += 1

    def oldest_age(self) -> float:
        """Seconds the longest-running unfinished job has been running (0 when none runs)."""
        with self._lock:
            if not self._running:
                return 0.0
            return time.monotonic() - min(self._running.values())

    @property
    def running(self) -> int:
        return len(self._running)


class Batch:
    """One request's copy, cut into `parts` jobs; its future completes once every job has ended (never
    earlier, even after a failure: the request's slots and region stay in use until then)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, parts: int) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.remaining = parts
        self.error: str | None = None
        self.gone: str | None = None
        self.cancelled = 0  # jobs that found the request cancelled (its fence) and copied nothing

    def job_done(self, error: str | None, gone: str | None = None, cancelled: bool = False) -> None:
        """From any thread. `gone`: the job found the region's memory gone (the error says how).
        `cancelled`: it found the request cancelled by the engine, and copied nothing."""
        call_on_loop(self.loop, self._done, error, gone, cancelled)

    def _done(self, error: str | None, gone: str | None, cancelled: bool = False) -> None:
        self.remaining -= 1
        self.error = self.error or error
        self.gone = self.gone or gone
        self.cancelled += cancelled
        if self.remaining == 0 and not self.future.done():
            if self.gone:
                self.future.set_exception(RegionGone(f"copy failed: {self.gone}"))
            elif self.error:
                self.future.set_exception(HicachedError(COPY_FAILED, f"copy failed: {self.error}"))
            elif self.cancelled:
                self.future.set_exception(CopyCancelled(self.cancelled))
            else:
                self.future.set_result(None)
