"""The tenant table built from [tenants.NAME]: which tenant a peer belongs to, and which namespaces each
tenant may open. A peer belongs to the first tenant it matches: the tenant socket it came through, then its
uid, then its (primary) gid; peers admitted otherwise (server.allowed_uids/gids, operators) are in the
default tenant, which may open every namespace that no configured tenant's patterns cover. With no
[tenants] there is one default tenant, holding every admitted engine and allowing every namespace."""

from __future__ import annotations

from dataclasses import dataclass

from hicached.config import Config, resolve_path
from hicached.config.tenants import DEFAULT, default_capacity, matches_any


@dataclass(frozen=True)
class Tenant:
    name: str
    uids: frozenset[int]
    gids: frozenset[int]
    socket: str  # absolute path of its own socket; "" when it has none (and always for the default tenant)
    patterns: tuple[str, ...]  # the default tenant's are empty: it has what no other tenant covers
    capacity: int  # bytes of L2 it is configured to get (the default tenant: what the others leave)


class TenantTable:
    def __init__(self, cfg: Config) -> None:
        self.tenants: dict[str, Tenant] = {
            name: Tenant(
                name,
                frozenset(t.uids),
                frozenset(t.gids),
                resolve_path(cfg, t.socket) if t.socket else "",
                tuple(t.namespaces),
                t.capacity,
            )
            for name, t in cfg.tenants.items()
        }
        self.configured = bool(self.tenants)
        self.tenants[DEFAULT] = Tenant(DEFAULT, frozenset(), frozenset(), "", (), default_capacity(cfg))
        self.by_socket = {t.socket: t.name for t in self.tenants.values() if t.socket}

    def member(self, uid: int, gid: int, via: str = "") -> str | None:
        """The configured tenant a peer that came through socket `via` ("": server.socket) belongs to, or
        None when it matches none (the caller decides whether it is admitted into the default tenant)."""
        if via in self.by_socket:
            return self.by_socket[via]
        for t in self.tenants.values():
            if uid in t.uids:
                return t.name
        for t in self.tenants.values():
            if gid in t.gids:
                return t.name
        return None

    def allows(self, tenant: str, namespace: str) -> bool:
        """Whether engines of `tenant` may open `namespace`."""
        t = self.tenants.get(tenant)
        if t is None:
            return False
        if t.name == DEFAULT:
            return not any(matches_any(o.patterns, namespace) for o in self.tenants.values())
        return matches_any(t.patterns, namespace)

    def owner(self, namespace: str) -> str:
        """The tenant whose engines may open `namespace`."""
        for t in self.tenants.values():
            if t.name != DEFAULT and matches_any(t.patterns, namespace):
                return t.name
        return DEFAULT

    def describe(self, tenant: str) -> dict:
        """What an operator's `stats` shows of `tenant` (its patterns; the default tenant: "the rest")."""
        t = self.tenants[tenant]
        return {
            "socket": t.socket,
            "uids": sorted(t.uids),
            "gids": sorted(t.gids),
            "patterns": list(t.patterns) if t.name != DEFAULT else ["(every namespace no tenant lists)"],
            "capacity_bytes": t.capacity,
        }
