"""Loads alone, over a real prefetcher, page life and backend (an in-memory store): lookups and leases."""

from __future__ import annotations

import pytest
from parts_rig import PAGE, MemStore, World, page_bytes, store

from hicached.common.errors import HicachedError
from hicached.daemon.l2.index import FILLING, READY
from hicached.daemon.sched.loads import Loads
from hicached.daemon.sched.prefetch import Prefetcher
from hicached.daemon.sched.session import Session

NS = "ns"


class Rig(World):
    """Loads built alone, with the prefetcher's workers running."""

    def __init__(self, tmp_path, connector="mem", **storage) -> None:
        self.conn = MemStore() if connector == "mem" else connector
        super().__init__(tmp_path, self.conn, **storage)
        st = self.cfg.storage
        self.prefetcher = Prefetcher(
            self.life,
            self.pool,
            self.backend,
            self.counters,
            st.prefetch_concurrency,
            st.prefetch_batch_pages,
            st.prefetch_batch_bytes,
            st.prefetch_queue_pages,
        )
        self.loads = Loads(self.cfg, self.index, self.backend, self.prefetcher, self.activity, self.counters)
        self.prefetcher.start()

    async def close(self) -> None:
        await self.prefetcher.stop()
        await super().close()

    def session(self) -> Session:
        return Session(peer="test", ns=NS, page_bytes=PAGE)

    def in_l2(self, *keys: str) -> None:
        store(self.life, NS, list(keys))

    def in_l3(self, *keys: str) -> None:
        for key in keys:
            self.conn.data[(NS, key)] = page_bytes(key)

    def leases(self, *keys: str) -> list[int]:
        return [self.index.get(NS, k).leases for k in keys]


async def test_exists_counts_the_leading_keys_in_l2_then_in_l3(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a", "b")
        r.in_l3("c", "d")
        assert await r.loads.exists(s, ["a", "b", "c", "d", "e"]) == 4
        assert await r.loads.exists(s, ["a", "x", "c"]) == 1  # a hole ends it
        assert await r.loads.exists(s, ["c", "d"]) == 2  # L3 alone
        assert (r.counters["lookup.l2_hits"], r.counters["lookup.l3_hits"]) == (3, 4)
        assert r.counters["lookup.misses"] == 2
        assert r.loads.exists_l2(s, ["a", "b"]) == 2
        assert r.loads.exists_l2(s, ["a", "c"]) is None  # L3 must say
        assert r.index.get(NS, "c") is None  # a lookup reads nothing into L2


async def test_exists_and_present_with_no_backend_answer_from_l2(tmp_path):
    async with Rig(tmp_path, None) as r:
        s = r.session()
        r.in_l2("a", "b")
        assert r.loads.exists_l2(s, ["a", "x", "b"]) == 1
        assert await r.loads.exists(s, ["a", "b", "x"]) == 2
        assert await r.loads.present(s, ["x", "b"]) == [False, True]


async def test_present_answers_each_key_holes_and_all(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a", "b")
        r.in_l3("c")
        assert await r.loads.present(s, ["a", "x", "c", "y", "b"]) == [True, False, True, False, True]
        assert (r.counters["lookup.l2_hits"], r.counters["lookup.l3_hits"]) == (2, 1)
        assert r.counters["lookup.misses"] == 2


async def test_acquire_without_fetch_leases_the_leading_pages_in_l2(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a", "b", "d")
        r.in_l3("c")
        lease, offsets = await r.loads.acquire(s, ["a", "b", "c", "d"], fetch=False)
        assert offsets == [r.index.get(NS, k).offset for k in "ab"] and r.leases("a", "b", "d") == [1, 1, 0]
        assert r.index.get(NS, "c") is None and r.conn.data.keys() == {(NS, "c")}  # nothing read
        assert s.leases == {lease: [r.index.get(NS, "a"), r.index.get(NS, "b")]}
        assert (r.counters["load.pages"], r.counters["load.bytes"], r.counters["load.misses"]) == (
            2,
            2 * PAGE,
            1,
        )
        r.loads.release(s, lease)
        assert r.leases("a", "b") == [0, 0] and not s.leases
        with pytest.raises(HicachedError):
            r.loads.release(s, lease)
        assert await r.loads.acquire(s, ["x", "a"], fetch=False) == (0, [])  # no leading page: no lease
        assert r.leases("a") == [0] and not s.leases


async def test_acquire_with_fetch_reads_the_missing_pages_up_to_the_first_hole(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a")
        r.in_l3("b", "c", "e")  # d is nowhere
        lease, offsets = await r.loads.acquire(s, ["a", "b", "c", "d", "e"], fetch=True)
        assert len(offsets) == 3
        assert [r.bytes_at(o) for o in offsets] == [page_bytes(k) for k in "abc"]
        for page in (r.index.get(NS, "b"), r.index.get(NS, "c")):
            assert (page.state, page.in_l3, page.dirty, page.leases) == (READY, True, False, 1)
        assert r.index.get(NS, "d") is None
        e = r.index.get(NS, "e")
        assert e is None or e.leases == 0  # read or skipped after the hole: never leased
        assert r.counters["load.pages"] == 3 and r.counters["load.misses"] == 1
        r.loads.release(s, lease)
        assert r.leases("a", "b", "c") == [0, 0, 0] and r.prefetcher.pending == 0


async def test_acquire_waits_for_a_page_another_fetch_is_reading(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l3("a", "b")
        fetched = r.prefetcher.fetch(NS, ["a", "b"], PAGE, priority=0)
        assert [e.state for e in fetched] == [FILLING, FILLING]
        lease, offsets = await r.loads.acquire(s, ["a", "b"], fetch=False)  # merged: waits on the read
        assert offsets == [e.offset for e in fetched] and [e.state for e in fetched] == [READY, READY]
        assert [r.bytes_at(o) for o in offsets] == [page_bytes("a"), page_bytes("b")]
        assert r.leases("a", "b") == [1, 1]
        r.loads.release(s, lease)
        assert r.leases("a", "b") == [0, 0]


async def test_leases_add_up_and_keep_pages_from_eviction(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l3("a", "b")
        one, _ = await r.loads.acquire(s, ["a", "b"], fetch=True)
        two, _ = await r.loads.acquire(s, ["a"], fetch=False)
        assert r.leases("a", "b") == [2, 1] and one != two
        assert r.index.stats()["leased"] == 2 and r.index.evictable_bytes == 0
        assert r.evict_all() == r.cfg.pool.capacity // PAGE - 2  # leased: not taken
        assert r.leases("a", "b") == [2, 1]
        r.loads.release(s, one)
        assert r.leases("a", "b") == [1, 0] and r.index.evictable_bytes == PAGE
        r.loads.release(s, two)
        assert r.leases("a", "b") == [0, 0] and r.index.evictable_bytes == 2 * PAGE


async def test_acquire_ready_and_a_lease_held_for_the_daemons_copy(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a", "b")
        assert r.loads.all_ready(s, ["a", "b"]) and not r.loads.all_ready(s, ["a", "x"])
        assert not r.loads.all_ready(s, [])
        lease, offsets = r.loads.acquire_ready(s, ["a", "b"])
        assert offsets == [r.index.get(NS, k).offset for k in "ab"] and r.leases("a", "b") == [1, 1]
        r.loads.hold_lease(s, lease)
        with pytest.raises(HicachedError):
            r.loads.release(s, lease)  # out of the engine's reach while the daemon copies
        assert r.leases("a", "b") == [1, 1]
        r.loads.release_held(s, lease)
        assert r.leases("a", "b") == [0, 0] and not s.loading


async def test_fetch_with_no_backend_attached_loads_from_l2_only(tmp_path):
    async with Rig(tmp_path, None) as r:
        s = r.session()
        r.in_l2("a")
        lease, offsets = await r.loads.acquire(s, ["a", "b"], fetch=True)
        assert len(offsets) == 1 and r.index.get(NS, "b") is None
        r.loads.release(s, lease)


async def test_each_load_marks_the_engines_busy(tmp_path):
    async with Rig(tmp_path) as r:
        s = r.session()
        r.in_l2("a")
        r.now = 3.0
        lease, _ = await r.loads.acquire(s, ["a"], fetch=False)
        assert r.activity.last == 3.0
        r.loads.release(s, lease)
        r.now = 4.0
        r.loads.acquire_ready(s, ["a"])
        assert r.activity.last == 4.0
