"""A page's life in L2: every state a page can be in, every move between them, and who hears of the moves.

Only this module changes what a page is (Entry.state, and what L2 owes L3 for it: dirty, queued, in_l3, the
pages given up, dropped and stranded; its pin and checksum). The index (hicached.daemon.l2.index) files
pages by what these say (keys, slots, the LRU and dirty lists, counts); the scheduler asks for moves by name;
the slot headers (PageRecords), the losses count and the counters hear of the moves here.

A page (Entry.state):

              alloc / reserve               commit / put / store_pages (publish)
    free ─────────────────────► WRITING ───────────────────────────────────────► READY
     ▲        a writer's own slot,   │   the key is READY already: this slot is freed, the page
     │        under no key           │   there is the one acknowledged (and owed to L3 again);
     ├── abort, writer gone ◄────────┘   the key is FILLING: that fill is SUPERSEDED, this page wins
     │   (quarantined)
     │          fetch (load, prefetch)             read whole
     ├───────────────────────► FILLING ─────────────────────────────► READY (in L3)
     │   miss, corrupt, failed ◄──┘  └── a store published ──► SUPERSEDED ──┐
     ├─────────────────────────────────────── read ends (slot freed) ◄──────┘
     └── evicted (clean, unleased, unpinned), forgotten (clear) ◄── READY

What a READY page owes L3:

    owed (dirty: held in L2) ──queue──► queued ──written──► in L3 (clean: evictable)
      ▲  │                                │  ├── refused after the attempts ──► given up
      │  │                                │  └── bytes changed since stored ──► nothing owed (counted)
      │  └── no backend attached ──► stranded
      │                                   └── backlog bound (drop_oldest) ──► dropped
      └── stored again, a backend attached, a flush (given up, dropped, stranded: none of them held in L2)

A page that leaves L2 while given up or stranded is lost (backup.lost, reported by `ctl flush`); dropped,
it is counted apart (backup.dropped_gone). The invariant: a page acknowledged to an engine is loadable from
L2 or L3 with its exact bytes, or its loss is counted. "Present" means READY, nothing less: a store never
answers present for a page being written or read. What L2 believes about L3 (in_l3) is a hint that can go
stale (a janitor, Redis eviction, another node's clear): a page stored again is owed to L3 again, never
taken for written on the strength of it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

import xxhash

from hicached.daemon.l2.index import FILLING, READY, SUPERSEDED, Entry, PageIndex, PageRecords
from hicached.daemon.l2.pool import Pool
from hicached.daemon.l2.slabs import SlabAllocator


class PageLife:
    """The owner of every page's state. `attached`: whether a backend is attached now (pages owed to L3 are
    held in L2 for it); `configured`: whether one is configured at all (storage.backend != "none": else
    nothing is owed); `lost`: told how many acknowledged pages left L2 before reaching L3; `arena_of` and
    `on_short`: as PageIndex takes them; `records`: the slot headers a crash rebuilds L2 from, told of every
    page made ready, written to L3 or gone (None: none are kept)."""

    def __init__(
        self,
        allocators: list[SlabAllocator],
        pool: Pool,
        counters: collections.Counter[str],
        *,
        attached: Callable[[], bool],
        configured: Callable[[], bool],
        lost: Callable[[int], None],
        arena_of: Callable[[str], int] | None = None,
        on_short: Callable[[int, int], int] | None = None,
        eviction: str = "lru",
        records: PageRecords | None = None,
    ) -> None:
        self.index = PageIndex(
            allocators, arena_of=arena_of, on_remove=self._left, on_short=on_short, eviction=eviction
        )
        self.pool = pool
        self.counters = counters
        self._attached = attached
        self._configured = configured
        self._lost = lost
        self.records = records
        # READY pages owed to L3 and not held in L2 for it (see the diagram). Each is bounded by L2: a page
        # leaves its set as it leaves L2.
        self.given_up: set[Entry] = set()
        self.dropped: set[Entry] = set()
        self.stranded: set[Entry] = set()
        self.pinned_bytes = 0
        self.arena_pinned = [0] * len(self.index.allocs)  # pinned_bytes by arena
        counters["backup.lost"] = 0  # counted from 0, so that the metric exists before the first loss
        counters["backup.dropped"] = 0

    # Writing.

    def start_writes(self, ns: str, keys: list[str], page_bytes: int) -> list[Entry]:
        """A WRITING slot for each of `keys` (all different), leased for its writer, under no key: fewer
        when the pool has no more to give."""
        cls, slots = self.index.take_slots(page_bytes, len(keys), ns)
        return self.index.private_entries(ns, keys, page_bytes, cls, slots)

    def publish(self, entry: Entry, checksum: int | None, key: str | None = None) -> tuple[Entry, bool]:
        """The writer of `entry` (from start_writes; or a reserved slot, given its `key`) wrote its bytes,
        hashing to `checksum` if the client took it: the page of its key is now READY. Returns that
        page, and whether it is owed to L3 now (for the caller to queue). The key READY already: this slot
        is freed and that page is the one acknowledged, owed to L3 again (what L2 believes of L3 may be
        stale). The key FILLING: that read is superseded and this page takes the key (a miss of the read
        never removes it)."""
        index = self.index
        reserved = key is not None
        if reserved:
            entry.key = key
        cur = index.get(entry.ns, entry.key)
        if cur is not None and cur.state is READY:
            if reserved:
                raise ValueError("a reserved slot is published only under a key with no ready page")
            entry.leases = 0
            index.release_private(entry)
            self.counters["store.present"] += 1
            return cur, self._stored_again(cur)
        if cur is not None:  # FILLING: its read goes on into its own slot, and is a miss once it ends
            index.take_off_key(cur)
            cur.state = SUPERSEDED
            self.counters["store.superseded_fills"] += 1
        if checksum is None:
            # A client that sent none (the protocol has them optional): taken now, as the page enters L2.
            # What its bytes must hash to from now on: L3 publishes it only if they do.
            checksum = xxhash.xxh3_64_intdigest(self.pool.slot(entry.offset, entry.size))
        entry.checksum = checksum
        entry.state = READY
        entry.in_l3 = False
        index.publish(entry, reserved)
        if self._attached():
            entry.dirty = True
        elif self._configured():
            # Owed to the configured backend, which is away (its breaker open, detached): backed up when it
            # attaches. With storage.backend = "none" the daemon is L2 only: nothing is owed.
            self.stranded.add(entry)
        if self.records is not None:
            self.records.commit(entry)  # before the answer: an acknowledged page outlives a crash
        index.unlease(entry)
        self.counters["store.pages"] += 1
        self.counters["store.bytes"] += entry.size
        return entry, entry.dirty

    def stored_again(self, entry: Entry) -> bool:
        """An engine stored a READY page again (alloc or put answered present): owed to L3 again unless it is
        already owed and held. True when it is owed now (for the caller to queue)."""
        self.counters["store.present"] += 1
        return self._stored_again(entry)

    def _stored_again(self, entry: Entry) -> bool:
        # Owed and held already, or being written right now (the write lands after the store came).
        if entry.dirty or entry.queued or not self._configured():
            return False
        self.given_up.discard(entry)
        self.dropped.discard(entry)
        if entry.in_l3:
            self.counters["store.rewritten"] += 1  # believed in L3: written again, the belief may be stale
        entry.in_l3 = False
        if not self._attached():  # owed to the backend when it is back, lost if it leaves L2 before
            self.stranded.add(entry)
            return False
        self.stranded.discard(entry)
        entry.dirty = True
        self.index.update(entry)
        return True

    def abort_write(self, entry: Entry, quarantine: float = 0.0) -> None:
        """A writer's slot whose bytes never came (aborted, its copy failed, its connection closed): freed,
        after `quarantine` seconds if a copy may still land in it."""
        entry.leases = 0
        self.index.release_private(entry, quarantine)

    def unreserve(self, entry: Entry, quarantine: float = 0.0) -> None:
        """A reserved slot never put: back to the allocator (as abort_write)."""
        entry.leases = 0
        self.index.unreserve(entry, quarantine)

    # Filling from L3.

    def start_fills(
        self, ns: str, keys: list[str], page_bytes: int, cls, slots: list[int], leases: int
    ) -> list[Entry]:
        """FILLING pages for `keys` (all different and not in L2) in `slots` from take_slots, each with
        `leases` leases."""
        return self.index.entries_at(ns, keys, page_bytes, cls, slots, FILLING, leases)

    def start_fill(self, ns: str, key: str, page_bytes: int, cls, slot: int, leases: int) -> Entry:
        return self.start_fills(ns, [key], page_bytes, cls, [slot], leases)[0]

    def filling(self, entries: list[Entry], done: asyncio.Future[None]) -> None:
        """FILLING pages queued for one read: `done` is set when it ends (who waits for a page waits on
        it)."""
        for entry in entries:
            entry.fill = done

    def filled(self, entry: Entry, good: bool, in_l3: bool) -> bool:
        """The read of a FILLING page ended: READY if its bytes came whole (`in_l3`: read from the store
        attached now), else it leaves L2. A SUPERSEDED one only gives its slot back. True when it became
        READY. The caller gives back the fill's own lease."""
        entry.fill = None
        if entry.state is not FILLING or not self.index.live(entry):
            self.index.remove(entry)  # superseded by a store, or removed (the read given up): its slot
            return False
        if not good:
            self.index.remove(entry)
            return False
        entry.state = READY
        entry.in_l3 = in_l3
        if self.records is not None:
            if entry.checksum is None:  # what a record carries; the backup then need not hash it
                entry.checksum = xxhash.xxh3_64_intdigest(self.pool.slot(entry.offset, entry.size))
            self.records.commit(entry)
        return True

    # What L3 is owed: the backup's moves.

    def queue(self, entries: Iterable[Entry]) -> list[Entry]:
        """The owed pages of `entries` not queued yet are handed to the backup: returns them."""
        update, out = self.index.update, []
        for entry in entries:
            if entry.queued or not entry.dirty:
                continue
            entry.queued = True
            update(entry)
            out.append(entry)
        return out

    def unqueue(self, entries: Iterable[Entry], refile: bool = False) -> None:
        """The backup is done with `entries` (written or not): refiled now with `refile`, else as their
        leases go."""
        for entry in entries:
            entry.queued = False
            if refile:
                self.index.update(entry)

    def drop(self, entry: Entry) -> bool:
        """A queued page the backlog bound takes out of the queue (drop_oldest): no longer held in L2 for L3.
        True if it was owed (and is now dropped)."""
        entry.queued = False
        if not entry.dirty:
            return False
        entry.dirty = False
        self.index.update(entry)
        self.dropped.add(entry)
        return True

    def checksum(self, entry: Entry, view: memoryview) -> int:
        """The page's checksum, hashed from its slot now if none was taken (a page read from L3 under no
        slot headers): the caller holds a lease on it."""
        if entry.checksum is None:
            entry.checksum = xxhash.xxh3_64_intdigest(view)
        return entry.checksum

    def written(self, entry: Entry) -> None:
        """The backup wrote the page to L3: clean, evictable once unleased."""
        entry.dirty = False
        entry.in_l3 = True
        if self.records is not None:
            self.records.in_l3(entry)
        self.given_up.discard(entry)
        # Out of the dirty count now, not when the last lease goes: an engine may hold the page past the
        # backup's lease. Evictable once that is given back (and any other lease).
        self.index.update(entry)

    def give_up(self, entries: Iterable[Entry]) -> None:
        """The backup gave up on the pages after its attempts: no longer held in L2, still owed."""
        for entry in entries:
            entry.dirty = False
            self.index.update(entry)
            self.given_up.add(entry)

    def changed(self, entry: Entry) -> None:
        """The page's bytes no longer hash to its checksum (an engine wrote into its slot after storing it):
        L3 will never take it and the daemon cannot vouch for it. Nothing owed any more, never lost."""
        entry.dirty = False
        self.given_up.discard(entry)
        self.index.update(entry)

    def owe_again(self) -> list[Entry]:
        """A flush: the pages given up or dropped that are still in L2 are owed again (the backend may take
        them now: a disk freed). Returns every page owed and not queued, oldest first."""
        for entry in [*self.given_up, *self.dropped]:
            if self.index.live(entry) and entry.state is READY and not entry.in_l3 and not entry.dirty:
                entry.dirty = True
                self.index.update(entry)
        self.given_up.clear()
        self.dropped.clear()
        return list(self.index.dirty.values())

    def backend_attached(self, other_store: bool) -> list[Entry]:
        """A backend was attached: every READY page not in L3 and not held for it is owed (returned, to
        queue); with `other_store` (not the store that was detached), no page is taken for in L3 any more
        (a swap does not copy L2 into the new store, nor hold the pool until it has)."""
        out = []
        for entry in self.index.entries.values():
            if entry.state is READY and not entry.in_l3 and not entry.dirty:
                entry.dirty = True
                self.index.update(entry)
                out.append(entry)
            elif other_store:
                entry.in_l3 = False
        self.stranded.clear()
        self.given_up.clear()
        self.dropped.clear()
        return out

    def backend_detached(self) -> None:
        """No backend: nothing can be written, so owed pages stop holding their slots (stranded)."""
        for entry in [e for e in self.index.entries.values() if e.dirty]:
            entry.dirty = False
            self.index.update(entry)
            self.stranded.add(entry)

    def settle_stranded(self) -> None:
        """With no backend: pages stranded that a put in flight as it went wrote after all, or gave up, are
        stranded no more."""
        self.stranded.difference_update([e for e in self.stranded if e.in_l3 or e in self.given_up])

    def not_in_l3(self, attached: bool, pending: int) -> int:
        """Pages acknowledged, owed to L3 and still in L2 that are not in it: `pending` (queued or being
        written) and those given up, and with no backend, those stranded."""
        if not attached:
            return len(self.given_up) + len(self.stranded)
        return pending + len(self.given_up)

    def not_in(self, entry: Entry) -> None:
        """The page is not taken for in L3 any more (it was in another store than the one attached)."""
        entry.in_l3 = False

    def forget(self, entry: Entry) -> None:
        """An idle READY page leaves L2 for clear(): owed to L3 no more, not lost, unpinned."""
        entry.dirty = False
        entry.in_l3 = False
        self.given_up.discard(entry)
        self.dropped.discard(entry)
        self.stranded.discard(entry)
        if entry.pinned:
            self._unpin(entry)
        self.index.remove(entry)

    def disown(self, entry: Entry) -> None:
        """A READY page whose namespace was cleared on another node (hicached.daemon.sched.epochs), held now
        by a load or the backup: owed to L3 no more (never written under the new epoch), not lost; it is
        forgotten once let go."""
        entry.dirty = False
        entry.in_l3 = False
        self.given_up.discard(entry)
        self.dropped.discard(entry)
        self.stranded.discard(entry)
        self.index.update(entry)

    def restored(self, entry: Entry, checksum: int, in_l3: bool, owed: bool, hot: bool = False) -> bool:
        """A page kept over a restart (hicached.daemon.persist.keep), READY again: owed to L3 as it was, and
        `hot` (used again since it entered L2: protected under slru) as it was. True when it is owed
        (stranded until a backend attaches)."""
        entry.checksum = checksum
        entry.in_l3 = in_l3
        entry.hot = entry.hot or hot
        owed = owed and not in_l3 and self._configured()
        if owed:
            self.stranded.add(entry)
        return owed

    def owed(self, entry: Entry) -> bool:
        """Whether the page is owed to L3 (held for it, or given up, dropped or stranded)."""
        return entry.dirty or entry in self.given_up or entry in self.dropped or entry in self.stranded

    # Pins.

    def pin(self, entry: Entry, limit: float) -> bool:
        """Pins the page unless that would pass `limit` bytes of pins in its arena."""
        if entry.pinned:
            return True
        arena = entry.cls.arena
        if self.arena_pinned[arena] + entry.cls.slot_bytes > limit:
            return False
        entry.pinned = True
        self.pinned_bytes += entry.cls.slot_bytes
        self.arena_pinned[arena] += entry.cls.slot_bytes
        self.index.update(entry)
        return True

    def unpin(self, entry: Entry) -> bool:
        if not entry.pinned:
            return False
        self._unpin(entry)
        self.index.update(entry)
        return True

    def _unpin(self, entry: Entry) -> None:
        entry.pinned = False
        self.pinned_bytes -= entry.cls.slot_bytes
        self.arena_pinned[entry.cls.arena] -= entry.cls.slot_bytes

    # Leaving L2 (the index tells every page that leaves its key: evicted, removed, a fill that failed).

    def _left(self, entries: list[Entry]) -> None:
        """Pages that left L2 (it runs for the pages a full pool evicts): those owed to L3 that never reached
        it (dirty, given up, stranded) are lost; dropped ones are counted apart."""
        if self.records is not None:
            self.records.clear(entries)
        given_up, stranded, dropped = self.given_up, self.stranded, self.dropped
        at_risk = bool(given_up or stranded)
        lost = gone = 0
        for entry in entries:
            owed = entry.dirty
            if at_risk and (entry in given_up or entry in stranded):
                given_up.discard(entry)
                stranded.discard(entry)
                owed = True
            if dropped and entry in dropped:  # counted when dropped (backup.dropped), not lost
                dropped.discard(entry)
                gone += not entry.in_l3
            if owed and not entry.in_l3:
                lost += 1
        if lost:
            self._lost(lost)
        if gone:
            self.counters["backup.dropped_gone"] += gone
