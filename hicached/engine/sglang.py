"""SGLang HiCache storage backend that keeps pages in the hicached daemon, loaded by SGLang's `dynamic`
backend (`module_path="hicached.engine.sglang"`, `class_name="HicachedStorage"`, `interface_v1: 1`).

SGLang calls a storage backend from background threads that it never restarts, so no method here raises:
a daemon that is down or restarting turns into misses (`0`, `False`, `None`) and one log line per kind of
failure, and the connection is made again on a later call.
"""

from __future__ import annotations

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

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:
    # Without sglang the class still works on its own (tests, tools); SGLang's loader needs the real base,
    # and it is there whenever SGLang is the one importing this module.
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["DEFAULT_SOCKET", "HicachedStorage", "namespace_prefix"]

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/hicached/hicached.sock"
DEFAULT_TIMEOUT_S = 5.0  # a hung daemon stalls SGLang's prefetch/backup threads for at most this long
DEFAULT_RECONNECT_S = 1.0  # first wait after a failed connect; doubles up to _RECONNECT_MAX_S
_RECONNECT_MAX_S = 30.0
_SCRATCH_BYTES = 64 << 20  # bounds the staging memory of one batch, whatever the page size

T = TypeVar("T")


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


def namespace_prefix(storage_config: Any) -> list[str]:
    """The parts of the namespace that SGLang's storage config decides: model, parallel ranks, salt."""
    extra = getattr(storage_config, "extra_config", None) or {}
    parts = [_clean(str(getattr(storage_config, "model_name", None) or "")) or "model"]
    # MLA keeps the same KV on every TP rank, so ranks share pages; otherwise each rank holds its heads.
    if not getattr(storage_config, "is_mla_model", False):
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if getattr(storage_config, "pp_size", 1) > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if getattr(storage_config, "attn_cp_size", 1) > 1:  # each context-parallel rank holds a slice of a page
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
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


class HicachedStorage(_Base):
    """`HiCacheStorage` over a hicached daemon; built by SGLang as `cls(storage_config, kwargs)`.

    extra_config keys: `socket` (default /run/hicached/hicached.sock), `timeout_s`, `reconnect_s`, `salt`.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.socket_path = str(extra.get("socket", DEFAULT_SOCKET))
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.reconnect_s = float(extra.get("reconnect_s", DEFAULT_RECONNECT_S))
        self._prefix = namespace_prefix(storage_config)
        self.namespace = _join(self._prefix)  # completed with the page layout by register_mem_pool_host
        self.mem_pool_host: Any = None
        self.page_bytes = 0
        self._page_numel = 0
        self._dtype: Any = None
        self._host_page_size = 1
        self._conn: Client | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = self.reconnect_s
        self._logged: set[str] = set()
        self._tls = threading.local()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        dummy = mem_pool_host.get_dummy_flat_data_page()
        self._dtype = dummy.dtype
        self._page_numel = dummy.numel()
        self.page_bytes = self._page_numel * dummy.element_size()
        self._host_page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        # Dtype, page size and layout all change the bytes of a flat page, so they belong to the namespace.
        dtype = str(self._dtype).removeprefix("torch.")
        layout = _clean(str(getattr(mem_pool_host, "layout", "") or ""))
        model, rest = self._prefix[0], self._prefix[1:]
        self.namespace = _join([model, dtype, f"p{self._host_page_size}", layout, *rest])
        self.mem_pool_host = mem_pool_host
        self._client()  # connect now so a wrong socket path shows in the log at start-up

    # -- connection --------------------------------------------------------------------------------

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("hicached: " + message + " (logged once until the daemon answers again)", *args)

    def _client(self) -> Client | None:
        with self._lock:
            if self._conn is not None:
                return self._conn
            if not self.page_bytes:
                self._log_once("no_pool", "no host pool registered yet; answering misses")
                return None
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                self._conn = Client(self.socket_path, self.namespace, self.page_bytes, timeout=self.timeout_s)
            except Exception as e:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, _RECONNECT_MAX_S)
                self._log_once(
                    "connect", "cannot connect to %s (%s); answering misses, retrying", self.socket_path, e
                )
                return None
            if self._logged - {"no_pool"}:
                logger.info("hicached: connected to %s again", self.socket_path)
            else:
                logger.info("hicached: connected to %s, namespace %s", self.socket_path, self.namespace)
            self._logged.clear()
            self._backoff = self.reconnect_s
            return self._conn

    def _drop(self, conn: Client) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._retry_at = 0.0  # the first reconnect is immediate; failures then back off
        with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
            conn.close()

    def _call(self, what: str, fn: Callable[[Client], T], default: T) -> T:
        conn = self._client()
        if conn is None:
            return default
        try:
            return fn(conn)
        except Exception as e:
            code = e.code if isinstance(e, HicachedError) else type(e).__name__
            # CONNECTION: the daemon went away (a restart). TIMEOUT: a late answer may hold a lease that only
            # closing the connection releases. Either way, connect afresh on a later call.
            if code in (CONNECTION, TIMEOUT) or isinstance(e, OSError):
                self._drop(conn)
            self._log_once(f"{what}:{code}", "%s failed (%s); answering a miss", what, e)
            return default

    # -- the v1 interface (interface_v1: 1) ---------------------------------------------------------

    def _page_offsets(self, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        ps = self._host_page_size
        if self.mem_pool_host is None:
            self._log_once("no_pool", "no host pool registered yet; answering misses")
            return None
        if len(host_indices) != len(keys) * ps:
            self._log_once(
                "indices", "%d host indices for %d keys of %d tokens", len(host_indices), len(keys), ps
            )
            return None
        return [int(i) for i in host_indices[::ps].tolist()]

    def _scratch(self) -> Any:
        # Per thread: SGLang's prefetch and backup threads call in parallel and must not share staging.
        scratch = getattr(self._tls, "scratch", None)
        if scratch is None or scratch.shape[1] != self._page_numel or scratch.dtype != self._dtype:
            import torch

            rows = max(1, _SCRATCH_BYTES // self.page_bytes)
            scratch = torch.empty((rows, self._page_numel), dtype=self._dtype)
            self._tls.scratch = scratch
        return scratch

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        result = [False] * len(keys)
        offsets = self._page_offsets(keys, host_indices) if keys else None
        if offsets is None:
            return result

        def load(c: Client) -> list[bool]:
            scratch = self._scratch()
            for start in range(0, len(keys), len(scratch)):
                chunk = keys[start : start + len(scratch)]
                hits = c.load(chunk, list(scratch[: len(chunk)]))
                for j in range(hits):
                    self.mem_pool_host.set_from_flat_data_page(offsets[start + j], scratch[j])
                    result[start + j] = True
                if hits < len(chunk):
                    break  # a hole ends the prefix: what follows is of no use to SGLang
            return result

        return self._call("batch_get_v1", load, result)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        result = [False] * len(keys)
        offsets = self._page_offsets(keys, host_indices) if keys else None
        if offsets is None:
            return result

        def store(c: Client) -> list[bool]:
            step = max(1, _SCRATCH_BYTES // self.page_bytes)  # get_data_page may copy a strided page
            for start in range(0, len(keys), step):
                pages = [
                    self.mem_pool_host.get_data_page(i, flat=True) for i in offsets[start : start + step]
                ]
                done = c.store(keys[start : start + step], [p.contiguous() for p in pages])
                result[start : start + len(done)] = done
                if not all(done):
                    break  # pages after a hole could never be read as a prefix
            return result

        return self._call("batch_set_v1", store, result)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._call("batch_exists", lambda c: c.exists(keys), 0) if keys else 0

    # -- the legacy interface (abstract in HiCacheStorage) -------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        misses: list[Any] = [None] * len(keys)
        if target_locations is not None:
            n = self._call("batch_get", lambda c: c.load(keys, target_locations), 0)
            return list(target_locations[:n]) + misses[n:]

        def fetch(c: Client) -> list[Any]:
            import torch

            pages = [torch.frombuffer(bytearray(p), dtype=torch.uint8).view(self._dtype) for p in c.get(keys)]
            return pages + misses[len(pages) :]

        return self._call("batch_get", fetch, misses)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None or len(values) != len(keys):
            return False
        pages = [v.contiguous() if hasattr(v, "contiguous") else v for v in values]
        return self._call("batch_set", lambda c: all(c.store(keys, pages)), False)

    # -- housekeeping ------------------------------------------------------------------------------

    def get_stats(self) -> None:
        return None  # SGLang asserts StorageMetrics or None; the daemon's own stats are `hicached ctl stats`

    def clear(self) -> None:
        """A no-op: the daemon's pages are shared by every engine on the node (`hicached ctl flush`)."""

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
