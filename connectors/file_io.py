"""The file backend's page I/O in Python, on its thread pools: a batch cut into jobs, each page written under
a temporary name and renamed into place, or read and checked, hashed in chunks as it passes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from hicached.common.keys import valid_key

from . import header
from .base import BackendUnavailable, Hold
from .file_layout import READ_FLAGS, TMP_FLAGS, make_shard, open_dir, shard_dirs, size_at

log = logging.getLogger("hicached.connectors.file")

HIT, MISS, CANCELLED = "hit", "miss", "cancelled"
CHANGED = "changed"  # a write whose payload did not hash to its checksum as written: not published
# A batch goes to the io threads in jobs of at least this many bytes (or one job): each job costs thread
# hand-offs that outweigh the I/O of a few small pages, and the callers' own concurrency keeps threads busy.
# Measured with 16-page batches: one job instead of eight for 256 KiB pages takes ~15 % less CPU; for 2 MiB
# pages, 1, 2, 4 or 8 jobs make no difference.
_JOB_MIN_BYTES = 8 << 20
# Payloads are read and written in chunks of this size, each hashed while it is in the CPU cache: right after
# it is read; on writes, right after the kernel copied it out (the C path; ~4 % faster a page than hashing
# first) or right before (the Python path). Hashing a 2 MiB page in a pass of its own costs ~10 % more.
CHUNK = 256 << 10
# A page read is marked used by setting its mtime (atime is unreliable under relatime and noatime), but only
# when the mark is older than this: utime costs ~0.5 us against ~9 us for reading a 256 KiB page from the
# page cache, and dirties the inode, so hot pages are not touched on every read.
TOUCH_AFTER_S = 60.0


class _Unpublished(Exception):
    """A page written under its temporary name and not renamed into place: `result` says why."""

    def __init__(self, result: str) -> None:
        self.result = result


class NotPage:
    """A read of a page's path that found no regular file there (a FIFO, a directory, a device): a miss
    that says nothing about the store."""


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A done callback: marks a future's outcome as seen (a job given up on may fail after its call)."""
    if not fut.cancelled():
        fut.exception()


def default_io_threads() -> int:
    """storage.file.io_threads = 0: twice the CPUs this process may run on, at most 8."""
    return min(8, 2 * len(os.sched_getaffinity(0)))


def lower_priority(increment: int, sched_idle: bool) -> None:
    """Thread initializer: raises this thread's niceness by `increment` (on Linux each thread has its own)
    and, with `sched_idle`, moves it to SCHED_IDLE (which an unprivileged thread may do)."""
    tid = threading.get_native_id()
    try:
        if increment:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        if sched_idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:  # not fatal: the writes still run, at the daemon's priority
        log.warning("file: could not lower the priority of a write thread: %s", e)


def errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, "EIO")


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """The part of `bufs` left after `n` bytes were transferred (pwritev/preadv may stop short)."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs = bufs[1:]
    if n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int = 0) -> None:
    bufs = _advance(bufs, 0)
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        bufs = _advance(bufs, n)


def _pwritev_at(fd: int, bufs: list[memoryview], nbytes: int, offset: int) -> None:
    """_pwritev_all with one call in the usual case, where the kernel takes all `nbytes` at once."""
    n = os.pwritev(fd, bufs, offset)
    if n < nbytes:
        _pwritev_all(fd, _advance(bufs, n), offset + n)


def _preadv_at(fd: int, bufs: list[memoryview], nbytes: int, offset: int) -> int:
    """_preadv_all with one call in the usual case, where the kernel fills all `nbytes` at once (buffers
    past them, a sentinel byte, are filled only if the file goes on)."""
    n = os.preadv(fd, bufs, offset)
    if 0 < n < nbytes:  # stopped short: the file may end here, or the kernel just returned early
        n += _preadv_all(fd, _advance(bufs, n), offset + n)
    return n


def _preadv_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """Reads until `bufs` are full or the file ends; returns the bytes read."""
    start = offset
    bufs = _advance(bufs, 0)
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:  # end of file: the object shrank under us
            break
        offset += n
        bufs = _advance(bufs, n)
    return offset - start


class PageIO:
    """Methods of FileConnector (file.py holds the state): its page I/O in Python, where the C engine
    (file_native) is not used."""

    async def _batch(
        self,
        chunk_fn: Callable[..., list],
        namespace: str,
        keys,
        views,
        what: str,
        hold: Hold | None,
        executor: ThreadPoolExecutor | None = None,
        sums: list[int | None] | None = None,
    ) -> list:
        """Runs `chunk_fn` over slices of the batch at once, one executor job each (see _JOB_MIN_BYTES);
        with `sums`, each job also gets its slice of them."""
        if self._closed:
            raise BackendUnavailable(self.name, "connector is closed", "closed")
        loop = asyncio.get_running_loop()
        stop = bytearray(1)  # set to 1 to cancel: read by the Python loops before each page
        jobs = [
            (executor or self._executor).submit(
                chunk_fn, namespace, keys[s], views[s], stop, *(() if sums is None else (sums[s],))
            )
            for s in self._parts(views)
        ]
        waits = [asyncio.wrap_future(job, loop=loop) for job in jobs]
        for wait in waits:
            wait.add_done_callback(self._progressed)
        try:
            async with asyncio.timeout(self._timeout):
                await asyncio.wait(waits)  # never cancels them: a job in flight still owns its buffers
        except TimeoutError:
            self.counters["errors.timeout"] += 1
            raise BackendUnavailable(self.name, f"{what} took over {self._timeout}s", "timeout") from None
        finally:
            stop[0] = 1  # after a time-out, workers stop before their next page
            for job, wait in zip(jobs, waits, strict=True):
                wait.add_done_callback(_retrieved)
                if not job.done():  # given up: not begun, it never runs; begun, its buffers stay held
                    if hold is not None:
                        hold.track_thread(job, loop)
                    else:
                        job.cancel()
        out: list = []
        for job in jobs:
            error = job.exception()
            if error is not None:
                if isinstance(error, OSError):
                    raise BackendUnavailable(self.name, f"{what} failed: {error}", errname(error)) from error
                raise error
            out.extend(job.result())
        return out

    def _progressed(self, _: object) -> None:
        self.progress += 1  # a job of a call ended (Connector.progress)

    def _parts(self, views: list[memoryview]) -> list[slice]:
        """A batch cut into jobs, in order: at most one an io thread, each of _JOB_MIN_BYTES or more."""
        n = len(views)
        jobs = max(1, min(self._threads, n, sum(map(len, views)) // _JOB_MIN_BYTES))  # byte views
        return [slice(i * n // jobs, (i + 1) * n // jobs) for i in range(jobs)]

    def _write_chunk(
        self, namespace: str, keys, views, stop: bytearray, sums: list[int | None] | None = None
    ) -> list[str | None]:
        out: list[str | None] = []
        added = 0
        root = self._open_root()
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                if stop[0]:
                    out.append(CANCELLED)
                elif not valid_key(key):
                    out.append("invalid_key")
                else:
                    try:
                        digest = None if sums is None else sums[i]
                        added += self._write_one(root, namespace, key, view, digest, stop)
                        out.append(None)
                    except _Unpublished as e:
                        out.append(e.result)
                    except OSError as e:
                        out.append(errname(e))
        finally:
            os.close(root)
        self._add_stored(added)
        return out

    def _write_one(
        self,
        root: int,
        namespace: str,
        key: str,
        payload: memoryview,
        digest: int | None = None,
        stop: bytearray | None = None,
    ) -> int:
        """Writes one page; returns by how many bytes the tree grew. `digest`: its checksum as it entered L2;
        the file is published (renamed to the page's name) only if what was written hashes to it, and only
        while the call still wants it (`stop` not set). Raises _Unpublished otherwise."""
        parts = (namespace, *shard_dirs(key))
        try:
            directory = open_dir(root, parts)
        except FileNotFoundError:  # the first page of a shard: existing directories are never re-checked
            directory = self._make_shard(root, parts)
        try:
            tmp = f".{key}.{self._tmp_tag}{next(self._tmp_seq)}.tmp"
            fd = os.open(tmp, TMP_FLAGS, 0o600, dir_fd=directory)
            try:
                try:
                    size = payload.nbytes
                    if digest is None and size <= CHUNK:  # nothing to check it against: hashed, then written
                        head = header.encode(namespace, key, payload)
                        _pwritev_at(fd, [memoryview(head), payload], header.HEADER_SIZE + size, 0)
                    else:
                        # Each chunk is hashed right after it is written (the kernel's copy brought it into
                        # the CPU cache); the header, which needs the checksum, goes last.
                        hasher = xxhash.xxh3_64()
                        for start in range(0, size, CHUNK):
                            part = payload[start : start + CHUNK]
                            _pwritev_at(fd, [part], part.nbytes, header.HEADER_SIZE + start)
                            hasher.update(part)
                        actual = hasher.intdigest()
                        if digest is not None and actual != digest:
                            raise _Unpublished(CHANGED)
                        head = header.pack(namespace, key, size, actual)
                        _pwritev_at(fd, [memoryview(head)], header.HEADER_SIZE, 0)
                    if self._fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if stop is not None and stop[0]:  # given up meanwhile: not published
                    raise _Unpublished(CANCELLED)
                replaced = size_at(directory, key) if self._max_bytes else 0  # the estimate, right
                os.rename(tmp, key, src_dir_fd=directory, dst_dir_fd=directory)
                return header.HEADER_SIZE + size - replaced
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=directory)
                raise
        finally:
            os.close(directory)

    _make_shard = staticmethod(make_shard)

    def _read_chunk(self, namespace: str, keys, views, stop: bytearray) -> list[Any]:
        out: list[Any] = []
        absent = False
        head = memoryview(bytearray(header.HEADER_SIZE))  # one per job: a page's header is parsed at once
        head = (head, memoryview(bytearray(1)))  # and a byte past the payload: a longer file is no page
        root = self._open_root()
        try:
            for key, view in zip(keys, views, strict=True):
                if stop[0]:
                    out.append(CANCELLED)
                elif not valid_key(key):
                    out.append(MISS)
                else:
                    try:
                        out.append(self._read_one(root, namespace, key, view, head))
                    except (FileNotFoundError, NotADirectoryError):  # from the opens: no such page
                        absent = True
                        out.append(MISS)
                    except OSError as e:
                        out.append(e)
        finally:
            os.close(root)
        if absent:  # once per job: a missing page is a miss, a missing root fails the call
            self._check_root()
        return out

    def _read_one(
        self, root: int, namespace: str, key: str, dest: memoryview, bufs: tuple[memoryview, memoryview]
    ) -> Any:
        head, extra = bufs
        directory = open_dir(root, (namespace, *shard_dirs(key)))
        try:
            # O_NONBLOCK: a FIFO's (or a device's) open would wait for a peer; a regular file reads the same.
            try:
                fd = os.open(key, READ_FLAGS, dir_fd=directory)
            except OSError as e:
                if e.errno == errno.ELOOP:  # a symlink: not a page of ours
                    return NotPage()
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return NotPage()
                return self._read_fd(fd, directory, namespace, key, dest, head, extra)
            finally:
                os.close(fd)
        finally:
            os.close(directory)

    def _read_fd(
        self,
        fd: int,
        directory: int,
        namespace: str,
        key: str,
        dest: memoryview,
        head: memoryview,
        extra: memoryview,
    ) -> Any:
        size = dest.nbytes
        expected = header.HEADER_SIZE + size
        try:
            # A short file shows in what preadv returns, a wrong length in the header, and a longer one in
            # the byte past the payload that the same call reads. Every line here runs per page on threads
            # that share the GIL: kept to few calls.
            if size <= CHUNK:
                got = _preadv_at(fd, [head, dest, extra], expected, 0)
                actual = xxhash.xxh3_64_intdigest(dest)
            else:
                part = dest[:CHUNK]
                got = _preadv_at(fd, [head, part], header.HEADER_SIZE + CHUNK, 0)
                hasher = xxhash.xxh3_64(part)
                end = CHUNK
                while got == header.HEADER_SIZE + end and end < size:
                    start, end = end, min(size, end + CHUNK)
                    part = dest[start:end]
                    bufs = [part, extra] if end == size else [part]
                    got += _preadv_at(fd, bufs, end - start, header.HEADER_SIZE + start)
                    hasher.update(part)
                actual = hasher.intdigest()
            if got < header.HEADER_SIZE:
                raise header.CorruptPage("short", f"file of {got} bytes holds no header")
            digest = header.parse(head, namespace, key, size)
            if got != expected:
                raise header.CorruptPage("length", f"file of {got} bytes, expected {expected}")
            if actual != digest:
                raise header.CorruptPage("checksum", "payload checksum does not match the header")
            if self._max_bytes:
                st = os.fstat(fd)
                if time.time() - st.st_mtime > TOUCH_AFTER_S:
                    with contextlib.suppress(OSError):  # marks it used for the janitor; best effort
                        os.utime(fd)
            return HIT
        except header.MisfitPage as e:
            if e.payload_len < 0 or os.fstat(fd).st_size == header.HEADER_SIZE + e.payload_len:
                return e  # another node's page size or format: its page, not ours to remove
            self._remove_if_same(directory, key, os.fstat(fd))  # its length field is damaged
            return header.CorruptPage("length", "file length does not match its header")
        except header.CorruptPage as e:
            self._remove_if_same(directory, key, os.fstat(fd))
            return e

    def _remove_if_same(self, directory: int, key: str, st: os.stat_result) -> None:
        # A put may have renamed a good page over the corrupt one since we opened it: remove what we read.
        # An error means it is gone already, or not ours to remove: the next read decides again.
        with contextlib.suppress(OSError):
            now = os.stat(key, dir_fd=directory, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(key, dir_fd=directory)
                self._add_stored(-now.st_size)

    def _leading_present(self, namespace: str, keys: Sequence[str]) -> int:
        root = self._open_root()
        try:
            for i, key in enumerate(keys):
                st = None
                if valid_key(key):
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        directory = open_dir(root, (namespace, *shard_dirs(key)))
                        try:
                            st = os.stat(key, dir_fd=directory, follow_symlinks=False)
                        finally:
                            os.close(directory)
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < header.HEADER_SIZE:
                    if i == 0:
                        self._check_root()
                    return i
            return len(keys)
        finally:
            os.close(root)

    def _remove_all(self, namespace: str, keys: Sequence[str]) -> int:
        removed = freed = 0
        root = self._open_root()
        try:
            for key in keys:
                if not valid_key(key):
                    continue
                try:
                    directory = open_dir(root, (namespace, *shard_dirs(key)))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    size = size_at(directory, key)
                    os.unlink(key, dir_fd=directory)
                    removed += 1
                    freed += size
                except (FileNotFoundError, NotADirectoryError):
                    pass
                finally:
                    os.close(directory)
        finally:
            os.close(root)
        self._add_stored(-freed)
        if removed < len(keys):
            self._check_root()
        return removed
