"""The tiers: what each request does to L2 (pool + index) and L3 (connector, backup, prefetch).

Engine-facing state lives in a Session per connection (its namespace, leases, slots being written,
prefetch handles); closing a session releases all of it, whatever the engine did.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import xxhash

from hicached.common.errors import BAD_REQUEST, NOT_FOUND, UNAUTHORIZED, HicachedError
from hicached.common.protocol import (
    ALLOC_BUSY,
    ALLOC_NO_SPACE,
    ALLOC_PRESENT,
    ALLOC_WRITE,
    PUT_BUSY,
    PUT_PRESENT,
    PUT_STORED,
)
from hicached.common.retry import Backoff
from hicached.config import Config
from hicached.config.tenants import DEFAULT as DEFAULT_TENANT
from hicached.config.tenants import matches_any
from hicached.connectors.base import BackendError, Connector
from hicached.daemon.l2.index import FILLING, READY, WRITING, Entry, PageIndex, PageRecords
from hicached.daemon.l2.pool import DEFAULT_ARENA, Arena, Pool
from hicached.daemon.l2.slabs import SlabAllocator, slot_size
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.prefetch import Prefetcher

log = logging.getLogger("hicached.tiers")

_BUSY_WINDOW_S = 0.01  # engines that stored or loaded within this are busy (see backup_concurrency_busy)
_LOST_LOG_INTERVAL_S = 60.0  # at most one log line about lost pages this often; it says how many since

# The slots a closed connection was writing into, or held ahead for its stores, are reused only this long
# after: a copy its engine started before it saw the close may still be landing in them.
CLOSED_SLOT_QUARANTINE_S = 5.0

LOAD_PRIORITY = 1 << 30  # reads an engine is blocked on go before any prefetch
# A prefetch places this many keys (finds or allocates their slots, evicting) per turn of the event loop:
# the reads of the first ones start while the rest are placed, instead of after ~8 us a page of placing.
PREFETCH_STEP = 64


class _EveryMinute:
    """A counter of pages that went wrong, logged at once, then at most once a minute: each line says how many
    came since the previous one (what comes meanwhile is in the next line, written at the next event)."""

    def __init__(self, counters: collections.Counter[str], key: str, level: int) -> None:
        self.counters, self.key, self.level = counters, key, level
        self.logged = 0  # the count at the last line
        self.next = 0.0  # time.monotonic() from which the next line may be written

    def add(self, n: int, message: str) -> None:
        """Counts `n`; `message` takes the number since the last line, "start" or "the last report", and
        the total."""
        self.counters[self.key] += n
        now = time.monotonic()
        if now < self.next:
            return
        total = self.counters[self.key]
        since = "the last report" if self.logged else "start"
        log.log(self.level, message, total - self.logged, since, total)
        self.logged, self.next = total, now + _LOST_LOG_INTERVAL_S


@dataclass
class Handle:
    entries: list[Entry]
    created: float = field(default_factory=time.monotonic)
    placed: asyncio.Future[None] | None = None  # while keys are still being placed: done when all are


@dataclass
class Session:
    """One engine connection's view: everything it holds is released by Tiers.close_session."""

    peer: str = ""
    tenant: str = "default"  # the tenant the peer belongs to (hicached.daemon.server.tenants)
    ns: str = ""
    page_bytes: int = 0
    leases: dict[int, list[Entry]] = field(default_factory=dict)
    writing: dict[str, Entry] = field(default_factory=dict)
    reserved: dict[int, Entry] = field(default_factory=dict)  # offset -> slot set aside for its stores
    # Slots the daemon copies a store_pages into: out of reach of the engine's commit, abort and hello, which
    # would give them away while the copy still writes them; committed or aborted by the copy's request.
    copying: set[Entry] = field(default_factory=set)
    # Leases of the pages a load_pages copies out of, by lease id: out of reach of the engine's release,
    # which would let the slots be reused while the copy still reads them.
    loading: dict[int, list[Entry]] = field(default_factory=dict)
    handles: dict[int, Handle] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # hicached.daemon.regions.service.SessionRegions once the connection registers a memory region.
    regions: Any = None

    def require_hello(self) -> None:
        if not self.ns:
            raise HicachedError(BAD_REQUEST, "send hello with a namespace and page_bytes first")


class Tiers:
    def __init__(self, cfg: Config, pool: Pool, connector: Connector | None) -> None:
        self.cfg = cfg
        self.pool = pool
        slab = cfg.pool.slab_size
        self.index = PageIndex([SlabAllocator(a.size, slab, a.base, a.index) for a in pool.arenas])
        # namespace -> its arena (tenant), from the tenants' namespaces: forgotten at each reload (retenant)
        self._ns_arena: dict[str, int] = {}
        # Tenants have pools of their own (the pool's arenas); else one pool serves every engine.
        self.tenanted = not (len(pool.arenas) == 1 and pool.arenas[0].name == DEFAULT_ARENA)
        self.index.arena_of = self.arena_of
        self.counters: collections.Counter[str] = collections.Counter()
        self.backend = Backend(cfg, self.counters)
        self.backend.current = connector
        if connector is not None:
            self.backend.note_location(connector)
        self._l3_epoch = self.backend.epoch  # the store that entries' in_l3 refers to
        self.backend.on_attach = self._attached
        self.backend.on_detach = self._detached
        self.attached = asyncio.Event()  # set while a backend is attached (the warmup waits for one)
        if connector is not None:
            self.attached.set()
        # (namespace, key) of pages that left L2 while in L3, most recent last; bounded.
        self.known_in_l3: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        # Acknowledged pages owed to L3 while no backend is attached to write them to (dirty when it went
        # away, or stored since): not held in L2 for it. Backed up when one attaches; lost if they leave L2
        # first. Bounded by L2, like backup.abandoned (the pages the backup gave up on).
        self.stranded: set[Entry] = set()
        # Pages lost: acknowledged, owed to L3, and gone from L2 before reaching it. Counted from 0, so that
        # the metric exists before the first loss.
        self.counters["backup.lost"] = 0
        self._lost_flushed = 0  # backup.lost when the previous flush answered
        self._gone_flushed = 0  # backup.dropped_gone then
        self.counters["backup.dropped"] = 0
        self._lost_report = _EveryMinute(self.counters, "backup.lost", logging.ERROR)
        self._dropped_report = _EveryMinute(self.counters, "backup.dropped", logging.WARNING)
        self.index.on_remove = self._removed
        # The slot headers a crash rebuilds L2 from (headers.Headers.attach sets them): written as pages
        # become ready, reach L3 and leave.
        self.headers: PageRecords | None = None
        self.index.on_short = self._backlog_full
        self.namespaces: dict[str, int] = {}
        st = cfg.storage
        self.backup = Backup(
            self.index,
            pool,
            self.backend,
            self.counters,
            st.backup_concurrency,
            st.backup_batch_pages,
            st.backup_batch_bytes,
            st.backup_queue_pages,
            Backoff.from_config(st.retry),
        )
        self.prefetcher = Prefetcher(
            self.index,
            pool,
            self.backend,
            self.counters,
            st.prefetch_concurrency,
            st.prefetch_batch_pages,
            st.prefetch_batch_bytes,
            st.prefetch_queue_pages,
        )
        self._pressure = asyncio.Event()
        self._writeback_task: asyncio.Task[None] | None = None
        self.pinned_bytes = 0
        self.arena_pinned = [0] * len(pool.arenas)  # pinned_bytes by arena
        self.last_engine_io = 0.0  # time.monotonic() of the last store or load
        self.backup.allowed = self._backup_calls_allowed
        self.backup.defer = self._backup_defer

    @property
    def connector(self) -> Connector | None:
        return self.backend.current

    def arena(self, tenant: str) -> tuple[int, int]:
        """(memfd, bytes) of the pool memory that `tenant`'s engines are handed and map: the whole pool
        where there are no tenants, else the tenant's arena. HicachedError(unauthorized) for a tenant
        without a share of L2 (the default tenant, when the tenants take all of pool.capacity)."""
        a = self._tenant_arena(tenant)
        return a.fd, a.size

    def _tenant_arena(self, tenant: str) -> Arena:
        if not self.tenanted:
            return self.pool.arenas[0]
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
        if not self.tenanted:
            return 0
        name = DEFAULT_TENANT
        for tenant, t in self.cfg.tenants.items():
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

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """One tenant's figures of L2: its pool (arena) and the namespaces whose pages live in it."""
        try:
            a = self._tenant_arena(tenant)
        except HicachedError:
            return {"capacity_bytes": 0, "used_bytes": 0, "pages": 0, "namespaces": {}}
        i = a.index
        names = {ns: pb for ns, pb in self.namespaces.items() if self.arena_of(ns) == i}
        return {
            "pool_bytes": a.size,
            "capacity_bytes": self.index.allocs[i].capacity,
            "used_bytes": self.index.used_bytes(i),
            "pages": sum(len(self.index.ns_entries(ns)) for ns in names),
            "unbacked_bytes": self.index.arena_dirty[i],
            "reserved_bytes": self.index.arena_reserved[i],
            "pinned_bytes": self.arena_pinned[i],
            "namespaces": names,
            "slabs": self.index.allocs[i].stats(),
        }

    def retenant(self) -> int:
        """After a reload (the tenants' namespaces may have changed): namespaces are placed afresh, and pages
        of a namespace that now belongs to another tenant leave L2 where nothing holds them (in L3 already,
        or nothing to back them up to); the others follow as they become idle (an engine is never handed
        another arena's offsets: engine_offsets refuses). Returns how many left."""
        self._ns_arena.clear()
        if not self.tenanted:
            return 0
        n = 0
        for ns in list(self.namespaces):
            arena = self.arena_of(ns)
            for entry in list(self.index.ns_entries(ns).values()):
                if entry.cls.arena != arena and entry.evictable:
                    self.index.remove(entry)
                    n += 1
        return n

    def engine_offsets(self, s: Session, offsets: list[int]) -> list[int]:
        """Pool offsets as the session's engine sees them: within the arena it maps (its tenant's). -1 stays
        -1. HicachedError if one is outside that arena (a namespace that moved to another tenant at a
        reload, with pages still in its old arena): never another tenant's offset."""
        if not self.tenanted:
            return offsets
        a = self._tenant_arena(s.tenant)
        lo, hi = a.base, a.base + a.size
        if any(not lo <= o < hi for o in offsets if o >= 0):
            raise HicachedError(
                BAD_REQUEST,
                f"namespace {s.ns!r} has pages outside tenant {s.tenant!r}'s pool (its tenant changed at a "
                "reload); they leave L2 once idle: retry later",
            )
        return [o - lo if o >= 0 else o for o in offsets]

    def pool_offsets(self, s: Session, offsets: list[Any]) -> list[Any]:
        """Offsets an engine sent (within its arena) as pool offsets; what is not an int is left as it is
        (the caller refuses it)."""
        if not self.tenanted:
            return offsets
        base = self._tenant_arena(s.tenant).base
        return [o + base if type(o) is int else o for o in offsets]

    def _backup_calls_allowed(self) -> int:
        """Write-through backups are background work: while engines store or load, they run at most
        storage.backup_concurrency_busy calls. Write-back writes (memory pressure, flush) are never held."""
        return self.cfg.storage.backup_concurrency_busy if self._through_while_busy() else 0

    def _backup_defer(self) -> float:
        """While engines store or load, a write-through backup waits for them to pause, at most
        storage.backup_defer from when its page was stored (then it runs, backup_concurrency_busy calls at
        a time): its I/O would take memory bandwidth and CPU from the engines' copies. Not once the pages
        waiting for L3 hold half of what they may (storage.max_unbacked_fraction): deferred longer, they would
        be the oldest ones dropped when the pool needs slots, and engines storing faster than the pool turns
        over in backup_defer would starve L3 of every page."""
        if not self._through_while_busy() or 2 * self.index.dirty_bytes > self._backlog_limit():
            return 0.0
        return self.cfg.storage.backup_defer

    def _through_while_busy(self) -> bool:
        """Write-through, with an engine that stored or loaded within the busy window."""
        return not self.write_back and time.monotonic() - self.last_engine_io <= _BUSY_WINDOW_S

    def _removed(self, entries: list[Entry]) -> None:
        """Pages leaving L2 (it runs for the pages a full pool evicts): those in L3 are remembered; those owed
        to L3 that never reached it (dirty, given up by the backup, stranded without a backend) are lost."""
        if self.headers is not None:
            self.headers.clear(entries)
        abandoned, stranded, dropped = self.backup.abandoned, self.stranded, self.backup.dropped
        at_risk = bool(abandoned or stranded)
        bound = self.cfg.storage.known_in_l3_keys
        known = self.known_in_l3
        lost = gone = 0
        for entry in entries:
            owed = entry.dirty
            if at_risk and (entry in abandoned or entry in stranded):
                abandoned.discard(entry)
                stranded.discard(entry)
                owed = True
            if dropped and entry in dropped:  # counted when dropped (backup.dropped), not lost
                dropped.discard(entry)
                gone += not entry.in_l3
            if entry.in_l3:
                if bound > 0:
                    k = (entry.ns, entry.key)
                    if k in known:
                        known.move_to_end(k)
                    else:
                        known[k] = None
            elif owed:
                lost += 1
        if bound > 0:
            while len(known) > bound:
                known.popitem(last=False)
        if lost:
            self._lose(lost)
        if gone:
            self.counters["backup.dropped_gone"] += gone

    def _lose(self, n: int) -> None:
        self._lost_report.add(
            n,
            "lost %d acknowledged pages since %s: they left L2 before reaching L3 (given up by the backup, "
            "or no backend attached to write them to); %d in all (backup.lost; `ctl flush` reports them)",
        )

    def _attached(self, connector: Connector) -> None:
        """A backend was attached: pages in L2 that never reached L3 are backed up to it."""
        self.attached.set()
        self.known_in_l3.clear()  # what the previous backend held says nothing about this one
        if self.headers is not None:
            self.headers.l3(repr(connector.location()))
        # Another store (not the same one re-attached): pages that reached the old store are not known to
        # be in this one. They stay clean and evictable (a swap does not copy L2 into the new store, nor
        # hold the pool until it has), but a page that leaves L2 is no longer remembered as in L3, and a
        # store of it again is written to the new store.
        other_store = self.backend.epoch != self._l3_epoch
        self._l3_epoch = self.backend.epoch
        n = 0
        for entry in self.index.entries.values():
            if entry.state == READY and not entry.in_l3 and not entry.dirty:
                entry.dirty = True
                self.index.update(entry)
                if not self.write_back:
                    self.backup.submit(entry)
                n += 1
            elif other_store:
                entry.in_l3 = False
        # Every page stranded, given up or dropped that is still in L2 is dirty again (or in L3 after all).
        self.stranded.clear()
        self.backup.abandoned.clear()
        self.backup.dropped.clear()
        if n:
            log.info("queued %d pages that are not in L3 yet for %s", n, connector.name)

    def _detached(self) -> None:
        """No backend: nothing can be written, so dirty pages stop holding their slots. They are still owed
        to L3 (stranded): backed up when a backend attaches again, lost if they leave L2 before."""
        self.attached.clear()
        for entry in [e for e in self.index.entries.values() if e.dirty]:
            entry.dirty = False
            self.index.update(entry)
            self.stranded.add(entry)

    @property
    def write_back(self) -> bool:
        return self.cfg.storage.write_policy == "write_back"

    def start(self) -> None:
        self.backend.start()
        self.backup.start()
        self.prefetcher.start()
        if self.write_back:
            self._writeback_task = asyncio.create_task(self._writeback_loop(), name="writeback")

    async def stop(self) -> None:
        if self._writeback_task is not None:
            self._writeback_task.cancel()
            await asyncio.gather(self._writeback_task, return_exceptions=True)
        await self.prefetcher.stop()
        await self.backup.stop()
        await self.backend.stop()

    def set_policy(self, was_write_back: bool) -> None:
        """Follow a change of storage.write_policy made by a reload."""
        if self.write_back and not was_write_back:
            self._writeback_task = asyncio.create_task(self._writeback_loop(), name="writeback")
        elif was_write_back and not self.write_back:
            if self._writeback_task is not None:
                self._writeback_task.cancel()
                self._writeback_task = None
            self.backup.submit_many(list(self.index.dirty.values()))

    async def flush_dirty(self, timeout: float) -> bool:
        """Queue every dirty page for L3, and the pages an earlier backup gave up on (the backend may take
        them now: a disk freed), and wait for the queue to drain (shutdown, drain). True only when every
        one of them reached L3: none was still queued at `timeout`, none was given up again. With no backend
        attached nothing can be written: True only when no page owed to L3 waits in L2 for one."""
        if self.connector is None:
            # A put in flight as the backend was detached may still have written some, or given them up
            # (they are counted in backup.abandoned then).
            abandoned = self.backup.abandoned
            self.stranded.difference_update([e for e in self.stranded if e.in_l3 or e in abandoned])
            return not self.not_in_l3()
        for entry in itertools.chain(self.backup.abandoned, self.backup.dropped):
            if self.index.live(entry) and entry.state == READY and not entry.in_l3 and not entry.dirty:
                entry.dirty = True
                self.index.update(entry)
        self.backup.abandoned.clear()
        self.backup.dropped.clear()
        failed = self.counters["backup.failed"]
        self.backup.submit_many(list(self.index.dirty.values()))
        drained = await self.backup.drain(timeout)
        return drained and self.counters["backup.failed"] == failed

    def not_in_l3(self) -> int:
        """Pages acknowledged to engines and owed to L3, still in L2, that are not known to be in L3 after a
        flush: still queued or being written, given up by the backup, or waiting for a backend."""
        if self.connector is None:  # whatever is still queued is stranded, and counted there
            return len(self.backup.abandoned) + len(self.stranded)
        return self.backup.pending + len(self.backup.abandoned)

    async def flush(self, timeout: float) -> dict:
        """What `ctl flush` and `ctl drain` answer: flush_dirty, and the pages lost since the previous answer.
        `flushed` is true only when every page owed to L3 is in it and none was lost since."""
        done = await self.flush_dirty(timeout)
        total = self.counters["backup.lost"]
        lost, self._lost_flushed = total - self._lost_flushed, total
        total = self.counters["backup.dropped_gone"]
        gone, self._gone_flushed = total - self._gone_flushed, total
        return {
            "flushed": done and not lost and not gone,
            "backup_pending": self.backup.pending,
            "not_in_l3": self.not_in_l3(),
            "lost": lost,
            # Pages dropped by the backlog bound (storage.when_backlog_full) that left L2 before reaching L3.
            "dropped": gone,
        }

    # Sessions.

    def hello(self, s: Session, ns: str, page_bytes: int) -> dict:
        if page_bytes <= 0 or slot_size(page_bytes) > self.cfg.pool.slab_size:
            limit = self.cfg.pool.slab_size
            raise HicachedError(
                BAD_REQUEST,
                f"page_bytes must be between 1 and pool.slab_size ({limit}); got {page_bytes}",
            )
        known = self.namespaces.setdefault(ns, page_bytes)
        if known != page_bytes:
            raise HicachedError(
                BAD_REQUEST, f"namespace {ns!r} holds pages of {known} bytes, not {page_bytes}"
            )
        if (s.ns, s.page_bytes) != (ns, page_bytes):
            if s.reserved:
                self._unreserve(s)  # set aside for the other namespace or page size
            if s.writing:  # keyed by key alone: pages being written for the old namespace are let go
                self._abandon_writing(s)
        s.ns, s.page_bytes = ns, page_bytes
        return {"slot_bytes": slot_size(page_bytes)}

    def _unreserve(self, s: Session) -> None:
        for e in s.reserved.values():
            self.index.unreserve(e, quarantine=CLOSED_SLOT_QUARANTINE_S)
        s.reserved.clear()

    def _abandon_writing(self, s: Session) -> None:
        for e in s.writing.values():
            self.index.unlease(e)
            self.index.remove(e, quarantine=CLOSED_SLOT_QUARANTINE_S)
        s.writing.clear()

    def close_session(self, s: Session) -> None:
        """Called once no copy of the connection runs any more (RegionService.close_session)."""
        self.abort_held(s, list(s.copying))  # the daemon's own copy into them has ended
        for entries in s.loading.values():
            self.index.unlease_all(entries)
        s.loading.clear()
        for entries in s.leases.values():
            self.index.unlease_all(entries)
        s.leases.clear()
        for h in s.handles.values():
            self.index.unlease_all(h.entries)
        s.handles.clear()
        self._abandon_writing(s)
        self._unreserve(s)

    # Store: alloc -> engine writes the bytes -> commit.

    def alloc(self, s: Session, keys: list[str]) -> tuple[list[int], list[int]]:
        """A slot for each key not in L2 yet (ALLOC_WRITE, leased until committed or aborted), in one go:
        the slots of the whole request are taken together (a full pool's evictions in one loop)."""
        self.last_engine_io = time.monotonic()
        n = len(keys)
        status, offsets = [ALLOC_PRESENT] * n, [-1] * n
        through = self.connector is not None and not self.write_back
        held = len(s.writing) + len(s.copying)
        room = self.backup.queue_pages - self.backup.pending - held if through else n
        if through and self.cfg.storage.when_backlog_full == "refuse":
            room = min(room, self._backlog_room(s) - held)
        get = self.index.ns_entries(s.ns).get
        given_up = self.backup.abandoned if self.connector is not None else ()
        retry: list[Entry] = []
        want: list[int] = []  # positions that get a slot
        first: dict[str, int] = {}  # key -> its first position, for a key asked twice
        again: list[tuple[int, int]] = []
        for i, key in enumerate(keys):
            entry = get(key)
            if entry is not None:
                if entry.state == READY:
                    self.index.touch(entry)
                    if given_up and entry in given_up:
                        retry.append(entry)
            elif key in first:
                again.append((i, first[key]))
            elif len(want) >= room:
                self.counters["store.busy"] += 1
                status[i] = ALLOC_BUSY
                first[key] = i
            else:
                want.append(i)
                first[key] = i
        if want:
            cls, slots = self.index.take_slots(s.page_bytes, len(want), s.ns)
            entries = self.index.entries_at(
                s.ns, [keys[i] for i in want[: len(slots)]], s.page_bytes, cls, slots, WRITING, leases=1
            )
            for i, entry in zip(want, entries, strict=False):  # entries may be fewer
                s.writing[entry.key] = entry
                status[i] = ALLOC_WRITE
                offsets[i] = entry.offset
            if len(entries) < len(want):
                self.counters["store.no_space"] += len(want) - len(entries)
                if self.write_back:
                    self._pressure.set()
                for i in want[len(entries) :]:
                    status[i] = ALLOC_NO_SPACE
        for i, j in again:  # as if asked after its first place: there now, or refused alike
            if status[j] != ALLOC_WRITE:
                status[i] = status[j]
                self.counters["store.busy" if status[j] == ALLOC_BUSY else "store.no_space"] += 1
        if retry:
            self._retry_given_up(retry)
        return status, offsets

    def commit(self, s: Session, keys: list[str], sums: list[int] | None = None) -> list[bool]:
        """The pages the engine wrote into slots from alloc are stored; `sums`: their checksums, if the
        client took them (the backup then writes them as they are)."""
        out = []
        backup = []
        for i, key in enumerate(keys):
            entry = s.writing.pop(key, None)
            if entry is None:
                out.append(False)
                continue
            if sums is not None:
                entry.checksum = sums[i]
            if self._stored(entry):
                backup.append(entry)
            out.append(True)
        self.backup.submit_many(backup)
        self._after_stores()
        return out

    def hold_writing(self, s: Session, keys: list[str]) -> list[Entry]:
        """The slots alloc just gave `keys` (all different), taken out of the engine's reach while the daemon
        copies into them (store_pages): commit_held or abort_held ends them, or close_session."""
        entries = [s.writing.pop(key) for key in keys]
        s.copying.update(entries)
        return entries

    def commit_held(self, s: Session, entries: list[Entry], sums: list[int] | None = None) -> None:
        """commit() of slots from hold_writing, whose copy ended; `sums`: their checksums, taken by the copy
        executor once it had."""
        backup = []
        for i, entry in enumerate(entries):
            s.copying.discard(entry)
            if sums is not None:
                entry.checksum = sums[i]
            if self._stored(entry):
                backup.append(entry)
        self.backup.submit_many(backup)
        self._after_stores()

    def abort_held(self, s: Session, entries: list[Entry]) -> None:
        """abort() of slots from hold_writing whose copy failed (or never started)."""
        for entry in entries:
            s.copying.discard(entry)
            self.index.unlease(entry)
            self.index.remove(entry)

    def _stored(self, entry: Entry) -> bool:
        """A page whose bytes the engine has written (leased while it did) becomes ready. True when it
        is for the backup queue now (write-through): the caller submits a request's pages together."""
        if entry.checksum is None:
            # A client that sent none (the protocol has them optional): taken now, as the page enters L2.
            # What its bytes must hash to from now on: L3 publishes it only if they do.
            entry.checksum = xxhash.xxh3_64_intdigest(self.pool.slot(entry.offset, entry.size))
        entry.state = READY
        k = (entry.ns, entry.key)
        if k in self.known_in_l3:
            del self.known_in_l3[k]
            entry.in_l3 = True  # it was there when this page last left L2: not written again
            self.counters["store.known_in_l3"] += 1
        if self.connector is not None:
            entry.dirty = not entry.in_l3
        elif not entry.in_l3 and self.cfg.storage.backend != "none":
            # Owed to the configured backend, which is away (its breaker open, detached): backed up when it
            # attaches. With storage.backend = "none" the daemon is L2 only: nothing is owed.
            self.stranded.add(entry)
        if self.headers is not None:
            self.headers.commit(entry)  # before the answer: an acknowledged page outlives a crash
        self.index.unlease(entry)
        self.counters["store.pages"] += 1
        self.counters["store.bytes"] += entry.size
        return entry.dirty and not self.write_back

    def _retry_given_up(self, entries: list[Entry]) -> None:
        """Pages the backup gave up on that an engine stored again while still in L2: owed to L3 again, so
        held for it and written (the backend may take them now), not lost when they leave L2 once written."""
        for entry in entries:
            self.backup.abandoned.discard(entry)
            entry.dirty = True
            self.index.update(entry)
        if not self.write_back:
            self.backup.submit_many(entries)

    def _after_stores(self) -> None:
        if self.write_back and self.index.reclaimable_fraction() < self.cfg.pool.writeback_low_watermark:
            self._pressure.set()

    def _backlog_limit(self, arena: int | None = None) -> float:
        """Bytes of slots that pages waiting for L3 may hold (write-through): max_unbacked_fraction of the
        pool, or of one arena (a tenant's pool)."""
        capacity = self.index.capacity if arena is None else self.index.allocs[arena].capacity
        return self.cfg.storage.max_unbacked_fraction * capacity

    def _backlog_room(self, s: Session) -> int:
        """Under when_backlog_full = "refuse": how many more pages of the session's may wait for L3."""
        arena = max(0, self.arena_of(s.ns))
        room = self._backlog_limit(arena) - self.index.arena_dirty[arena]
        return max(0, int(room) // slot_size(s.page_bytes))

    def _backlog_full(self, nbytes: int, arena: int = 0) -> int:
        """The pool has no slot left to free for `nbytes` of new pages (index.on_short). Under write-through
        with drop_oldest, while the pages waiting for L3 hold more than storage.max_unbacked_fraction of the
        pool, the oldest of them stop holding their slots until they are within it: the pool takes new pages
        whatever L3 does. Nothing is dropped while a slot is free or evictable: a backend that is only
        behind for a burst loses nothing. Counted, and logged once a minute. Returns how many."""
        over = self.index.arena_dirty[arena] - self._backlog_limit(arena)
        if over <= 0 or self.write_back or self.cfg.storage.when_backlog_full != "drop_oldest":
            return 0
        n = self.backup.drop_oldest(int(over), arena if len(self.index.allocs) > 1 else None)
        if n:
            fraction = self.cfg.storage.max_unbacked_fraction
            self._dropped_report.add(
                n,
                f"L3 ({self.backend.name}) is behind: %d pages waiting for it stopped being held in L2 since "
                f"%s, the oldest first (storage.max_unbacked_fraction = {fraction:g}; they stay in L2 until "
                "evicted, and are backed up if the backend catches up first); %d in all (backup.dropped)",
            )
        return n

    # Store from reserved slots: reserve (ahead, answered while the engine copies) -> the engine writes
    # the bytes into slots it already holds -> put binds each slot to its key. A store then waits on
    # one round trip (the put), not two; the reserve is refilled in the background of the next copies.

    def reserve(self, s: Session, n: int) -> tuple[list[int], int]:
        """Up to `n` more slots set aside for this connection's stores, within pool.reserve_per_connection
        and, over all connections, pool.reserve_max_fraction of the pool. Evicts like a store would.
        Returns their offsets and how many this connection may hold."""
        self.last_engine_io = time.monotonic()
        slot = slot_size(s.page_bytes)
        arena = self.arena_of(s.ns)
        if arena < 0:
            return [], 0
        every = int(self.cfg.pool.reserve_max_fraction * self.index.allocs[arena].capacity)
        limit = min(self.cfg.pool.reserve_per_connection, every) // slot
        n = min(n, limit - len(s.reserved), (every - self.index.arena_reserved[arena]) // slot)
        entries = self.index.reserve(s.ns, s.page_bytes, n) if n > 0 else []
        if len(entries) < n:
            self.counters["store.no_space"] += 1
            if self.write_back:
                self._pressure.set()
        offsets = []
        for entry in entries:
            s.reserved[entry.offset] = entry
            offsets.append(entry.offset)
        return offsets, limit

    def put(
        self, s: Session, keys: list[str], offsets: list[int], sums: list[int] | None = None
    ) -> list[int]:
        """Binds reserved slots, whose bytes the engine wrote, to `keys`: a PUT_* status per key. A slot
        whose key is there already, or that the backup queue cannot take, stays reserved. `sums`: as in
        commit."""
        if not all(type(o) is int and o in s.reserved for o in offsets):
            raise HicachedError(BAD_REQUEST, "put names a slot this connection has not reserved")
        if len(offsets) != len(keys) or len(set(offsets)) != len(offsets):
            raise HicachedError(BAD_REQUEST, "put needs one distinct offset per key")
        self.last_engine_io = time.monotonic()
        through = self.connector is not None and not self.write_back
        status = []
        backup: list[Entry] = []  # queued together after the loop, and counted against the bound meanwhile
        held = len(s.writing) + len(s.copying)  # slots of this connection on their way to the queue too
        room = self.backup.queue_pages - self.backup.pending - held
        if through and self.cfg.storage.when_backlog_full == "refuse":
            room = min(room, self._backlog_room(s) - held)
        given_up = self.backup.abandoned if self.connector is not None else ()
        retry: list[Entry] = []
        for i, (key, off) in enumerate(zip(keys, offsets, strict=True)):
            entry = self.index.get(s.ns, key)
            if entry is not None:
                if entry.state == READY:
                    self.index.touch(entry)
                    if given_up and entry in given_up:
                        retry.append(entry)
                status.append(PUT_PRESENT)
                continue
            if through and len(backup) >= room:
                self.counters["store.busy"] += 1
                status.append(PUT_BUSY)
                continue
            entry = s.reserved.pop(off)
            self.index.bind(entry, key)
            entry.checksum = None if sums is None else sums[i]
            if self._stored(entry):
                backup.append(entry)
            status.append(PUT_STORED)
        self.backup.submit_many(backup)
        if retry:
            self._retry_given_up(retry)
        self._after_stores()
        return status

    def abort(self, s: Session, keys: list[str]) -> int:
        n = 0
        for key in keys:
            entry = s.writing.pop(key, None)
            if entry is not None:
                self.index.unlease(entry)
                self.index.remove(entry)
                n += 1
        return n

    # Lookup and load.

    def _leading_l2(self, ns: str, keys: list[str]) -> list[Entry]:
        out = []
        get = self.index.ns_entries(ns).get
        for key in keys:
            entry = get(key)
            if entry is None or entry.state == WRITING:
                break
            out.append(entry)
        return out

    def exists_l2(self, s: Session, keys: list[str]) -> int | None:
        """The answer to `exists` when L2 alone settles it (all keys there, or no L3), else None."""
        n = len(self._leading_l2(s.ns, keys))
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
        n = len(self._leading_l2(ns, keys))
        self.counters["lookup.l2_hits"] += n
        if n < len(keys) and self.connector is not None:
            rest = keys[n:]
            try:
                more = await self.backend.call("exists", lambda c: c.exists(ns, rest))
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
        out = [(e := get(k)) is not None and e.state != WRITING for k in keys]
        hits = sum(out)
        self.counters["lookup.l2_hits"] += hits
        missing = [i for i, here in enumerate(out) if not here]
        if missing and self.connector is not None:
            rest = [keys[i] for i in missing]
            try:
                found = await self.backend.call("exists", lambda c: c.present(ns, rest))
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
        self.last_engine_io = time.monotonic()
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
        self.last_engine_io = time.monotonic()
        entries = self._leading_l2(ns, keys)
        self.index.lease_all(entries)
        self.prefetcher.merge(entries)
        if fetch and len(entries) < len(keys):
            entries += self.prefetcher.fetch(ns, keys[len(entries) :], page_bytes, LOAD_PRIORITY, lease=True)
        try:
            await self._settle(entries, self.cfg.server.request_timeout)
        except BaseException:  # the connection went away while we waited: give the leases back
            self.index.unlease_all(entries)
            raise
        n = self._leading_ready(entries)
        self.index.unlease_all(entries[n:])
        self.counters["load.pages"] += n
        self.counters["load.bytes"] += n * page_bytes
        self.counters["load.misses"] += len(keys) > n
        if n == 0:
            return 0, []
        lease = next(s.ids)
        s.leases[lease] = entries[:n]
        return lease, [e.offset for e in entries[:n]]

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

    # Prefetch.

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
        entries = self._leading_l2(ns, step)
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
            await self._settle(h.entries, timeout)
            return self._leading_ready(h.entries)
        finally:
            if s.handles.pop(handle, None) is not None:
                self.index.unlease_all(h.entries)

    async def _settle(self, entries: list[Entry], timeout: float) -> None:
        futures = {e.fill for e in entries if e.state == FILLING and e.fill is not None}  # one per batch
        if futures and timeout > 0:
            await asyncio.wait(futures, timeout=timeout)

    def _leading_ready(self, entries: list[Entry]) -> int:
        return self.index.leading_live(entries[0].ns, entries, READY) if entries else 0

    # Clear.

    async def clear(self, s: Session) -> dict[str, Any]:
        """Forgets every page of the session's namespace, in L2 and in L3 (an engine's `clear()`: SGLang's
        clear_hicache_storage, after which no page stored before it may be served; a weight update under
        the same model name needs it). Taken in the namespace the session has now.

        L2: each page leaves the index as soon as nothing holds it: at once for most; a page an engine is
        loading, that the backup is writing or that is being read from L3 once that ends (waited for up to
        server.request_timeout; what is still held then is counted in `busy` and stays). Pages given up
        here are not lost: the engine asked for them to go. L3: every object of the namespace is deleted.
        Reads from L3 of the namespace that overlap the clear are dropped (misses), so that an object read
        just before its deletion does not come back. Pages stored while the clear runs are new and stay in
        L2, though their copies in L3 may go with the others (misses once they leave L2, never wrong)."""
        s.require_hello()
        ns = s.ns
        self.prefetcher.forgetting(ns, True)
        try:
            out: dict[str, Any] = {"l2": 0, "busy": 0, "l3": 0}
            todo = [e for e in self.index.ns_entries(ns).values() if e.state != WRITING]
            deadline = time.monotonic() + self.cfg.server.request_timeout
            while todo:
                held = []
                for e in todo:
                    if not self.index.live(e):
                        continue
                    if e.state == READY and not e.leases:
                        self._forget(e)
                        out["l2"] += 1
                    else:
                        held.append(e)
                todo = held
                if todo and time.monotonic() >= deadline:
                    out["busy"] = len(todo)
                    break
                if todo:
                    await asyncio.sleep(0.005)
            for k in [k for k in self.known_in_l3 if k[0] == ns]:
                del self.known_in_l3[k]
            if self.connector is not None:
                try:
                    # A namespace may be many objects (a thousand a request on S3): the request's bound, not
                    # one page operation's.
                    timeout = max(self.cfg.storage.operation_timeout, self.cfg.server.request_timeout)
                    out["l3"] = await self.backend.call("clear", lambda c: c.clear_namespace(ns), timeout)
                except BackendError as e:
                    self.counters[f"clear.l3_errors.{e.reason}"] += 1
                    out["l3"], out["error"] = None, f"{e.reason}: {e}"
            elif self.cfg.storage.backend != "none":
                out["l3"], out["error"] = None, "detached: no L3 backend attached, nothing deleted there"
        finally:
            self.prefetcher.forgetting(ns, False)
        self.counters["clear.requests"] += 1
        self.counters["clear.l2_pages"] += out["l2"]
        self.counters["clear.l3_objects"] += out["l3"] or 0
        log.info("namespace %s cleared by %s: %s", ns, s.peer or "an engine", out)
        return out

    def _forget(self, entry: Entry) -> None:
        """An idle page out of L2 for clear(): owed to L3 no more, not remembered as in it, not lost."""
        entry.dirty = False
        entry.in_l3 = False
        self.backup.abandoned.discard(entry)
        self.backup.dropped.discard(entry)
        self.stranded.discard(entry)
        if entry.pinned:
            entry.pinned = False
            self.pinned_bytes -= entry.cls.slot_bytes
            self.arena_pinned[entry.cls.arena] -= entry.cls.slot_bytes
        self.index.remove(entry)

    # Recency.

    def touch(self, s: Session, keys: list[str]) -> int:
        """The keys' pages in L2 become the most recently used (what an engine's own cache just used, so
        that eviction follows use): no lease, no L3 read, nothing copied. How many were in L2."""
        n = self.index.touch_keys(s.ns, keys)
        self.counters["touch.pages"] += n
        return n

    # Pins.

    def pin(self, s: Session, keys: list[str]) -> int:
        n = 0
        for key in keys:
            entry = self.index.get(s.ns, key)
            if entry is None or entry.state != READY:
                continue
            if not entry.pinned and not self.pin_entry(entry):
                raise HicachedError(
                    "no_space", f"pinning more would exceed pool.max_pinned_fraction; {n} pages pinned"
                )
            n += 1
        return n

    def pin_entry(self, entry: Entry, limit: float | None = None) -> bool:
        """Pins one page unless that would pass `limit` bytes of pins (default: pool.max_pinned_fraction of
        its arena: a tenant's pins are bounded within its own pool)."""
        if entry.pinned:
            return True
        arena = entry.cls.arena
        if limit is None:
            limit = self.cfg.pool.max_pinned_fraction * self.index.allocs[arena].capacity
        if self.arena_pinned[arena] + entry.cls.slot_bytes > limit:
            return False
        entry.pinned = True
        self.pinned_bytes += entry.cls.slot_bytes
        self.arena_pinned[arena] += entry.cls.slot_bytes
        self.index.update(entry)
        return True

    def unpin(self, s: Session, keys: list[str]) -> int:
        n = 0
        for key in keys:
            entry = self.index.get(s.ns, key)
            if entry is not None and entry.pinned:
                entry.pinned = False
                self.pinned_bytes -= entry.cls.slot_bytes
                self.arena_pinned[entry.cls.arena] -= entry.cls.slot_bytes
                self.index.update(entry)
                n += 1
        return n

    # Write-back.

    async def _writeback_loop(self) -> None:
        mark = self.cfg.pool.writeback_low_watermark
        while True:
            await self._pressure.wait()
            self._pressure.clear()
            if self.connector is None:
                continue
            while self.index.dirty and (low := self._pressed(mark)):
                # A round: as much as the backup workers write at once, then look again.
                st = self.cfg.storage
                pages, budget = (
                    st.backup_batch_pages * st.backup_concurrency,
                    st.backup_batch_bytes * st.backup_concurrency,
                )
                dirty = self.index.dirty.values()
                if len(low) < len(self.index.allocs):  # tenants: the pools under the mark first
                    dirty = (e for e in dirty if e.cls.arena in low)
                for entry in list(itertools.islice(dirty, pages)):
                    self.backup.submit(entry)
                    budget -= entry.size
                    if budget <= 0:
                        break
                await self.backup.drain(self.cfg.storage.operation_timeout)
                if not self.index.dirty:
                    break

    def _pressed(self, mark: float) -> set[int]:
        """The arenas (tenants' pools; the one pool without tenants) with pages to write out: free or
        evictable below the write-back watermark, or no room left at all."""
        idx = self.index
        return {
            i
            for i, a in enumerate(idx.allocs)
            if idx.arena_dirty[i]
            and (idx.reclaimable_fraction(i) < mark or (idx.arena_evictable[i] == 0 and not a.free_slabs))
        }

    def stats(self, pool: dict | None = None) -> dict:
        """`pool`: the index's counts, if taken already (PageIndex.stats_sliced); else taken here."""
        return {
            "pool": self.index.stats() if pool is None else pool,
            "counters": dict(self.counters),
            "backup": {
                "pending": self.backup.pending,
                "inflight": self.backup.inflight,
                "held_by_stuck_writes": self.backup.lingering,
            },
            "prefetch": {"pending": self.prefetcher.pending},
            "pinned_bytes": self.pinned_bytes,
            "namespaces": dict(self.namespaces),
            "backend": self.backend.name,
            "backend_state": self.backend.state,
            "backend_counters": dict(self.connector.counters) if self.connector else {},
            "backend_info": self.connector.info() if self.connector else {},
            "latency": {
                f"{name}.{op}": {"count": h.count, "sum_s": round(h.sum, 6)}
                for (name, op), h in self.backend.latency.items()
            },
        }
