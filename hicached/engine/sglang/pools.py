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

from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.engine.client import Client
from hicached.engine.sglang.metrics import _Metrics
from hicached.engine.sglang.pages import NotSegmentable, PageGeometry, page_geometry, shared_fd, storage_bytes

logger = logging.getLogger("hicached.engine.sglang")

_RECONNECT_MAX_S = 30.0
_SCRATCH_BYTES = 64 << 20  # bounds the staging memory of one batch on the page-method path

T = TypeVar("T")


class _Owner(Protocol):
    """What a link reads of the backend that holds it (hicached.engine.sglang.HicachedStorage)."""

    socket_path: str
    timeout_s: float
    reconnect_s: float
    metrics: _Metrics

    def log_once(self, kind: str, message: str, *args: Any) -> None: ...

    def connected(self, link: _Link) -> None: ...


class _Link:
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
        self._conn: Client | None = None
        self._handle: int | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = owner.reconnect_s
        self._tls = threading.local()

    # -- connection --------------------------------------------------------------------------------

    def client(self) -> tuple[Client, int | None] | None:
        with self._lock:
            if self._conn is not None:
                return self._conn, self._handle
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                conn = Client(
                    self.owner.socket_path, self.namespace, self.page_bytes, timeout=self.owner.timeout_s
                )
            except Exception as e:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, _RECONNECT_MAX_S)
                self.owner.log_once(
                    "connect",
                    "cannot connect to %s (%s); answering misses, retrying",
                    self.owner.socket_path,
                    e,
                )
                return None
            self._handle = self._register(conn)
            self._conn = conn
            self._backoff = self.owner.reconnect_s
            self.owner.connected(self)
            return conn, self._handle

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
                if e.code in (CONNECTION, TIMEOUT):
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

    def drop(self, conn: Client) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn, self._handle = None, None
                self._retry_at = 0.0  # the first reconnect is immediate; failures then back off
        with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
            conn.close()

    def call(self, what: str, fn: Callable[[Client, int | None], T], default: T) -> T:
        got = self.client()
        if got is None:
            return default
        conn, handle = got
        try:
            return fn(conn, handle)
        except Exception as e:
            code = e.code if isinstance(e, HicachedError) else type(e).__name__
            # CONNECTION: the daemon went away (a restart). TIMEOUT: a late answer may hold a lease that only
            # closing the connection releases. Either way, connect afresh (and register again) later.
            if code in (CONNECTION, TIMEOUT) or isinstance(e, OSError):
                self.drop(conn)
            self.owner.log_once(f"{what}:{code}", "%s failed (%s); answering a miss", what, e)
            return default

    def close(self) -> None:
        with self._lock:
            conn, self._conn, self._handle = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

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
