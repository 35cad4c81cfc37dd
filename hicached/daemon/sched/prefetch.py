"""Prefetch: L3 -> L2 reads on coroutines, by priority, with concurrent fetches of one key merged.

A fetch allocates FILLING entries for the keys that are not in L2 and queues them in batches; a worker
reads each batch straight into the pool's slots. Leading-prefix semantics: once a key turns out missing,
batches after it that have not started are dropped, since nobody can use pages after a hole.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hicached.config.schema import batch_size
from hicached.connectors.base import BackendError, Hold
from hicached.daemon.l2.index import Entry
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.pool import Pool
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.epochs import plain
from hicached.daemon.sched.origin import KeysWritten

log = logging.getLogger("hicached.prefetch")


class _Request:
    __slots__ = ("hole",)

    def __init__(self) -> None:
        self.hole = 1 << 62  # position of the first key known to be missing


class Prefetcher:
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
        stored: Callable[[str], Awaitable[str]] = plain,
        written: KeysWritten | None = None,
    ) -> None:
        self.life = life
        # The pages this node wrote to L3 (origin.py): a page read that is not among them is another node's.
        self.written = written
        self.stored = stored  # the name of a namespace's objects in L3 now (hicached.daemon.sched.epochs)
        self.index = life.index
        self.pool = pool
        self.backend = backend
        self.counters = counters
        self.concurrency = concurrency
        self.batch_pages = batch_pages
        self.batch_bytes = batch_bytes
        self.queue_pages = queue_pages
        self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self.pending = 0  # pages queued or being read
        # Futures of batches that another fetch merged into (it waits on their pages): such a batch is
        # read even after its own request found a hole before it.
        self._merged: set[asyncio.Future[None]] = set()
        self._workers: list[asyncio.Task[None]] = []
        # Namespaces being cleared (Tiers.clear): how many clears run on each, and a count of those started,
        # so that a read of one of their pages from L3 that overlaps a clear is dropped.
        self._clearing: dict[str, int] = {}
        self._clears: dict[str, int] = {}

    def forgetting(self, ns: str, start: bool) -> None:
        """A clear of `ns` starts (True) or ends: reads of its pages that overlap it are misses."""
        if start:
            self._clearing[ns] = self._clearing.get(ns, 0) + 1
            self._clears[ns] = self._clears.get(ns, 0) + 1
        elif self._clearing[ns] == 1:
            del self._clearing[ns]
        else:
            self._clearing[ns] -= 1

    def start(self) -> None:
        self.resize(self.concurrency)

    def resize(self, concurrency: int) -> None:
        """Runs `concurrency` workers: more are started now, extra ones exit after their current batch."""
        self.concurrency = concurrency
        while len(self._workers) < concurrency:
            self._workers.append(asyncio.create_task(self._worker(), name="prefetch"))
        for _ in range(len(self._workers) - concurrency):
            self._queue.put_nowait((float("-inf"), next(self._seq), None, None, None))  # wake one to exit

    async def stop(self) -> None:
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while not self._queue.empty():
            _, _, _, _, batch = self._queue.get_nowait()
            if batch is not None:
                self._finish(batch, [False] * len(batch))

    def request(self) -> _Request:
        """What fetch() calls for the steps of one request share: where its first missing page is."""
        return _Request()

    def merge(self, entries: list[Any]) -> None:
        """A request waits on `entries`: those being read (FILLING) are in the batches of other requests,
        which must now be read even if their own request finds a hole before them."""
        merged = self._merged
        for e in entries:
            if type(e) is Entry and e.fill is not None:
                merged.add(e.fill)

    def fetch(
        self,
        ns: str,
        keys: list[str],
        page_bytes: int,
        priority: int,
        req: _Request | None = None,
        first: int = 0,
        lease: bool = False,
    ) -> list[Entry]:
        """Entries for the leading `keys` that are in L2 or are now being read from L3 (FILLING, with a
        future). Stops at a full pool and at the queue bound (a key an engine is writing is read from L3
        meanwhile: its store supersedes the read, hicached.daemon.l2.life). `req`
        and `first` (the position of keys[0] in it) let the steps of one request share hole skipping.
        With `lease`, every entry returned also holds a lease for the caller."""
        if self.backend.current is None:
            return []
        index = self.index
        # First the keys as they stand: those in L2 or being read are leased at once (no slot taken below
        # may evict a page this call hands back); those missing are counted, up to the queue bound.
        out: list[Any] = []  # an entry, or the key of a missing page until its entry is made
        missing: list[int] = []  # positions in out
        room = self.queue_pages - self.pending
        get = index.ns_entries(ns).get  # read only, and nothing is added before the second loop
        for pos, key in enumerate(keys):
            entry = get(key)
            if entry is None:
                if len(missing) >= room:
                    self.counters["prefetch.dropped"] += len(keys) - pos
                    break
                missing.append(pos)
                out.append(key)
            else:
                index.lease(entry)
                out.append(entry)
        self.merge(out)
        # Then the slots for the missing pages, all in one go (a full pool evicts one page for each). A new
        # entry holds two leases: one for the fetch until the read ends, one as for the pages found above.
        new: list[tuple[int, Entry]] = []
        if missing:
            cls, slots = index.take_slots(page_bytes, len(missing), ns)
            wanted = [out[pos] for pos in missing]
            if len(set(wanted)) == len(wanted):  # as a rule: every key once
                made = self.life.start_fills(ns, wanted[: len(slots)], page_bytes, cls, slots, leases=2)
                for pos, entry in zip(missing, made, strict=False):  # made may be shorter
                    out[pos] = entry
                    new.append((first + pos, entry))
                full = missing[len(made)] if len(made) < len(missing) else -1
            else:  # the same key twice in one call: its entry is made by its first place
                full = -1
                slots.reverse()
                for pos in missing:
                    entry = index.get(ns, out[pos])
                    if entry is None:
                        if not slots:
                            full = pos
                            break
                        entry = self.life.start_fill(ns, out[pos], page_bytes, cls, slots.pop(), leases=2)
                        new.append((first + pos, entry))
                    else:
                        index.lease(entry)
                    out[pos] = entry
                index.give_back(cls, slots)
            if full >= 0:  # the pool is full: the call stops at the first key that found no slot
                self.counters["prefetch.no_space"] += len(keys) - full
                for e in out[full:]:  # pages found after it
                    if type(e) is Entry:
                        index.unlease(e)
                del out[full:]
        if not lease:  # the leases taken above only guarded the pages while slots were taken
            for entry in out:
                index.unlease(entry)
        if new:
            req = req or _Request()
            self.pending += len(new)
            loop = asyncio.get_running_loop()
            step = batch_size(self.batch_pages, self.batch_bytes, page_bytes)
            for i in range(0, len(new), step):
                batch = new[i : i + step]
                # One future per batch, done when its read ends: who waits for a page waits for its batch
                # (a future per page cost ~1 us a page).
                self.life.filling([entry for _, entry in batch], loop.create_future())
                self._queue.put_nowait((-priority, next(self._seq), ns, req, batch))
        return out

    async def _worker(self) -> None:
        me = asyncio.current_task()
        while True:
            _, _, ns, req, batch = await self._queue.get()
            if batch is None:  # a wake-up from resize
                if len(self._workers) > self.concurrency:
                    self._workers.remove(me)
                    return
                continue
            try:
                if batch[0][0] > req.hole and batch[0][1].fill not in self._merged:
                    self.counters["prefetch.skipped_after_hole"] += len(batch)
                    self._finish(batch, [False] * len(batch))
                    continue
                epoch, clears = self.backend.epoch, self._clears.get(ns)
                ok = await self._read(ns, [e for _, e in batch])
                if ns in self._clearing or self._clears.get(ns) != clears:
                    # Read while the namespace was being cleared: maybe an object deleted since.
                    self.counters["prefetch.cleared"] += sum(ok)
                    ok = [False] * len(ok)
                if self.written is not None:
                    written = self.written
                    self.counters["prefetch.other_nodes_pages"] += sum(
                        good and (ns, e.key) not in written for (_, e), good in zip(batch, ok, strict=True)
                    )
                for (pos, _), good in zip(batch, ok, strict=True):
                    if not good:
                        req.hole = min(req.hole, pos)
                        break
                # Read from a store swapped out meanwhile: good bytes, but not known to be in the new one.
                self._finish(batch, ok, in_l3=self.backend.epoch == epoch)
            except asyncio.CancelledError:
                self._finish(batch, [False] * len(batch))
                raise
            except Exception:
                log.exception("prefetch worker failed on a batch of %d pages; treated as misses", len(batch))
                self._finish(batch, [False] * len(batch))

    async def _read(self, ns: str, entries: list[Entry]) -> list[bool]:
        keys = [e.key for e in entries]
        pool = self.pool.view  # Pool.slot inlined: this runs for every page prefetched
        views = [pool[e.offset : e.offset + e.size] for e in entries]
        hold = Hold()
        try:
            name = await self.stored(ns)
            return await self.backend.call("get", lambda c: c.get_into(name, keys, views, hold=hold))
        except BackendError as e:
            self.counters[f"prefetch.errors.{e.reason}"] += 1
        finally:
            if not hold.released:
                # Given up while an io thread is still in the middle of a page that lands in these slots:
                # out of use until it let go of them, never handed to new pages meanwhile.
                for entry in entries:
                    self.index.remove(entry, until=hold)
        return [False] * len(entries)

    def _finish(self, batch: list[tuple[int, Entry]], ok: list[bool], in_l3: bool = True) -> None:
        self.pending -= len(batch)
        done = batch[0][1].fill
        pages = 0
        filled, unlease = self.life.filled, self.index.unlease  # runs for every page prefetched
        for (_, entry), good in zip(batch, ok, strict=True):
            pages += filled(entry, good, in_l3)
            unlease(entry)  # the fetch's own lease
        self.counters["prefetch.pages"] += pages
        self.counters["prefetch.bytes"] += pages * batch[0][1].size  # a batch is of one namespace
        if pages < len(batch):
            self.counters["prefetch.misses"] += len(batch) - pages
        if done is not None:
            self._merged.discard(done)
            if not done.done():
                done.set_result(None)
