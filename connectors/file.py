"""The local-file L3 backend: one file per page, `{root}/{namespace}/{key[0:2]}/{key[2:4]}/{key}`, each a
header (connectors.header) followed by the payload, written to a temporary name and renamed into place.
With `max_bytes` set, a janitor removes the least recently used pages when the tree grows past it, however
many daemons share the root. Here the connector; its page I/O in file_io (Python) and file_native (C), paths
in file_layout, bound in file_bound (shared with the other daemons on the root through file_fleet)."""

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiofiles.os
import aiofiles.ospath
from hicached.config import Config, resolve_path

from hicached.common.keys import valid_stored_namespace

from . import file_fleet, file_janitor, file_marks, header
from .base import (
    PROBE_NAMESPACE,
    BackendMisconfigured,
    BackendUnavailable,
    Capabilities,
    Connector,
    Hold,
    put_checksums,
)
from .file_bound import Bound
from .file_io import CANCELLED, HIT, MISS, NotPage, PageIO, default_io_threads, errname, lower_priority
from .file_layout import ROOT_FLAGS, shard_dirs
from .file_native import NativeIO, _pageio

log = logging.getLogger("hicached.connectors.file")

_READONLY = operator.attrgetter("readonly")


def _byte_view(buf: Any) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1:  # the daemon's slots: as they are
        return buf
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class FileConnector(PageIO, NativeIO, Bound, Connector):
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
            initializer=lower_priority,
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
        # Capacity bound (0: none), of the whole tree whatever the number of daemons sharing the root. The
        # bytes of page files are an estimate: the last janitor scan (of any daemon on the root), plus what
        # each daemon's ledger says it added and removed since (puts, deletes, corrupt pages removed,
        # clears), this daemon's at once, the others' at each fleet_refresh (file_fleet).
        self._max_bytes = fc.max_bytes
        self._low_bytes = int(fc.max_bytes * fc.low_watermark)
        self._janitor_interval = fc.janitor_interval
        self._fleet_refresh = fc.fleet_refresh
        self._ledger = file_fleet.Ledger(self.root, self._tmp_tag, shared=fc.max_bytes > 0)
        self._last_scan_total = 0  # bytes of page files the last run of this daemon's janitor found
        self._lock_unsupported = False  # flock failed on the root: janitors run uncoordinated (warned once)
        self._skipped = False  # the last janitor run was left to another daemon's, which held the lease
        self._scan_unshared = False  # the last run's scan could not be written for the others (warned)
        self._refresher: asyncio.Task[None] | None = None  # with a bound: the ledger's refreshes
        self._refreshed = asyncio.Event()  # set after each refresh
        self._scanned = asyncio.Event()  # set after the first janitor run: the estimate means something
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
        # The ledger's files too: never behind a scan, however long it takes.
        self._fleet_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicached-file-fleet")

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
            raise BackendUnavailable(self.name, f"cannot create {self.root}: {e}", errname(e)) from None
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
            if self._max_bytes:
                self._refresher = asyncio.create_task(self._fleet_loop(), name="hicached-file-fleet")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            if self._janitor is not None:
                self._janitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._janitor
            await self._close_fleet()
            # Not waiting: a hung disk must not hang shutdown. Jobs already submitted still run to the end,
            # so every call in flight gets its answer.
            self._executor.shutdown(wait=False)
            self._write_executor.shutdown(wait=False)
            self._scan_executor.shutdown(wait=False)
            self._probe_executor.shutdown(wait=False)
            self._fleet_executor.shutdown(wait=False)
            if self._engines is not None:
                for engine in self._engines:
                    engine.close()
                if not self._in_engines:
                    self._unwatch()  # else once the last job is reaped

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
            raise BackendUnavailable(self.name, f"probe failed: {e}", errname(e)) from None
        for what in ("puts", "gets", "hits", "deletes"):  # as a probe through put, get_into, delete counts
            self.counters[what] += 1

    def _probe_here(self) -> None:
        payload = memoryview(b"hicached-probe-" + bytes(range(256)))
        back = memoryview(bytearray(len(payload)))
        bufs = (memoryview(bytearray(header.HEADER_SIZE)), memoryview(bytearray(1)))
        key = self._probe_key
        root = self._open_root()
        try:
            self._add_stored(self._write_one(root, PROBE_NAMESPACE, key, payload))  # _remove_all takes it off
            if self._read_one(root, PROBE_NAMESPACE, key, back, bufs) != HIT or back != payload:
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
        if self._max_bytes:
            out["bound"] = self._bound_info()
        return out

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
        if not valid_stored_namespace(namespace):
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
            elif result != CANCELLED:
                self.counters[f"errors.{result}"] += 1
        failed = [r for r in results if r is not None]
        if failed:  # once per call, not per page: a full disk fails every page of a batch alike
            log.warning("file: %d of %d pages not written (%s)", len(failed), len(keys), failed[0])
        if self._max_bytes and self.stored_bytes > self._max_bytes:
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
        results = [MISS] * len(keys)
        if keys and valid_stored_namespace(namespace):
            if self._engines is not None:
                results = await self._engine_get(namespace, keys, views, hold)
            else:
                results = await self._batch(self._read_chunk, namespace, keys, views, "get", hold)
        hits = [result == HIT for result in results]
        nhits = hits.count(True)
        self.counters["hits"] += nhits
        self.counters["bytes_read"] += sum(map(len, itertools.compress(views, hits)))  # len: byte views
        if nhits < len(keys):
            self._count_misses(namespace, keys, results)
        return hits

    def _count_misses(self, namespace: str, keys: Sequence[str], results: list[Any]) -> None:
        odd = None
        for key, result in zip(keys, results, strict=True):
            if result == HIT:
                continue
            self.counters["misses"] += 1
            if isinstance(result, header.MisfitPage):
                self.misfit(namespace, key, result.reason, str(result))
            elif isinstance(result, header.CorruptPage):
                self.corrupt(namespace, key, result.reason, str(result))
            elif isinstance(result, NotPage):
                self.counters["not_a_page"] += 1
                odd = odd or key
            elif isinstance(result, OSError):
                self.counters[f"errors.{errname(result)}"] += 1
                log.warning("file: reading page %s/%s failed (%s); treated as a miss", namespace, key, result)
        if odd is not None:  # once a call: left there by someone else, and not ours to remove
            log.warning("file: %s is not a regular file; treated as a miss", self._path(namespace, odd))

    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        if not keys or not valid_stored_namespace(namespace):
            return 0
        # Stat alone (no payload read): one job for the whole list, stopping at the first hole.
        if self._engines is not None:
            codes = await self._engine_names("exists", namespace, keys)
            return next((i for i, code in enumerate(codes) if code), len(codes))
        return await self._call(aiofiles.ospath.wrap(self._leading_present), namespace, keys, what="exists")

    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        if not keys or not valid_stored_namespace(namespace):
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
        if not valid_stored_namespace(namespace):
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

    async def read_marks(self, names: Sequence[str]) -> list[bytes | None]:
        return await self._call(aiofiles.ospath.wrap(self._read_marks), list(names), what="read_marks")

    async def write_mark(self, name: str, value: bytes) -> None:
        await self._call(aiofiles.ospath.wrap(self._write_mark), name, bytes(value), what="write_mark")

    def _read_marks(self, names: list[str]) -> list[bytes | None]:
        root = self._open_root()
        try:
            return file_marks.read(root, names)
        finally:
            os.close(root)

    def _write_mark(self, name: str, value: bytes) -> None:
        root = self._open_root()
        try:
            file_marks.write(root, name, value, f"{self._tmp_tag}m{next(self._tmp_seq)}", self._fsync)
        finally:
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
            raise BackendUnavailable(self.name, f"{what} failed: {e}", errname(e)) from None

    def _root_unusable(self, err: int) -> None:
        if err == errno.ENOTDIR:
            raise BackendUnavailable(self.name, f"root {self.root} is not a directory", "ENOTDIR")
        e = OSError(err, os.strerror(err), self.root)
        raise BackendUnavailable(self.name, f"root {self.root} is unusable: {e}", errname(e))

    def _path(self, namespace: str, key: str) -> str:
        return f"{self.root}/{namespace}/{'/'.join(shard_dirs(key))}/{key}"

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
            return os.open(self.root, ROOT_FLAGS)
        except OSError:
            self._check_root()
            raise
