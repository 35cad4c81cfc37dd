"""The engine requests (hello, exists, alloc, put, acquire, ...): a handler per op over the tiers, with the
namespace each tenant may open and the engine's offsets within its tenant's arena."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from hicached.common.errors import BAD_REQUEST, UNAUTHORIZED, HicachedError
from hicached.common.keys import check_keys, check_namespace
from hicached.common.protocol import ALLOC_WRITE, arg, keys_arg
from hicached.config.tenants import DEFAULT
from hicached.daemon.sched.tiers import Session, Tiers
from hicached.daemon.server.tenants import TenantTable

Handler = Callable[[Session, dict[str, Any]], Any]


class Unanswered(dict):
    """The handlers of a server being handed over: every op is held without an answer until its
    connection closes (cancelling it); nothing runs."""

    def get(self, op: Any, default: Any = None) -> Handler:
        return _never_answered


def _never_answered(session: Session, req: dict[str, Any]) -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


def check_tenant_namespace(table: TenantTable, tenant: str, ns: str) -> None:
    """`unauthorized` unless engines of `tenant` may open `ns` (and the tenant has L2 to store in)."""
    if not table.allows(tenant, ns):
        owner = table.owner(ns)
        if tenant == DEFAULT:
            why = f"it is tenant {owner!r}'s (tenants.{owner}.namespaces)"
        else:
            patterns = ", ".join(table.tenants[tenant].patterns)
            why = f"tenant {tenant!r} may open {patterns} (tenants.{tenant}.namespaces)"
        raise HicachedError(UNAUTHORIZED, f"namespace {ns!r} is not tenant {tenant!r}'s: {why}")
    if table.configured and table.tenants[tenant].capacity <= 0:
        raise HicachedError(
            UNAUTHORIZED,
            f"tenant {tenant!r} has no L2 (the tenants' capacities take all of pool.capacity): no "
            "namespace can be opened in it",
        )


def engine_handlers(server: Any, tiers: Tiers) -> dict[str, Handler]:
    """The handlers of the engine requests, by op, for `server` (hicached.daemon.server.listener.Server)
    over `tiers`: offsets in and out are the engine's, within its tenant's arena."""
    t = tiers

    def keys(s: Session, req: dict[str, Any]) -> list[str]:
        s.require_hello()
        try:
            return list(check_keys(keys_arg(req, server.cfg.server.max_keys_per_request)))
        except ValueError as e:
            raise HicachedError(BAD_REQUEST, str(e)) from None

    def sums(req: dict[str, Any], n: int) -> list[int] | None:
        """The optional checksums of a put or commit: the xxh3-64 of each page, taken by the client as it
        copied the page (a wrong one makes the page a miss when it is read back from L3)."""
        got = req.get("sums")
        if got is None:
            return None
        if (
            type(got) is not list
            or len(got) != n
            or (n and (set(map(type, got)) != {int} or min(got) < 0 or max(got) >= 1 << 64))
        ):  # (in C-speed passes: a bool, a float or None is refused by its type)
            raise HicachedError(
                BAD_REQUEST, f"sums must be a list of {n} unsigned 64-bit integers, one a key"
            )
        return got

    def hello(s: Session, req: dict[str, Any]) -> dict:
        try:
            ns = check_namespace(arg(req, "namespace", str))
        except ValueError as e:
            raise HicachedError(BAD_REQUEST, str(e)) from None
        check_tenant_namespace(server.tenants, s.tenant, ns)
        return t.hello(s, ns, arg(req, "page_bytes", int))

    def all_in_l2(s: Session, req: dict[str, Any]) -> list[str] | None:
        """The request's keys when every one is a ready page in L2: those are known to be valid, so
        the common lookup skips validation; None otherwise."""
        s.require_hello()
        ks = keys_arg(req, server.cfg.server.max_keys_per_request)
        try:
            return ks if t.all_ready(s, ks) else None
        except TypeError:  # an unhashable "key"
            return None

    def exists(s: Session, req: dict[str, Any]) -> Any:
        ks = all_in_l2(s, req)
        if ks is not None:
            t.counters["lookup.l2_hits"] += len(ks)
            return {"n": len(ks)}  # answered inline: no task, no extra loop pass
        ks = keys(s, req)
        n = t.exists_l2(s, ks)
        if n is not None:
            return {"n": n}
        return _exists_l3(t.exists(s, ks))  # taken now: of the request's namespace, not a later hello's

    async def _exists_l3(pending: Awaitable[int]) -> dict:
        return {"n": await pending}

    async def _present(pending: Awaitable[list[bool]]) -> dict:
        return {"present": await pending}

    def alloc(s: Session, req: dict[str, Any]) -> dict:
        ks = keys(s, req)
        status, offsets = t.alloc(s, ks)
        try:
            return {"status": status, "offsets": t.engine_offsets(s, offsets)}
        except HicachedError:
            t.abort(s, [k for k, st in zip(ks, status, strict=True) if st == ALLOC_WRITE])
            raise

    def reserve(s: Session, req: dict[str, Any]) -> dict:
        s.require_hello()
        n = arg(req, "n", int)
        limit = server.cfg.server.max_keys_per_request
        if not 0 <= n <= limit:
            raise HicachedError(BAD_REQUEST, f"n must be between 0 and {limit}, got {n}")
        offsets, may_hold = t.reserve(s, n)
        return {"offsets": t.engine_offsets(s, offsets), "limit": may_hold}

    def put(s: Session, req: dict[str, Any]) -> dict:
        ks = keys(s, req)
        offsets = t.pool_offsets(s, arg(req, "offsets", list))  # the engine's are within its arena
        return {"status": t.put(s, ks, offsets, sums(req, len(ks)))}

    def commit(s: Session, req: dict[str, Any]) -> dict:
        ks = keys(s, req)
        return {"ok": t.commit(s, ks, sums(req, len(ks)))}

    def acquire(s: Session, req: dict[str, Any]) -> Any:
        ks = all_in_l2(s, req)
        if ks is not None:
            return leased(s, *t.acquire_ready(s, ks))
        # Taken now: in the namespace of the request, not of a hello sent after it.
        return _acquire(s, t.acquire(s, keys(s, req), arg(req, "fetch", bool, True)))

    async def _acquire(s: Session, pending: Awaitable[tuple[int, list[int]]]) -> dict:
        return leased(s, *await pending)

    def leased(s: Session, lease: int, offsets: list[int]) -> dict:
        """The answer to an acquire: offsets as the engine sees them (within its tenant's arena)."""
        try:
            return {"lease": lease, "offsets": t.engine_offsets(s, offsets)}
        except HicachedError:
            if lease:
                t.release(s, lease)
            raise

    def release(s: Session, req: dict[str, Any]) -> dict:
        t.release(s, arg(req, "lease", int))
        return {}

    def prefetch(s: Session, req: dict[str, Any]) -> dict:
        return {"handle": t.prefetch(s, keys(s, req), arg(req, "priority", int, 0))}

    async def wait(s: Session, req: dict[str, Any]) -> dict:
        timeout = arg(req, "timeout", (int, float), None)
        if timeout is not None and timeout < 0:
            raise HicachedError(BAD_REQUEST, "timeout cannot be negative")
        return {"n": await t.wait(s, arg(req, "handle", int), timeout)}

    def status(s: Session, req: dict[str, Any]) -> dict:
        return server.status()

    def stats(s: Session, req: dict[str, Any]) -> Any:
        return server.stats_sliced()

    return {
        "hello": hello,
        "exists": exists,
        "present": lambda s, req: _present(t.present(s, keys(s, req))),
        "alloc": alloc,
        "commit": commit,
        "abort": lambda s, req: {"n": t.abort(s, keys(s, req))},
        "reserve": reserve,
        "put": put,
        "acquire": acquire,
        "release": release,
        "prefetch": prefetch,
        "wait": wait,
        "pin": lambda s, req: {"n": t.pin(s, keys(s, req))},
        "unpin": lambda s, req: {"n": t.unpin(s, keys(s, req))},
        "touch": lambda s, req: {"n": t.touch(s, keys(s, req))},
        "clear": lambda s, req: t.clear(s),
        "status": status,
        "stats": stats,
    }
