"""Stores alone, over a real page life, backup, backend (an in-memory store), write policy and activity."""

from __future__ import annotations

import pytest
from parts_rig import CAPACITY, PAGE, MemStore, World, page_bytes

from hicached.common.errors import HicachedError
from hicached.common.protocol import (
    ALLOC_BUSY,
    ALLOC_NO_SPACE,
    ALLOC_PRESENT,
    ALLOC_WRITE,
    PUT_BUSY,
    PUT_PRESENT,
    PUT_STORED,
)
from hicached.daemon.l2.index import FILLING, READY, SUPERSEDED
from hicached.daemon.sched.session import Session
from hicached.daemon.sched.stores import Stores

NS = "ns"
SLOTS = CAPACITY // PAGE


class Rig(World):
    """Stores built alone over the world's collaborators."""

    def __init__(self, tmp_path, connector="mem", **storage) -> None:
        self.conn = MemStore() if connector == "mem" else connector
        super().__init__(tmp_path, self.conn, **storage)
        policy = self.make_policy()
        self.stores = Stores(
            self.cfg, self.life, self.backup, self.backend, policy, self.activity, self.counters
        )

    def session(self) -> Session:
        return Session(peer="test", ns=NS, page_bytes=PAGE)

    def store(self, s: Session, keys: list[str]) -> list[bool]:
        """alloc, copy, commit: an engine's store of pages it has not stored before."""
        status, offsets = self.stores.alloc(s, keys)
        assert status == [ALLOC_WRITE] * len(keys)
        for key, off in zip(keys, offsets, strict=True):
            self.write(off, key)
        return self.stores.commit(s, keys)


async def test_alloc_then_commit_stores_the_pages_and_queues_them_for_l3(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        status, offsets = r.stores.alloc(s, ["a", "b"])
        assert status == [ALLOC_WRITE, ALLOC_WRITE] and min(offsets) >= 0 and offsets[0] != offsets[1]
        assert sorted(s.writing) == ["a", "b"] and r.index.get(NS, "a") is None  # a slot under no key yet
        for key, off in zip(["a", "b"], offsets, strict=True):
            r.write(off, key)
        assert r.stores.commit(s, ["a", "b", "never"]) == [True, True, False]
        assert not s.writing
        pages = [r.index.get(NS, k) for k in "ab"]
        assert [p.state for p in pages] == [READY, READY] and [p.offset for p in pages] == offsets
        assert r.backup.pending == 2 and r.counters["store.pages"] == 2  # write-through: queued at once
        assert r.stores.alloc(s, ["a", "b"]) == ([ALLOC_PRESENT] * 2, [-1, -1])
        assert r.backup.pending == 2  # owed and queued already: not twice
        r.now = 1.0  # the engines paused: the backup does not wait for them
        r.backup.start()
        assert await r.backup.drain(5)
        assert r.conn.data == {(NS, "a"): page_bytes("a"), (NS, "b"): page_bytes("b")}
        assert r.index.stats()["dirty"] == 0


async def test_a_page_in_l3_stored_again_is_written_again(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.store(s, ["a"])
        r.now = 1.0  # the engines paused: the backup does not wait for them
        r.backup.start()
        assert await r.backup.drain(5) and r.conn.puts == 1
        del r.conn.data[(NS, "a")]  # left L3 behind the daemon (a janitor)
        assert r.stores.alloc(s, ["a"]) == ([ALLOC_PRESENT], [-1])
        r.now = 2.0
        assert await r.backup.drain(5)
        assert r.conn.data == {(NS, "a"): page_bytes("a")} and r.conn.puts == 2
        assert r.counters["store.rewritten"] == 1


async def test_a_key_another_session_writes_gets_a_slot_of_its_own(tmp_path):
    async with Rig(tmp_path) as rig:
        s1, s2 = rig.session(), rig.session()
        (st1,), (off1,) = rig.stores.alloc(s1, ["k"])
        (st2,), (off2,) = rig.stores.alloc(s2, ["k"])
        assert st1 == st2 == ALLOC_WRITE and off1 != off2  # never present: its bytes are not there yet
        assert rig.used() == 2
        rig.write(off2, "k")
        assert rig.stores.commit(s2, ["k"]) == [True]
        rig.pool.view[off1 : off1 + PAGE] = b"\x99" * PAGE
        assert rig.stores.commit(s1, ["k"]) == [True]  # the key is READY: its own slot is freed
        page = rig.index.get(NS, "k")
        assert page.offset == off2 and rig.bytes_at(off2) == page_bytes("k")
        assert rig.used() == 1 and rig.counters["store.present"] == 1 and rig.backup.pending == 1


async def test_a_key_written_by_another_session_that_aborts_leaves_nothing_present(tmp_path):
    async with Rig(tmp_path) as rig:
        s1, s2 = rig.session(), rig.session()
        rig.stores.alloc(s1, ["k"])
        assert rig.stores.alloc(s2, ["k"])[0] == [ALLOC_WRITE]
        assert rig.stores.abort(s1, ["k"]) == 1
        assert rig.index.get(NS, "k") is None and rig.used() == 1
        assert rig.stores.alloc(rig.session(), ["k"])[0] == [ALLOC_WRITE]  # still not present


async def test_a_key_this_session_writes_is_busy(tmp_path):
    async with Rig(tmp_path) as rig:
        s = rig.session()
        assert rig.stores.alloc(s, ["k"])[0] == [ALLOC_WRITE]
        assert rig.stores.alloc(s, ["k"]) == ([ALLOC_BUSY], [-1])  # its first write may still be aborted
        assert rig.counters["store.busy"] == 1 and rig.used() == 1
        assert rig.stores.abort(s, ["k", "other"]) == 1
        assert rig.used() == 0 and not s.writing
        assert rig.stores.alloc(s, ["k"])[0] == [ALLOC_WRITE]


async def test_a_key_being_read_from_l3_gets_a_slot_and_the_store_wins(tmp_path):
    async with Rig(tmp_path) as rig:
        cls, slots = rig.index.take_slots(PAGE, 1, NS)
        fill = rig.life.start_fill(NS, "k", PAGE, cls, slots[0], leases=1)
        s = rig.session()
        (st,), (off,) = rig.stores.alloc(s, ["k"])
        assert st == ALLOC_WRITE and off != fill.offset and fill.state is FILLING
        rig.write(off, "k")
        assert rig.stores.commit(s, ["k"]) == [True]
        assert fill.state is SUPERSEDED and rig.index.get(NS, "k").offset == off
        assert rig.life.filled(fill, False, in_l3=True) is False  # the read misses: the page stays
        rig.index.unlease(fill)
        assert rig.index.get(NS, "k").offset == off and rig.used() == 1 and rig.backup.pending == 1


async def test_reserve_then_put_binds_the_slots_and_keeps_those_of_present_keys(tmp_path):
    async with Rig(tmp_path, pool={"reserve_per_connection": 4 * PAGE, "reserve_max_fraction": 0.5}) as r:
        s = r.session()
        r.store(s, ["x"])
        offsets, limit = r.stores.reserve(s, 10)
        assert limit == 4 and len(offsets) == 4 and sorted(s.reserved) == sorted(offsets)
        assert r.stores.reserve(s, 10) == ([], 4)  # holds all it may
        assert r.index.stats()["reserved"] == 4 and r.used() == 5
        for key, off in zip(["p0", "x", "p1"], offsets, strict=False):
            r.write(off, key)
        assert r.stores.put(s, ["p0", "x", "p1"], offsets[:3]) == [PUT_STORED, PUT_PRESENT, PUT_STORED]
        assert r.index.get(NS, "p0").offset == offsets[0] and r.index.get(NS, "p1").offset == offsets[2]
        assert r.index.get(NS, "x").offset not in offsets
        assert sorted(s.reserved) == sorted([offsets[1], offsets[3]])  # present: the slot stays reserved
        assert r.index.stats()["reserved"] == 2 and r.backup.pending == 3
        with pytest.raises(HicachedError):
            r.stores.put(s, ["q"], [offsets[0]])  # bound already: not this connection's reserve any more
        with pytest.raises(HicachedError):
            r.stores.put(s, ["q", "r"], [offsets[1], offsets[1]])
        assert sorted(s.reserved) == sorted([offsets[1], offsets[3]])


async def test_abort_frees_the_slots_of_the_keys_being_written(tmp_path):
    async with Rig(tmp_path) as rig:
        s = rig.session()
        rig.stores.alloc(s, ["a", "b"])
        assert rig.stores.abort(s, ["a", "zz"]) == 1
        assert list(s.writing) == ["b"] and rig.used() == 1 and rig.index.stats()["writing"] == 1


async def test_slots_held_for_the_daemons_copy_are_out_of_the_engines_reach(tmp_path):
    async with Rig(tmp_path) as rig:
        s = rig.session()
        status, offsets = rig.stores.alloc(s, ["a", "b", "c"])
        held = rig.stores.hold_writing(s, ["a", "b"])
        assert [e.key for e in held] == ["a", "b"] and list(s.writing) == ["c"] and s.copying == set(held)
        assert rig.stores.commit(s, ["a"]) == [False] and rig.stores.abort(s, ["b"]) == 0
        rig.write(offsets[0], "a")
        rig.stores.commit_held(s, [held[0]], sums=[1234])
        page = rig.index.get(NS, "a")
        assert page.state is READY and page.checksum == 1234 and page.offset == offsets[0]
        rig.stores.abort_held(s, [held[1]])
        assert rig.index.get(NS, "b") is None and not s.copying
        assert rig.used() == 2 and rig.backup.pending == 1  # a, and c still being written


async def test_alloc_is_bounded_by_the_backup_queue(tmp_path):
    async with Rig(tmp_path, backup_queue_pages=4) as r:
        s = r.session()
        status, _ = r.stores.alloc(s, [f"k{i}" for i in range(6)])
        assert status == [ALLOC_WRITE] * 4 + [ALLOC_BUSY] * 2  # slots on their way to the queue count
        assert r.counters["store.busy"] == 2
        assert r.stores.commit(s, [f"k{i}" for i in range(4)]) == [True] * 4
        assert r.backup.pending == 4
        assert r.stores.alloc(s, ["more"])[0] == [ALLOC_BUSY]
        offsets, _ = r.stores.reserve(s, 2)
        assert r.stores.put(s, ["p0", "p1"], offsets) == [PUT_BUSY, PUT_BUSY]
        assert sorted(s.reserved) == sorted(offsets)  # refused: still this connection's
        r.now = 1.0
        r.backup.start()
        assert await r.backup.drain(5)
        assert r.stores.alloc(s, ["more"])[0] == [ALLOC_WRITE]


async def test_no_queue_bound_under_write_back_or_with_no_backend(tmp_path):
    for connector, policy in [("mem", "write_back"), (None, "write_through")]:
        async with Rig(tmp_path, connector, backup_queue_pages=2, write_policy=policy) as r:
            s = r.session()
            status, _ = r.stores.alloc(s, [f"k{i}" for i in range(5)])
            assert status == [ALLOC_WRITE] * 5, (connector, policy)
            assert r.stores.commit(s, [f"k{i}" for i in range(5)]) == [True] * 5
            assert r.backup.pending == 0  # write-back writes on pressure; with no backend, none is queued


async def test_refuse_bounds_the_pages_waiting_for_l3(tmp_path):
    # A quarter of 16 slots may wait for L3: 4 pages.
    async with Rig(tmp_path, max_unbacked_fraction=0.25, when_backlog_full="refuse") as r:
        s = r.session()
        status, _ = r.stores.alloc(s, [f"k{i}" for i in range(6)])
        assert status == [ALLOC_WRITE] * 4 + [ALLOC_BUSY] * 2
        assert r.stores.commit(s, [f"k{i}" for i in range(4)]) == [True] * 4
        assert r.index.dirty_bytes == 4 * PAGE
        assert r.stores.alloc(s, ["more"])[0] == [ALLOC_BUSY]
        offsets, _ = r.stores.reserve(s, 1)
        assert r.stores.put(s, ["p"], offsets) == [PUT_BUSY] and list(s.reserved) == offsets
        assert r.counters["backup.dropped"] == 0


async def test_a_full_pool_answers_no_space_and_tells_write_back(tmp_path):
    async with Rig(tmp_path, write_policy="write_back") as r:
        s = r.session()
        status, offsets = r.stores.alloc(s, [f"k{i}" for i in range(SLOTS + 2)])
        assert status == [ALLOC_WRITE] * SLOTS + [ALLOC_NO_SPACE] * 2 and offsets[SLOTS:] == [-1, -1]
        assert r.counters["store.no_space"] == 2 and r.policy.pressure.is_set()


async def test_each_store_request_marks_the_engines_busy(tmp_path):
    async with Rig(tmp_path) as rig:
        s = rig.session()
        assert not rig.activity.busy()
        rig.now = 5.0
        rig.stores.alloc(s, ["a"])
        assert rig.activity.last == 5.0 and rig.activity.busy()
        rig.now = 6.0
        offsets, _ = rig.stores.reserve(s, 1)
        assert rig.activity.last == 6.0
        rig.now = 7.0
        rig.stores.put(s, ["b"], offsets)
        assert rig.activity.last == 7.0
        rig.now = 7.0 + 2 * rig.activity.window_s
        assert not rig.activity.busy()
