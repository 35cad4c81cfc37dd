"""The tiers: what each request does to L2 (pool + index) and L3 (connector, backup, prefetch).

A front over parts built here and handed their dependencies: the pages' lifecycle (hicached.daemon.l2.life),
stores (stores.Stores), lookups and loads (loads.Loads), what L3 is owed (losses.L3Debt), the write policy
(writeback.WritePolicy), the backup and the prefetcher, the tenants' arenas, each namespace's clear epoch
in the shared L3 (epochs.Epochs) and clears (clears.Clears). Sessions, prefetch handles, pins and stats are
here. Engine-facing state lives in a Session per connection (its namespace,
leases, slots being written, prefetch handles); closing a session releases all of it, whatever the engine
did.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.common.retry import Backoff
from hicached.config import Config
from hicached.connectors.base import Connector
from hicached.daemon.l2.index import READY, Entry, PageRecords
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.pool import Pool
from hicached.daemon.l2.slabs import SlabAllocator, slot_size
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.arenas import Arenas
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.clears import Clears
from hicached.daemon.sched.epochs import Epochs
from hicached.daemon.sched.loads import Loads
from hicached.daemon.sched.losses import L3Debt
from hicached.daemon.sched.origin import KeysWritten
from hicached.daemon.sched.prefetch import Prefetcher
from hicached.daemon.sched.reports import EveryMinute
from hicached.daemon.sched.session import Handle, Session
from hicached.daemon.sched.stores import Stores
from hicached.daemon.sched.writeback import WritePolicy

__all__ = ["CLOSED_SLOT_QUARANTINE_S", "Handle", "Session", "Tiers"]

log = logging.getLogger("hicached.tiers")

# The slots a closed connection was writing into, or held ahead for its stores, are reused only this long
# after: a copy its engine started before it saw the close may still be landing in them.
CLOSED_SLOT_QUARANTINE_S = 5.0

_LOST = (
    "lost %d acknowledged pages since %s: they left L2 before reaching L3 (given up by the backup, or no "
    "backend attached to write them to); %d in all (backup.lost; `ctl flush` reports them)"
)


class Tiers:
    """What each request does to L2 and L3: the parts, and the requests that span them. `cfg` is the
    configuration in force: a reload sets it, and every part follows. `records` (the slot headers a crash
    rebuilds L2 from) hears of every page made ready, written to L3 or gone, and `on_slab(arena, slab,
    slot_bytes)` of every slab an arena's allocator gives to a class: what keeps L2 over a crash
    (hicached.daemon.persist) is handed in here, never imported."""

    def __init__(
        self,
        cfg: Config,
        pool: Pool,
        connector: Connector | None,
        records: PageRecords | None = None,
        on_slab: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self._cfg = cfg
        self.pool = pool
        self.counters: collections.Counter[str] = collections.Counter()
        self.activity = EngineActivity()
        # The backend's attach and detach, the index's shortage and the backup's pace are told to parts built
        # after them, through these methods of the front.
        self.backend = Backend(cfg, self.counters, on_attach=self._attached, on_detach=self._detached)
        self.backend.current = connector
        if connector is not None:
            self.backend.note_location(connector)
        self.arenas = Arenas(pool, lambda: self.cfg.tenants)
        # Every page's state and its moves (see life.py); the index files the pages.
        self.life = PageLife(
            [
                SlabAllocator(
                    a.size,
                    cfg.pool.slab_size,
                    a.base,
                    a.index,
                    on_assign=None if on_slab is None else functools.partial(on_slab, a.index),
                )
                for a in pool.arenas
            ],
            pool,
            self.counters,
            attached=lambda: self.backend.current is not None,
            configured=lambda: self.cfg.storage.backend != "none",
            lost=EveryMinute(self.counters, "backup.lost", logging.ERROR, _LOST).add,
            arena_of=self.arenas.arena_of,
            on_short=self._short,
            eviction=cfg.pool.eviction,
            records=records,
        )
        self.index = self.life.index
        self.namespaces: dict[str, int] = {}
        st = cfg.storage
        # Each namespace's clear epoch, shared by the nodes of a fleet through L3: the name of its objects
        # there, and clears made on other nodes (epochs.py).
        self.epochs = Epochs(
            self.backend,
            self.counters,
            interval=lambda: self.cfg.storage.epoch_interval,
            changed=self._cleared_elsewhere,
            in_l2=self.index.namespaces,
        )
        written = KeysWritten()  # which pages read from L3 other nodes stored (a metric: origin.py)
        self.backup = Backup(
            self.life,
            pool,
            self.backend,
            self.counters,
            st.backup_concurrency,
            st.backup_batch_pages,
            st.backup_batch_bytes,
            st.backup_queue_pages,
            Backoff.from_config(st.retry),
            allowed=self._backup_calls_allowed,
            defer=self._backup_defer,
            stored=self.epochs.stored,
            written=written,
        )
        self.prefetcher = Prefetcher(
            self.life,
            pool,
            self.backend,
            self.counters,
            st.prefetch_concurrency,
            st.prefetch_batch_pages,
            st.prefetch_batch_bytes,
            st.prefetch_queue_pages,
            stored=self.epochs.stored,
            written=written,
        )
        dropped = EveryMinute(self.counters, "backup.dropped", logging.WARNING)
        self.policy = WritePolicy(cfg, self.index, self.backup, self.backend, self.activity, dropped)
        self.debt = L3Debt(self.life, self.backend, self.backup, self.policy, self.counters)
        self.stores = Stores(
            cfg, self.life, self.backup, self.backend, self.policy, self.activity, self.counters
        )
        self.loads = Loads(
            cfg, self.index, self.backend, self.prefetcher, self.activity, self.counters, self.epochs.stored
        )
        self.clears = Clears(
            lambda: self.cfg, self.life, self.backend, self.prefetcher, self.epochs, self.counters
        )
        # The requests of each part, as the server and the region service call them.
        self.alloc = self.stores.alloc
        self.commit = self.stores.commit
        self.abort = self.stores.abort
        self.reserve = self.stores.reserve
        self.put = self.stores.put
        self.hold_writing = self.stores.hold_writing
        self.commit_held = self.stores.commit_held
        self.abort_held = self.stores.abort_held
        self.exists_l2 = self.loads.exists_l2
        self.exists = self.loads.exists
        self.present = self.loads.present
        self.all_ready = self.loads.all_ready
        self.acquire_ready = self.loads.acquire_ready
        self.acquire = self.loads.acquire
        self.release = self.loads.release
        self.hold_lease = self.loads.hold_lease
        self.prefetch = self.loads.prefetch
        self.wait = self.loads.wait
        self.release_held = self.loads.release_held
        self.clear = self.clears.clear
        self.flush = self.debt.flush
        self.flush_dirty = self.debt.flush_dirty
        self.not_in_l3 = self.debt.not_in_l3
        self.set_policy = self.policy.set_policy
        self.attached = self.debt.attached  # set while a backend is attached (the warmup waits for one)

    @property
    def cfg(self) -> Config:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:
        """A reload's configuration, for every part."""
        self._cfg = cfg
        self.policy.cfg = self.stores.cfg = self.loads.cfg = cfg

    @property
    def write_back(self) -> bool:
        return self.policy.write_back

    @property
    def pinned_bytes(self) -> int:
        return self.life.pinned_bytes

    @property
    def stranded(self) -> set[Entry]:
        """Acknowledged pages owed to L3 while no backend is attached (life.PageLife.stranded)."""
        return self.life.stranded

    @property
    def connector(self) -> Connector | None:
        return self.backend.current

    # What the parts built first tell those built after them.

    def _attached(self, connector: Connector) -> None:
        self.debt.backend_attached(connector)

    def _detached(self) -> None:
        self.debt.backend_detached()

    def _cleared_elsewhere(self, ns: str) -> None:
        self.clears.cleared_elsewhere(ns)

    def _short(self, nbytes: int, arena: int) -> int:
        return self.policy.backlog_full(nbytes, arena)

    def _backup_calls_allowed(self) -> int:
        return self.policy.calls_allowed()

    def _backup_defer(self) -> float:
        return self.policy.defer()

    # Tenants' arenas: hicached.daemon.sched.arenas.Arenas.

    def arena(self, tenant: str) -> tuple[int, int]:
        return self.arenas.arena(tenant)

    def arena_of(self, ns: str) -> int:
        return self.arenas.arena_of(ns)

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        return self.arenas.tenant_stats(self.index, tenant, self.namespaces, self.life.arena_pinned)

    def retenant(self) -> int:
        return self.arenas.retenant(self.index, self.namespaces)

    def engine_offsets(self, s: Session, offsets: list[int]) -> list[int]:
        return self.arenas.engine_offsets(s, offsets)

    def pool_offsets(self, s: Session, offsets: list[Any]) -> list[Any]:
        return self.arenas.pool_offsets(s, offsets)

    def start(self) -> None:
        self.backend.start()
        self.backup.start()
        self.prefetcher.start()
        self.policy.start()
        self.epochs.start()

    async def stop(self) -> None:
        await self.epochs.stop()
        await self.clears.stop()
        await self.policy.stop()
        await self.prefetcher.stop()
        await self.backup.stop()
        await self.backend.stop()

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
        self.epochs.using(ns)
        return {"slot_bytes": slot_size(page_bytes)}

    def _unreserve(self, s: Session) -> None:
        for e in s.reserved.values():
            self.life.unreserve(e, quarantine=CLOSED_SLOT_QUARANTINE_S)
        s.reserved.clear()

    def _abandon_writing(self, s: Session) -> None:
        for e in s.writing.values():
            self.life.abort_write(e, quarantine=CLOSED_SLOT_QUARANTINE_S)
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
        if limit is None:
            limit = self.cfg.pool.max_pinned_fraction * self.index.allocs[entry.cls.arena].capacity
        return self.life.pin(entry, limit)

    def unpin(self, s: Session, keys: list[str]) -> int:
        n = 0
        for key in keys:
            entry = self.index.get(s.ns, key)
            if entry is not None and self.life.unpin(entry):
                n += 1
        return n

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
