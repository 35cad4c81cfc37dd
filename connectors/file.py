"""The local-file L3 backend: one file per page, `{root}/{namespace}/{key[0:2]}/{key[2:4]}/{key}`, each a
header (connectors.header) followed by the payload, written to a temporary name and renamed into place.
With `max_bytes` set, a janitor removes the least recently used pages when the tree grows past it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import operator
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiofiles.os
import aiofiles.ospath
import xxhash
from hicached.config import Config, resolve_path

from hicached.common.keys import KEY_MAX_LEN, NAMESPACE_MAX_LEN, valid_key, valid_namespace

from . import file_janitor, header
from .base import (
    PROBE_NAMESPACE,
    BackendMisconfigured,
    BackendUnavailable,
    Capabilities,
    Connector,
    Hold,
    put_checksums,
)

log = logging.getLogger("hicached.connectors.file")

_PAGEIO_API = 6  # the arguments and answers of hicached.common._pageio that this file was written for
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
        _pageio.VERSION_BAD: ("version", "unsupported page format version"),
        _pageio.LENGTH_BAD: ("length", "file length does not match the page size"),
        _pageio.KEY_BAD: ("key", "object belongs to another key or namespace"),
        _pageio.CHECKSUM_BAD: ("checksum", "payload checksum does not match the header"),
    }
    if _pageio is not None
    else {}
)

_HIT, _MISS, _CANCELLED = "hit", "miss", "cancelled"
_CHANGED = "changed"  # a write whose payload did not hash to its checksum as written: not published
# Pages are opened beneath the root one directory at a time, none through a symlink (O_NOFOLLOW; with
# O_DIRECTORY a symlink fails as ENOTDIR), and a read never waits in open() (O_NONBLOCK: a FIFO's open
# would wait for a writer; a regular file reads the same).
_ROOT_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
# A batch goes to the io threads in jobs of at least this many bytes (or one job): each job costs thread
# hand-offs that outweigh the I/O of a few small pages, and the callers' own concurrency keeps threads busy.
# Measured with 16-page batches: one job instead of eight for 256 KiB pages takes ~15 % less CPU; for 2 MiB
# pages, 1, 2, 4 or 8 jobs make no difference.
_JOB_MIN_BYTES = 8 << 20
# Payloads are read and written in chunks of this size, each hashed while it is in the CPU cache: right after
# it is read; on writes, right after the kernel copied it out (the C path; ~4 % faster a page than hashing
# first) or right before (the Python path). Hashing a 2 MiB page in a pass of its own costs ~10 % more.
_CHUNK = 256 << 10
# A page read is marked used by setting its mtime (atime is unreliable under relatime and noatime), but only
# when the mark is older than this: utime costs ~0.5 us against ~9 us for reading a 256 KiB page from the
# page cache, and dirties the inode, so hot pages are not touched on every read.
_TOUCH_AFTER_S = 60.0


class _Unpublished(Exception):
    """A page written under its temporary name and not renamed into place: `result` says why."""

    def __init__(self, result: str) -> None:
        self.result = result


class _NotPage:
    """A read of a page's path that found no regular file there (a FIFO, a directory, a device): a miss
    that says nothing about the store."""


def _shard(key: str) -> tuple[str, str]:
    """The two shard directories of a page: key[0:2] and key[2:4], the key padded with '_' to 4 characters."""
    shard = key if len(key) >= 4 else key.ljust(4, "_")
    return shard[0:2], shard[2:4]


def _open_dir(root: int, parts: tuple[str, ...]) -> int:
    """The directory root/parts[0]/parts[1]/... opened (O_PATH) one level at a time, none through a symlink
    (NotADirectoryError where one is); FileNotFoundError where one is missing."""
    fd = root
    try:
        for part in parts:
            fd, parent = os.open(part, _DIR_FLAGS, dir_fd=fd), fd
            if parent != root:
                os.close(parent)
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd


def _size_at(directory: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_size
    except (FileNotFoundError, NotADirectoryError):
        return 0


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A done callback: marks a future's outcome as seen (a job given up on may fail after its call)."""
    if not fut.cancelled():
        fut.exception()


def default_io_threads() -> int:
    """storage.file.io_threads = 0: twice the CPUs this process may run on, at most 8."""
    return min(8, 2 * len(os.sched_getaffinity(0)))


def _lower_priority(increment: int, sched_idle: bool) -> None:
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


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, "EIO")


def _native_write_result(code: int) -> str | None:
    """A write result of hicached.common._pageio as _write_chunk reports it: None, _CANCELLED, _CHANGED,
    "invalid_key" or an errno name."""
    if code == 0:
        return None
    if code == _pageio.BAD_KEY:
        return "invalid_key"
    if code == _pageio.CHANGED:
        return _CHANGED
    return _CANCELLED if code < 0 else errno.errorcode.get(code, "EIO")


_READONLY = operator.attrgetter("readonly")


def _byte_view(buf: Any) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1:  # the daemon's slots: as they are
        return buf
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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


class FileConnector(Connector):
    """Pages as files under a local directory. Page bytes move on a private thread pool, with preadv and
    pwritev straight between file and shared memory, checksummed in the same job (xxh3 drops the GIL)."""

    name = "file"
    capabilities = Capabilities(shared=False, persistent=True, ttl=False)

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        fc = cfg.storage.file
        self._cfg_file = fc
        self.root = resolve_path(cfg, fc.root)
        self._fsync = fc.fsync
        self._threads = fc.io_threads or default_io_threads()
        self._timeout = cfg.storage.operation_timeout
        self._executor = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="hicached-file")
        # Backups write on threads of their own, at a lower CPU priority (storage.file.write_nice and
        # write_sched_idle), so that on a busy node they take the CPU that engines and prefetch reads leave.
        self._write_executor = ThreadPoolExecutor(
            max_workers=self._threads,
            thread_name_prefix="hicached-file-w",
            initializer=_lower_priority,
            initargs=(fc.write_nice, fc.write_sched_idle),
        )
        # Page I/O in C where the module was built: jobs run on threads of its own
        # (hicached.common._pageio.Engine, made at start) that never take the GIL. Else the Python path on
        # the executors above, which writes and reads the same files (the tests run both).
        self._native = _pageio
        self._engines: tuple[Any, Any] | None = None  # (reads, writes)
        self._engine_loop: asyncio.AbstractEventLoop | None = None  # the loop that watches their eventfds
        self._in_engines = 0  # jobs submitted and not yet reaped
        self._closed = False
        # Temporary names: a tag drawn once (a restarted daemon must not meet its predecessor's leftovers)
        # and a counter, instead of a getrandom call per page.
        self._tmp_tag = secrets.token_hex(4)
        self._tmp_seq = itertools.count()
        # The C page I/O counts its own names: a "c" after the tag keeps them apart from these.
        self._native_tmp_tag = f"{self._tmp_tag}c".encode()
        self._root_bytes = os.fsencode(self.root)
        # Capacity bound (0: none). The bytes of page files are an estimate kept by the io threads (puts,
        # deletes, corrupt pages removed) and made exact by each janitor scan.
        self._max_bytes = fc.max_bytes
        self._low_bytes = int(fc.max_bytes * fc.low_watermark)
        self._janitor_interval = fc.janitor_interval
        self._stored = 0
        self._stored_lock = threading.Lock()
        self._scanned = asyncio.Event()  # set after the first scan: the estimate means something
        self._wake = asyncio.Event()
        self._enforcing = asyncio.Lock()
        self._janitor: asyncio.Task[None] | None = None
        self._stop = threading.Event()  # stops a scan still running in its thread after close()
        # Trash names (file_janitor.TRASH_PREFIX) of the namespaces being cleared now: their trees are the
        # clears' to remove, not the janitor's. Changed on io threads, read on the janitor's.
        self._clearing: set[str] = set()
        # When the temporary files of a crash that the last scan found too young to remove (a restart soon
        # after it) turn stale (time.time()); the janitor scans again then. None: none seen.
        self._leftovers_due: float | None = None
        # Scans walk the whole tree: on a thread of their own, so that they never hold up page I/O.
        self._scan_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicached-file-janitor")
        # The breaker's probe runs on a thread of its own: it never waits behind page I/O.
        self._probe_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicached-file-probe")

    async def start(self) -> None:
        kw = {"executor": self._executor}
        try:
            created = not await aiofiles.ospath.exists(self.root, **kw)
            await aiofiles.os.makedirs(self.root, mode=0o700, exist_ok=True, **kw)
            if created:  # makedirs' mode is filtered by the umask; the cache must stay private either way
                await aiofiles.ospath.wrap(os.chmod)(self.root, 0o700, **kw)
            if not await aiofiles.ospath.wrap(os.access)(self.root, os.W_OK | os.X_OK, **kw):
                raise PermissionError(errno.EACCES, "not writable", self.root)
        except (PermissionError, FileExistsError, NotADirectoryError) as e:
            raise BackendMisconfigured(self.name, f"storage.file.root {self.root} is unusable: {e}") from None
        except OSError as e:
            raise BackendUnavailable(self.name, f"cannot create {self.root}: {e}", _errname(e)) from None
        if self._native is not None and self._engines is None:
            self._start_engines()
        if self._janitor is None:
            if self._native is not None:
                log.info("file: %s, %d io threads, page I/O in C (_pageio)", self.root, self._threads)
            elif _pageio is None:  # else _start_engines said why the C module is not used
                log.warning(
                    "file: %s, %d io threads, page I/O in Python: hicached.common._pageio is not built (no C "
                    "compiler at install?); same files, more CPU per page",
                    self.root,
                    self._threads,
                )
            self._janitor = asyncio.create_task(self._janitor_loop(), name="hicached-file-janitor")

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

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            if self._janitor is not None:
                self._janitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._janitor
            # Not waiting: a hung disk must not hang shutdown. Jobs already submitted still run to the end,
            # so every call in flight gets its answer.
            self._executor.shutdown(wait=False)
            self._write_executor.shutdown(wait=False)
            self._scan_executor.shutdown(wait=False)
            self._probe_executor.shutdown(wait=False)
            if self._engines is not None:
                for engine in self._engines:
                    engine.close()
                if not self._in_engines:
                    self._unwatch()  # else once the last job is reaped

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

    def location(self) -> tuple:
        return ("file", self.root)

    async def probe(self, timeout: float = 10.0) -> None:
        """Writes, reads back and removes a probe page on a thread of its own, never queued behind the io
        threads: what they may be stuck on (one odd object, a slow page) says nothing of whether the store
        works. BackendError if it does not, or does not answer within `timeout`."""
        if self._closed:
            raise BackendUnavailable(self.name, "connector is closed", "closed")
        job = self._probe_executor.submit(self._probe_here)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wrap_future(job)
        except TimeoutError:
            raise BackendUnavailable(
                self.name, f"probe did not finish within {timeout}s", "timeout"
            ) from None
        except OSError as e:
            raise BackendUnavailable(self.name, f"probe failed: {e}", _errname(e)) from None
        for what in ("puts", "gets", "hits", "deletes"):  # as a probe through put, get_into, delete counts
            self.counters[what] += 1

    def _probe_here(self) -> None:
        payload = memoryview(b"hicached-probe-" + bytes(range(256)))
        back = memoryview(bytearray(len(payload)))
        bufs = (memoryview(bytearray(header.HEADER_SIZE)), memoryview(bytearray(1)))
        key = self._probe_key
        root = self._open_root()
        try:
            self._write_one(root, PROBE_NAMESPACE, key, payload)
            if self._read_one(root, PROBE_NAMESPACE, key, back, bufs) != _HIT or back != payload:
                raise BackendUnavailable(self.name, "probe read did not return what was written", "probe")
        finally:
            os.close(root)
        self._remove_all(PROBE_NAMESPACE, [key])

    def info(self) -> dict:
        out = {
            "root": self.root,
            "io_threads": self._threads,
            "page_io": "c" if self._native is not None else "python",  # hicached.common._pageio built or not
        }
        if self._engines is not None:  # the C engines' jobs waiting for a thread and being run
            for what, engine in zip(("reads", "writes"), self._engines, strict=True):
                e = engine.info
                out[f"{what}_queued"], out[f"{what}_running"] = e["queued"], e["running"]
        return out

    @property
    def stored_bytes(self) -> int:
        """Bytes of the page files under root, headers included: exact after a scan, estimated between."""
        return self._stored

    async def enforce_bound(self) -> int:
        """Scans the tree (on the janitor thread): counts the bytes stored, removes temporary files and
        trees of cleared namespaces left by a crash, and when over `max_bytes` removes the least recently
        used pages down to the low watermark. Returns how many pages it removed."""
        async with self._enforcing:
            loop = asyncio.get_running_loop()
            done = await loop.run_in_executor(self._scan_executor, self._enforce, self._stop)
            self._scanned.set()
            if done is None:  # stopped by close()
                return 0
            evicted, freed, stale, trash = done
            self.counters["evictions"] += evicted
            self.counters["evicted_bytes"] += freed
            self.counters["stale_temp_removed"] += stale
            self.counters["stale_trash_removed"] += trash
            if evicted:
                log.info(
                    "file: %s was over its bound of %d bytes; removed %d least recently used pages, %d bytes",
                    self.root,
                    self._max_bytes,
                    evicted,
                    freed,
                )
            if stale:
                log.info("file: removed %d temporary files left by an earlier crash", stale)
            if trash:
                log.info("file: removed %d namespace trees left by clears that did not finish", trash)
            return evicted

    async def _janitor_loop(self) -> None:
        failing = False
        while True:
            try:
                evicted = await self.enforce_bound()
            except Exception as e:
                if not failing:  # once, not every interval: it is tried again until it works
                    log.warning(
                        "file: the janitor cannot scan %s (%r); trying again every %ss",
                        self.root,
                        e,
                        self._janitor_interval,
                    )
                failing = True
            else:
                if failing:
                    log.info("file: the janitor scans %s again", self.root)
                failing = False
            due = None if failing else self._leftovers_due
            if not self._max_bytes:
                if due is None:
                    return  # no bound: the first scan (the count, crash leftovers) is all there is to do
                # Temporary files of a crash too young to remove yet: scan again once they are stale.
                await asyncio.sleep(max(0.0, due - time.time()))
                continue
            if failing or (self._stored > self._max_bytes and not evicted):
                # Over, yet nothing could be removed: wait an interval rather than scan again on every put.
                await asyncio.sleep(self._janitor_interval)
                continue
            # Under the bound: wait for a put that crosses it, looking at the estimate every interval too,
            # or for crash leftovers to turn stale. Still over after removing pages: new pages came in
            # meanwhile, so go again at once.
            while self._stored <= self._max_bytes:
                wait = self._janitor_interval
                if due is not None:
                    if time.time() >= due:
                        break
                    wait = min(wait, due - time.time())
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    async def put(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        checksums: Sequence[int | None] | None = None,
        hold: Hold | None = None,
    ) -> list[bool]:
        sums = put_checksums(keys, payloads, checksums)
        views = list(map(_byte_view, payloads))
        self.counters["puts"] += len(keys)
        if not keys:
            return []
        if not valid_namespace(namespace):
            self.counters["errors.invalid_namespace"] += len(keys)
            return [False] * len(keys)
        if self._engines is not None:
            results = await self._engine_put(namespace, keys, views, sums, hold)
        else:
            results = await self._batch(
                self._write_chunk, namespace, keys, views, "put", hold, self._write_executor, sums
            )
        ok = []
        for result, view in zip(results, views, strict=True):
            ok.append(result is None)
            if result is None:
                self.counters["bytes_written"] += view.nbytes
            elif result != _CANCELLED:
                self.counters[f"errors.{result}"] += 1
        failed = [r for r in results if r is not None]
        if failed:  # once per call, not per page: a full disk fails every page of a batch alike
            log.warning("file: %d of %d pages not written (%s)", len(failed), len(keys), failed[0])
        if self._max_bytes and self._stored > self._max_bytes:
            self._wake.set()
        return ok

    async def get_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], hold: Hold | None = None
    ) -> list[bool]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = list(map(_byte_view, buffers))
        if any(map(_READONLY, views)):
            raise ValueError("get_into needs writable buffers")
        self.counters["gets"] += len(keys)
        results = [_MISS] * len(keys)
        if keys and valid_namespace(namespace):
            if self._engines is not None:
                results = await self._engine_get(namespace, keys, views, hold)
            else:
                results = await self._batch(self._read_chunk, namespace, keys, views, "get", hold)
        hits = [result == _HIT for result in results]
        nhits = hits.count(True)
        self.counters["hits"] += nhits
        self.counters["bytes_read"] += sum(map(len, itertools.compress(views, hits)))  # len: byte views
        if nhits < len(keys):
            self._count_misses(namespace, keys, results)
        return hits

    def _count_misses(self, namespace: str, keys: Sequence[str], results: list[Any]) -> None:
        odd = None
        for key, result in zip(keys, results, strict=True):
            if result == _HIT:
                continue
            self.counters["misses"] += 1
            if isinstance(result, header.CorruptPage):
                self.corrupt(namespace, key, result.reason, str(result))
            elif isinstance(result, _NotPage):
                self.counters["not_a_page"] += 1
                odd = odd or key
            elif isinstance(result, OSError):
                self.counters[f"errors.{_errname(result)}"] += 1
                log.warning("file: reading page %s/%s failed (%s); treated as a miss", namespace, key, result)
        if odd is not None:  # once a call: left there by someone else, and not ours to remove
            log.warning("file: %s is not a regular file; treated as a miss", self._path(namespace, odd))

    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        if not keys or not valid_namespace(namespace):
            return 0
        # Stat alone (no payload read): one job for the whole list, stopping at the first hole.
        if self._engines is not None:
            codes = await self._engine_names("exists", namespace, keys)
            return next((i for i, code in enumerate(codes) if code), len(codes))
        return await self._call(aiofiles.ospath.wrap(self._leading_present), namespace, keys, what="exists")

    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        if not keys or not valid_namespace(namespace):
            return 0
        if self._engines is not None:
            removed = (await self._engine_names("delete", namespace, keys)).count(0)
        else:
            removed = await self._call(aiofiles.ospath.wrap(self._remove_all), namespace, keys, what="delete")
        self.counters["deletes"] += removed
        return removed

    async def clear_namespace(self, namespace: str) -> int:
        """Renames `{root}/{namespace}` to a trash name under the root (file_janitor.TRASH_PREFIX, which no
        namespace can take), then removes that tree on an io thread and returns how many page files it held.
        The rename is one step: every read after it misses, and a put after it starts a new tree. A put that
        had opened its shard before may still publish its page into the trash, where it is removed with the
        rest or, if it comes last, left for the janitor: its put said True, yet the page reads as a miss; or
        it finds its shard removed under it, and says False for the page (errors.ENOENT).
        Nothing is followed through a symlink: a namespace that is a symlink (or anything else but a
        directory) is itself removed, what it points to is left alone, and it held no pages (0). Past
        storage.operation_timeout the call raises BackendUnavailable while the removal goes on; trees that
        a clear left behind (a crash) are removed by the janitor's next scan, one at every start."""
        if not valid_namespace(namespace):
            return 0
        removed = await self._call(aiofiles.ospath.wrap(self._clear), namespace, what="clear_namespace")
        self.counters["deletes"] += removed
        return removed

    def _clear(self, namespace: str) -> int:
        trash = f"{file_janitor.TRASH_PREFIX}{self._tmp_tag}.{next(self._tmp_seq)}"
        root = self._open_root()
        self._clearing.add(trash)  # before the rename: the janitor must never take the tree for a leftover
        try:
            try:
                os.rename(namespace, trash, src_dir_fd=root, dst_dir_fd=root)
            except FileNotFoundError:  # no such namespace
                return 0
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile by someone else
                return file_janitor.remove_tree(root, trash, self._freed)
            return 0
        finally:
            self._clearing.discard(trash)
            os.close(root)

    def _freed(self, nbytes: int) -> None:
        self._add_stored(-nbytes)

    async def _call(
        self, fn: Callable[..., Any], *args: Any, what: str, executor: ThreadPoolExecutor | None = None
    ) -> Any:
        if self._closed:
            raise BackendUnavailable(self.name, "connector is closed", "closed")
        try:
            async with asyncio.timeout(self._timeout):
                return await fn(*args, executor=executor or self._executor)
        except TimeoutError:
            self.counters["errors.timeout"] += 1
            raise BackendUnavailable(self.name, f"{what} took over {self._timeout}s", "timeout") from None
        except OSError as e:
            raise BackendUnavailable(self.name, f"{what} failed: {e}", _errname(e)) from None

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
                    raise BackendUnavailable(self.name, f"{what} failed: {error}", _errname(error)) from error
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
                    _CHUNK,
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
            _TOUCH_AFTER_S if self._max_bytes else -1.0,
        )
        parts = self._parts(views)
        calls = [(read, (namespace, list(keys[s]), root, views[s], _CHUNK, stop, touch)) for s in parts]
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
                raise BackendUnavailable(self.name, f"{what} failed: {e}", _errname(e))
        return codes

    def _root_unusable(self, err: int) -> None:
        if err == errno.ENOTDIR:
            raise BackendUnavailable(self.name, f"root {self.root} is not a directory", "ENOTDIR")
        e = OSError(err, os.strerror(err), self.root)
        raise BackendUnavailable(self.name, f"root {self.root} is unusable: {e}", _errname(e))

    def _path(self, namespace: str, key: str) -> str:
        return f"{self.root}/{namespace}/{'/'.join(_shard(key))}/{key}"

    def _check_root(self) -> None:
        """Tells a missing object from a missing store: the latter fails the whole call."""
        try:
            st = os.stat(self.root)
        except OSError as e:
            self._root_unusable(e.errno or errno.EIO)
        if not stat.S_ISDIR(st.st_mode):
            self._root_unusable(errno.ENOTDIR)

    def _open_root(self) -> int:
        """The root as it is now, for a job's pages to be opened beneath it; a root that is gone fails the
        call (BackendUnavailable)."""
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except OSError:
            self._check_root()
            raise

    def _add_stored(self, nbytes: int) -> None:
        if nbytes:
            with self._stored_lock:
                self._stored += nbytes

    def _write_chunk(
        self, namespace: str, keys, views, stop: bytearray, sums: list[int | None] | None = None
    ) -> list[str | None]:
        out: list[str | None] = []
        added = 0
        root = self._open_root()
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                if stop[0]:
                    out.append(_CANCELLED)
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
                        out.append(_errname(e))
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
        parts = (namespace, *_shard(key))
        try:
            directory = _open_dir(root, parts)
        except FileNotFoundError:  # the first page of a shard: existing directories are never re-checked
            directory = self._make_shard(root, parts)
        try:
            tmp = f".{key}.{self._tmp_tag}{next(self._tmp_seq)}.tmp"
            fd = os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=directory)
            try:
                try:
                    size = payload.nbytes
                    if digest is None and size <= _CHUNK:  # nothing to check it against: hashed, then written
                        head = header.encode(namespace, key, payload)
                        _pwritev_at(fd, [memoryview(head), payload], header.HEADER_SIZE + size, 0)
                    else:
                        # Each chunk is hashed right after it is written (the kernel's copy brought it into
                        # the CPU cache); the header, which needs the checksum, goes last.
                        hasher = xxhash.xxh3_64()
                        for start in range(0, size, _CHUNK):
                            part = payload[start : start + _CHUNK]
                            _pwritev_at(fd, [part], part.nbytes, header.HEADER_SIZE + start)
                            hasher.update(part)
                        actual = hasher.intdigest()
                        if digest is not None and actual != digest:
                            raise _Unpublished(_CHANGED)
                        head = header.pack(namespace, key, size, actual)
                        _pwritev_at(fd, [memoryview(head)], header.HEADER_SIZE, 0)
                    if self._fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if stop is not None and stop[0]:  # given up meanwhile: not published
                    raise _Unpublished(_CANCELLED)
                replaced = _size_at(directory, key) if self._max_bytes else 0  # the estimate, right
                os.rename(tmp, key, src_dir_fd=directory, dst_dir_fd=directory)
                return header.HEADER_SIZE + size - replaced
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=directory)
                raise
        finally:
            os.close(directory)

    def _make_shard(self, root: int, parts: tuple[str, ...]) -> int:
        """The directories of a page (namespace, k0k1, k2k3) made where missing, beneath `root` and never
        through a symlink; the last one opened. Never the root itself: a missing root fails the call
        (BackendUnavailable) instead of being quietly re-created."""
        fd = root
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):  # or another thread made it
                    os.mkdir(part, 0o700, dir_fd=fd)
                fd, parent = os.open(part, _DIR_FLAGS, dir_fd=fd), fd
                if parent != root:
                    os.close(parent)
        except BaseException:
            if fd != root:
                os.close(fd)
            raise
        return fd

    def _read_chunk(self, namespace: str, keys, views, stop: bytearray) -> list[Any]:
        out: list[Any] = []
        absent = False
        head = memoryview(bytearray(header.HEADER_SIZE))  # one per job: a page's header is parsed at once
        head = (head, memoryview(bytearray(1)))  # and a byte past the payload: a longer file is no page
        root = self._open_root()
        try:
            for key, view in zip(keys, views, strict=True):
                if stop[0]:
                    out.append(_CANCELLED)
                elif not valid_key(key):
                    out.append(_MISS)
                else:
                    try:
                        out.append(self._read_one(root, namespace, key, view, head))
                    except (FileNotFoundError, NotADirectoryError):  # from the opens: no such page
                        absent = True
                        out.append(_MISS)
                    except OSError as e:
                        out.append(e)
        finally:
            os.close(root)
        if absent:  # once per job: a missing page is a miss, a missing root fails the call
            self._check_root()
        return out

    def _read_results(self, namespace: str, keys, codes: list[int]) -> list[Any]:
        """The C engine's read codes as _read_chunk reports them (the engine checked the root)."""
        if not any(codes):  # every page read: the usual answer
            return [_HIT] * len(codes)
        out: list[Any] = [_MISS] * len(codes)
        native = self._native
        for i, code in enumerate(codes):
            if code == 0:
                out[i] = _HIT
            elif code == native.CANCELLED:
                out[i] = _CANCELLED
            elif code == native.BAD_KEY or code in (errno.ENOENT, errno.ENOTDIR):  # no such page
                pass
            elif code == native.NOT_PAGE:
                out[i] = _NotPage()
            elif code < 0:
                out[i] = header.CorruptPage(*_NATIVE_CORRUPT[code])
            else:
                out[i] = OSError(code, os.strerror(code), self._path(namespace, keys[i]))
        return out

    def _read_one(
        self, root: int, namespace: str, key: str, dest: memoryview, bufs: tuple[memoryview, memoryview]
    ) -> Any:
        head, extra = bufs
        directory = _open_dir(root, (namespace, *_shard(key)))
        try:
            # O_NONBLOCK: a FIFO's (or a device's) open would wait for a peer; a regular file reads the same.
            try:
                fd = os.open(key, _READ_FLAGS, dir_fd=directory)
            except OSError as e:
                if e.errno == errno.ELOOP:  # a symlink: not a page of ours
                    return _NotPage()
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return _NotPage()
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
            if size <= _CHUNK:
                got = _preadv_at(fd, [head, dest, extra], expected, 0)
                actual = xxhash.xxh3_64_intdigest(dest)
            else:
                part = dest[:_CHUNK]
                got = _preadv_at(fd, [head, part], header.HEADER_SIZE + _CHUNK, 0)
                hasher = xxhash.xxh3_64(part)
                end = _CHUNK
                while got == header.HEADER_SIZE + end and end < size:
                    start, end = end, min(size, end + _CHUNK)
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
                if time.time() - st.st_mtime > _TOUCH_AFTER_S:
                    with contextlib.suppress(OSError):  # marks it used for the janitor; best effort
                        os.utime(fd)
            return _HIT
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
                        directory = _open_dir(root, (namespace, *_shard(key)))
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
                    directory = _open_dir(root, (namespace, *_shard(key)))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    size = _size_at(directory, key)
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

    # The janitor's side, run on its own thread.

    def _enforce(self, stop: threading.Event) -> tuple[int, int, int, int] | None:
        """One janitor run: (pages removed, their bytes, stale temporary files removed, trees of unfinished
        clears removed); None if stopped."""
        trash = file_janitor.remove_trash(self.root, self._clearing, stop)
        with self._stored_lock:
            before = self._stored
        scanned = file_janitor.scan(
            self.root, stop, collect=self._max_bytes > 0, own_tag=self._tmp_tag, clearing=self._clearing
        )
        if scanned is None:
            return None
        total, pages, stale, self._leftovers_due = scanned
        evicted = freed = 0
        if self._max_bytes and total > self._max_bytes:
            pages.sort()
            for used, size, ino, path in pages:
                if total - freed <= self._low_bytes or stop.is_set():
                    break
                if file_janitor.evict(path, ino, used):
                    evicted += 1
                    freed += size
        with self._stored_lock:  # what puts and deletes changed during the scan counts on top of it
            self._stored = total - freed + (self._stored - before)
        return evicted, freed, stale, trash
