"""What L3 is owed: a backend attached or detached, `ctl flush` (the pages' moves are
hicached.daemon.l2.life's)."""

from __future__ import annotations

import asyncio
import collections
import logging

from hicached.connectors.base import Connector
from hicached.daemon.l2.life import PageLife
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.writeback import WritePolicy

log = logging.getLogger("hicached.tiers")


class L3Debt:
    """What L3 is owed as backends come and go, and `ctl flush`: built on the page lifecycle (`life`), the
    backup queue and the write policy (under write-back, pages owed are written on pressure)."""

    def __init__(
        self,
        life: PageLife,
        backend: Backend,
        backup: Backup,
        policy: WritePolicy,
        counters: collections.Counter[str],
    ) -> None:
        self.life = life
        self.backend = backend
        self.backup = backup
        self.policy = policy
        self.counters = counters
        self.attached = asyncio.Event()  # set while a backend is attached (the warmup waits for one)
        if backend.current is not None:
            self.attached.set()
        self._l3_epoch = backend.epoch  # the store that pages' in_l3 refers to
        self._lost_flushed = 0  # backup.lost when the previous flush answered
        self._gone_flushed = 0  # backup.dropped_gone then

    def backend_attached(self, connector: Connector) -> None:
        """A backend was attached: pages in L2 that never reached L3 are backed up to it."""
        self.attached.set()
        if self.life.records is not None:
            self.life.records.l3(repr(connector.location()))
        # Another store (not the same one re-attached): pages that reached the old store are not known to
        # be in this one. They stay clean and evictable (a swap does not copy L2 into the new store, nor
        # hold the pool until it has); a store of one again is written to the new store, as any store is.
        other_store = self.backend.epoch != self._l3_epoch
        self._l3_epoch = self.backend.epoch
        owed = self.life.backend_attached(other_store)
        if not self.policy.write_back:
            self.backup.submit_many(owed)
        if owed:
            log.info("queued %d pages that are not in L3 yet for %s", len(owed), connector.name)

    def backend_detached(self) -> None:
        """No backend: nothing can be written, so dirty pages stop holding their slots. They are still owed
        to L3 (stranded): backed up when a backend attaches again, lost if they leave L2 before."""
        self.attached.clear()
        self.life.backend_detached()

    async def flush_dirty(self, timeout: float) -> bool:
        """Queue every dirty page for L3, and the pages an earlier backup gave up on (the backend may take
        them now: a disk freed), and wait for the queue to drain (shutdown, drain). True only when every
        one of them reached L3: none was still queued at `timeout`, none was given up again. With no backend
        attached nothing can be written: True only when no page owed to L3 waits in L2 for one."""
        if self.backend.current is None:
            # A put in flight as the backend was detached may still have written some, or given them up
            # (they are counted in given_up then).
            self.life.settle_stranded()
            return not self.not_in_l3()
        failed = self.counters["backup.failed"]
        self.backup.submit_many(self.life.owe_again())
        drained = await self.backup.drain(timeout)
        return drained and self.counters["backup.failed"] == failed

    def not_in_l3(self) -> int:
        """Pages acknowledged to engines and owed to L3, still in L2, that are not known to be in L3 after a
        flush: still queued or being written, given up by the backup, or waiting for a backend."""
        return self.life.not_in_l3(self.backend.current is not None, self.backup.pending)

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
