"""Lookups, loads and prefetches: which keys L2 or L3 hold, and leases on the pages an engine copies out
(reading them from L3 first if asked, or ahead of need: a prefetch handle waited on later)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from hicached.common.errors import NOT_FOUND, HicachedError
from hicached.config import Config
from hicached.connectors.base import BackendError, Connector
from hicached.daemon.l2.index import FILLING, READY, Entry, PageIndex
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.epochs import plain
from hicached.daemon.sched.prefetch import Prefetcher
from hicached.daemon.sched.session import Handle, Session

log = logging.getLogger("hicached.tiers")

LOAD_PRIORITY = 1 << 30  # reads an engine is blocked on go before any prefetch

# A prefetch places this many keys (finds or allocates their slots, evicting) per turn of the event loop:
# the reads of the first ones start while the rest are placed, instead of after ~8 us a page of placing.
PREFETCH_STEP = 64


class Loads:
    """The lookup and load requests of engines' sessions. `cfg` is replaced by a reload (Tiers.cfg)."""

    def __init__(
        self,
        cfg: Config,
        index: PageIndex,
        backend: Backend,
        prefetcher: Prefetcher,
        activity: EngineActivity,
        counters: collections.Counter[str],
        stored: Callable[[str], Awaitable[str]] = plain,
    ) -> None:
        self.cfg = cfg
        self.stored = stored  # the name of a namespace's objects in L3 now (hicached.daemon.sched.epochs)
        self.index = index
        self.backend = backend
        self.prefetcher = prefetcher
        self.activity = activity
        self.counters = counters

    @property
    def connector(self) -> Connector | None:
        return self.backend.current

    # Lookup and load.

    def leading_l2(self, ns: str, keys: list[str]) -> list[Entry]:
        out = []
        get = self.index.ns_entries(ns).get
        for key in keys:
            entry = get(key)  # READY or FILLING: a page being written is under no key yet
            if entry is None:
                break
            out.append(entry)
        return out

    def exists_l2(self, s: Session, keys: list[str]) -> int | None:
        """The answer to `exists` when L2 alone settles it (all keys there, or no L3), else None."""
        n = len(self.leading_l2(s.ns, keys))
        if n == len(keys) or self.connector is None:
            self.counters["lookup.l2_hits"] += n
            self.counters["lookup.misses"] += len(keys) > n
            return n
        return None

    def exists(self, s: Session, keys: list[str]) -> Coroutine[Any, Any, int]:
        """Leading hits in L2 then L3, in the session's namespace as it is now, when the request is taken:
        the coroutine may first run after a hello that the engine sent next (hicached.daemon.server)."""
        return self._exists(s.ns, keys)

    async def _exists(self, ns: str, keys: list[str]) -> int:
        n = len(self.leading_l2(ns, keys))
        self.counters["lookup.l2_hits"] += n
        if n < len(keys) and self.connector is not None:
            rest = keys[n:]
            try:
                name = await self.stored(ns)
                more = await self.backend.call("exists", lambda c: c.exists(name, rest))
            except BackendError as e:
                self.counters[f"lookup.l3_errors.{e.reason}"] += 1
                more = 0
            self.counters["lookup.l3_hits"] += more
            n += more
        self.counters["lookup.misses"] += len(keys) > n
        return n

    def present(self, s: Session, keys: list[str]) -> Coroutine[Any, Any, list[bool]]:
        """Whether each key is in L2 or L3 (not only the leading ones), in the session's namespace as it is
        when the request is taken: what a pool that keeps only some pages of a prefix (the trailing ones)
        needs to know."""
        return self._present(s.ns, keys)

    async def _present(self, ns: str, keys: list[str]) -> list[bool]:
        get = self.index.ns_entries(ns).get
        out = [get(k) is not None for k in keys]
        hits = sum(out)
        self.counters["lookup.l2_hits"] += hits
        missing = [i for i, here in enumerate(out) if not here]
        if missing and self.connector is not None:
            rest = [keys[i] for i in missing]
            try:
                name = await self.stored(ns)
                found = await self.backend.call("exists", lambda c: c.present(name, rest))
            except BackendError as e:
                self.counters[f"lookup.l3_errors.{e.reason}"] += 1
                found = [False] * len(rest)
            for i, here in zip(missing, found, strict=True):
                out[i] = bool(here)
            self.counters["lookup.l3_hits"] += sum(found)
        self.counters["lookup.misses"] += len(keys) - sum(out)
        return out

    def all_ready(self, s: Session, keys: list[str]) -> bool:
        """Every key is a ready page of the session's namespace in L2 (the fast path of lookups)."""
        get = self.index.ns_entries(s.ns).get
        for key in keys:
            entry = get(key)
            if entry is None or entry.state != READY:
                return False
        return bool(keys)

    def acquire_ready(self, s: Session, keys: list[str]) -> tuple[int, list[int]]:
        """acquire() for keys that all_ready() just vouched for: nothing to wait on."""
        self.activity.touch()
        by_key = self.index.ns_entries(s.ns)
        entries = [by_key[key] for key in keys]
        self.index.lease_all(entries)
        self.counters["load.pages"] += len(entries)
        self.counters["load.bytes"] += len(entries) * s.page_bytes
        lease = next(s.ids)
        s.leases[lease] = entries
        return lease, [e.offset for e in entries]

    def acquire(self, s: Session, keys: list[str], fetch: bool) -> Coroutine[Any, Any, tuple[int, list[int]]]:
        """Leases the leading pages present in L2 (reading missing ones from L3 first when `fetch`);
        returns a lease id and their offsets. In the session's namespace as it is now, when the request is
        taken: the coroutine may first run after a hello that the engine sent next (the server)."""
        return self._acquire(s, s.ns, s.page_bytes, keys, fetch)

    async def _acquire(
        self, s: Session, ns: str, page_bytes: int, keys: list[str], fetch: bool
    ) -> tuple[int, list[int]]:
        self.activity.touch()
        entries = self.leading_l2(ns, keys)
        self.index.lease_all(entries)
        self.prefetcher.merge(entries)
        if fetch and len(entries) < len(keys):
            entries += self.prefetcher.fetch(ns, keys[len(entries) :], page_bytes, LOAD_PRIORITY, lease=True)
        try:
            await self.settle(entries, self.cfg.server.request_timeout)
        except BaseException:  # the connection went away while we waited: give the leases back
            self.index.unlease_all(entries)
            raise
        n = self.leading_ready(entries)
        self.index.unlease_all(entries[n:])
        self.counters["load.pages"] += n
        self.counters["load.bytes"] += n * page_bytes
        self.counters["load.misses"] += len(keys) > n
        if n == 0:
            return 0, []
        lease = next(s.ids)
        s.leases[lease] = entries[:n]
        return lease, [e.offset for e in entries[:n]]

    # Prefetch handles: placed a step a turn of the loop, then waited on.

    def prefetch(self, s: Session, keys: list[str], priority: int) -> int:
        if len(s.handles) >= self.cfg.server.max_prefetch_handles_per_connection:
            raise HicachedError(
                "busy", "too many prefetch handles not waited on (server.max_prefetch_handles_per_connection)"
            )
        handle = next(s.ids)
        h = s.handles[handle] = Handle([])
        self._place(s, s.ns, s.page_bytes, handle, h, keys, 0, priority, self.prefetcher.request())
        return handle

    def _place(
        self,
        s: Session,
        ns: str,
        page_bytes: int,
        handle: int,
        h: Handle,
        keys: list[str],
        start: int,
        priority: int,
        req,
    ) -> None:
        """Places keys[start:start + PREFETCH_STEP] of a prefetch (L2 hits leased, misses queued for
        reading), and the next step on the next turn of the loop, until a key cannot be placed. Every step
        is of the namespace the prefetch was asked in (`ns`), whatever hello the connection sent since."""
        if s.handles.get(handle) is not h:  # waited on already, or its connection closed
            self._placed(h)
            return
        step = keys[start : start + PREFETCH_STEP]
        entries = self.leading_l2(ns, step)
        self.index.lease_all(entries)
        self.prefetcher.merge(entries)
        if len(entries) < len(step):
            entries += self.prefetcher.fetch(
                ns, step[len(entries) :], page_bytes, priority, req, start + len(entries), lease=True
            )
        h.entries += entries
        nxt = start + len(step)
        if len(entries) == len(step) and nxt < len(keys) and req.hole > nxt:
            loop = asyncio.get_running_loop()
            if h.placed is None:
                h.placed = loop.create_future()
            place = lambda: self._place(s, ns, page_bytes, handle, h, keys, nxt, priority, req)  # noqa: E731
            loop.call_soon(self._place_next, h, place)
        else:
            self._placed(h)

    def _place_next(self, h: Handle, place: Callable[[], None]) -> None:
        try:
            place()
        except Exception:  # a bug: the handle keeps what was placed, and wait() must not hang on the rest
            log.exception("placing the keys of a prefetch failed; it stops at %d pages", len(h.entries))
            self._placed(h)

    @staticmethod
    def _placed(h: Handle) -> None:
        if h.placed is not None and not h.placed.done():
            h.placed.set_result(None)

    async def wait(self, s: Session, handle: int, timeout: float | None) -> int:
        h = s.handles.get(handle)
        if h is None:
            raise HicachedError(NOT_FOUND, f"no prefetch handle {handle} on this connection")
        pf = self.cfg.storage.prefetch
        if h.placed is not None and not h.placed.done() and timeout != 0 and pf.policy != "best_effort":
            # Placing is quick (a few ms for thousands of pages); the policy's clock starts after it.
            await asyncio.wait({h.placed}, timeout=self.cfg.server.request_timeout)
        if timeout is None:
            if pf.policy == "best_effort":
                timeout = 0.0
            elif pf.policy == "wait_complete":
                timeout = self.cfg.server.request_timeout
            else:
                filling = sum(1 for e in h.entries if e.state == FILLING)
                timeout = pf.timeout_base + pf.timeout_per_page * filling
        timeout = min(timeout, self.cfg.server.request_timeout)
        try:
            await self.settle(h.entries, timeout)
            return self.leading_ready(h.entries)
        finally:
            if s.handles.pop(handle, None) is not None:
                self.index.unlease_all(h.entries)

    def hold_lease(self, s: Session, lease: int) -> None:
        """Takes lease `lease` (just granted by acquire) out of the engine's reach while the daemon copies
        out of its pages (load_pages): release_held ends it, or close_session."""
        s.loading[lease] = s.leases.pop(lease)

    def release_held(self, s: Session, lease: int) -> None:
        self.index.unlease_all(s.loading.pop(lease))

    def release(self, s: Session, lease: int) -> None:
        entries = s.leases.pop(lease, None)
        if entries is None:
            raise HicachedError(NOT_FOUND, f"no lease {lease} on this connection")
        self.index.unlease_all(entries)

    async def settle(self, entries: list[Entry], timeout: float) -> None:
        futures = {e.fill for e in entries if e.state == FILLING and e.fill is not None}  # one per batch
        if futures and timeout > 0:
            await asyncio.wait(futures, timeout=timeout)

    def leading_ready(self, entries: list[Entry]) -> int:
        return self.index.leading_live(entries[0].ns, entries, READY) if entries else 0
