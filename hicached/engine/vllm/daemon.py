"""The vLLM tier's link to the daemon: one connection, vLLM's primary region registered on it by fd (the
daemon copies rows itself), made again after the daemon went away; never raises (hicached.engine.vllm)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hicached.common.errors import CONNECTION, COPY_FAILED, NOT_FOUND, HicachedError
from hicached.engine.client import Client, control
from hicached.engine.link import Link, LogOnce, connect_backoff
from hicached.engine.reconnect import AWAY
from hicached.engine.vllm.rows import RegionFile, daemon_keys, daemon_pages, namespace, row_parts

logger = logging.getLogger("hicached.engine.vllm")

DEFAULT_SLAB_BYTES = 32 << 20  # the daemon's default pool.slab_size, if its stats do not say
REGISTER_TIMEOUT_S = 600.0
# The errors on which a connection is closed and made afresh, registering the region again: those that say
# the daemon is away (CONNECTION: it went; TIMEOUT: a late answer may hold what only closing the connection
# gives back), and COPY_FAILED, NOT_FOUND: the daemon dropped the region (its file shrank).
_DROP = (*AWAY, COPY_FAILED, NOT_FOUND)
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
        self._fd = region.fd  # ours (dup'd or opened): kept for registering again after a reconnect
        self._link: Link[Conn] = Link(
            socket_path,
            self._connect,
            lambda conn: conn.client.close(),
            backoff=connect_backoff(reconnect_s),
            log_once=LogOnce(logger),
            connected=self._connected,
            down="cannot use the daemon at %s (%s); lookups miss and jobs fail until it can be used",
            failed="%s failed (%s)",
            drop=_DROP,
        )

    @property
    def reachable(self) -> bool:
        return self._link.reachable

    @property
    def connects(self) -> int:
        return self._link.connects

    def client(self) -> Conn | None:
        return self._link.get()

    def _connected(self, conn: Conn, again: bool) -> None:
        logger.info(
            "hicached: %s %s, namespace %s, vLLM's primary region (%d rows of %d bytes%s) mapped",
            "connected again to" if again else "connected to",
            self.socket_path,
            conn.namespace,
            self.num_rows,
            self.row_bytes,
            f", {conn.parts} parts a row" if conn.parts > 1 else "",
        )

    def _connect(self) -> Conn:
        try:
            stats = control(self.socket_path, "stats", timeout=self.timeout_s)
            slab = stats.get("pool", {}).get("slabs", {}).get("slab_bytes") or DEFAULT_SLAB_BYTES
        except HicachedError as e:
            if e.code in AWAY:
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

    def call(self, what: str, fn: Callable[[Conn], T], default: T, drop_on_timeout: bool = True) -> T:
        """fn(conn), or `default` when there is no daemon or the call failed (logged once a kind)."""
        return self._link.call(what, fn, default, drop_on_timeout)

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
        self._link.close(bye=lambda conn: conn.client.unregister_region(conn.handle))

    def release_fd(self) -> None:
        """Close our fd of vLLM's file (after close()): vLLM's cleanup then frees its memory."""
        self._link.close()  # no connect is under way, or will be, that could register the fd
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
