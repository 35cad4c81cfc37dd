"""The file backend's page I/O in C (hicached.common._pageio, where the install built it): the module and its
checks, its engines' threads and jobs, and their result codes as the Python path (file_io) words them."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from hicached.common.keys import KEY_MAX_LEN, NAMESPACE_MAX_LEN

from . import header
from .base import BackendUnavailable, Hold
from .file_io import CANCELLED, CHANGED, CHUNK, HIT, MISS, TOUCH_AFTER_S, NotPage, errname

log = logging.getLogger("hicached.connectors.file")

_PAGEIO_API = 8  # the arguments and answers of hicached.common._pageio that this file was written for
try:  # the C page I/O (hicached/common/_pageio.c), built by the install where a C compiler is at hand
    from hicached.common import _pageio
except ImportError:
    _pageio = None
if _pageio is not None and (
    _pageio.HEADER_SIZE,
    _pageio.MAGIC,
    _pageio.VERSION,
    getattr(_pageio, "API", 1),
    getattr(_pageio, "KEY_MAX_LEN", 0),
    getattr(_pageio, "NAMESPACE_MAX_LEN", 0),
) != (
    header.HEADER_SIZE,
    header.MAGIC,
    header.VERSION,
    _PAGEIO_API,
    KEY_MAX_LEN,
    NAMESPACE_MAX_LEN,
):  # built from other sources: its pages might not verify here, or its calls not fit; not used
    log.warning("file: hicached.common._pageio was built from other sources; reinstall to rebuild it")
    _pageio = None
# What its result codes mean (besides 0, done, and an errno): CorruptPage reasons and messages as
# header.parse words them.
_NATIVE_CORRUPT = (
    {
        _pageio.SHORT: ("short", "file holds no header"),
        _pageio.MAGIC_BAD: ("magic", "not a hicached page (bad magic)"),
        _pageio.LENGTH_BAD: ("length", "file length does not match the page size"),
        _pageio.KEY_BAD: ("key", "object belongs to another key or namespace"),
        _pageio.CHECKSUM_BAD: ("checksum", "payload checksum does not match the header"),
    }
    if _pageio is not None
    else {}
)
# Pages of the key for another format version or page size: a miss, left alone (header.MisfitPage).
_NATIVE_MISFIT = (
    {
        _pageio.VERSION_BAD: ("version", "another page format version"),
        _pageio.MISFIT: ("length", "a page of another size"),
    }
    if _pageio is not None
    else {}
)


def _native_write_result(code: int) -> str | None:
    """A write result of hicached.common._pageio as _write_chunk reports it: None, CANCELLED, CHANGED,
    "invalid_key" or an errno name."""
    if code == 0:
        return None
    if code == _pageio.BAD_KEY:
        return "invalid_key"
    if code == _pageio.CHANGED:
        return CHANGED
    return CANCELLED if code < 0 else errno.errorcode.get(code, "EIO")


class NativeIO:
    """Methods of FileConnector (file.py holds the state): its page I/O on the C engines."""

    def _start_engines(self) -> None:
        """The C engines' threads, named as the Python path's threads are (top -H, ps -L). Where they cannot
        start (a thread or file limit), the Python path runs instead: the same files, more CPU a page."""
        fc, made = self._cfg_file, []
        try:
            made.append(self._native.Engine(self._threads, name="hicached-file"))
            made.append(
                self._native.Engine(self._threads, fc.write_nice, fc.write_sched_idle, "hicached-file-w")
            )
        except OSError as e:
            for engine in made:
                engine.close()
            log.warning("file: the C page I/O threads did not start (%s); page I/O in Python instead", e)
            self._native = None
            return
        self._engines = (made[0], made[1])
        err = made[1].info["priority_errno"]
        if err:  # not fatal: the writes still run, at the daemon's priority
            log.warning("file: could not lower the priority of the write threads: %s", os.strerror(err))
        self._watch(asyncio.get_running_loop())

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Has `loop` reap the engines' finished jobs (moving from a loop used before, if any)."""
        self._unwatch()
        for engine in self._engines or ():
            loop.add_reader(engine.fileno(), self._reap, engine)
        self._engine_loop = loop

    def _unwatch(self) -> None:
        loop, self._engine_loop = self._engine_loop, None
        if loop is not None and not loop.is_closed():
            for engine in self._engines or ():
                loop.remove_reader(engine.fileno())

    def _reap(self, engine: Any) -> None:
        """The loop's reader callback: hands each finished job's answer to the call waiting for it (gone
        after a time-out) and counts the bytes it added to or removed from the tree."""
        for future, results, total, root_errno in engine.reap():
            self._in_engines -= 1
            if total:  # the tree grew by a put, or shrank by a delete or corrupt pages removed
                self._add_stored(total)
            if not future.done():
                future.set_result((results, root_errno))
        if self._closed and not self._in_engines:
            self._unwatch()

    async def _engine_run(
        self, what: str, stop: bytearray, calls: list[tuple[Callable, tuple]], hold: Hold | None = None
    ) -> list:
        """Runs jobs on the C engines: each (submit, args) is queued at once with a future of its own, which
        _reap completes; returns each job's result codes, in order. A job given up on (a time-out, the call
        cancelled) that no thread has begun is taken off its queue; one that runs keeps its buffers in
        `hold` until it ends (after its page in progress: the threads see `stop` before the next one)."""
        if self._closed:
            raise BackendUnavailable(self.name, "connector is closed", "closed")
        loop = asyncio.get_running_loop()
        if loop is not self._engine_loop:  # a connector started on one loop and used on another
            self._watch(loop)
        jobs: list[tuple[Any, asyncio.Future[Any]]] = []
        try:
            for submit, args in calls:
                future = loop.create_future()
                future.add_done_callback(self._progressed)
                submit(future, *args)
                self._in_engines += 1
                jobs.append((submit.__self__, future))
            async with asyncio.timeout(self._timeout):
                await asyncio.wait([f for _, f in jobs])  # never cancels them: _reap completes each
        except TimeoutError:
            self.counters["errors.timeout"] += 1
            raise BackendUnavailable(self.name, f"{what} took over {self._timeout}s", "timeout") from None
        finally:
            stop[0] = 1  # after a time-out, the threads stop before their next page
            for engine, future in jobs:
                if not future.done() and not engine.cancel(future) and hold is not None:
                    hold.track(future)
        done = [future.result() for _, future in jobs]
        for _, root_errno in done:
            if root_errno:  # a missing page is a miss, a missing root fails the call
                self._root_unusable(root_errno)
        return [codes for codes, _ in done]

    async def _engine_put(
        self, namespace: str, keys, views: list[memoryview], sums: list[int | None] | None, hold: Hold | None
    ) -> list[str | None]:
        stop = bytearray(1)  # set to 1 to cancel: the engine's threads read it before each page
        write, root, tag = self._engines[1].write, self._root_bytes, self._native_tmp_tag
        measure = bool(self._max_bytes)  # a bound wants the estimate right: the sizes of files replaced
        fsync = self._fsync
        calls = [
            (
                write,
                (
                    namespace,
                    list(keys[s]),
                    root,
                    tag,
                    views[s],
                    CHUNK,
                    stop,
                    fsync,
                    measure,
                    sums and sums[s],
                ),
            )
            for s in self._parts(views)
        ]
        done = await self._engine_run("put", stop, calls, hold)
        return [result for codes in done for result in map(_native_write_result, codes)]

    async def _engine_get(
        self, namespace: str, keys, views: list[memoryview], hold: Hold | None
    ) -> list[Any]:
        stop = bytearray(1)
        read, root, touch = (
            self._engines[0].read,
            self._root_bytes,
            TOUCH_AFTER_S if self._max_bytes else -1.0,
        )
        parts = self._parts(views)
        calls = [(read, (namespace, list(keys[s]), root, views[s], CHUNK, stop, touch)) for s in parts]
        done = await self._engine_run("get", stop, calls, hold)
        out: list[Any] = []
        for s, codes in zip(parts, done, strict=True):
            out.extend(self._read_results(namespace, keys[s], codes))
        return out

    async def _engine_names(self, what: str, namespace: str, keys: Sequence[str]) -> list[int]:
        """exists or delete on the read engine: one job, a result code a page."""
        stop = bytearray(1)
        submit = getattr(self._engines[0], what)
        [codes] = await self._engine_run(
            what, stop, [(submit, (namespace, list(keys), self._root_bytes, stop))]
        )
        for code in codes:
            if code > 0 and code not in (errno.ENOENT, errno.ENOTDIR):  # as the Python path raises it
                e = OSError(code, os.strerror(code))
                raise BackendUnavailable(self.name, f"{what} failed: {e}", errname(e))
        return codes

    def _read_results(self, namespace: str, keys, codes: list[int]) -> list[Any]:
        """The C engine's read codes as _read_chunk reports them (the engine checked the root)."""
        if not any(codes):  # every page read: the usual answer
            return [HIT] * len(codes)
        out: list[Any] = [MISS] * len(codes)
        native = self._native
        for i, code in enumerate(codes):
            if code == 0:
                out[i] = HIT
            elif code == native.CANCELLED:
                out[i] = CANCELLED
            elif code == native.BAD_KEY or code in (errno.ENOENT, errno.ENOTDIR):  # no such page
                pass
            elif code == native.NOT_PAGE:
                out[i] = NotPage()
            elif code in _NATIVE_MISFIT:
                out[i] = header.MisfitPage(*_NATIVE_MISFIT[code])
            elif code < 0:
                out[i] = header.CorruptPage(*_NATIVE_CORRUPT[code])
            else:
                out[i] = OSError(code, os.strerror(code), self._path(namespace, keys[i]))
        return out
