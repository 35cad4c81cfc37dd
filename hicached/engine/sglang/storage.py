"""SGLang HiCache storage backend that keeps pages in the hicached daemon, loaded by SGLang's `dynamic`
backend (`module_path="hicached.engine.sglang"`, `class_name="HicachedStorage"`, `interface_v1: 1`).

Each host pool SGLang registers (the KV pool, and for hybrid models the extra pools of the v2 interface:
Mamba state, sliding-window, indexer, ...) is served through a daemon connection of its own, in a namespace
of its own. Its pages move without a copy on SGLang's side: where SGLang allocated the pool in shared memory
(`"allocator": "shm"`), the daemon maps that memfd once as a region and copies a whole batch on its own
threads (one `store_pages` / `load_pages` request); otherwise the pool is a local region and this process
copies a batch straight between the pool's memory and the daemon's shared pool, one copy a page, in one C
call with the GIL released. Pages are described as segments read off SGLang's own page views
(hicached.engine.sglang.pages); a pool that cannot be described so moves through SGLang's page methods.

SGLang calls a storage backend from background threads that it never restarts, so no method here raises:
a daemon that is down or restarting turns into misses (`0`, `False`) and one log line per kind of failure,
and the connection (with its region) is made again on a later call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hicached.engine.client import Client
from hicached.engine.link import LogOnce
from hicached.engine.sglang.metrics import _Metrics
from hicached.engine.sglang.namespace import KV, _join, namespace_prefix, pool_namespace
from hicached.engine.sglang.pools import PoolLink

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:
    # Without sglang the class still works on its own (tools); SGLang's loader needs the real base, and it
    # is there whenever SGLang is the one importing this module.
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["DEFAULT_SOCKET", "KV", "HicachedStorage", "namespace_prefix", "pool_namespace"]

logger = logging.getLogger("hicached.engine.sglang")

DEFAULT_SOCKET = "/run/hicached/hicached.sock"
DEFAULT_TIMEOUT_S = 5.0  # a hung daemon stalls SGLang's prefetch/backup threads for at most this long
DEFAULT_RECONNECT_S = 1.0  # first wait after a failed connect; doubles up to link.RECONNECT_MAX_S


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
        self.links: dict[str, PoolLink] = {}  # pool name -> its link; KV for the anchor pool
        self.metrics = _Metrics()
        self.log_once = LogOnce(logger)  # shared by the pools' links: one line a kind, for the engine

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
        self.links[name] = PoolLink(self, name, pool, pool_namespace(self.storage_config, pool, name))

    # -- logging -----------------------------------------------------------------------------------

    def connected(self, link: PoolLink, again: bool) -> None:
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

    def _kv(self, what: str) -> PoolLink | None:
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

    def _pool(self, name: Any) -> PoolLink | None:
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

    def _block_groups(self, link: PoolLink | None, keys: list[str], transfer: Any) -> int:
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
        self, transfers: Any, what: str, move: Callable[[PoolLink, Any], list[bool]]
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
        return self.metrics.storage_metrics()

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
