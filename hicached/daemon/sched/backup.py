"""Backup: coroutines that write dirty L2 pages to L3, with a concurrency limit, batches, and retries.

Write-through queues a page as soon as it is committed; write-back queues the oldest dirty pages when the
pool runs short of reclaimable space, and everything on shutdown. A page that cannot be written after the
configured attempts is counted and logged once per batch; it then stops holding its slot. Under
write-through the pages waiting for L3 are bounded (storage.max_unbacked_fraction): past it the oldest
queued ones stop holding their slots (drop_oldest).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from itertools import groupby

import xxhash

from hicached.common.retry import Backoff
from hicached.connectors.base import BackendError, Hold
from hicached.daemon.l2.index import READY, Entry
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.pool import Pool
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.epochs import plain
from hicached.daemon.sched.origin import KeysWritten

log = logging.getLogger("hicached.backup")

_BUSY_POLL_S = 0.002  # how often a worker held back by busy engines looks again
_DEFER_POLL_S = 0.01  # how often a worker deferring to busy engines looks whether they paused


class Backup:
    def __init__(
        self,
        life: PageLife,
        pool: Pool,
        backend: Backend,
        counters: collections.Counter[str],
        concurrency: int,
        batch_pages: int,
        batch_bytes: int,
        queue_pages: int,
        backoff: Backoff,
        allowed: Callable[[], int] | None = None,
        defer: Callable[[], float] | None = None,
        stored: Callable[[str], Awaitable[str]] = plain,
        written: KeysWritten | None = None,
    ) -> None:
        self.life = life
        self.written = written  # the pages this node wrote to L3 (origin.py): for a metric
        # The name of a namespace's objects in L3 now (its clear epoch: hicached.daemon.sched.epochs).
        self.stored = stored
        self.index = life.index
        self.pool = pool
        self.backend = backend  # read at every attempt, so queued work retargets to a swapped backend
        self.counters = counters
        self.concurrency = concurrency
        self.batch_pages = batch_pages
        self.batch_bytes = batch_bytes
        self.queue_pages = queue_pages
        self.backoff = backoff
        self._queue: collections.deque[tuple[float, Entry]] = collections.deque()  # (when queued, page)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0
        self.calls = 0  # backend calls in flight
        self.lingering = 0  # pages still leased by puts given up whose io threads have not let go yet
        # Calls allowed in flight right now (0: no limit besides concurrency); the write policy lowers it
        # while engines are busy, so that background writes leave them the CPU.
        self.allowed: Callable[[], int] = allowed or (lambda: 0)
        # How long a page may wait, from when it was queued, for engines to pause before it is written
        # anyway (0: not at all); the write policy sets it while engines are busy (storage.backup_defer).
        self.defer: Callable[[], float] = defer or (lambda: 0.0)
        self._workers: list[asyncio.Task[None]] = []

    @property
    def pending(self) -> int:
        """Pages queued or being written."""
        return len(self._queue) + self.inflight

    @property
    def full(self) -> bool:
        return self.pending >= self.queue_pages

    def start(self) -> None:
        self.resize(self.concurrency)

    def resize(self, concurrency: int) -> None:
        """Runs `concurrency` workers: more are started now, extra ones exit before their next batch."""
        self.concurrency = concurrency
        while len(self._workers) < concurrency:
            self._workers.append(asyncio.create_task(self._worker(), name="backup"))
        self._wakeup.set()

    async def stop(self) -> None:
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    def submit(self, entry: Entry) -> None:
        self.submit_many((entry,))

    def submit_many(self, entries: Iterable[Entry]) -> None:
        """Queues the dirty pages not queued yet: one clock reading and one wake-up for a request's pages."""
        taken = self.life.queue(entries)
        if taken:
            now = time.monotonic()
            self._queue.extend((now, entry) for entry in taken)
            self._idle.clear()
            self._wakeup.set()

    def drop_oldest(self, nbytes: int, arena: int | None = None) -> int:
        """Stops holding the oldest queued pages for L3 until `nbytes` of slots are no longer held (or none is
        queued): they leave the queue, stay in L2 as any clean page (evictable) and are remembered in
        `dropped`. Pages being written are not taken: their call is under way. With `arena`, only pages of
        that arena of the pool (a tenant's) are taken. Returns how many."""
        queue, drop = self._queue, self.life.drop
        freed = n = 0
        others = []  # another arena's, put back in their order
        while queue and freed < nbytes:
            item = queue.popleft()
            entry = item[1]
            if arena is not None and entry.cls.arena != arena:
                others.append(item)
                continue
            if drop(entry):
                freed += entry.cls.slot_bytes
                n += 1
        queue.extendleft(reversed(others))
        if not queue and not self.inflight:
            self._idle.set()
        return n

    async def drain(self, timeout: float) -> bool:
        """Waits until nothing is queued or in flight; False if `timeout` passed first."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def _worker(self) -> None:
        me = asyncio.current_task()
        while True:
            while not self._queue and len(self._workers) <= self.concurrency:
                self._wakeup.clear()
                await self._wakeup.wait()
            if len(self._workers) > self.concurrency:
                self._workers.remove(me)
                self._wakeup.set()  # pass the news on to the next extra worker
                return
            allowed = self.allowed()
            if allowed and self.calls >= allowed:
                await asyncio.sleep(_BUSY_POLL_S)
                continue
            defer = self.defer()
            if defer > 0 and (wait := self._queue[0][0] + defer - time.monotonic()) > 0:
                await asyncio.sleep(min(wait, _DEFER_POLL_S))  # engines busy: wait for a pause, or the bound
                continue
            batch = [self._queue.popleft()[1]]
            nbytes = batch[0].size
            while (
                self._queue
                and len(batch) < self.batch_pages
                and nbytes + self._queue[0][1].size <= self.batch_bytes
            ):
                batch.append(self._queue.popleft()[1])
                nbytes += batch[-1].size
            self.inflight += len(batch)
            self.calls += 1
            try:
                for ns, group in groupby(sorted(batch, key=lambda e: e.ns), key=lambda e: e.ns):
                    await self._write(ns, list(group))
            except Exception:
                log.exception(
                    "backup worker failed on a batch of %d pages; they stay dirty in L2", len(batch)
                )
                self.life.unqueue(batch, refile=True)
            finally:
                self.inflight -= len(batch)
                self.calls -= 1
                if not self._queue and not self.inflight:
                    self._idle.set()

    async def _write(self, ns: str, entries: list[Entry]) -> None:
        self.index.lease_all(entries)
        hold = Hold()
        try:
            await self._write_leased(ns, entries, hold)
        finally:
            self.life.unqueue(entries)
            if hold.released:
                self.index.unlease_all(entries)
            else:
                # A put given up (time-out) whose io thread is still in the middle of a page: the slots
                # stay leased, out of eviction's and everyone's reach, until it let go of them.
                self.lingering += len(entries)
                hold.when_released(lambda: self._let_go(entries))

    def _let_go(self, entries: list[Entry]) -> None:
        self.lingering -= len(entries)
        self.index.unlease_all(entries)

    def _not_changed(
        self, ns: str, failed: list[Entry], views: list[memoryview], todo: list[Entry]
    ) -> list[Entry]:
        """Of the pages L3 refused, those whose bytes no longer hash to the checksum they were stored with
        (an engine wrote into its slot after storing it, or sent a wrong checksum): L3 will never take them
        and the daemon cannot vouch for them, so they are not retried nor owed to L3 any more (counted,
        never lost); the others are returned, to be retried. Hashed only here, after a refusal."""
        slot = dict(zip(map(id, todo), views, strict=True))
        changed = [e for e in failed if xxhash.xxh3_64_intdigest(slot[id(e)]) != e.checksum]
        if not changed:
            return failed
        self.counters["backup.changed"] += len(changed)
        log.warning(
            "%d pages of %s do not hash to the checksum they were stored with (an engine wrote into its "
            "slot after storing it, or sent a wrong checksum): not written to L3",
            len(changed),
            ns,
        )
        for e in changed:
            self.life.changed(e)
        gone = set(map(id, changed))
        return [e for e in failed if id(e) not in gone]

    async def _write_leased(self, ns: str, todo: list[Entry], hold: Hold) -> None:
        attempt = 1
        last_error = "the backend refused the pages"
        while todo:
            live = self.index.ns_entries(ns).get  # index.live, inlined: this runs for every page
            todo = [e for e in todo if live(e.key) is e and e.dirty and e.state == READY]
            if not todo or self.backend.current is None:
                return  # detached: the tiers queue pages that are not in L3 again when a backend attaches
            try:
                # No lookup before the write: a page owed to L3 is written, whatever L2 believed of L3
                # (hicached.daemon.l2.life), and a lookup per page cost as much as the write itself on S3.
                keys = [e.key for e in todo]
                pool = self.pool.view  # Pool.slot, inlined
                views = [pool[e.offset : e.offset + e.size] for e in todo]
                # Each page's checksum as it entered L2 (taken by the engine's client or the copy executor):
                # the backend writes it into the header and publishes the page only if its bytes, as
                # written, hash to it; never one of a page's bytes as they may be now.
                # A page read from L3 (checked there) may have none: hashed now, while leased.
                checksum = self.life.checksum
                sums = [checksum(e, v) for e, v in zip(todo, views, strict=True)]
                epoch = self.backend.epoch
                name = await self.stored(ns)
                ok = await self.backend.call(
                    "put",
                    lambda c, n=name, ks=keys, vs=views, sums=sums: c.put(n, ks, vs, sums, hold=hold),
                )
                if self.backend.epoch != epoch:
                    continue  # written to a store swapped out meanwhile: write them to the new one
                failed, nbytes = [], 0
                for e, good in zip(todo, ok, strict=True):
                    if good:
                        self.life.written(e)
                        nbytes += e.size
                        if self.written is not None:
                            self.written.add(ns, e.key)
                    else:
                        failed.append(e)
                self.counters["backup.pages"] += len(todo) - len(failed)
                self.counters["backup.bytes"] += nbytes
                todo = self._not_changed(ns, failed, views, todo) if failed else failed
            except BackendError as e:
                last_error = str(e)
                self.counters[f"backup.errors.{e.reason}"] += 1
            if not todo:
                return
            if attempt >= self.backoff.attempts:
                self.counters["backup.failed"] += len(todo)
                log.error(
                    "backup of %d pages of %s failed after %d attempts (%s); they are no longer held for L3",
                    len(todo),
                    ns,
                    attempt,
                    last_error,
                )
                self.life.give_up(todo)
                return
            self.counters["backup.retries"] += 1
            await asyncio.sleep(self.backoff.delay(attempt))
            attempt += 1
