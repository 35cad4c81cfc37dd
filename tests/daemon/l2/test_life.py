"""PageLife alone over a tiny pool: every named move of a page, what it owes L3 after it, and who hears."""

from __future__ import annotations

import collections

import pytest
import xxhash
from parts_rig import PAGE, Flags, Records, make_life, page_bytes, store, used
from waits import wait_until

from hicached.daemon.l2.index import FILLING, QUARANTINED, READY, SUPERSEDED, WRITING, Entry
from hicached.daemon.l2.pool import Pool

NS = "ns"
POOL = 128 * 1024  # 2 slabs of 64 KiB: 8 slots of PAGE
SLOTS = POOL // PAGE


@pytest.fixture
def pool():
    p = Pool(POOL, prefault=False)
    yield p
    p.close()


class Rig:
    """A PageLife over the pool, the world it asks (attached, configured) and the slot headers it tells."""

    def __init__(self, pool: Pool, attached: bool = True, configured: bool = True) -> None:
        self.flags = Flags(attached, configured)
        self.counters: collections.Counter[str] = collections.Counter()
        self.records = Records()
        self.life, self.alloc = make_life(pool, self.counters, self.flags, records=self.records)
        self.index = self.life.index
        self.pool = pool

    def store(self, *keys: str) -> list[Entry]:
        return [page for page, _ in store(self.life, NS, list(keys))]

    def used(self) -> int:
        return used(self.alloc)

    def get(self, key: str) -> Entry | None:
        return self.index.get(NS, key)

    def fill(self, key: str, leases: int = 1) -> Entry:
        """A FILLING page of `key` in a slot of its own (what a prefetch makes)."""
        cls, slots = self.index.take_slots(PAGE, 1, NS)
        return self.life.start_fill(NS, key, PAGE, cls, slots[0], leases)

    def written(self, *pages: Entry) -> None:
        """The backup's moves for pages it wrote to L3."""
        self.life.queue(pages)
        for e in pages:
            self.life.written(e)
        self.life.unqueue(pages)

    def evict_all(self) -> int:
        """Takes every slot the pool can give (evicting what can be) and gives them back: how many."""
        taken = self.life.start_writes(NS, [f"new{i}" for i in range(SLOTS)], PAGE)
        for e in taken:
            self.life.abort_write(e)
        return len(taken)

    def bytes_of(self, e: Entry) -> bytes:
        return bytes(self.pool.slot(e.offset, PAGE))


def test_start_writes_gives_private_writing_slots_under_no_key(pool):
    r = Rig(pool)
    es = r.life.start_writes(NS, ["a", "b", "c"], PAGE)
    assert [e.state for e in es] == [WRITING] * 3 and [e.leases for e in es] == [1, 1, 1]
    assert [e.key for e in es] == ["a", "b", "c"] and len({e.offset for e in es}) == 3
    assert [r.get(k) for k in "abc"] == [None, None, None]
    stats = r.index.stats()
    assert (stats["writing"], stats["pages"], stats["ready"], stats["dirty"]) == (3, 0, 0, 0)
    assert r.used() == 3
    more = r.life.start_writes(NS, [f"x{i}" for i in range(10)], PAGE)  # fewer: the pool holds 8
    assert len(more) == SLOTS - 3 and r.index.stats()["writing"] == SLOTS
    assert r.index.counters["alloc_failures"] == 1
    for e in es + more:
        r.life.abort_write(e)
    assert r.used() == 0 and r.index.stats()["writing"] == 0
    assert r.records.events == []


def test_publish_under_a_free_key_is_ready_and_owed_when_attached(pool):
    r = Rig(pool)
    (e,) = r.life.start_writes(NS, ["a"], PAGE)
    r.pool.view[e.offset : e.offset + PAGE] = page_bytes("a")
    page, owed = r.life.publish(e, None)
    assert page is e and owed is True
    assert (e.state, e.dirty, e.in_l3, e.leases, e.queued) == (READY, True, False, 0, False)
    assert r.get("a") is e and list(r.index.dirty) == [e]
    assert e.checksum == xxhash.xxh3_64_intdigest(page_bytes("a"))  # taken as it entered L2
    assert r.life.owed(e) and not r.life.stranded
    stats = r.index.stats()
    assert (stats["writing"], stats["pages"], stats["ready"], stats["dirty"]) == (0, 1, 1, 1)
    assert stats["evictable_bytes"] == 0  # held for L3
    assert (r.counters["store.pages"], r.counters["store.bytes"]) == (1, PAGE)
    assert r.records.events == [("commit", "a")]
    (b,) = r.life.start_writes(NS, ["b"], PAGE)
    assert r.life.publish(b, 1234) == (b, True) and b.checksum == 1234  # the client's, as it sent it


def test_publish_while_detached_strands_the_page(pool):
    r = Rig(pool, attached=False)
    (e,) = r.store("a")
    assert r.life.publish(r.life.start_writes(NS, ["b"], PAGE)[0], None)[1] is False
    assert e.state is READY and not e.dirty and e in r.life.stranded and r.life.owed(e)
    assert r.index.stats()["dirty"] == 0 and r.index.evictable_bytes == 2 * PAGE  # not held in L2
    assert r.life.not_in_l3(attached=False, pending=0) == 2


def test_publish_with_no_backend_configured_owes_nothing_and_loses_nothing(pool):
    r = Rig(pool, attached=False, configured=False)
    (e,) = r.store("a")
    assert not e.dirty and not r.life.stranded and not r.life.owed(e)
    assert r.life.not_in_l3(attached=False, pending=0) == 0
    assert r.evict_all() == SLOTS
    assert r.get("a") is None and r.flags.lost == [] and r.counters["backup.lost"] == 0
    assert r.records.events == [("commit", "a"), ("clear", ["a"])]


def test_publish_under_a_ready_key_frees_its_slot_and_answers_that_page(pool):
    r = Rig(pool)
    (first,) = r.store("a")
    (second,) = r.life.start_writes(NS, ["a"], PAGE)
    r.pool.view[second.offset : second.offset + PAGE] = b"\xee" * PAGE
    assert r.used() == 2
    assert r.life.publish(second, None) == (first, False)  # owed and held already: nothing to queue
    assert r.used() == 1 and r.index.stats()["writing"] == 0 and r.get("a") is first
    assert r.bytes_of(first) == page_bytes("a")
    assert r.counters["store.present"] == 1 and r.counters["store.pages"] == 1
    # Believed in L3: stored again, it is owed again (the belief may be stale), counted as rewritten.
    r.written(first)
    assert first.in_l3 and not first.dirty
    (third,) = r.life.start_writes(NS, ["a"], PAGE)
    assert r.life.publish(third, None) == (first, True)
    assert first.dirty and not first.in_l3 and list(r.index.dirty) == [first]
    assert r.counters["store.rewritten"] == 1 and r.counters["store.present"] == 2
    assert r.used() == 1


def test_a_page_given_up_then_stored_again_is_owed_and_held_again(pool):
    r = Rig(pool)
    (e,) = r.store("a")
    r.life.queue([e])
    r.life.give_up([e])
    r.life.unqueue([e])
    assert e in r.life.given_up and not e.dirty
    assert r.life.stored_again(e) is True  # an alloc or put answered present
    assert e.dirty and e not in r.life.given_up and r.counters["store.present"] == 1
    assert r.life.stored_again(e) is False  # owed and held already


def test_a_reserved_slot_is_published_under_a_free_key_only(pool):
    r = Rig(pool)
    r.store("a")
    slot, other = r.index.reserve(NS, PAGE, 2)
    assert r.index.stats()["reserved"] == 2 and r.used() == 3
    with pytest.raises(ValueError):
        r.life.publish(slot, None, key="a")
    r.life.unreserve(slot)
    assert r.used() == 2
    page, owed = r.life.publish(other, None, key="b")
    assert page is other and owed and r.get("b") is other and other.state is READY
    assert r.index.stats()["reserved"] == 0 and r.index.reserved_bytes == 0


@pytest.mark.parametrize("good", [True, False])
def test_a_store_supersedes_a_fill_whose_end_never_touches_the_stored_page(pool, good):
    r = Rig(pool)
    fill = r.fill("a")
    assert fill.state is FILLING and r.get("a") is fill
    (e,) = r.life.start_writes(NS, ["a"], PAGE)
    r.pool.view[e.offset : e.offset + PAGE] = page_bytes("a")
    assert r.life.publish(e, None) == (e, True)
    assert fill.state is SUPERSEDED and r.get("a") is e and r.counters["store.superseded_fills"] == 1
    assert r.used() == 2  # the read goes on into its own slot
    r.pool.view[fill.offset : fill.offset + PAGE] = b"\x11" * PAGE  # what the read lands
    assert r.life.filled(fill, good, in_l3=True) is False
    r.index.unlease(fill)  # the fill's own lease, given back by its caller
    assert r.used() == 1
    assert r.get("a") is e and e.state is READY and e.dirty and not e.in_l3
    assert r.bytes_of(e) == page_bytes("a")
    assert r.records.events == [("commit", "a")] and r.flags.lost == []


async def test_abort_write_frees_the_slot_after_its_quarantine(pool):
    r = Rig(pool)
    now, later = r.life.start_writes(NS, ["a", "b"], PAGE)
    r.life.abort_write(now)
    assert r.used() == 1
    r.life.abort_write(later, quarantine=0.01)  # a copy may still land in it
    assert later.state is QUARANTINED and r.used() == 1 and r.index.counters["quarantined"] == 1
    assert r.index.stats()["writing"] == 0 and r.get("a") is None and r.get("b") is None
    await wait_until(lambda: r.used() == 0)
    assert r.records.events == []


def test_a_fill_read_whole_is_ready_and_a_miss_leaves_l2(pool):
    r = Rig(pool)
    a, b, c = r.fill("a"), r.fill("b"), r.fill("c")
    r.pool.view[a.offset : a.offset + PAGE] = page_bytes("a")
    assert r.life.filled(a, True, in_l3=True) is True
    assert (a.state, a.in_l3, a.dirty, a.fill) == (READY, True, False, None)
    assert a.checksum == xxhash.xxh3_64_intdigest(page_bytes("a"))  # what its record carries
    r.index.unlease(a)
    assert a.in_lru and r.index.evictable_bytes == PAGE
    assert r.life.filled(b, False, in_l3=True) is False  # a miss, a corrupt page, a failed read
    assert r.get("b") is None and r.used() == 2
    assert r.life.filled(c, True, in_l3=False) is True  # read from a store swapped out meanwhile
    assert c.state is READY and not c.in_l3 and not c.dirty
    assert r.records.events == [("commit", "a"), ("clear", ["b"]), ("commit", "c")]
    assert r.flags.lost == []


def test_queue_unqueue_and_written(pool):
    r = Rig(pool)
    a, b = r.store("a", "b")
    assert r.life.queue([a, b]) == [a, b]
    assert r.life.queue([a, b]) == []  # queued already
    assert a.queued and b.queued and list(r.index.dirty) == []  # out of write-back's list
    assert r.index.stats()["dirty"] == 2  # still not in L3
    r.life.unqueue([b], refile=True)
    assert not b.queued and list(r.index.dirty) == [b]
    r.life.written(a)
    r.life.unqueue([a])
    assert (a.dirty, a.in_l3) == (False, True) and r.index.stats()["dirty"] == 1
    assert a.in_lru and r.index.evictable_bytes == PAGE
    assert r.life.queue([a]) == []  # owes nothing
    assert r.records.events == [("commit", "a"), ("commit", "b"), ("in_l3", "a")]


def test_give_up_stops_holding_the_page_but_it_stays_owed(pool):
    r = Rig(pool)
    (a,) = r.store("a")
    r.life.queue([a])
    r.life.give_up([a])
    r.life.unqueue([a])
    assert not a.dirty and a in r.life.given_up and r.life.owed(a)
    assert r.index.evictable_bytes == PAGE and r.index.stats()["dirty"] == 0
    assert r.life.not_in_l3(attached=True, pending=0) == 1
    r.written(a)  # a later flush wrote it after all
    assert a not in r.life.given_up and not r.life.owed(a) and a.in_l3


def test_drop_takes_a_queued_page_off_the_hold(pool):
    r = Rig(pool)
    a, b = r.store("a", "b")
    r.life.queue([a, b])
    assert r.life.drop(a) is True
    assert not a.dirty and not a.queued and a in r.life.dropped and r.life.owed(a)
    assert r.index.stats()["dirty"] == 1 and r.index.evictable_bytes == PAGE
    r.life.written(b)
    assert r.life.drop(b) is False and b not in r.life.dropped  # it owed nothing
    assert r.life.not_in_l3(attached=True, pending=0) == 0  # dropped ones are counted apart


def test_a_changed_page_is_owed_nothing_and_never_lost(pool):
    r = Rig(pool)
    a, b = r.store("a", "b")
    r.life.queue([a, b])
    r.life.give_up([a])
    r.life.changed(a)  # its bytes no longer hash to its checksum
    r.life.changed(b)
    r.life.unqueue([a, b])
    assert not r.life.owed(a) and not r.life.owed(b) and not r.life.given_up
    assert r.index.stats()["dirty"] == 0
    assert r.evict_all() == SLOTS and r.flags.lost == []


def test_owe_again_owes_the_given_up_and_dropped_pages_in_l2(pool):
    r = Rig(pool)
    a, b, c, d = r.store("a", "b", "c", "d")
    r.life.queue([a, b, c])
    r.life.give_up([a])
    r.life.drop(b)
    r.life.written(c)
    r.life.unqueue([a, b, c])
    out = r.life.owe_again()
    assert out[0] is d and set(out) == {a, b, d}  # every page owed and not queued, the oldest first
    assert a.dirty and b.dirty and not c.dirty and d.dirty
    assert not r.life.given_up and not r.life.dropped
    assert r.index.stats()["dirty"] == 3


@pytest.mark.parametrize("other_store", [False, True])
def test_backend_attached_owes_every_ready_page_not_in_l3(pool, other_store):
    r = Rig(pool, attached=False)
    (stranded,) = r.store("s")
    r.flags.attached = True
    held, in_l3, given_up = r.store("h", "w", "g")
    r.written(in_l3)
    r.life.queue([given_up])
    r.life.give_up([given_up])
    r.life.unqueue([given_up])
    fill = r.fill("f")
    out = r.life.backend_attached(other_store)
    assert set(out) == {stranded, given_up}  # held already: not returned twice
    assert stranded.dirty and given_up.dirty and held.dirty and not fill.dirty
    assert in_l3.in_l3 is (not other_store) and not in_l3.dirty  # another store: stays clean, evictable
    assert not r.life.stranded and not r.life.given_up and not r.life.dropped


def test_backend_detached_strands_the_owed_pages(pool):
    r = Rig(pool)
    a, b, c = r.store("a", "b", "c")
    r.written(c)
    r.life.queue([a])
    r.life.backend_detached()
    assert not a.dirty and not b.dirty and r.life.stranded == {a, b}
    assert r.index.stats()["dirty"] == 0 and r.index.evictable_bytes == 3 * PAGE  # queued: no lease
    r.life.unqueue([a])
    assert r.life.not_in_l3(attached=False, pending=0) == 2
    assert r.evict_all() == SLOTS
    assert r.flags.lost == [2] and not r.life.stranded


def test_forget_owes_nothing_loses_nothing_and_unpins(pool):
    r = Rig(pool)
    (a,) = r.store("a")
    assert r.life.pin(a, POOL)
    r.life.forget(a)
    assert r.get("a") is None and r.used() == 0 and r.life.pinned_bytes == 0 and r.life.arena_pinned == [0]
    assert r.index.stats()["dirty"] == 0
    r.flags.attached = False
    (b,) = r.store("b")
    r.life.forget(b)
    assert not r.life.stranded and r.used() == 0
    assert r.flags.lost == []
    assert r.records.events == [("commit", "a"), ("clear", ["a"]), ("commit", "b"), ("clear", ["b"])]


def test_pins_are_bounded_by_the_limit(pool):
    r = Rig(pool)
    a, b, c = r.store("a", "b", "c")
    r.written(a, b, c)
    assert r.index.evictable_bytes == 3 * PAGE
    assert r.life.pin(a, 2 * PAGE) and r.life.pin(a, 2 * PAGE)  # pinned already: counted once
    assert r.life.pin(b, 2 * PAGE)
    assert not r.life.pin(c, 2 * PAGE) and not c.pinned
    assert r.life.pinned_bytes == 2 * PAGE and r.life.arena_pinned == [2 * PAGE]
    assert r.index.evictable_bytes == PAGE and r.index.stats()["pinned"] == 2
    assert r.life.unpin(a) and not r.life.unpin(a)
    assert r.life.pinned_bytes == PAGE and r.index.evictable_bytes == 2 * PAGE
    assert r.evict_all() == SLOTS - 1  # b stays pinned
    assert r.get("b") is b and r.get("a") is None and r.get("c") is None


def test_a_page_held_for_l3_is_never_evicted(pool):
    r = Rig(pool)
    pages = r.store(*[f"p{i}" for i in range(SLOTS)])
    assert r.life.start_writes(NS, ["more"], PAGE) == []
    assert r.index.counters["alloc_failures"] == 1
    assert all(r.get(p.key) is p for p in pages) and r.flags.lost == []


def test_lost_is_told_exactly_the_owed_pages_that_left_l2(pool):
    r = Rig(pool, attached=False)
    (stranded,) = r.store("s")
    r.flags.attached = True
    given_up, given_up2, dropped, *written = r.store(*[f"p{i}" for i in range(SLOTS - 1)])
    r.life.queue([given_up, given_up2, dropped, *written])
    r.life.give_up([given_up, given_up2])
    r.life.drop(dropped)
    for e in written:
        r.life.written(e)
    r.life.unqueue([given_up, given_up2, dropped, *written])
    assert r.evict_all() == SLOTS  # one eviction of the whole pool
    assert r.flags.lost == [3]  # the stranded page and the two given up; told once
    assert r.counters["backup.dropped_gone"] == 1 and r.counters["backup.lost"] == 0  # lost: the caller's
    assert not r.life.given_up and not r.life.stranded and not r.life.dropped
    assert r.records.events[-1] == ("clear", sorted(["s", *(f"p{i}" for i in range(SLOTS - 1))]))


def test_records_hear_commit_in_l3_and_clear_in_order(pool):
    r = Rig(pool)
    (a,) = r.store("a")
    r.written(a)
    b = r.fill("b")
    r.life.filled(b, True, in_l3=True)
    r.index.unlease(b)
    r.life.forget(a)
    assert r.evict_all() == SLOTS
    assert r.records.events == [
        ("commit", "a"),
        ("in_l3", "a"),
        ("commit", "b"),
        ("clear", ["a"]),
        ("clear", ["b"]),
    ]


# Regression: a page stored again while no backend is attached is owed to the backend when it is back (the
# belief that it is in L3 may be stale); evicted before, it is counted lost.
def test_a_page_stored_again_while_detached_is_owed_again_when_a_backend_attaches(pool):
    r = Rig(pool)
    (a,) = r.store("a")
    r.written(a)
    r.flags.attached = False
    r.life.backend_detached()
    (again,) = r.life.start_writes(NS, ["a"], PAGE)
    assert r.life.publish(again, None) == (a, False)
    assert a in r.life.stranded and r.life.owed(a)  # owed to the backend that is away
    r.flags.attached = True
    assert r.life.backend_attached(other_store=False) == [a]  # fails: [] (a.in_l3 still True)
    assert a.dirty and not a.in_l3
