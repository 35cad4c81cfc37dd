"""The page index: (namespace, key) -> slot, with leases, pins, the "not yet in L3" state and eviction.

Every operation costs O(1) per key. Only pages that are ready, unleased, unpinned and clean (in L3, or
nothing to back up to) sit in the per-class eviction lists, so eviction never scans past pages it cannot
take.

Eviction is LRU (the default), segmented LRU (`pool.eviction = "slru"`), or "auto", which follows one of
the two. slru suits traffic where most pages are stored once and never asked for again while the pages
that were asked for once are asked for again more often than not (shared prompts and documents asked again
and again): a page enters a *probation* list and moves to the *protected* one when it is used again (looked
up, loaded, stored again); protected pages are at most PROTECTED_FRACTION of a class's listed pages (the
least recent go back to probation), and eviction takes probation's least recent first. A page evicted from
probation leaves a trace in a *ghost* (two generations of a Bloom filter, 16 bytes a page of the index):
stored again while its trace lasts, it enters protected directly (used again, later than probation's reach).
Measured through a daemon (bench/bench_trace.py, docs/sizing.md): on Mooncake's synthetic trace slru holds
1.04-1.07x LRU's L2 hits at 2,000-20,000 pages (1.07x at 5,859: 0.331 against 0.309; Belady 0.550); on
multi-turn conversations (bench/make_trace.py) up to 11% fewer, where a page is read once, soon, by the next
turn and LRU is near the optimum.

"auto" keeps slru's lists, flags and ghost, and each listed page's stamp (when it was filed last). A referee
(Duel) plays one key in SHADOW_SAMPLE through two small caches of its own, an LRU and an slru, with the same
uses; while the slru one leads by more than SHADOW_ENTER hits the index evicts as slru does, and once the
lead is gone it evicts exactly as LRU would: the older of the two lists' heads (protected is not bounded
then, and goes back to its share a few pages a filing when slru is followed again). The referee is not kept
over a restart (the lists and flags are): it starts again following LRU.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from hicached.daemon.l2.slabs import SizeClass, SlabAllocator, slot_size

# A page's states (hicached.daemon.l2.life draws the diagram and makes every move between them).
WRITING = "writing"  # a writer's slot, bytes not yet committed: under no key until they are (life.publish)
FILLING = "filling"  # under its key, being read from L3 by a prefetch or a load
READY = "ready"  # under its key, bytes whole
SUPERSEDED = "superseded"  # a fill whose key a store took: under no key, slot freed as the read ends
QUARANTINED = "quarantined"  # removed, slot not yet reusable

_STEAL_CANDIDATES = 16  # LRU pages of a victim class whose slabs are tried before giving up
EVICTION = ("auto", "slru", "lru")
PROTECTED_FRACTION = 0.8  # slru: protected pages' share of a class's listed pages at most
GHOST_GENERATION = 2  # slru: a ghost generation takes this many times the pages in the index
# Bloom filter bits a ghost entry, two set a key: ~0.4% false positives a generation. At 8 bits (~5%, ~10%
# over both generations) the new pages taken for ghosts crowded out the protected ones: 0.140 against LRU's
# 0.144 at 2,000 pages of the Mooncake trace, 0.152 at 32.
GHOST_BITS = 32
_PROBATION, _PROTECTED = 1, 2  # Entry.in_lru: which list an evictable entry is in (0: none)
# auto: one key in SHADOW_SAMPLE (by its ghost hash) is also played through two small caches of its own, an
# LRU and an slru, each SHADOW_SAMPLE times smaller than the index. The lead of the slru one (its hits less
# the LRU one's, on the sampled keys, bounded by +-SHADOW_SWING) decides what the index evicts: slru's
# choice once the lead passes SHADOW_ENTER, LRU's (exactly) again once it falls to 0. Chosen from replays
# of the index alone on Mooncake's trace and five of bench/make_trace.py's shapes: a lead of 16 or 32 let
# slru's losses through on multi-turn traffic (to 0.96x LRU), 128 gave up slru's gains at small pools;
# sampling 1 in 4 held no more hits than 1 in 8 and cost twice the time and memory (~50 bytes a page).
SHADOW_SAMPLE = 8
SHADOW_SWING = 512
SHADOW_ENTER = 64
_SHADOW_MIN = 16  # pages a shadow holds at least
_DEMOTE_STEP = 32  # auto: protected pages past their share sent back to probation a filing, at most
# Python's cyclic garbage collector scans every object it tracks in a full collection, and every entry is
# one: filling a pool of 512K pages (4 KiB) ran five full collections, the longest stalling the event loop
# for 215 ms. So the index freezes what is alive each time it has grown by a quarter (gc.freeze: never
# scanned again, still freed by reference counting when it goes), from this many entries on.
_FREEZE_FROM = 16384
_FREEZE_GROWTH = 1.25
# stats_sliced yields to the event loop after this many entries (~2 ms of walk), not after all of them
# (~100 ms for 512K entries).
_STATS_SLICE = 16384


def _tally(entries: Iterable[Entry]) -> list[int]:
    """[ready, filling, pinned, leased] over `entries` (the pages under a key), in one pass."""
    ready = filling = pinned = leased = 0
    for e in entries:
        st = e.state
        if st is READY:
            ready += 1
        elif st is FILLING:
            filling += 1
        if e.pinned:
            pinned += 1
        if e.leases:
            leased += 1
    return [ready, filling, pinned, leased]


class Entry:
    __slots__ = (
        "ns",
        "key",
        "offset",
        "size",
        "cls",
        "state",
        "leases",
        "pinned",
        "dirty",
        "queued",
        "in_l3",
        "fill",
        "in_lru",
        "hot",
        "in_dirty",
        "counted_dirty",
        "checksum",
    )

    def __init__(self, ns: str, key: str, offset: int, size: int, cls: SizeClass, state: str) -> None:
        self.ns = ns
        self.key = key
        self.offset = offset
        self.size = size
        self.cls = cls
        self.state = state
        self.leases = 0
        self.pinned = False
        self.dirty = False  # acknowledged to an engine, not yet in L3
        self.queued = False  # dirty and handed to the backup workers
        self.in_l3 = False
        self.fill: asyncio.Future[None] | None = None  # while FILLING: done when its batch's read ends
        self.in_lru = 0  # filed in its class's probation (1) or protected (2) list: evictable
        self.hot = False  # used again since it entered (slru: filed in the protected list)
        self.in_dirty = False  # filed in PageIndex.dirty
        self.counted_dirty = False  # counted in PageIndex.dirty_pages
        self.checksum: int | None = None  # the payload's xxh3-64 as the engine's client took it, if it did

    @property
    def evictable(self) -> bool:
        return self.state == READY and not self.leases and not self.pinned and not self.dirty

    def __repr__(self) -> str:
        return f"<Entry {self.ns}/{self.key[:12]} {self.state} off={self.offset} leases={self.leases}>"


try:  # the compiled part (setup.py): a ghost's test or add in one call
    from hicached.common._pageio import bloom as _bloom
except ImportError:
    _bloom = None


def ghost_hash(ns: str, key: str) -> int:
    """A page's hash for the ghost: of its key and namespace (str hashes are kept by the strings: no tuple
    built and hashed a page)."""
    return hash(key) ^ hash(ns)


class Ghost:
    """The keys of pages evicted from probation, for a while (slru): a Bloom filter in two generations, each
    taking GHOST_GENERATION times the pages in the index before the older one is dropped. A key is a hash of
    (namespace, key): a false positive (~0.4%) only files a new page as protected."""

    __slots__ = ("_cur", "_old", "_cur_mask", "_old_mask", "_added", "_room")

    def __init__(self) -> None:
        self._old: bytearray | None = None
        self._old_mask = 0
        self._new_generation(0)

    def _new_generation(self, pages: int) -> None:
        self._room = max(4096, GHOST_GENERATION * pages)
        bits = 1 << (self._room * GHOST_BITS - 1).bit_length()
        self._cur = bytearray(bits >> 3)
        self._cur_mask = bits - 1
        self._added = 0

    def add(self, h: int, pages: int) -> None:
        """Remembers hash `h`; `pages`: the pages in the index now (the next generation's size)."""
        if _bloom is not None:
            _bloom(self._cur, h, True)
        else:
            m, b = self._cur_mask, self._cur
            i = h & m
            b[i >> 3] |= 1 << (i & 7)
            i = (h >> 32) & m
            b[i >> 3] |= 1 << (i & 7)
        self._added += 1
        if self._added >= self._room:
            self._old, self._old_mask = self._cur, self._cur_mask
            self._new_generation(pages)

    def __contains__(self, h: int) -> bool:
        return self.holds(h)

    def holds(self, h: int) -> bool:
        if _bloom is not None:
            return _bloom(self._cur, h, False) or (self._old is not None and _bloom(self._old, h, False))
        m, b = self._cur_mask, self._cur
        i, j = h & m, (h >> 32) & m
        if (b[i >> 3] >> (i & 7)) & (b[j >> 3] >> (j & 7)) & 1:
            return True
        b = self._old
        if b is None:
            return False
        m = self._old_mask
        i, j = h & m, (h >> 32) & m
        return bool((b[i >> 3] >> (i & 7)) & (b[j >> 3] >> (j & 7)) & 1)

    @property
    def nbytes(self) -> int:
        return len(self._cur) + (len(self._old) if self._old is not None else 0)


class Duel:
    """auto's referee: an LRU and an slru cache of the sampled keys' hashes (SHADOW_SAMPLE), played with the
    same uses as the index; `slru` says which of the two the index follows now."""

    __slots__ = ("lru", "prob", "prot", "ghost", "lead", "slru", "switches")

    def __init__(self) -> None:
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.ghost = Ghost()  # the slru shadow's, as the index's own
        self.lead = 0
        self.slru = False
        self.switches = 0

    def use(self, h: int, pages: int) -> None:
        """A sampled page (hash `h`) is stored or used again; `pages`: the pages in the index now."""
        cap = pages // SHADOW_SAMPLE
        if cap < _SHADOW_MIN:
            cap = _SHADOW_MIN
        lru = self.lru
        hit_lru = h in lru
        if hit_lru:
            lru.move_to_end(h)
        else:
            lru[h] = None
            while len(lru) > cap:
                lru.popitem(last=False)
        prob, prot = self.prob, self.prot
        if h in prot:
            prot.move_to_end(h)
            hit_slru = True
        elif h in prob:
            del prob[h]
            prot[h] = None
            hit_slru = True
        else:
            hit_slru = False
            if self.ghost.holds(h):
                prot[h] = None
            else:
                prob[h] = None
        if len(prot) > PROTECTED_FRACTION * cap:
            prob[prot.popitem(last=False)[0]] = None
        while len(prob) + len(prot) > cap:
            if prob:
                self.ghost.add(prob.popitem(last=False)[0], cap)
            else:
                prot.popitem(last=False)
        if hit_lru is not hit_slru:
            lead = self.lead + (1 if hit_slru else -1)
            if -SHADOW_SWING <= lead <= SHADOW_SWING:
                self.lead = lead
                if lead > SHADOW_ENTER and not self.slru or lead <= 0 and self.slru:
                    self.slru = not self.slru
                    self.switches += 1

    @property
    def nbytes(self) -> int:
        """Roughly: the lists' entries (~100 bytes each: an int of 32 and an ordered dict's entry) and the
        ghost's bits."""
        return 100 * (len(self.lru) + len(self.prob) + len(self.prot)) + self.ghost.nbytes


class PageRecords(Protocol):
    """What is told of each page's transitions so that L2 can be rebuilt after a crash (the slot headers,
    hicached.daemon.persist.headers.Headers): the scheduler calls these, and never needs to know more."""

    def commit(self, e: Entry) -> None: ...

    def in_l3(self, e: Entry) -> None: ...

    def clear(self, entries: list[Entry]) -> None: ...

    def l3(self, location: str | None) -> None: ...


_NO_ENTRIES: dict[str, Entry] = {}


class EntriesView:
    """Every entry of an index, whatever its namespace: len() and values() (iterate over a copy of values()
    to add or remove entries meanwhile)."""

    __slots__ = ("_index",)

    def __init__(self, index: PageIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return self._index._count

    def values(self) -> Iterator[Entry]:
        return itertools.chain.from_iterable(d.values() for d in list(self._index._by_ns.values()))


class PageIndex:
    """With several allocators, one an arena of the pool (a tenant's share: hicached.daemon.l2.pool), each
    namespace's pages live in the arena `arena_of(namespace)` names, and evictions, slab moves and the
    counts the pool's fractions bound (dirty_bytes, reserved_bytes: arena_dirty, arena_reserved) stay within
    an arena."""

    def __init__(
        self,
        allocator: SlabAllocator | list[SlabAllocator],
        arena_of: Callable[[str], int] | None = None,
        on_remove: Callable[[list[Entry]], None] | None = None,
        on_short: Callable[[int, int], int] | None = None,
        eviction: str = "lru",
    ) -> None:
        if eviction not in EVICTION:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION)}, got {eviction!r}")
        self.eviction = eviction
        # slru's lists, hot flags and ghost are kept under "auto" too: ready for the moment it follows slru.
        self._slru = eviction in ("slru", "auto")
        self.ghost: Ghost | None = Ghost() if self._slru else None
        self.duel: Duel | None = Duel() if eviction == "auto" else None
        self._clock = 0  # auto: the stamp of the last page filed (the lists' values: when each was last used)
        self.allocs = allocator if isinstance(allocator, list) else [allocator]
        if [a.arena for a in self.allocs] != list(range(len(self.allocs))):
            raise ValueError("allocators must be given in arena order")
        self.alloc = self.allocs[0]
        # namespace -> the arena its pages live in (the tenants' namespaces; one arena without them).
        self.arena_of: Callable[[str], int] = arena_of or (lambda ns: 0)
        # namespace -> key -> entry. Looked up per key on every request: a dict per namespace costs half
        # of one dict keyed by (namespace, key) tuples, which builds and hashes a tuple per lookup.
        self._by_ns: dict[str, dict[str, Entry]] = {}
        self._count = 0
        self._freeze_at = _FREEZE_FROM  # entries at which _freeze runs next
        self.entries = EntriesView(self)
        # The LRU lists and the dirty list are keyed by the entries themselves (hashed by identity: cheaper
        # than a (namespace, key) tuple built for each change). The lists' values: None, or under "auto"
        # each page's stamp (when it was filed last), so that following LRU takes the older of two heads.
        self._lru: dict[SizeClass, OrderedDict[Entry, int | None]] = {}  # lru: all; slru, auto: probation
        self._hot: dict[SizeClass, OrderedDict[Entry, int | None]] = {}  # slru, auto: protected
        self._by_offset: dict[int, Entry] = {}
        self._classes: dict[int, SizeClass] = {}  # page bytes -> its size class, looked up per page
        # Dirty, ready pages in the order they became dirty: what write-back writes out first.
        self.dirty: OrderedDict[Entry, Entry] = OrderedDict()
        # Pages not yet in L3, queued for backup or not: counted as update() re-files them, so that stats
        # and metrics need no walk over every entry (147 ms for 512K entries).
        self.dirty_pages = 0
        self.dirty_bytes = 0  # their slots' bytes: the pool held for L3 (storage.max_unbacked_fraction)
        self.evictable_bytes = 0
        self.reserved = 0  # slots set aside for connections' next stores, under no key yet
        self.writing = 0  # slots handed to writers by alloc, under no key until committed
        self.reserved_bytes = 0
        self.arena_dirty = [0] * len(self.allocs)  # dirty_bytes by arena
        self.arena_reserved = [0] * len(self.allocs)  # reserved_bytes by arena
        self.arena_evictable = [0] * len(self.allocs)  # evictable_bytes by arena
        self.counters: collections.Counter[str] = collections.Counter()
        # Called with the entries that leave their keys (evicted, removed, a failed fill): a list, so that a
        # full pool's evictions for a whole request are told in one call.
        self.on_remove: Callable[[list[Entry]], None] = on_remove or (lambda entries: None)
        # Called with the bytes still wanted, and the arena, when nothing more can be evicted for an
        # allocation: it may make pages evictable (the write policy: the oldest pages waiting for L3, past
        # storage.max_unbacked_fraction) and returns how many it did; the allocation then tries eviction once
        # more.
        self.on_short: Callable[[int, int], int] = on_short or (lambda nbytes, arena: 0)

    def get(self, ns: str, key: str) -> Entry | None:
        d = self._by_ns.get(ns)
        return None if d is None else d.get(key)

    def ns_entries(self, ns: str) -> dict[str, Entry]:
        """The entries of one namespace by key, for loops over many keys (read only)."""
        return self._by_ns.get(ns, _NO_ENTRIES)

    def namespaces(self) -> list[str]:
        """The namespaces with entries in the index."""
        return [ns for ns, d in self._by_ns.items() if d]

    def live(self, entry: Entry) -> bool:
        d = self._by_ns.get(entry.ns)
        return d is not None and d.get(entry.key) is entry

    def _insert(self, entry: Entry) -> None:
        d = self._by_ns.get(entry.ns)
        if d is None:
            d = self._by_ns[entry.ns] = {}
        d[entry.key] = entry
        self._count += 1
        ghost = self.ghost
        if ghost is not None:
            h = hash(entry.key) ^ hash(entry.ns)  # ghost_hash, inlined: this runs for every page stored
            if ghost.holds(h):
                entry.hot = True  # evicted from probation a while ago, and wanted again
                self.counters["ghost_hits"] += 1
            if self.duel is not None and not (h >> 60) & (SHADOW_SAMPLE - 1):
                self.duel.use(h, self._count)
        if self._count >= self._freeze_at:
            self._freeze()

    def _freeze(self) -> None:
        """Moves every object the collector tracks out of its sight (see _FREEZE_FROM). Young garbage is
        collected first, since what is frozen is never collected: cyclic garbage older than that, and
        cycles through frozen objects, stay (the daemon makes few; a restart frees them)."""
        gc.collect(1)
        gc.freeze()
        self._freeze_at = int(self._count * _FREEZE_GROWTH)
        self.counters["gc_freezes"] += 1

    def _delete(self, entry: Entry) -> None:
        del self._by_ns[entry.ns][entry.key]
        if entry.counted_dirty:
            entry.counted_dirty = False
            self.dirty_pages -= 1
            self.dirty_bytes -= entry.cls.slot_bytes
            self.arena_dirty[entry.cls.arena] -= entry.cls.slot_bytes
        self._count -= 1

    def allocate(self, ns: str, key: str, page_bytes: int, state: str) -> Entry | None:
        """A new entry with a slot of its own, evicting if needed; None when nothing can be freed."""
        arena = self.arena_of(ns)
        if arena < 0:
            return None  # a namespace no arena holds (a tenant without a share of L2)
        cls = self.size_class(page_bytes, arena)
        offset = self.allocs[arena].alloc(cls)
        if offset is None:
            cls, offsets = self.take_slots(page_bytes, 1, ns)
            if not offsets:
                return None
            offset = offsets[0]
        return self.entry_at(ns, key, page_bytes, cls, offset, state)

    def reserve(self, ns: str, page_bytes: int, n: int) -> list[Entry]:
        """Up to `n` slots set aside for a connection's next stores (Tiers.reserve): WRITING entries under
        no key yet, leased, so that neither eviction nor a slab move takes them. Fewer when
        nothing more can be freed."""
        cls, offsets = self.take_slots(page_bytes, n, ns)
        out = []
        for offset in offsets:
            entry = Entry(ns, "", offset, page_bytes, cls, WRITING)
            entry.leases = 1
            self._by_offset[offset] = entry
            out.append(entry)
        self.reserved += len(out)
        self.reserved_bytes += len(out) * cls.slot_bytes
        self.arena_reserved[cls.arena] += len(out) * cls.slot_bytes
        return out

    def bind(self, entry: Entry, key: str) -> None:
        """A reserved slot takes its key (the caller checked that the key is free)."""
        entry.key = key
        self._insert(entry)
        self.reserved -= 1
        self.reserved_bytes -= entry.cls.slot_bytes
        self.arena_reserved[entry.cls.arena] -= entry.cls.slot_bytes

    def unreserve(self, entry: Entry, quarantine: float = 0.0) -> None:
        """A reserved slot that was never bound goes back to the allocator (`quarantine`: as in remove)."""
        self.reserved -= 1
        self.reserved_bytes -= entry.cls.slot_bytes
        self.arena_reserved[entry.cls.arena] -= entry.cls.slot_bytes
        self._release_slot(entry, quarantine)

    def size_class(self, page_bytes: int, arena: int = 0) -> SizeClass:
        """The size class of pages of `page_bytes` in arena `arena`."""
        cls = self._classes.get(page_bytes) if not arena else None
        if cls is None:
            cls = self.allocs[arena].size_class(slot_size(page_bytes))
            if not arena:
                self._classes[page_bytes] = cls  # looked up per page: arena 0 (no tenants) the fast path
        return cls

    def take_slots(self, page_bytes: int, n: int, ns: str | None = None) -> tuple[SizeClass, list[int]]:
        """Up to `n` slots for pages of `page_bytes` (in the arena of namespace `ns`), evicting as needed;
        fewer when nothing more can be freed. What n allocations would take, with a full pool's work (an
        eviction for each page taken in) done in one loop. The caller turns every slot into an entry
        (entry_at) or gives it back (give_back) before anything else allocates: until then the slot
        belongs to no entry."""
        arena = self.arena_of(ns) if ns is not None else 0
        if arena < 0:  # a namespace no arena holds (a tenant without a share of L2): no slot
            return self.size_class(page_bytes, 0), []
        cls = self.size_class(page_bytes, arena)
        alloc = self.allocs[arena]
        out = alloc.alloc_many(cls, n)
        short = True  # on_short not asked yet
        while len(out) < n:
            share = alloc.fair_share(cls)
            if len(cls.slabs) < share and self._steal_slab(cls, share):
                out += alloc.alloc_many(cls, n - len(out))
                continue
            evicted = self._evict(cls, n - len(out))
            if evicted:
                out += evicted
                continue
            if self._steal_slab(cls, share):
                out += alloc.alloc_many(cls, n - len(out))
                continue
            if short:
                short = False
                if self.on_short((n - len(out)) * cls.slot_bytes, cls.arena):
                    continue
            self.counters["alloc_failures"] += 1
            break
        return cls, out

    def entry_at(self, ns: str, key: str, page_bytes: int, cls: SizeClass, offset: int, state: str) -> Entry:
        """A new entry under `key` in a slot from take_slots."""
        entry = Entry(ns, key, offset, page_bytes, cls, state)
        self._by_offset[offset] = entry
        self._insert(entry)
        return entry

    def entries_at(
        self,
        ns: str,
        keys: list[str],
        page_bytes: int,
        cls: SizeClass,
        offsets: list[int],
        state: str,
        leases: int,
    ) -> list[Entry]:
        """entry_at for each of `keys` (all different and new) in the slots `offsets` from take_slots, with
        `leases` leases each, in one loop: prefetch and alloc make an entry for every page of a request."""
        d = self._by_ns.get(ns)
        if d is None:
            d = self._by_ns[ns] = {}
        by_offset = self._by_offset
        out = []
        for key, offset in zip(keys, offsets, strict=True):
            entry = Entry(ns, key, offset, page_bytes, cls, state)
            entry.leases = leases
            by_offset[offset] = entry
            d[key] = entry
            out.append(entry)
        self._count += len(out)
        if self._count >= self._freeze_at:
            self._freeze()
        return out

    def give_back(self, cls: SizeClass, offsets: list[int]) -> None:
        """Slots from take_slots that became no entry."""
        alloc = self.allocs[cls.arena]
        for offset in offsets:
            alloc.free(cls, offset)

    def private_entries(
        self, ns: str, keys: list[str], page_bytes: int, cls: SizeClass, offsets: list[int]
    ) -> list[Entry]:
        """WRITING entries for `keys` in the slots `offsets` from take_slots, each leased once for its writer
        and under no key: a store's slot joins its key only when its bytes are committed (publish)."""
        by_offset = self._by_offset
        out = []
        for key, offset in zip(keys, offsets, strict=False):
            entry = Entry(ns, key, offset, page_bytes, cls, WRITING)
            entry.leases = 1
            by_offset[offset] = entry
            out.append(entry)
        self.writing += len(out)
        return out

    def publish(self, entry: Entry, reserved: bool) -> None:
        """A writer's slot (from private_entries, or from reserve when `reserved`) goes under its key, which
        the caller made sure is free."""
        self._insert(entry)
        if reserved:
            self.reserved -= 1
            self.reserved_bytes -= entry.cls.slot_bytes
            self.arena_reserved[entry.cls.arena] -= entry.cls.slot_bytes
        else:
            self.writing -= 1

    def release_private(self, entry: Entry, quarantine: float = 0.0) -> None:
        """A writer's slot from private_entries that was never published goes back to the allocator
        (`quarantine`: as in remove)."""
        self.writing -= 1
        self._release_slot(entry, quarantine)

    def take_off_key(self, entry: Entry) -> None:
        """A live entry leaves its key, keeping its slot (a fill superseded by a store): its slot is freed by
        remove() once its read ends."""
        if entry.in_lru:
            self._unlist(entry)
        if entry.in_dirty:
            del self.dirty[entry]
            entry.in_dirty = False
        self._delete(entry)

    def remove(self, entry: Entry, quarantine: float = 0.0, until: Any = None) -> None:
        """Drops the entry and frees its slot. The caller makes sure nobody holds a lease on it.

        With `quarantine`, the slot is only freed that many seconds later (an engine's copy that may still
        land in it); with `until` (a hicached.connectors.base.Hold), once nothing runs on it any more: a
        read from L3 given up while its I/O thread, which cannot be stopped mid-page, still writes into it.
        An entry taken off its key (SUPERSEDED) only has its slot freed, once."""
        if not self.live(entry):
            if entry.state is SUPERSEDED and self._by_offset.get(entry.offset) is entry:
                self._release_slot(entry, quarantine, until)
            return
        if entry.in_lru:
            self._unlist(entry)
        if entry.in_dirty:
            del self.dirty[entry]
            entry.in_dirty = False
        self._delete(entry)
        self.on_remove([entry])
        self._release_slot(entry, quarantine, until)

    def _release_slot(self, entry: Entry, quarantine: float, until: Any = None) -> None:
        if quarantine > 0 or (until is not None and not until.released):
            # The slot's own state, not the page's: still in _by_offset, so its slab is not reassigned
            # meanwhile.
            entry.state = QUARANTINED
            self.counters["quarantined"] += 1
            if until is not None:
                until.when_released(lambda: self._free_slot(entry))
            else:
                asyncio.get_running_loop().call_later(quarantine, self._free_slot, entry)
        else:
            self._free_slot(entry)

    def _free_slot(self, entry: Entry) -> None:
        del self._by_offset[entry.offset]
        self.allocs[entry.cls.arena].free(entry.cls, entry.offset)

    # State changes. Each one re-files the entry in or out of the LRU.

    def update(self, entry: Entry) -> None:
        """Re-file an entry after its state, leases, pin or dirty flag changed; moves it to the MRU end."""
        d = self._by_ns.get(entry.ns)  # live(), inlined: this runs for every page taken in or let go
        if d is None or d.get(entry.key) is not entry:
            return  # removed already (a failed fill); late lease releases must not resurrect it
        if entry.dirty != entry.counted_dirty:
            entry.counted_dirty = entry.dirty
            self.dirty_pages += 1 if entry.dirty else -1
            change = entry.cls.slot_bytes if entry.dirty else -entry.cls.slot_bytes
            self.dirty_bytes += change
            self.arena_dirty[entry.cls.arena] += change
        if entry.state == READY and not entry.leases and not entry.pinned and not entry.dirty:
            self._file(entry)
        elif entry.in_lru:
            self._unlist(entry)
        if entry.dirty and entry.state == READY and not entry.queued:
            if not entry.in_dirty:
                self.dirty[entry] = entry
                entry.in_dirty = True
        elif entry.in_dirty:
            del self.dirty[entry]
            entry.in_dirty = False

    def _file(self, entry: Entry) -> None:
        """An evictable entry goes to the most recent end of its list: probation, or protected when hot."""
        where = _PROTECTED if entry.hot and self._slru else _PROBATION
        lists = self._hot if where == _PROTECTED else self._lru
        lst = lists.get(entry.cls)
        if lst is None:
            lst = lists[entry.cls] = OrderedDict()
        stamp = None
        if self.duel is not None:
            self._clock = stamp = self._clock + 1
        if entry.in_lru == where:
            lst.move_to_end(entry)
            if stamp is not None:
                lst[entry] = stamp
            return
        if entry.in_lru:
            self._unlist(entry)
        lst[entry] = stamp
        entry.in_lru = where
        self.evictable_bytes += entry.cls.slot_bytes
        self.arena_evictable[entry.cls.arena] += entry.cls.slot_bytes
        if where == _PROTECTED and (self.duel is None or self.duel.slru):
            self._demote(entry.cls)

    def _demote(self, cls: SizeClass) -> None:
        """Protected pages past their share go back to probation, least recent first (cold again)."""
        hot = self._hot[cls]
        prob = self._lru.get(cls)
        if prob is None:
            prob = self._lru[cls] = OrderedDict()
        limit = PROTECTED_FRACTION * (len(hot) + len(prob))
        # auto: protected grew past its share while LRU was followed; it goes back a few pages a filing
        # (no pause of the event loop for the whole excess at the moment slru is followed again).
        budget = _DEMOTE_STEP if self.duel is not None else -1
        while len(hot) > limit and budget:
            budget -= 1
            e, stamp = hot.popitem(last=False)
            e.hot = False
            e.in_lru = _PROBATION
            prob[e] = stamp  # auto: keeps when it was used (probation's order by stamp is then approximate)
            self.counters["demotions"] += 1

    def _unlist(self, entry: Entry) -> None:
        lists = self._hot if entry.in_lru == _PROTECTED else self._lru
        del lists[entry.cls][entry]
        entry.in_lru = 0
        self.evictable_bytes -= entry.cls.slot_bytes
        self.arena_evictable[entry.cls.arena] -= entry.cls.slot_bytes

    def lru_lists(self) -> list[list[Entry]]:
        """The evictable pages of each size class in the order eviction takes them (probation's least recent
        first, then protected's; "auto" following LRU: by when each was used last)."""
        out = []
        for cls in list(self._lru) + [c for c in self._hot if c not in self._lru]:
            prob, hot = self._lru.get(cls) or {}, self._hot.get(cls) or {}
            if not prob and not hot:
                continue
            if self.duel is not None and not self.duel.slru:
                out.append(sorted(itertools.chain(prob, hot), key=lambda e: prob.get(e) or hot.get(e) or 0))
            else:
                out.append(list(prob) + list(hot))
        return out

    def _used(self, entry: Entry) -> None:
        """auto: a page used again, told to the referee when its key is one of the sampled."""
        h = hash(entry.key) ^ hash(entry.ns)  # ghost_hash, inlined
        if not (h >> 60) & (SHADOW_SAMPLE - 1):
            self.duel.use(h, self._count)  # type: ignore[union-attr]

    def touch(self, entry: Entry) -> None:
        """The page was used again (stored again, warmed): to the most recent end (slru: protected)."""
        if self._slru:
            entry.hot = True
            if self.duel is not None:
                self._used(entry)
        if entry.in_lru:
            self._file(entry)

    def touch_keys(self, ns: str, keys: Iterable[str]) -> int:
        """Moves the ready pages of `keys` (namespace `ns`) to the most-recently-used end: how many are in L2.
        A page out of the LRU (leased, pinned, dirty) counts too; it is filed at that end when it returns."""
        get = self._by_ns.get(ns, _NO_ENTRIES).get
        slru = self._slru
        used = self._used if self.duel is not None else None
        n = 0
        for key in keys:
            entry = get(key)
            if entry is None or entry.state != READY:
                continue
            if slru:
                entry.hot = True
            if used is not None:
                used(entry)
            if entry.in_lru:
                self._file(entry)
            n += 1
        return n

    def lease(self, entry: Entry) -> None:
        entry.leases += 1
        if self._slru:
            entry.hot = True  # loaded (or read from L3 for a load): used again
            if self.duel is not None and entry.state == READY:  # a fill's use was its insert
                self._used(entry)
        if entry.leases == 1 and entry.in_lru:
            self._unlist(entry)  # a leased page is not evictable; nothing else changes

    def unlease(self, entry: Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            self.update(entry)

    def lease_all(self, entries: list[Entry]) -> None:
        """lease of each entry, in one loop."""
        unlist = self._unlist
        slru = self._slru
        duel = self.duel
        mask = SHADOW_SAMPLE - 1
        for entry in entries:
            entry.leases += 1
            if slru:
                entry.hot = True
                if duel is not None and entry.state == READY:  # _used, inlined
                    h = hash(entry.key) ^ hash(entry.ns)
                    if not (h >> 60) & mask:
                        duel.use(h, self._count)
            if entry.leases == 1 and entry.in_lru:
                unlist(entry)

    def unlease_all(self, entries: list[Entry]) -> None:
        """unlease of each entry (a lease on a request's pages is given back page by page, for every page
        loaded or prefetched: one loop here, not a call a page)."""
        update = self.update
        for entry in entries:
            entry.leases -= 1
            if not entry.leases:
                update(entry)

    def leading_live(self, ns: str, entries: list[Entry], state: str) -> int:
        """How many of the leading `entries` (all of namespace `ns`) are still in the index, in `state`."""
        d = self._by_ns.get(ns, _NO_ENTRIES)
        n = 0
        for entry in entries:
            if entry.state != state or d.get(entry.key) is not entry:
                break
            n += 1
        return n

    # Eviction and slab rebalancing.

    def _evict(self, cls: SizeClass, n: int) -> list[int]:
        """Evicts up to `n` of the least recently used pages of `cls` and hands their slots over as they
        are (still counted as used): remove() + free() + alloc() in one step, as it runs for every page a
        full pool takes in."""
        lru = self._lru.get(cls)
        hot = self._hot.get(cls)
        listed = (len(lru) if lru else 0) + (len(hot) if hot else 0)
        if not listed:
            return []
        n = min(n, listed)
        by_ns, by_offset, ghost = self._by_ns, self._by_offset, self.ghost
        # auto following LRU: the older of the two heads (each list is in order of its stamps): probation's
        # is taken unless protected's, `oldest`, is older; then it goes back in front.
        by_stamp = self.duel is not None and not self.duel.slru
        oldest = next(iter(hot.values())) if by_stamp and hot else None
        ghost_add = ghost.add if ghost is not None else None
        count = self._count
        victims = []
        out = []
        for _ in range(n):
            victim = None
            if lru:
                victim, stamp = lru.popitem(last=False)
                if oldest is not None and stamp > oldest:  # type: ignore[operator]
                    lru[victim] = stamp
                    lru.move_to_end(victim, last=False)
                    victim = None
                elif ghost_add is not None:
                    ghost_add(hash(victim.key) ^ hash(victim.ns), count)  # ghost_hash, inlined
            if victim is None:
                victim, _ = hot.popitem(last=False)  # type: ignore[union-attr]
                oldest = next(iter(hot.values())) if by_stamp and hot else None
            victim.in_lru = 0
            del by_ns[victim.ns][victim.key]  # evictable means clean: never in self.dirty
            del by_offset[victim.offset]
            victims.append(victim)
            out.append(victim.offset)
        self.on_remove(victims)
        self._count -= n
        self.evictable_bytes -= n * cls.slot_bytes
        self.arena_evictable[cls.arena] -= n * cls.slot_bytes
        self.counters["evictions"] += n
        return out

    def _steal_slab(self, cls: SizeClass, share: int) -> bool:
        """Take a whole slab of evictable pages from the class holding the most slabs above its share."""
        alloc = self.allocs[cls.arena]  # slabs move within an arena only
        victims = sorted(
            (c for c in alloc.classes.values() if c is not cls and len(c.slabs) > share),
            key=lambda c: len(c.slabs),
            reverse=True,
        )
        for victim in victims:
            lru, hot = self._lru.get(victim), self._hot.get(victim)
            tried: set[int] = set()
            candidates = list(itertools.islice(lru, _STEAL_CANDIDATES)) if lru else []
            if hot:
                candidates += itertools.islice(hot, _STEAL_CANDIDATES)
            for entry in candidates:
                slab = alloc.slab_of(entry.offset)
                if slab in tried:
                    continue
                tried.add(slab)
                residents = [self._by_offset.get(o) for o in alloc.slots_of(slab)]
                if all(e is None or e.evictable for e in residents):
                    for e in residents:
                        if e is not None:
                            self.remove(e)
                            self.counters["evictions"] += 1
                    alloc.move_slab(slab, cls)
                    self.counters["slab_moves"] += 1
                    return True
        return False

    def reclaimable_fraction(self, arena: int | None = None) -> float:
        """Share of an arena (a tenant's pool) that is free or could be evicted now (write-back flushes
        below a watermark); without `arena`, the least of every arena's (the whole pool's, with one)."""
        if arena is None:
            return min(self.reclaimable_fraction(i) for i in range(len(self.allocs)))
        a = self.allocs[arena]
        free = len(a.free_slabs) * a.slab_bytes + sum(len(c.free) * c.slot_bytes for c in a.classes.values())
        return (free + self.arena_evictable[arena]) / a.capacity

    @property
    def capacity(self) -> int:
        """Bytes of slabs over every arena."""
        return sum(a.capacity for a in self.allocs)

    def all_classes(self) -> Iterator[SizeClass]:
        """The size classes of every arena."""
        return itertools.chain.from_iterable(a.classes.values() for a in self.allocs)

    def used_bytes(self, arena: int | None = None) -> int:
        """Bytes of slots in use, in one arena or over all of them."""
        classes = self.all_classes() if arena is None else self.allocs[arena].classes.values()
        return sum(c.used * c.slot_bytes for c in classes)

    def stats(self) -> dict:
        """Counts of the index, exact: the states, pins and leases from one walk over every entry."""
        return self._stats(_tally(self.entries.values()))

    async def stats_sliced(self, per_slice: int = _STATS_SLICE) -> dict:
        """stats() for a running daemon (`ctl stats`, an engine's `stats`): the walk over the entries, of a
        copy of each namespace's list taken first, yields to the event loop every `per_slice` entries. An
        entry that changes meanwhile is counted as it was when the walk reached it."""
        totals = [0] * 4
        for entries in [list(d.values()) for d in list(self._by_ns.values())]:
            for start in range(0, len(entries), per_slice):
                totals = [
                    a + b for a, b in zip(totals, _tally(entries[start : start + per_slice]), strict=True)
                ]
                await asyncio.sleep(0)
        return self._stats(totals)

    def _stats(self, tally: list[int]) -> dict:
        ready, filling, pinned, leased = tally
        return {
            "pages": self._count,
            "ready": ready,
            "writing": self.writing,
            "filling": filling,
            "dirty": self.dirty_pages,
            "pinned": pinned,
            "leased": leased,
            "reserved": self.reserved,
            "reserved_bytes": self.reserved_bytes,
            "evictable_bytes": self.evictable_bytes,
            "used_bytes": self.used_bytes(),
            "capacity_bytes": self.capacity,
            **{k: v for k, v in self.counters.items()},
            **(
                {
                    "eviction": {
                        "follows": "slru" if self.duel.slru else "lru",
                        "lead": self.duel.lead,
                        "switches": self.duel.switches,
                        "shadow_bytes": self.duel.nbytes,
                    }
                }
                if self.duel is not None
                else {}
            ),
            "slabs": self.alloc.stats(),
            **({"arena_slabs": [a.stats() for a in self.allocs]} if len(self.allocs) > 1 else {}),
        }
