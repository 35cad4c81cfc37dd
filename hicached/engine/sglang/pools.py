"""One SGLang host pool served through a daemon connection of its own: the pool registered as a region
(its memfd mapped by the daemon, or its memory as a local region) and its pages moved, or, failing that,
moved through SGLang's page methods."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from hicached.common.errors import HicachedError
from hicached.engine.client import Client
from hicached.engine.link import Link, LogOnce, connect_backoff
from hicached.engine.reconnect import AWAY
from hicached.engine.sglang.metrics import _Metrics
from hicached.engine.sglang.pages import NotSegmentable, PageGeometry, page_geometry, shared_fd, storage_bytes

logger = logging.getLogger("hicached.engine.sglang")

_SCRATCH_BYTES = 64 << 20  # bounds the staging memory of one batch on the page-method path

T = TypeVar("T")
_Conn = tuple[Client, int | None]  # a connection and the pool's region on it (None: the page methods)


class _Owner(Protocol):
    """What a link reads of the backend that holds it (hicached.engine.sglang.HicachedStorage)."""

    socket_path: str
    timeout_s: float
    reconnect_s: float
    metrics: _Metrics
    log_once: LogOnce

    def connected(self, link: PoolLink, again: bool) -> None: ...


class PoolLink:
    """One host pool served through a daemon connection of its own, in its own namespace: its region (the
    pool's memfd, mapped by the daemon, or its memory as a local region), made again after a reconnect.
    Every method answers a miss rather than raise."""

    def __init__(self, owner: _Owner, name: str, pool: Any, namespace: str) -> None:
        self.owner = owner
        self.name = name
        self.pool = pool
        self.namespace = namespace
        flat = pool.get_dummy_flat_data_page()
        self.page_bytes = flat.numel() * flat.element_size()
        self.tokens = int(getattr(pool, "page_size", 1) or 1)
        self._dtype, self._numel = flat.dtype, flat.numel()
        self.geom: PageGeometry | None
        try:
            self.geom = page_geometry(pool)
        except NotSegmentable as e:
            self.geom = None
            logger.warning("hicached: pool %s moves through SGLang's page methods: %s", name, e)
        self.shm = shared_fd(pool, self.geom) if self.geom is not None else None
        self.zero_copy = False  # the daemon maps the pool's memfd (true once registered)
        # The client reconnects by itself within its default wait, registering the region again; the link
        # makes a new one when it gave up. CONNECTION: the daemon went away (a restart). TIMEOUT: a late
        # answer may hold a lease that only closing the connection releases.
        self._link: Link[_Conn] = Link(
            owner.socket_path,
            self._connect,
            lambda conn: conn[0].close(),
            backoff=connect_backoff(owner.reconnect_s),
            log_once=owner.log_once,
            connected=lambda _, again: owner.connected(self, again),
        )
        self._tls = threading.local()

    # -- connection --------------------------------------------------------------------------------

    def client(self) -> _Conn | None:
        """The connection and the pool's region handle on it (None: moved through the page methods), made
        if there is none; None while the daemon is away."""
        return self._link.get()

    def _connect(self) -> _Conn:
        conn = Client(self.owner.socket_path, self.namespace, self.page_bytes, timeout=self.owner.timeout_s)
        try:
            return conn, self._register(conn)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise

    def _register(self, conn: Client) -> int | None:
        """The pool as a region on `conn`: the daemon maps its memfd (zero-copy), or, when the daemon cannot
        take it (an older daemon refuses memory it cannot seal) or there is none, a local region."""
        geom = self.geom
        if geom is None:
            return None
        segments = [list(s) for s in geom.segments]
        if self.shm is not None:
            fd, start = self.shm
            shifted = [[off + start, n, st] for off, n, st in segments]
            try:
                handle = conn.register_region(fd, self.page_bytes, shifted, num_pages=geom.num_pages)
                self.zero_copy = True
                return handle
            except HicachedError as e:
                if e.code in AWAY:
                    raise
                self.owner.log_once(
                    f"region:{self.name}",
                    "the daemon did not map pool %s's shared memory (%s); copying here",
                    self.name,
                    e,
                )
        self.zero_copy = False
        return conn.register_local_region(
            storage_bytes(geom), self.page_bytes, segments, num_pages=geom.num_pages
        )

    def call(self, what: str, fn: Callable[[Client, int | None], T], default: T) -> T:
        """fn(client, handle), or `default` when the daemon is away or the call failed (logged once)."""
        return self._link.call(what, lambda conn: fn(*conn), default)

    def close(self) -> None:
        self._link.close()

    # -- pages -------------------------------------------------------------------------------------

    def pages(self, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        """Host pages of the keys, from SGLang's token indices (one per token of each page)."""
        n = len(host_indices) if host_indices is not None else 0
        if n != len(keys) * self.tokens:
            self.owner.log_once(
                f"indices:{self.name}", "%d host indices for %d keys of %d tokens", n, len(keys), self.tokens
            )
            return None
        return [int(i) // self.tokens for i in host_indices[:: self.tokens].tolist()]

    def store(self, keys: list[str], host_indices: Any, what: str) -> list[bool]:
        """Per key: stored (or there already)."""
        result = [False] * len(keys)
        pages = self.pages(keys, host_indices) if keys else None
        if pages is None:
            return result
        start = time.perf_counter()

        def run(c: Client, handle: int | None) -> list[bool]:
            if handle is not None:
                return c.store_pages(handle, pages, keys)
            return self._store_by_methods(c, keys, pages)

        result = self.call(what, run, result)
        self.owner.metrics.record(
            "backup", sum(result), sum(result) * self.page_bytes, time.perf_counter() - start
        )
        return result

    def load(self, keys: list[str], host_indices: Any, what: str, each: bool) -> list[bool]:
        """Per key: loaded into its host page. The leading run only, or, with `each`, past holes too (a page
        missing ends a call; the pages after it are asked for again)."""
        result = [False] * len(keys)
        pages = self.pages(keys, host_indices) if keys else None
        if pages is None:
            return result
        start = time.perf_counter()

        def run(c: Client, handle: int | None) -> list[bool]:
            i = 0
            while i < len(keys):
                if handle is not None:
                    n = c.load_pages(handle, pages[i:], keys[i:])
                else:
                    n = self._load_by_methods(c, keys[i:], pages[i:])
                result[i : i + n] = [True] * n
                if not each:
                    break
                i += n + 1
            return result

        result = self.call(what, run, result)
        self.owner.metrics.record(
            "prefetch", sum(result), sum(result) * self.page_bytes, time.perf_counter() - start
        )
        return result

    def exists(self, keys: list[str], what: str) -> int:
        return self.call(what, lambda c, _: c.exists(keys), 0) if keys else 0

    def present(self, keys: list[str], what: str) -> list[bool]:
        return self.call(what, lambda c, _: c.present(keys), [False] * len(keys)) if keys else []

    # -- the page-method path: a pool whose pages are not segments of one buffer --------------------

    def _scratch(self) -> Any:
        # Per thread: SGLang's prefetch and backup threads call in parallel and must not share staging.
        scratch = getattr(self._tls, "scratch", None)
        if scratch is None:
            import torch

            rows = max(1, _SCRATCH_BYTES // self.page_bytes)
            scratch = self._tls.scratch = torch.empty((rows, self._numel), dtype=self._dtype)
        return scratch

    def _store_by_methods(self, c: Client, keys: list[str], pages: list[int]) -> list[bool]:
        out: list[bool] = []
        step = max(1, _SCRATCH_BYTES // self.page_bytes)  # get_data_page may copy a strided page
        for start in range(0, len(keys), step):
            batch = [
                self.pool.get_data_page(p * self.tokens, flat=True).contiguous()
                for p in pages[start : start + step]
            ]
            out += c.store(keys[start : start + step], batch)
        return out

    def _load_by_methods(self, c: Client, keys: list[str], pages: list[int]) -> int:
        scratch = self._scratch()
        done = 0
        for start in range(0, len(keys), len(scratch)):
            chunk = keys[start : start + len(scratch)]
            hits = c.load(chunk, list(scratch[: len(chunk)]))
            for j in range(hits):
                self.pool.set_from_flat_data_page(pages[start + j] * self.tokens, scratch[j])
            done += hits
            if hits < len(chunk):
                break
        return done
