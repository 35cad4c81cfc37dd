"""Pages owed to L3: remembered once there, stranded while no backend is attached, counted lost when they
leave L2 first; a backend attached or detached; `ctl flush`. Methods of Tiers (tiers.py holds the state)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

from hicached.config import Config
from hicached.connectors.base import Connector
from hicached.daemon.l2.index import READY, Entry, PageIndex, PageRecords
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup

log = logging.getLogger("hicached.tiers")


class Losses:
    """Tiers' bookkeeping of what L3 is owed (state set up in Tiers.__init__)."""

    cfg: Config
    index: PageIndex
    backend: Backend
    backup: Backup
    counters: collections.Counter[str]
    headers: PageRecords | None
    attached: asyncio.Event
    known_in_l3: collections.OrderedDict[tuple[str, str], None]
    stranded: set[Entry]
    write_back: bool
    connector: Connector | None
    _l3_epoch: int
    _lost_flushed: int
    _gone_flushed: int

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
