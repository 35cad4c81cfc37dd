"""The vLLM tier's link to the daemon: one connection, vLLM's primary region registered on it by fd (the
daemon copies rows itself), made again after the daemon went away; never raises (hicached.engine.vllm)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hicached.common.errors import CONNECTION, COPY_FAILED, NOT_FOUND, TIMEOUT, HicachedError
from hicached.engine.client import Client, control
from hicached.engine.vllm.rows import RegionFile, daemon_keys, daemon_pages, namespace, row_parts

logger = logging.getLogger("hicached.engine.vllm")

DEFAULT_SLAB_BYTES = 32 << 20  # the daemon's default pool.slab_size, if its stats do not say
_RECONNECT_MAX_S = 30.0
REGISTER_TIMEOUT_S = 600.0
_DROP = (CONNECTION, COPY_FAILED, NOT_FOUND)
MAX_KEYS = 4096  # per request: well under server.max_keys_per_request and server.max_frame

T = TypeVar("T")


@dataclass(frozen=True)
class Conn:
    """One live connection and what it was made with."""

    client: Client
    handle: int  # vLLM's primary region, as the daemon maps it
    parts: int  # daemon pages a row (1 unless a row is larger than pool.slab_size)
    part_bytes: int
    namespace: str

    def keys(self, keys: Sequence[bytes]) -> list[str]:
        return daemon_keys(keys, self.parts)

    def pages(self, chunk_ids: Any) -> list[int]:
        return daemon_pages(chunk_ids, self.parts)


class Daemon:
    """The connection, made on first use and again after it broke (with backoff), by whichever I/O thread
    needs it: never under vLLM's lock."""

    def __init__(
        self,
        socket_path: str,
        region: RegionFile,
        num_rows: int,
        row_bytes: int,
        fields: dict[str, Any],
        prefix: str,
        timeout_s: float,
        reconnect_s: float,
    ) -> None:
        self.socket_path = socket_path
        self.region = region
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.fields = fields
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.namespace = ""  # known once connected
        self.connects = 0
        self._conn: Conn | None = None
        self._fd = region.fd  # ours (dup'd or opened): kept for registering again after a reconnect
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = 0.0
        self._backoff = reconnect_s
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()

    @property
    def reachable(self) -> bool:
        return self._conn is not None

    def log_once(self, kind: str, message: str, *args: Any) -> None:
        with self._log_lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        logger.warning("hicached: " + message + " (logged once until the daemon answers again)", *args)

    def client(self) -> Conn | None:
        with self._lock:
            if self._conn is not None or self._closed:
                return self._conn
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                conn = self._connect()
            except Exception as e:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, _RECONNECT_MAX_S)
                self.log_once(
                    "connect",
                    "cannot use the daemon at %s (%s); lookups miss and jobs fail until it can be used",
                    self.socket_path,
                    e,
                )
                return None
            self._conn = conn
            self._backoff = self.reconnect_s
            self.connects += 1
        with self._log_lock:
            again = bool(self._logged)
            self._logged.clear()
        logger.info(
            "hicached: %s %s, namespace %s, vLLM's primary region (%d rows of %d bytes%s) mapped",
            "connected again to" if again else "connected to",
            self.socket_path,
            conn.namespace,
            self.num_rows,
            self.row_bytes,
            f", {conn.parts} parts a row" if conn.parts > 1 else "",
        )
        return conn

    def _connect(self) -> Conn:
        try:
            stats = control(self.socket_path, "stats", timeout=self.timeout_s)
            slab = stats.get("pool", {}).get("slabs", {}).get("slab_bytes") or DEFAULT_SLAB_BYTES
        except HicachedError as e:
            if e.code in (CONNECTION, TIMEOUT):
                raise
            slab = DEFAULT_SLAB_BYTES  # a daemon that does not tell: its default; a hello too big says so
        parts = row_parts(self.row_bytes, int(slab))
        part_bytes = self.row_bytes // parts
        ns = namespace(self.prefix, self.fields, part_bytes)
        # reconnect=0: a call on a connection that broke fails at once; this class connects again (and may
        # find another slab size, so other parts and another namespace) on the next use, with backoff.
        client = Client(self.socket_path, ns, part_bytes, timeout=self.timeout_s, reconnect=0)
        try:
            segments = [[self.region.offset, part_bytes, part_bytes]]
            pages = self.num_rows * parts
            if self._fd < 0:
                raise HicachedError(CONNECTION, "the tier was shut down")
            # The daemon maps and prefaults the whole region before it answers: seconds for a large one.
            client.timeout = max(self.timeout_s, REGISTER_TIMEOUT_S)
            try:
                handle = client.register_region(self._fd, part_bytes, segments, num_pages=pages)
            finally:
                client.timeout = self.timeout_s
        except BaseException:
            with contextlib.suppress(Exception):
                client.close()
            raise
        self.namespace = ns
        return Conn(client, handle, parts, part_bytes, ns)

    def drop(self, conn: Conn) -> None:
        """Close `conn` (the daemon unregisters the region and gives back what it held); the next use
        connects again, at once the first time."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._retry_at = 0.0
        with contextlib.suppress(Exception):
            conn.client.close()

    def call(self, what: str, fn: Callable[[Conn], T], default: T, drop_on_timeout: bool = True) -> T:
        """fn(conn), or `default` when there is no daemon or the call failed (logged once a kind)."""
        conn = self.client()
        if conn is None:
            return default
        try:
            return fn(conn)
        except Exception as e:
            code = e.code if isinstance(e, HicachedError) else type(e).__name__
            # CONNECTION: the daemon went away. TIMEOUT: a late answer may hold what only closing the
            # connection gives back. COPY_FAILED, NOT_FOUND: the daemon dropped the region (its file shrank).
            # Connect afresh, registering the region again.
            if code in _DROP or (code == TIMEOUT and drop_on_timeout) or isinstance(e, OSError):
                self.drop(conn)
            self.log_once(f"{what}:{code}", "%s failed (%s)", what, e)
            return default

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block is in L2 or L3 (every part of a split row)."""

        def ask(conn: Conn) -> list[bool]:
            names = conn.keys(keys)
            found: list[bool] = []
            for i in range(0, len(names), MAX_KEYS):
                found += conn.client.present(names[i : i + MAX_KEYS])
            k = conn.parts
            return [all(found[j * k : (j + 1) * k]) for j in range(len(keys))]

        # A lookup that timed out holds nothing: the jobs on this connection go on.
        return self.call("lookup", ask, [False] * len(keys), drop_on_timeout=False)

    def touch(self, keys: Sequence[bytes]) -> int | None:
        """Makes the blocks' pages in L2 the most recently used, the last key most: how many pages the
        daemon holds, or None when it could not be asked."""

        def run(conn: Conn) -> int:
            names = conn.keys(keys)
            return sum(conn.client.touch(names[i : i + MAX_KEYS]) for i in range(0, len(names), MAX_KEYS))

        # Like a lookup, a touch that timed out holds nothing: the jobs on this connection go on.
        return self.call("touch", run, None, drop_on_timeout=False)

    def store(self, keys: Sequence[bytes], chunk_ids: Any) -> tuple[int, int] | None:
        """Copies the rows into the daemon under their keys: (blocks stored, there already counting; bytes
        the daemon copied, not counting what it held already), or None when the daemon could not be asked."""

        def run(conn: Conn) -> tuple[int, int]:
            names, pages = conn.keys(keys), conn.pages(chunk_ids)
            ok: list[bool] = []
            copied: int | None = 0
            for i in range(0, len(names), MAX_KEYS):
                got, n = conn.client.store_pages_copied(
                    conn.handle, pages[i : i + MAX_KEYS], names[i : i + MAX_KEYS]
                )
                ok += got
                copied = None if n is None or copied is None else copied + n
            k = conn.parts
            blocks = sum(all(ok[j * k : (j + 1) * k]) for j in range(len(keys)))
            # A daemon that does not say what it copied (older than the `copied` answer): every block stored.
            return blocks, blocks * self.row_bytes if copied is None else copied * conn.part_bytes

        return self.call("store", run, None)

    def load(self, keys: Sequence[bytes], chunk_ids: Any) -> tuple[int, int]:
        """Fills the rows with the leading blocks the daemon has: (from L2, from L3) in blocks. L2 is asked
        first alone, so that the split is exact; L3 is read (by the daemon) only for what L2 lacked."""

        def run(conn: Conn) -> tuple[int, int]:
            names, pages = conn.keys(keys), conn.pages(chunk_ids)
            n_l2 = self._leading(conn, pages, names, fetch=False)
            n = n_l2
            if n < len(names):
                n += self._leading(conn, pages[n:], names[n:], fetch=True)
            blocks = n // conn.parts
            from_l2 = min(blocks, n_l2 // conn.parts)
            return from_l2, blocks - from_l2

        return self.call("load", run, (0, 0))

    @staticmethod
    def _leading(conn: Conn, pages: list[int], names: list[str], fetch: bool) -> int:
        n = 0
        for i in range(0, len(names), MAX_KEYS):
            batch = names[i : i + MAX_KEYS]
            got = conn.client.load_pages(conn.handle, pages[i : i + MAX_KEYS], batch, fetch=fetch)
            n += got
            if got < len(batch):
                break
        return n

    def close(self) -> None:
        """Unregister the region and close the connection; no connection is made after this."""
        with self._lock:
            conn, self._conn, self._closed = self._conn, None, True
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.client.unregister_region(conn.handle)
            with contextlib.suppress(Exception):
                conn.client.close()

    def release_fd(self) -> None:
        """Close our fd of vLLM's file (after close()): vLLM's cleanup then frees its memory."""
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
