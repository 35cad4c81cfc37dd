"""The write policy: write-back's loop under memory pressure, the bound on pages waiting for L3 (the backlog)
and the pace of write-through backups while engines are busy."""

from __future__ import annotations

import asyncio
import itertools

from hicached.config import Config
from hicached.daemon.l2.index import PageIndex
from hicached.daemon.l2.slabs import slot_size
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.reports import EveryMinute


class WritePolicy:
    """When pages owed to L3 are written (storage.write_policy) and how many may wait for it. `cfg` is
    replaced by a reload (Tiers.cfg); `arena_of`: the arena of a namespace (a tenant's pool)."""

    def __init__(
        self,
        cfg: Config,
        index: PageIndex,
        backup: Backup,
        backend: Backend,
        activity: EngineActivity,
        dropped: EveryMinute,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.backup = backup
        self.backend = backend
        self.activity = activity
        self._dropped_report = dropped
        self.pressure = asyncio.Event()  # set when write-back should look at the pool
        self._task: asyncio.Task[None] | None = None

    @property
    def write_back(self) -> bool:
        return self.cfg.storage.write_policy == "write_back"

    def start(self) -> None:
        if self.write_back:
            self._task = asyncio.create_task(self._writeback_loop(), name="writeback")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def set_policy(self, was_write_back: bool) -> None:
        """Follow a change of storage.write_policy made by a reload."""
        if self.write_back and not was_write_back:
            self._task = asyncio.create_task(self._writeback_loop(), name="writeback")
        elif was_write_back and not self.write_back:
            if self._task is not None:
                self._task.cancel()
                self._task = None
            self.backup.submit_many(list(self.index.dirty.values()))

    def stored(self) -> None:
        """Pages were stored: write-back looks at the pool once it is below the watermark."""
        if self.write_back and self.index.reclaimable_fraction() < self.cfg.pool.writeback_low_watermark:
            self.pressure.set()

    def short(self) -> None:
        """A store found no slot: write-back writes pages out so that they can be evicted."""
        if self.write_back:
            self.pressure.set()

    def backlog_limit(self, arena: int | None = None) -> float:
        """Bytes of slots that pages waiting for L3 may hold (write-through): max_unbacked_fraction of the
        pool, or of one arena (a tenant's pool)."""
        capacity = self.index.capacity if arena is None else self.index.allocs[arena].capacity
        return self.cfg.storage.max_unbacked_fraction * capacity

    def backlog_room(self, ns: str, page_bytes: int) -> int:
        """Under when_backlog_full = "refuse": how many more pages of `ns` may wait for L3."""
        arena = max(0, self.index.arena_of(ns))
        room = self.backlog_limit(arena) - self.index.arena_dirty[arena]
        return max(0, int(room) // slot_size(page_bytes))

    def backlog_full(self, nbytes: int, arena: int = 0) -> int:
        """The pool has no slot left to free for `nbytes` of new pages (the index's on_short). Under
        write-through with drop_oldest, while the pages waiting for L3 hold more than
        storage.max_unbacked_fraction of the pool, the oldest of them stop holding their slots until they are
        within it: the pool takes new pages whatever L3 does. Nothing is dropped while a slot is free or
        evictable: a backend that is only behind for a burst loses nothing. Counted, and logged once a
        minute. Returns how many."""
        over = self.index.arena_dirty[arena] - self.backlog_limit(arena)
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

    def _through_while_busy(self) -> bool:
        """Write-through, with an engine that stored or loaded within the busy window."""
        return not self.write_back and self.activity.busy()

    def calls_allowed(self) -> int:
        """Write-through backups are background work: while engines store or load, they run at most
        storage.backup_concurrency_busy calls. Write-back writes (memory pressure, flush) are never held."""
        return self.cfg.storage.backup_concurrency_busy if self._through_while_busy() else 0

    def defer(self) -> float:
        """While engines store or load, a write-through backup waits for them to pause, at most
        storage.backup_defer from when its page was stored (then it runs, backup_concurrency_busy calls at
        a time): its I/O would take memory bandwidth and CPU from the engines' copies. Not once the pages
        waiting for L3 hold half of what they may (storage.max_unbacked_fraction): deferred longer, they would
        be the oldest ones dropped when the pool needs slots, and engines storing faster than the pool turns
        over in backup_defer would starve L3 of every page."""
        if not self._through_while_busy() or 2 * self.index.dirty_bytes > self.backlog_limit():
            return 0.0
        return self.cfg.storage.backup_defer

    async def _writeback_loop(self) -> None:
        mark = self.cfg.pool.writeback_low_watermark
        while True:
            await self.pressure.wait()
            self.pressure.clear()
            if self.backend.current is None:
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
