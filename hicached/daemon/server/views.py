"""What `status` and `stats` say, and how each asker sees them: an operator the whole daemon with a section
per tenant, an engine only its own tenant's namespaces, connections and pool."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

# `server` below is a hicached.daemon.server.listener.Server (not imported: the listener imports this module).


def view(server: Any, op: str, answer: Any, tenant: str | None) -> Any:
    """`status` or `stats` as the asker may see it: an engine (`tenant` given) sees only its tenant's
    namespaces and figures, and its tenant's name; an operator everything, and a `tenants` section."""
    if isinstance(answer, Awaitable):
        return _view_later(server, op, answer, tenant)
    # Per-tenant pool figures, where the tiers have them.
    tenant_stats = getattr(server.tiers, "tenant_stats", None)
    if tenant is None:
        if op == "status":
            answer["tenants"] = {name: connections_of(server, name) for name in server.tenants.tenants}
            return answer
        answer["tenants"] = {
            name: {
                **server.tenants.describe(name),
                "connections": connections_of(server, name),
                **(tenant_stats(name) if tenant_stats is not None else {}),
            }
            for name in server.tenants.tenants
        }
        return answer
    answer = _only_namespaces(answer, lambda ns: server.tenants.allows(tenant, ns))
    own = tenant_stats(tenant) if tenant_stats is not None and server.tenants.configured else None
    if op == "status":
        answer["connections"] = connections_of(server, tenant)
        answer["socket"] = server.tenants.tenants[tenant].socket or server.path
        answer["tenant"] = tenant
        if own is not None:  # its own pool's figures, not the whole pool's
            answer.update(
                pages=own["pages"], capacity_bytes=own["capacity_bytes"], used_bytes=own["used_bytes"]
            )
        return answer
    answer["server"]["connections"] = connections_of(server, tenant)
    answer["tenant"] = {"name": tenant, **(tenant_stats(tenant) if tenant_stats is not None else {})}
    if own is not None:
        # The whole pool's figures and the daemon's counters tell of every tenant's pages and traffic:
        # an engine sees its own pool's (what clients read of `pool`, slabs included) and no more.
        answer["pool"] = {k: own[k] for k in ("pages", "capacity_bytes", "used_bytes", "slabs")}
        for k in ("counters", "latency", "backend_counters", "backup", "prefetch", "pinned_bytes"):
            answer.pop(k, None)
    return answer


async def _view_later(server: Any, op: str, answer: Awaitable[Any], tenant: str | None) -> Any:
    return view(server, op, await answer, tenant)


def connections_of(server: Any, tenant: str) -> int:
    return sum(1 for c in server.connections if c.session.tenant == tenant)


def status(server: Any) -> dict:
    pool = server.tiers.index
    return {
        "pid": os.getpid(),
        "socket": server.path,
        "backend": server.tiers.connector.name if server.tiers.connector else "none",
        "write_policy": server.cfg.storage.write_policy,
        "connections": len(server.connections),
        "pages": len(pool.entries),
        "capacity_bytes": pool.capacity,
        "used_bytes": pool.used_bytes(),
        "backup_pending": server.tiers.backup.pending,
        "draining": server.draining,
        "regions": server.regions.count,
    }


async def stats_sliced(server: Any) -> dict:
    """stats(), with the walk over L2's index in slices between which the event loop runs."""
    return stats(server, await server.tiers.index.stats_sliced())


def stats(server: Any, pool: dict | None = None) -> dict:
    out = server.tiers.stats(pool)
    out["server"] = {
        "connections": len(server.connections),
        "refused": server.refused,
        "unauthorized": server.unauthorized,
        "handshake_timeouts": server.handshake_timeouts,
        **server.budget.stats(),
    }
    out["regions"] = server.regions.stats()
    return out


def _only_namespaces(answer: Any, allowed: Callable[[str], bool]) -> Any:
    """`answer` with every map or list under a key named "namespaces" cut down to the allowed namespaces."""
    if not isinstance(answer, dict):
        return answer
    out = {}
    for k, v in answer.items():
        if k == "namespaces" and isinstance(v, dict):
            out[k] = {ns: x for ns, x in v.items() if isinstance(ns, str) and allowed(ns)}
        elif k == "namespaces" and isinstance(v, list):
            out[k] = [ns for ns in v if isinstance(ns, str) and allowed(ns)]
        else:
            out[k] = _only_namespaces(v, allowed)
    return out
