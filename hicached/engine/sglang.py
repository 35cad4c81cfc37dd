"""SGLang HiCache storage backend that keeps pages in the hicached daemon, loaded by SGLang's `dynamic`
backend (`module_path="hicached.engine.sglang"`, `class_name="HicachedStorage"`, `interface_v1: 1`).

Each host pool SGLang registers (the KV pool, and for hybrid models the extra pools of the v2 interface:
Mamba state, sliding-window, indexer, ...) is served through a daemon connection of its own, in a namespace
of its own. Its pages move without a copy on SGLang's side: where SGLang allocated the pool in shared memory
(`"allocator": "shm"`), the daemon maps that memfd once as a region and copies a whole batch on its own
threads (one `store_pages` / `load_pages` request); otherwise the pool is a local region and this process
copies a batch straight between the pool's memory and the daemon's shared pool, one copy a page, in one C
call with the GIL released. Pages are described as segments read off SGLang's own page views
(hicached.engine.sglang_pages); a pool that cannot be described so moves through SGLang's page methods.

SGLang calls a storage backend from background threads that it never restarts, so no method here raises:
a daemon that is down or restarting turns into misses (`0`, `False`) and one log line per kind of failure,
and the connection (with its region) is made again on a later call.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.common.keys import NAMESPACE_MAX_LEN
from hicached.engine.client import Client
from hicached.engine.sglang_pages import NotSegmentable, PageGeometry, page_geometry, shared_fd, storage_bytes

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:
    # Without sglang the class still works on its own (tools); SGLang's loader needs the real base, and it
    # is there whenever SGLang is the one importing this module.
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["DEFAULT_SOCKET", "HicachedStorage", "namespace_prefix"]

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/hicached/hicached.sock"
DEFAULT_TIMEOUT_S = 5.0  # a hung daemon stalls SGLang's prefetch/backup threads for at most this long
DEFAULT_RECONNECT_S = 1.0  # first wait after a failed connect; doubles up to _RECONNECT_MAX_S
_RECONNECT_MAX_S = 30.0
_SCRATCH_BYTES = 64 << 20  # bounds the staging memory of one batch on the page-method path
_METRICS_MAX = 4096  # figures kept between two get_stats() calls (SGLang reads them every few seconds)
KV = "kv"  # the anchor pool's name (SGLang's PoolName.KV)

T = TypeVar("T")


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


def namespace_prefix(storage_config: Any) -> list[str]:
    """The parts of the namespace that SGLang's storage config decides: model, parallel ranks, salt."""
    return _prefix(storage_config, tp_always=False)


def _prefix(storage_config: Any, tp_always: bool) -> list[str]:
    extra = getattr(storage_config, "extra_config", None) or {}
    parts = [_clean(str(getattr(storage_config, "model_name", None) or "")) or "model"]
    # MLA keeps the same KV on every TP rank, so ranks share pages; otherwise each rank holds its heads.
    # Mamba state is TP-sharded even when the model's MLA KV is replicated (`tp_always`).
    if tp_always or not getattr(storage_config, "is_mla_model", False):
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if getattr(storage_config, "pp_size", 1) > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if getattr(storage_config, "attn_cp_size", 1) > 1:  # each context-parallel rank holds a slice of a page
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    if getattr(storage_config, "dcp_size", 1) > 1:  # MLA shards of decode context parallelism
        parts.append(f"dcp{storage_config.dcp_rank}of{storage_config.dcp_size}")
    if extra.get("salt"):
        parts.append(_salt(str(extra["salt"])))
    return parts


def _salt(salt: str) -> str:
    """The salt as a namespace part: as it is when it is made of namespace characters and short, else its
    cleaned start and a digest of all of it, so that salts differing only in other characters (`a/b`, `a:b`)
    or past the cut never share pages."""
    clean = _clean(salt)
    if clean == salt and len(salt) <= 32:
        return salt
    return "-".join(p for p in (clean[:32], hashlib.sha256(salt.encode()).hexdigest()[:16]) if p)


def _join(parts: list[str]) -> str:
    ns = ".".join(p for p in parts if p)
    if len(ns) <= NAMESPACE_MAX_LEN:
        return ns
    # A long model name: keep it recognisable and still distinct.
    digest = hashlib.sha256(parts[0].encode()).hexdigest()[:12]
    room = NAMESPACE_MAX_LEN - len(ns) + len(parts[0]) - len(digest) - 1
    if room >= 1:
        return ".".join(p for p in [f"{parts[0][:room]}-{digest}", *parts[1:]] if p)
    # The other parts alone are too long: the start of the whole, and a digest of all of it.
    digest = hashlib.sha256(ns.encode()).hexdigest()[:16]
    return f"{ns[: NAMESPACE_MAX_LEN - len(digest) - 1]}-{digest}"


def pool_namespace(storage_config: Any, pool: Any, name: str) -> str:
    """The namespace of one host pool's pages: what changes their bytes (model, dtype, tokens per page,
    layout, parallel ranks, salt) and, for an extra pool of the v2 interface, its name."""
    flat = pool.get_dummy_flat_data_page()
    dtype = str(flat.dtype).removeprefix("torch.")
    tokens = int(getattr(pool, "page_size", 1) or 1)
    layout = _clean(str(getattr(pool, "layout", "") or ""))
    parts = _prefix(storage_config, tp_always=name == "mamba")
    model, rest = parts[0], parts[1:]
    return _join([model, dtype, f"p{tokens}", layout, *rest, "" if name == KV else _clean(name)])


class _Metrics:
    """SGLang's StorageMetrics figures, taken per call and handed over (then forgotten) by get_stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.figures: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=_METRICS_MAX)
            for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        with self._lock:
            self.figures[f"{kind}_pgs"].append(pages)
            self.figures[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)  # GB/s

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out = {k: list(v) for k, v in self.figures.items()}
            for v in self.figures.values():
                v.clear()
        return out


class _Link:
    """One host pool served through a daemon connection of its own, in its own namespace: its region (the
    pool's memfd, mapped by the daemon, or its memory as a local region), made again after a reconnect.
    Every method answers a miss rather than raise."""

    def __init__(self, owner: HicachedStorage, name: str, pool: Any, namespace: str) -> None:
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


class HicachedStorage(_Base):
    """`HiCacheStorage` over a hicached daemon; built by SGLang as `cls(storage_config, kwargs)`.

    extra_config keys: `socket` (default /run/hicached/hicached.sock), `timeout_s`, `reconnect_s`, `salt`.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.storage_config = storage_config
        self.socket_path = str(extra.get("socket", DEFAULT_SOCKET))
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.reconnect_s = float(extra.get("reconnect_s", DEFAULT_RECONNECT_S))
        self.namespace = _join(namespace_prefix(storage_config))  # completed once the KV pool is registered
        self.mem_pool_host: Any = None
        self.links: dict[str, _Link] = {}  # pool name -> its link; KV for the anchor pool
        self.metrics = _Metrics()
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()

    @property
    def page_bytes(self) -> int:
        kv = self.links.get(KV)
        return kv.page_bytes if kv is not None else 0

    # -- registration ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._link(KV, mem_pool_host)
        self.namespace = self.links[KV].namespace
        self.links[KV].client()  # connect now so a wrong socket path shows in the log at start-up

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == KV and self.mem_pool_host is host_pool:
            return  # the anchor pool, registered already
        self._link(name, host_pool)

    def on_host_pools_registered(self) -> None:
        for link in list(self.links.values()):
            link.client()  # never raises: a daemon that is down is tried again on the first call

    def _link(self, name: str, pool: Any) -> None:
        old = self.links.get(name)
        if old is not None:
            old.close()
        self.links[name] = _Link(self, name, pool, pool_namespace(self.storage_config, pool, name))

    # -- logging -----------------------------------------------------------------------------------

    def log_once(self, kind: str, message: str, *args: Any) -> None:
        with self._log_lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        logger.warning("hicached: " + message + " (logged once until the daemon answers again)", *args)

    def connected(self, link: _Link) -> None:
        with self._log_lock:
            again = bool(self._logged)
            self._logged.clear()
        how = "shared memory mapped by the daemon" if link.zero_copy else "copied by this process"
        if link.geom is None:
            how = "SGLang's page methods"
        logger.info(
            "hicached: %s %s, pool %s in namespace %s (%s)",
            "connected again to" if again else "connected to",
            self.socket_path,
            link.name,
            link.namespace,
            how,
        )

    def _kv(self, what: str) -> _Link | None:
        link = self.links.get(KV)
        if link is None:
            self.log_once("no_pool", "%s before a host pool was registered; answering misses", what)
        return link

    # -- the v1 interface (interface_v1: 1) ---------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """The leading hits, read into their host pages (SGLang uses the leading run only)."""
        link = self._kv("batch_get_v1")
        return link.load(keys, host_indices, "batch_get_v1", each=False) if link else [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        link = self._kv("batch_set_v1")
        return link.store(keys, host_indices, "batch_set_v1") if link else [False] * len(keys)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        link = self._kv("batch_exists")
        return link.exists(keys, "batch_exists") if link else 0

    # -- the v2 interface: several host pools, each in a namespace of its own -----------------------

    def _pool(self, name: Any) -> _Link | None:
        link = self.links.get(str(getattr(name, "value", name)))
        if link is None:
            self.log_once(f"pool:{name}", "no host pool %s registered; answering misses", name)
        return link

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """As SGLang's HiCacheFile answers it: the leading KV pages present, then each extra pool narrows
        the prefix lengths that can be restored (all_pages: each page of the prefix; trailing_pages: the
        last len(keys) pages before it; block_groups: whole groups of blocks, reported, never narrowing)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult

        kv = self._kv("batch_exists_v2")
        kv_pages = kv.exists(keys, "batch_exists_v2") if kv else 0
        hit_count: dict[Any, int] = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            link = self._pool(transfer.name)
            name = transfer.name
            policy = transfer.hit_policy
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = link.exists(keys[:kv_pages], "batch_exists_v2") if link else 0
                pool_restorable = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                here = link.present(keys[:kv_pages], "batch_exists_v2") if link else [False] * kv_pages
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {p for p in range(1, kv_pages + 1) if all(here[max(0, p - trailing) : p])}
                boundary = max(pool_restorable, default=0)
            elif policy == PoolHitPolicy.BLOCK_GROUPS:
                boundary = self._block_groups(link, keys[:kv_pages], transfer)
                if boundary:
                    hit_count[name] = boundary
                continue  # its own verdict: it never gates the KV hit
            else:
                self.log_once(
                    f"policy:{policy}", "unknown pool hit policy %s; pool %s is a miss", policy, name
                )
                pool_restorable, boundary = set(), 0
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hit_count, restorable)

    def _block_groups(self, link: _Link | None, keys: list[str], transfer: Any) -> int:
        """The pages that the pool's leading complete groups cover: its keys are the pages at block
        boundaries from the span start (every block_pages-th page's key), a group is group_pages of them."""
        block, group = int(transfer.block_pages or 0), int(transfer.group_pages or 0)
        if link is None or block <= 0 or group <= 0:
            return 0
        boundaries = keys[block - 1 :: block]
        whole = len(boundaries) // group * group
        present = link.present(boundaries[:whole], "batch_exists_v2")
        groups = 0
        while groups * group < whole and all(present[groups * group : (groups + 1) * group]):
            groups += 1
        return groups * group * block

    def _batch_v2(
        self, transfers: Any, what: str, move: Callable[[_Link, Any], list[bool]]
    ) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            link = self._pool(transfer.name)
            if link is None:
                out[transfer.name] = [False] * len(keys)
                continue
            out[transfer.name] = move(link, transfer) if keys else []
        return out

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Per pool, per key: read into its host page (each key on its own, as HiCacheFile answers)."""
        return self._batch_v2(
            transfers,
            "batch_get_v2",
            lambda link, t: link.load(list(t.keys), t.host_indices, "batch_get_v2", each=True),
        )

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._batch_v2(
            transfers,
            "batch_set_v2",
            lambda link, t: link.store(list(t.keys), t.host_indices, "batch_set_v2"),
        )

    # -- the legacy interface (abstract in HiCacheStorage) -------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        misses: list[Any] = [None] * len(keys)
        kv = self._kv("batch_get")
        if kv is None:
            return misses
        if target_locations is not None:
            n = kv.call("batch_get", lambda c, _: c.load(keys, target_locations), 0)
            return list(target_locations[:n]) + misses[n:]

        def fetch(c: Client, _: Any) -> list[Any]:
            import torch

            pages = [torch.frombuffer(bytearray(p), dtype=torch.uint8).view(kv._dtype) for p in c.get(keys)]
            return pages + misses[len(pages) :]

        return kv.call("batch_get", fetch, misses)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        kv = self._kv("batch_set")
        if kv is None or values is None or len(values) != len(keys):
            return False
        pages = [v.contiguous() if hasattr(v, "contiguous") else v for v in values]
        return kv.call("batch_set", lambda c, _: all(c.store(keys, pages)), False)

    # -- housekeeping ------------------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics: per batch since the last call, the pages read (prefetch_pgs) and
        written (backup_pgs) and their speed in GB/s, as this process saw each call end to end."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        out = StorageMetrics()
        for name, values in self.metrics.take().items():
            getattr(out, name).extend(values)
        return out

    def clear(self) -> bool:
        """SGLang's clear_hicache_storage: every page of this engine's pools (their namespaces: the model,
        its layout and this rank, so every engine on the node that shares them) is forgotten by the daemon,
        in L2 and in L3; no page stored before is served after it (a weight update under the same model
        name must not meet the KV of the old weights). True when every pool's namespace was cleared in both;
        a failure is logged, never raised (SGLang calls this on its scheduler thread)."""
        ok = True
        for name, link in list(self.links.items()):
            got = link.call("clear", lambda conn, _: conn.clear(), None)
            if got is None or got.get("error") or got.get("busy"):
                ok = False
                logger.error("hicached: clearing pool %s (%s) did not finish: %s", name, link.namespace, got)
            else:
                logger.info(
                    "hicached: pool %s (%s) cleared: %d pages from L2, %d objects from L3",
                    name, link.namespace, got["l2"], got["l3"],
                )  # fmt: skip
        return ok

    def close(self) -> None:
        for link in self.links.values():
            link.close()
