"""The write policy: write-back's loop under memory pressure, the bound on pages waiting for L3 (the backlog)
and the pace of write-through backups while engines are busy. Methods of Tiers (tiers.py holds the state)."""

from __future__ import annotations

import asyncio
import collections
import itertools

from hicached.config import Config
from hicached.connectors.base import Connector
from hicached.daemon.l2.index import PageIndex
from hicached.daemon.l2.slabs import slot_size
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.session import Session


class WriteBack:
    """Tiers' write policy (state set up in Tiers.__init__)."""

    cfg: Config
    index: PageIndex
    backend: Backend
    backup: Backup
    counters: collections.Counter[str]
    connector: Connector | None
    _pressure: asyncio.Event
    _writeback_task: asyncio.Task[None] | None

    @property
    def write_back(self) -> bool:
        return self.cfg.storage.write_policy == "write_back"

    def set_policy(self, was_write_back: bool) -> None:
        """Follow a change of storage.write_policy made by a reload."""
        if self.write_back and not was_write_back:
            self._writeback_task = asyncio.create_task(self._writeback_loop(), name="writeback")
        elif was_write_back and not self.write_back:
            if self._writeback_task is not None:
                self._writeback_task.cancel()
                self._writeback_task = None
            self.backup.submit_many(list(self.index.dirty.values()))

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
