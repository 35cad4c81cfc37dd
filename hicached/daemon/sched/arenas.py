"""The tenants' arenas: which arena of the pool each namespace's pages live in, and pool offsets as the
engines of a tenant see them (within the one arena they map). Without [tenants] the pool is one arena, the
default tenant's, and every engine is of that tenant: the same code serves both."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hicached.common.errors import BAD_REQUEST, UNAUTHORIZED, HicachedError
from hicached.config.schema import TenantConfig
from hicached.config.tenants import DEFAULT as DEFAULT_TENANT
from hicached.config.tenants import matches_any
from hicached.daemon.l2.index import PageIndex
from hicached.daemon.l2.pool import Arena, Pool
from hicached.daemon.sched.session import Session


class Arenas:
    """Namespace -> arena and tenant -> arena. `tenants`: the tenants of the configuration in force (a reload
    replaces it; retenant then places the namespaces afresh)."""

    def __init__(self, pool: Pool, tenants: Callable[[], Mapping[str, TenantConfig]]) -> None:
        self.pool, self.tenants = pool, tenants
        # namespace -> its arena (tenant), from the tenants' namespaces: forgotten at each reload (retenant)
        self._ns_arena: dict[str, int] = {}

    def arena(self, tenant: str) -> tuple[int, int]:
        """(memfd, bytes) of the pool memory that `tenant`'s engines are handed and map: the tenant's arena
        (the default tenant's is the whole pool where there are no tenants). HicachedError(unauthorized) for
        a tenant without a share of L2 (the default tenant, when the tenants take all of pool.capacity)."""
        a = self._tenant_arena(tenant)
        return a.fd, a.size

    def _tenant_arena(self, tenant: str) -> Arena:
        try:
            return self.pool.arena(tenant)
        except KeyError:
            raise HicachedError(
                UNAUTHORIZED,
                f"tenant {tenant!r} has no share of L2: the tenants' capacities take all of pool.capacity",
            ) from None

    def arena_of(self, ns: str) -> int:
        """The arena (index in pool.arenas) that namespace `ns`'s pages live in: its tenant's, by the
        tenants' namespaces (hicached.config.tenants); the default tenant's for the rest."""
        got = self._ns_arena.get(ns)
        if got is not None:
            return got
        name = DEFAULT_TENANT
        for tenant, t in self.tenants().items():
            if matches_any(t.namespaces, ns):
                name = tenant
                break
        try:
            got = self.pool.arena(name).index
        except KeyError:
            got = -1  # the default tenant without a share: nothing of this namespace can be stored
        if len(self._ns_arena) < 1 << 16:
            self._ns_arena[ns] = got
        return got

    def tenant_stats(
        self, index: PageIndex, tenant: str, namespaces: dict[str, int], pinned: list[int]
    ) -> dict[str, Any]:
        """One tenant's figures of L2 (`index`): its pool (arena) and the namespaces whose pages live in
        it."""
        try:
            a = self._tenant_arena(tenant)
        except HicachedError:
            return {"capacity_bytes": 0, "used_bytes": 0, "pages": 0, "namespaces": {}}
        i = a.index
        names = {ns: pb for ns, pb in namespaces.items() if self.arena_of(ns) == i}
        return {
            "pool_bytes": a.size,
            "capacity_bytes": index.allocs[i].capacity,
            "used_bytes": index.used_bytes(i),
            "pages": sum(len(index.ns_entries(ns)) for ns in names),
            "unbacked_bytes": index.arena_dirty[i],
            "reserved_bytes": index.arena_reserved[i],
            "pinned_bytes": pinned[i],
            "namespaces": names,
            "slabs": index.allocs[i].stats(),
        }

    def retenant(self, index: PageIndex, namespaces: dict[str, int]) -> int:
        """After a reload (the tenants' namespaces may have changed): namespaces are placed afresh, and pages
        of a namespace that now belongs to another tenant leave L2 where nothing holds them (in L3 already,
        or nothing to back them up to); the others follow as they become idle (an engine is never handed
        another arena's offsets: engine_offsets refuses). Returns how many left."""
        self._ns_arena.clear()
        if len(self.pool.arenas) == 1 and all(self.arena_of(ns) == 0 for ns in namespaces):
            return 0  # one arena, every namespace in it: nothing to move (no page is looked at)
        n = 0
        for ns in list(namespaces):
            arena = self.arena_of(ns)
            for entry in list(index.ns_entries(ns).values()):
                if entry.cls.arena != arena and entry.evictable:
                    index.remove(entry)
                    n += 1
        return n

    def engine_offsets(self, s: Session, offsets: list[int]) -> list[int]:
        """Pool offsets as the session's engine sees them: within the arena it maps (its tenant's). -1 stays
        -1. HicachedError if one is outside that arena (a namespace that moved to another tenant at a
        reload, with pages still in its old arena): never another tenant's offset."""
        a = self._tenant_arena(s.tenant)
        lo, hi = a.base, a.base + a.size
        if any(not lo <= o < hi for o in offsets if o >= 0):
            raise HicachedError(
                BAD_REQUEST,
                f"namespace {s.ns!r} has pages outside tenant {s.tenant!r}'s pool (its tenant changed at a "
                "reload); they leave L2 once idle: retry later",
            )
        return offsets if not lo else [o - lo if o >= 0 else o for o in offsets]

    def pool_offsets(self, s: Session, offsets: list[Any]) -> list[Any]:
        """Offsets an engine sent (within its arena) as pool offsets; what is not an int is left as it is
        (the caller refuses it)."""
        base = self._tenant_arena(s.tenant).base
        if not base:
            return offsets
        return [o + base if type(o) is int else o for o in offsets]
