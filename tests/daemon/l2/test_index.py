"""The page index over a slab allocator: states, leases, pins, dirty pages, LRU eviction and slab stealing.
Pure bookkeeping: no memory is mapped."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable

import pytest

from hicached.daemon.l2 import index as index_module
from hicached.daemon.l2.index import FILLING, QUARANTINED, READY, WRITING, Entry, PageIndex
from hicached.daemon.l2.slabs import SlabAllocator

KiB = 1024
SLAB = 64 * KiB
NSLABS = 8
A = 16 * KiB  # 4 pages per slab
B = 32 * KiB  # 2 pages per slab
NS = "llama.bf16.p64"


def key(i: int, tag: str = "a") -> str:
    return f"{tag}{i:063x}"


@pytest.fixture
def idx() -> PageIndex:
    return PageIndex(SlabAllocator(NSLABS * SLAB, SLAB))


def ready(idx: PageIndex, k: str, size: int = A, ns: str = NS) -> Entry:
    e = idx.allocate(ns, k, size, READY)
    assert e is not None
    idx.update(e)
    return e


def fill(idx: PageIndex, size: int, tag: str) -> list[Entry]:
    """Fills every free slot of the pool with evictable pages of one size."""
    per_slab = SLAB // size
    return [ready(idx, key(i, tag), size) for i in range(len(idx.alloc.free_slabs) * per_slab)]


def slabs_of(idx: PageIndex, size: int) -> int:
    return len(idx.alloc.size_class(size).slabs)


def lru_keys(idx: PageIndex, size: int) -> list[str]:
    return [e.key for e in idx._lru.get(idx.alloc.size_class(size), {})]


# Allocation and removal.


def test_allocate_and_get(idx: PageIndex) -> None:
    e = idx.allocate(NS, key(1), 10 * KiB, WRITING)
    assert e is not None
    assert e.state == WRITING
    assert e.size == 10 * KiB
    assert e.cls.slot_bytes == 12 * KiB
    assert e.offset % 4096 == 0
    assert idx.get(NS, key(1)) is e
    assert idx.get("other", key(1)) is None
    assert idx.live(e)
    assert e.leases == 0 and not e.pinned and not e.dirty and not e.queued and not e.in_l3
    assert not e.evictable


def test_same_key_in_two_namespaces_are_two_pages(idx: PageIndex) -> None:
    e1 = ready(idx, key(1), ns="m1")
    e2 = ready(idx, key(1), ns="m2")
    assert e1 is not e2
    assert e1.offset != e2.offset
    idx.remove(e1)
    assert idx.get("m2", key(1)) is e2


def test_distinct_offsets(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    assert len(entries) == NSLABS * SLAB // A
    assert len({e.offset for e in entries}) == len(entries)


def test_remove_frees_the_slot(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    cls = e.cls
    assert cls.used == 1
    assert idx.evictable_bytes == A
    idx.remove(e)
    assert cls.used == 0
    assert idx.get(NS, key(1)) is None
    assert not idx.live(e)
    assert idx.evictable_bytes == 0
    assert lru_keys(idx, A) == []
    # The slot is reused.
    assert idx.allocate(NS, key(2), A, WRITING).offset == e.offset


def test_remove_twice_frees_once(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    other = ready(idx, key(2))
    idx.remove(e)
    idx.remove(e)
    assert e.cls.used == 1
    assert e.cls.free.count(e.offset) == 1
    assert idx.live(other)


def test_remove_of_a_replaced_entry_leaves_the_new_one(idx: PageIndex) -> None:
    old = ready(idx, key(1))
    idx.remove(old)
    new = idx.allocate(NS, key(1), A, WRITING)
    idx.remove(old)
    assert idx.get(NS, key(1)) is new
    assert new.cls.used == 1


# LRU eviction.


def test_evicts_least_recently_used_first(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    n = len(entries)
    e = idx.allocate(NS, key(0, "x"), A, WRITING)
    assert e is not None
    assert e.offset == entries[0].offset
    assert not idx.live(entries[0])
    assert idx.live(entries[1])
    assert idx.counters["evictions"] == 1
    assert len(idx.entries) == n


def test_touch_moves_to_mru(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    idx.touch(entries[0])
    idx.allocate(NS, key(0, "x"), A, WRITING)
    assert idx.live(entries[0])
    assert not idx.live(entries[1])
    assert lru_keys(idx, A)[-1] == entries[0].key


def test_lease_release_moves_to_mru(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    idx.lease(entries[0])
    idx.unlease(entries[0])
    idx.allocate(NS, key(0, "x"), A, WRITING)
    assert idx.live(entries[0])
    assert not idx.live(entries[1])


def test_update_moves_to_mru(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    idx.update(entries[0])
    idx.update(entries[1])
    idx.allocate(NS, key(0, "x"), A, WRITING)
    idx.allocate(NS, key(1, "x"), A, WRITING)
    assert idx.live(entries[0]) and idx.live(entries[1])
    assert not idx.live(entries[2]) and not idx.live(entries[3])


def test_touch_does_not_make_a_page_evictable(idx: PageIndex) -> None:
    e = idx.allocate(NS, key(1), A, WRITING)
    idx.update(e)
    idx.touch(e)
    assert idx.evictable_bytes == 0
    assert lru_keys(idx, A) == []


def _leased(idx: PageIndex, e: Entry) -> None:
    idx.lease(e)


def _pinned(idx: PageIndex, e: Entry) -> None:
    e.pinned = True
    idx.update(e)


def _dirty(idx: PageIndex, e: Entry) -> None:
    e.dirty = True
    idx.update(e)


def _dirty_queued(idx: PageIndex, e: Entry) -> None:
    e.dirty = True
    e.queued = True
    idx.update(e)


def _writing(idx: PageIndex, e: Entry) -> None:
    e.state = WRITING
    idx.update(e)


def _filling(idx: PageIndex, e: Entry) -> None:
    e.state = FILLING
    idx.update(e)


HOLDS = pytest.mark.parametrize(
    "hold", [_leased, _pinned, _dirty, _dirty_queued, _writing, _filling], ids=lambda f: f.__name__[1:]
)


@HOLDS
def test_held_pages_are_never_evicted(idx: PageIndex, hold: Callable[[PageIndex, Entry], None]) -> None:
    entries = fill(idx, A, "a")
    # The oldest pages are held; only the newest one remains evictable.
    for e in entries[:-1]:
        hold(idx, e)
    assert idx.evictable_bytes == A
    assert not entries[0].evictable
    got = idx.allocate(NS, key(0, "x"), A, WRITING)
    assert got is not None
    assert got.offset == entries[-1].offset
    assert not idx.live(entries[-1])
    assert all(idx.live(e) for e in entries[:-1])
    # Nothing left that can be freed.
    assert idx.allocate(NS, key(1, "x"), A, WRITING) is None
    assert idx.counters["alloc_failures"] == 1
    assert idx.get(NS, key(1, "x")) is None
    assert all(idx.live(e) for e in entries[:-1])


@HOLDS
def test_held_pages_are_not_stolen_by_another_class(
    idx: PageIndex, hold: Callable[[PageIndex, Entry], None]
) -> None:
    entries = fill(idx, A, "a")
    # One held page in every slab: no slab can be taken whole.
    for e in entries[:: SLAB // A]:
        hold(idx, e)
    assert idx.allocate(NS, key(0, "b"), B, WRITING) is None
    assert slabs_of(idx, B) == 0
    assert slabs_of(idx, A) == NSLABS
    assert all(idx.live(e) for e in entries)


def test_pages_become_evictable_again_when_released(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    idx.lease(e)
    idx.lease(e)
    assert idx.evictable_bytes == 0
    idx.unlease(e)
    assert idx.evictable_bytes == 0  # still one lease
    idx.unlease(e)
    assert idx.evictable_bytes == A
    e.pinned = True
    idx.update(e)
    assert idx.evictable_bytes == 0
    e.pinned = False
    e.dirty = True
    idx.update(e)
    assert idx.evictable_bytes == 0
    e.dirty = False
    e.in_l3 = True
    idx.update(e)
    assert idx.evictable_bytes == A
    idx.update(e)
    idx.update(e)
    assert idx.evictable_bytes == A  # re-filing does not count twice
    assert lru_keys(idx, A) == [key(1)]


def test_allocate_returns_none_when_everything_is_leased(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    for e in entries:
        idx.lease(e)
    assert idx.allocate(NS, key(0, "x"), A, WRITING) is None
    assert idx.allocate(NS, key(0, "y"), B, WRITING) is None
    assert idx.counters["alloc_failures"] == 2
    assert idx.counters["evictions"] == 0


# One size does not starve the others.


def test_new_class_steals_slabs_up_to_its_fair_share(idx: PageIndex) -> None:
    a_pages = fill(idx, A, "a")
    assert slabs_of(idx, A) == NSLABS
    share = NSLABS // 2
    b_pages = []
    for i in range(share * (SLAB // B)):
        e = idx.allocate(NS, key(i, "b"), B, WRITING)
        assert e is not None, i
        b_pages.append(e)
    assert slabs_of(idx, B) == share
    assert slabs_of(idx, A) == NSLABS - share
    assert idx.counters["slab_moves"] == share
    # The slabs taken held A's least recently used pages.
    lost = [e for e in a_pages if not idx.live(e)]
    assert lost == a_pages[: share * (SLAB // A)]
    # B's pages are still being written: B is at its share and cannot take more from A.
    assert idx.allocate(NS, key(99, "b"), B, WRITING) is None
    assert slabs_of(idx, A) == NSLABS - share


def test_class_at_its_share_evicts_its_own_pages(idx: PageIndex) -> None:
    a_pages = fill(idx, A, "a")
    b_pages = [ready(idx, key(i, "b"), B) for i in range(NSLABS // 2 * (SLAB // B))]
    live_a = [e for e in a_pages if idx.live(e)]
    moves = idx.counters["slab_moves"]
    for i in range(20):
        ready(idx, key(100 + i, "b"), B)
    assert idx.counters["slab_moves"] == moves
    assert all(idx.live(e) for e in live_a)
    assert not idx.live(b_pages[0])
    assert slabs_of(idx, B) == NSLABS // 2
    # And A, at its share too, evicts its own as well.
    for i in range(10):
        ready(idx, key(100 + i, "a"), A)
    assert slabs_of(idx, A) == NSLABS // 2
    assert idx.counters["slab_moves"] == moves


def test_two_active_classes_end_with_half_the_slabs_each(idx: PageIndex) -> None:
    for i in range(400):
        ready(idx, key(i, "a"), A)
        ready(idx, key(i, "b"), B)
    assert slabs_of(idx, A) == NSLABS // 2
    assert slabs_of(idx, B) == NSLABS // 2
    assert not idx.alloc.free_slabs


def test_three_classes_share_the_pool(idx: PageIndex) -> None:
    fill(idx, A, "a")
    c = 8 * KiB
    for i in range(200):
        ready(idx, key(i, "b"), B)
        ready(idx, key(i, "c"), c)
    share = NSLABS // 3
    assert slabs_of(idx, B) >= share
    assert slabs_of(idx, c) >= share
    assert slabs_of(idx, A) >= share
    assert slabs_of(idx, A) + slabs_of(idx, B) + slabs_of(idx, c) == NSLABS


def test_steal_skips_slabs_with_a_held_page(idx: PageIndex) -> None:
    a_pages = fill(idx, A, "a")
    held = a_pages[1]  # in slab 0, the least recently used slab
    idx.lease(held)
    slab0 = idx.alloc.slab_of(held.offset)
    e = idx.allocate(NS, key(0, "b"), B, WRITING)
    assert e is not None
    assert idx.alloc.slab_of(e.offset) != slab0
    assert idx.alloc.owner(slab0).slot_bytes == A
    assert idx.live(held)
    assert idx.live(a_pages[0])  # same slab as the held page: left alone


def test_steal_takes_a_slab_whose_other_slots_are_free(idx: PageIndex) -> None:
    a_pages = fill(idx, A, "a")
    # Slab 0 keeps one evictable page; its other slots are freed.
    for e in a_pages[1 : SLAB // A]:
        idx.remove(e)
    for e in a_pages[SLAB // A :]:
        idx.lease(e)
    got = idx.allocate(NS, key(0, "b"), B, WRITING)
    assert got is not None
    assert idx.alloc.slab_of(got.offset) == idx.alloc.slab_of(a_pages[0].offset)
    assert not idx.live(a_pages[0])
    # The slab's free A slots went with it: A cannot hand them out any more.
    a_cls = idx.alloc.size_class(A)
    assert all(idx.alloc.slab_of(o) != idx.alloc.slab_of(got.offset) for o in a_cls.free)


# update must not resurrect removed entries.


def test_update_on_a_removed_entry_does_not_resurrect_it(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    idx.remove(e)
    e.dirty = True
    idx.update(e)
    assert idx.get(NS, key(1)) is None
    assert len(idx.dirty) == 0
    e.dirty = False
    idx.update(e)
    idx.touch(e)
    assert idx.evictable_bytes == 0
    assert lru_keys(idx, A) == []


def test_late_unlease_of_a_removed_entry(idx: PageIndex) -> None:
    e = idx.allocate(NS, key(1), A, FILLING)
    idx.lease(e)
    idx.remove(e)  # a failed fill
    idx.unlease(e)
    assert idx.evictable_bytes == 0
    assert lru_keys(idx, A) == []
    # The slot went back to the allocator exactly once and is handed out again.
    assert e.cls.used == 0
    assert idx.allocate(NS, key(2), A, WRITING).offset == e.offset


def test_stale_update_does_not_touch_a_new_entry_under_the_same_key(idx: PageIndex) -> None:
    old = ready(idx, key(1))
    idx.remove(old)
    new = idx.allocate(NS, key(1), A, WRITING)
    idx.update(new)
    idx.update(old)  # old still says READY and evictable
    assert old.evictable
    assert idx.evictable_bytes == 0
    assert lru_keys(idx, A) == []
    # Filling the pool must not evict the new, still written, entry.
    for i in range(NSLABS * SLAB // A):
        idx.allocate(NS, key(i, "z"), A, WRITING)
    assert idx.live(new)


# The write-back queue.


def test_dirty_tracks_dirty_ready_unqueued_entries_in_order(idx: PageIndex) -> None:
    e1, e2, e3 = (ready(idx, key(i)) for i in range(3))
    for e in (e2, e1, e3):
        e.dirty = True
        idx.update(e)
    assert list(idx.dirty.values()) == [e2, e1, e3]
    # Re-filing keeps the order in which pages became dirty.
    idx.update(e2)
    idx.lease(e2)
    idx.unlease(e2)
    assert list(idx.dirty.values()) == [e2, e1, e3]
    e1.queued = True
    idx.update(e1)
    assert list(idx.dirty) == [e2, e3]
    e1.queued = False
    e1.dirty = False
    e1.in_l3 = True
    idx.update(e1)
    assert e1 not in idx.dirty.values()
    assert e1.evictable
    # Back-up failed: queued again later, it is the newest dirty page.
    e3.queued = True
    idx.update(e3)
    e3.queued = False
    idx.update(e3)
    assert list(idx.dirty.values()) == [e2, e3]
    idx.remove(e2)
    assert list(idx.dirty.values()) == [e3]


def test_dirty_excludes_pages_not_ready(idx: PageIndex) -> None:
    w = idx.allocate(NS, key(1), A, WRITING)
    f = idx.allocate(NS, key(2), A, FILLING)
    for e in (w, f):
        e.dirty = True
        idx.update(e)
    assert len(idx.dirty) == 0
    w.state = READY
    idx.update(w)
    assert list(idx.dirty.values()) == [w]
    # A leased dirty page is still one to write out.
    idx.lease(w)
    assert list(idx.dirty.values()) == [w]


# Accounting.


def test_reclaimable_fraction(idx: PageIndex) -> None:
    cap = NSLABS * SLAB
    assert idx.reclaimable_fraction() == 1.0
    written = [idx.allocate(NS, key(i), A, WRITING) for i in range(4)]  # one whole slab
    assert idx.reclaimable_fraction() == pytest.approx((cap - SLAB) / cap)
    for e in written[:2]:
        e.state = READY
        idx.update(e)
    assert idx.reclaimable_fraction() == pytest.approx((cap - SLAB + 2 * A) / cap)
    idx.allocate(NS, key(0, "b"), B, WRITING)  # a second slab, half of it free
    assert idx.reclaimable_fraction() == pytest.approx((cap - 2 * SLAB + B + 2 * A) / cap)
    idx.lease(written[0])
    assert idx.reclaimable_fraction() == pytest.approx((cap - 2 * SLAB + B + A) / cap)


def test_reclaimable_fraction_of_a_full_pool(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    assert idx.reclaimable_fraction() == 1.0
    for e in entries:
        e.dirty = True
        idx.update(e)
    assert idx.reclaimable_fraction() == 0.0
    for e in entries[:8]:
        e.dirty = False
        idx.update(e)
    assert idx.reclaimable_fraction() == pytest.approx(8 * A / (NSLABS * SLAB))


def test_stats(idx: PageIndex) -> None:
    r = ready(idx, key(1))
    p = ready(idx, key(2))
    p.pinned = True
    idx.update(p)
    d = ready(idx, key(3))
    d.dirty = True
    idx.update(d)
    leased = ready(idx, key(4), B)
    idx.lease(leased)
    cls, slots = idx.take_slots(A, 1, NS)
    idx.private_entries(NS, [key(5)], A, cls, slots)  # a writer's slot: under no key until committed
    idx.allocate(NS, key(6), A, FILLING)
    s = idx.stats()
    assert s["pages"] == 5
    assert s["ready"] == 4
    assert s["writing"] == 1
    assert s["filling"] == 1
    assert s["dirty"] == 1
    assert s["pinned"] == 1
    assert s["leased"] == 1
    assert s["evictable_bytes"] == A  # only r
    assert s["used_bytes"] == 5 * A + B
    assert s["capacity_bytes"] == NSLABS * SLAB
    assert s["slabs"]["classes"][str(A)]["used"] == 5
    assert s["slabs"]["classes"][str(B)]["used"] == 1
    assert "evictions" not in s
    idx.remove(r)
    assert idx.stats()["pages"] == 4


async def test_stats_sliced_counts_as_stats_does_and_lets_the_loop_run(idx: PageIndex) -> None:
    """What `ctl stats` uses on a running daemon: the same counts, the walk cut into slices (here of 2
    entries) between which the event loop runs other work."""
    for i in range(3):
        ready(idx, key(i))
    p = ready(idx, key(3))
    p.pinned = True
    idx.update(p)
    idx.lease(ready(idx, key(4), B))
    cls, slots = idx.take_slots(A, 1, NS)
    idx.private_entries(NS, [key(5)], A, cls, slots)
    idx.allocate("other.ns", key(6), A, FILLING)
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(other_work())
    await asyncio.sleep(0)
    try:
        before = turns
        sliced = await idx.stats_sliced(per_slice=2)
        assert turns - before >= 3  # 6 entries in one namespace and 1 in another: 4 slices
    finally:
        task.cancel()
    assert sliced == idx.stats()
    counts = {k: sliced[k] for k in ("ready", "writing", "filling", "pinned", "leased")}
    assert counts == {"ready": 5, "writing": 1, "filling": 1, "pinned": 1, "leased": 1}


def test_stats_counters(idx: PageIndex) -> None:
    fill(idx, A, "a")
    ready(idx, key(0, "x"), A)  # one eviction
    ready(idx, key(0, "b"), B)  # one slab move: evicts the 4 pages of a slab
    for e in list(idx.entries.values()):
        if not e.leases:
            idx.lease(e)
    idx.allocate(NS, key(1, "x"), A, WRITING)
    s = idx.stats()
    assert s["evictions"] == 1 + SLAB // A
    assert s["slab_moves"] == 1
    assert s["alloc_failures"] == 1


def test_page_larger_than_a_slab_is_refused(idx: PageIndex) -> None:
    with pytest.raises(ValueError):
        idx.allocate(NS, key(1), SLAB + 1, WRITING)
    assert idx.get(NS, key(1)) is None
    assert idx.stats()["pages"] == 0
    assert idx.allocate(NS, key(1), SLAB, WRITING) is not None


# Quarantine: a slot an I/O thread may still write into is freed only later.


QUARANTINE = 0.001


async def _until_freed(e: Entry) -> None:
    # Timers fire in deadline order, so the quarantine's has run when this sleep ends.
    await asyncio.sleep(10 * QUARANTINE)
    assert e.offset in e.cls.free


async def test_quarantined_slot_is_freed_later(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    idx.lease(e)
    idx.unlease(e)
    idx.remove(e, quarantine=QUARANTINE)
    assert e.state == QUARANTINED
    assert idx.get(NS, key(1)) is None
    assert not idx.live(e)
    assert idx.evictable_bytes == 0
    assert idx.counters["quarantined"] == 1
    # The slot is not handed out while quarantined.
    assert e.cls.used == 1
    other = idx.allocate(NS, key(2), A, WRITING)
    assert other.offset != e.offset
    await _until_freed(e)
    assert e.cls.used == 1  # only `other`
    assert idx.allocate(NS, key(3), A, WRITING).offset == e.offset


async def test_quarantined_slot_is_not_evicted_or_reused_when_full(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    q = entries[0]
    idx.remove(q, quarantine=QUARANTINE)
    for e in entries[1:]:
        idx.lease(e)
    # Nothing evictable and the quarantined slot is not free yet.
    assert idx.allocate(NS, key(0, "x"), A, WRITING) is None
    await _until_freed(q)
    got = idx.allocate(NS, key(0, "x"), A, WRITING)
    assert got is not None and got.offset == q.offset


async def test_quarantined_slot_keeps_its_slab_from_being_stolen(idx: PageIndex) -> None:
    entries = fill(idx, A, "a")
    q = entries[1]  # slab 0, the least recently used one
    slab0 = idx.alloc.slab_of(q.offset)
    idx.remove(q, quarantine=QUARANTINE)
    got = idx.allocate(NS, key(0, "b"), B, WRITING)
    assert got is not None
    assert idx.alloc.slab_of(got.offset) != slab0
    assert idx.alloc.owner(slab0).slot_bytes == A
    assert idx.live(entries[0])
    await _until_freed(q)


async def test_remove_twice_with_quarantine_frees_once(idx: PageIndex) -> None:
    e = ready(idx, key(1))
    idx.remove(e, quarantine=QUARANTINE)
    idx.remove(e, quarantine=QUARANTINE)
    idx.remove(e)
    assert idx.counters["quarantined"] == 1
    await _until_freed(e)
    assert e.cls.used == 0
    assert e.cls.free.count(e.offset) == 1


def test_reserved_slots_are_never_evicted_nor_moved(idx: PageIndex) -> None:
    # Slab 0: one slot reserved (under no key), the others free. Another class short of slabs must not
    # take that slab: the engine may be writing into the reserved slot at this very moment.
    a_pages = fill(idx, A, "a")
    for e in a_pages[: SLAB // A]:
        idx.remove(e)
    (spare,) = idx.reserve(NS, A, 1)
    assert idx.alloc.slab_of(spare.offset) == 0
    assert idx.reserved == 1 and idx.reserved_bytes == A
    for e in a_pages[SLAB // A :]:
        idx.lease(e)
    assert idx.allocate(NS, key(0, "b"), B, WRITING) is None  # nothing else can be taken
    assert idx.alloc.owner(0).slot_bytes == A
    assert idx.stats()["pages"] == len(a_pages) - SLAB // A  # a reserved slot is no page yet
    idx.bind(spare, key(9, "r"))
    assert idx.get(NS, key(9, "r")) is spare and idx.reserved == 0 and idx.reserved_bytes == 0
    (other,) = idx.reserve(NS, A, 1)
    used = idx.stats()["used_bytes"]
    idx.unreserve(other)
    assert idx.stats()["used_bytes"] == used - A and idx.reserved == 0


# Slots taken many at a time (prefetch, reserve): the same slots, in the same order, as one at a time.


def test_alloc_many_hands_out_what_successive_allocs_would() -> None:
    one, many = SlabAllocator(NSLABS * SLAB, SLAB), SlabAllocator(NSLABS * SLAB, SLAB)
    c1, c2 = one.size_class(A), many.size_class(A)
    singles = [one.alloc(c1) for _ in range(7)]
    assert many.alloc_many(c2, 3) + many.alloc_many(c2, 4) == singles  # across a slab boundary
    assert c2.used == 7 and c2.free == c1.free
    everything = many.alloc_many(c2, 1000)
    assert len(everything) == NSLABS * SLAB // A - 7 and many.alloc_many(c2, 1) == []
    assert c2.used == NSLABS * SLAB // A


def test_take_slots_evicts_in_lru_order_and_stops_at_what_can_be_freed(idx: PageIndex) -> None:
    pages = fill(idx, A, "a")
    idx.touch(pages[0])  # now the most recently used
    removed: list[Entry] = []
    idx.on_remove = removed.extend
    for e in pages[-3:]:
        idx.lease(e)
    want = len(pages) - 3  # all but the leased ones can go
    cls, slots = idx.take_slots(A, want + 5)
    assert len(slots) == want
    assert [e.key for e in removed] == [e.key for e in pages[1:-3]] + [pages[0].key]
    assert slots == [e.offset for e in removed]
    assert idx.stats()["pages"] == 3 and idx.evictable_bytes == 0
    assert idx.counters["evictions"] == want and idx.counters["alloc_failures"] == 1
    assert idx.get(NS, pages[0].key) is None and idx.get(NS, pages[-1].key) is pages[-1]
    entries = [idx.entry_at(NS, key(i, "n"), A, cls, o, FILLING) for i, o in enumerate(slots[:2])]
    idx.give_back(cls, slots[2:])
    assert [idx.get(NS, key(i, "n")) for i in range(2)] == entries
    assert idx.stats()["used_bytes"] == 5 * A  # 3 leased + 2 new; the rest free again
    again = idx.take_slots(A, want - 2)[1]
    assert sorted(again) == sorted(slots[2:])  # from the free list, no eviction
    assert idx.counters["evictions"] == want


def test_take_slots_takes_a_slab_from_a_class_above_its_share(idx: PageIndex) -> None:
    fill(idx, A, "a")  # class A holds every slab
    cls, slots = idx.take_slots(B, 3)  # class B has no slab: it is entitled to half of them
    assert len(slots) == 3 and slabs_of(idx, B) == 2 and idx.counters["slab_moves"] == 2
    assert {idx.alloc.slab_of(o) for o in slots} == {idx.alloc.slab_of(slots[0]), idx.alloc.slab_of(slots[2])}
    assert idx.counters["evictions"] == 2 * SLAB // A


def test_entries_at_files_each_key_as_entry_at_would(idx: PageIndex) -> None:
    cls, slots = idx.take_slots(A, 3)
    made = idx.entries_at(NS, [key(i) for i in range(3)], A, cls, slots, FILLING, leases=2)
    assert [idx.get(NS, key(i)) for i in range(3)] == made
    assert [e.offset for e in made] == slots and all(e.leases == 2 and e.state == FILLING for e in made)
    assert idx.stats()["pages"] == 3 and idx.stats()["filling"] == 3
    for e in made:  # a fill that ends: evictable once both leases are gone, not before
        e.state = READY
        idx.unlease(e)
    assert idx.evictable_bytes == 0
    idx.unlease_all(made)
    assert lru_keys(idx, A) == [key(i) for i in range(3)] and idx.evictable_bytes == 3 * A
    with pytest.raises(ValueError):  # one slot per key, never a key left without one
        idx.entries_at(NS, [key(7), key(8)], A, cls, idx.take_slots(A, 1)[1], FILLING, leases=1)


def test_lease_all_and_unlease_all_as_one_call_a_page(idx: PageIndex) -> None:
    pages = [ready(idx, key(i)) for i in range(4)]
    idx.lease(pages[1])
    idx.lease_all(pages)
    assert [e.leases for e in pages] == [1, 2, 1, 1] and idx.evictable_bytes == 0
    idx.unlease_all(pages[1:])
    assert [e.leases for e in pages] == [1, 1, 0, 0]
    assert lru_keys(idx, A) == [key(2), key(3)]  # back in the LRU in the order given back
    idx.remove(pages[3])
    idx.unlease_all(pages[:2])
    assert lru_keys(idx, A) == [key(2), key(0), key(1)]


def test_leading_live_stops_at_a_page_not_in_the_state_or_gone(idx: PageIndex) -> None:
    pages = [ready(idx, key(i)) for i in range(5)]
    assert idx.leading_live(NS, pages, READY) == 5
    assert idx.leading_live("other", pages, READY) == 0
    pages[3].state = FILLING
    assert idx.leading_live(NS, pages, READY) == 3
    idx.remove(pages[1])
    assert idx.leading_live(NS, pages, READY) == 1
    again = idx.allocate(NS, key(1), A, READY)  # the same key, a new entry: the old one is still gone
    assert again is not None and idx.leading_live(NS, pages, READY) == 1
    assert idx.leading_live(NS, [], READY) == 0


def test_evictions_are_told_in_one_call_a_request(idx: PageIndex) -> None:
    pages = fill(idx, A, "a")
    calls: list[list[str]] = []
    idx.on_remove = lambda entries: calls.append([e.key for e in entries])
    idx.take_slots(A, 5)
    assert calls == [[e.key for e in pages[:5]]]
    idx.remove(pages[7])
    assert calls[-1] == [pages[7].key]


def test_a_growing_index_freezes_its_entries_out_of_the_collectors_sight() -> None:
    # A full collection scans every tracked object: the index freezes what is alive each time it has grown
    # by a quarter, from _FREEZE_FROM entries on, after collecting young garbage.
    page = 4 * KiB
    n = int(index_module._FREEZE_FROM * index_module._FREEZE_GROWTH) + 10
    idx = PageIndex(SlabAllocator(n * page + SLAB, SLAB))
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        first = [idx.allocate("ns", key(i), page, READY) for i in range(index_module._FREEZE_FROM - 1)]
        assert idx.counters["gc_freezes"] == 0
        idx.allocate("ns", key(index_module._FREEZE_FROM), page, READY)
        assert idx.counters["gc_freezes"] == 1 and gc.get_freeze_count() >= index_module._FREEZE_FROM
        cls, slots = idx.take_slots(page, n - index_module._FREEZE_FROM)
        idx.entries_at("ns", [key(i, "b") for i in range(len(slots))], page, cls, slots, READY, leases=0)
        assert idx.counters["gc_freezes"] == 2
        # A frozen entry is still freed by reference counting once it leaves the index: nothing else
        # holds it (the collector would never find it).
        gone = first.pop(0)
        idx.remove(gone)
        assert sys.getrefcount(gone) == 2  # `gone` and getrefcount's argument
    finally:
        gc.unfreeze()
