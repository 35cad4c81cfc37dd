"""L3Debt alone, over a real page life, backup, write policy and backend (in-memory stores): flush answers,
backends attached and detached."""

from __future__ import annotations

import pytest
from parts_rig import MemStore, Records, World, page_bytes, store

from hicached.daemon.sched.losses import L3Debt

NS = "ns"


class Rig(World):
    """L3Debt built alone; the backend tells it of attaches and detaches, as Tiers wires them."""

    def __init__(self, tmp_path, connector="mem", **storage) -> None:
        self.conn = MemStore() if connector == "mem" else connector
        self.records = Records()
        super().__init__(tmp_path, self.conn, records=self.records, **storage)
        self.debt = L3Debt(self.life, self.backend, self.backup, self.make_policy(), self.counters)
        self.backend.on_attach = self.debt.backend_attached
        self.backend.on_detach = self.debt.backend_detached

    def store(self, *keys: str) -> list:
        return [page for page, _ in store(self.life, NS, list(keys))]

    def in_l3(self) -> set[str]:
        return {k for (ns, k) in self.conn.data if ns == NS}


def answer(flushed: bool, not_in_l3: int = 0, lost: int = 0, dropped: int = 0, pending: int = 0) -> dict:
    return {
        "flushed": flushed,
        "backup_pending": pending,
        "not_in_l3": not_in_l3,
        "lost": lost,
        "dropped": dropped,
    }


async def test_flush_writes_every_owed_page_to_a_healthy_backend(tmp_path):
    async with Rig(tmp_path) as r:
        r.backup.start()
        pages = r.store("a", "b", "c")
        assert r.debt.not_in_l3() == 0  # held and not queued yet: the flush queues them
        assert await r.debt.flush(5) == answer(True)
        assert r.in_l3() == {"a", "b", "c"} and all(p.in_l3 and not p.dirty for p in pages)
        assert r.conn.data[(NS, "b")] == page_bytes("b")


async def test_flush_reports_pages_given_up_then_lost_once(tmp_path):
    async with Rig(tmp_path) as r:
        r.backup.start()
        r.conn.refuse = True  # a full disk
        r.store("a", "b")
        assert await r.debt.flush(5) == answer(False, not_in_l3=2)
        assert r.counters["backup.failed"] == 2 and r.debt.not_in_l3() == 2
        assert r.evict_all() == 16  # given up: not held in L2, so a full pool takes them
        assert r.lost == [2]
        assert await r.debt.flush(5) == answer(False, lost=2)
        assert await r.debt.flush(5) == answer(True)  # lost since the previous answer: none


async def test_flush_writes_the_pages_given_up_once_the_backend_takes_them(tmp_path):
    async with Rig(tmp_path) as r:
        r.backup.start()
        r.conn.refuse = True
        (a,) = r.store("a")
        assert await r.debt.flush(5) == answer(False, not_in_l3=1)
        r.conn.refuse = False  # a disk freed
        assert await r.debt.flush(5) == answer(True)
        assert r.in_l3() == {"a"} and a.in_l3 and a not in r.life.given_up


async def test_flush_reports_dropped_pages_that_left_l2(tmp_path):
    # A quarter of 16 slots may wait for L3: 4 pages; 2 of the 6 queued are dropped.
    async with Rig(tmp_path, max_unbacked_fraction=0.25) as r:
        pages = r.store(*[f"p{i}" for i in range(6)])
        r.backup.submit_many(pages)
        assert r.policy.backlog_full(16 * 1024) == 2
        assert r.evict_all() == 16 - 4  # the dropped pages go; the 4 still held stay
        assert r.counters["backup.dropped_gone"] == 2 and r.lost == []
        r.backup.start()
        assert await r.debt.flush(5) == answer(False, dropped=2)
        assert r.in_l3() == {f"p{i}" for i in range(2, 6)}
        assert await r.debt.flush(5) == answer(True)


async def test_flush_writes_the_dropped_pages_still_in_l2(tmp_path):
    async with Rig(tmp_path, max_unbacked_fraction=0.25) as r:
        pages = r.store(*[f"p{i}" for i in range(6)])
        r.backup.submit_many(pages)
        assert r.policy.backlog_full(16 * 1024) == 2
        r.backup.start()
        assert await r.debt.flush(5) == answer(True)
        assert r.in_l3() == {f"p{i}" for i in range(6)} and not r.life.dropped


async def test_flush_with_no_backend_attached_reports_the_stranded_pages(tmp_path):
    async with Rig(tmp_path, None) as r:
        assert not r.debt.attached.is_set()
        r.store("a", "b")
        assert await r.debt.flush(5) == answer(False, not_in_l3=2)
        assert r.evict_all() == 16 and r.lost == [2]
        assert await r.debt.flush(5) == answer(False, lost=2)
        assert await r.debt.flush(5) == answer(True)


async def test_flush_with_no_backend_configured_owes_nothing(tmp_path):
    async with Rig(tmp_path, None, backend="none") as r:
        r.store("a", "b")
        assert await r.debt.flush(5) == answer(True)
        assert r.evict_all() == 16 and r.lost == []


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_backend_attached_is_owed_the_pages_not_in_l3(tmp_path, policy):
    async with Rig(tmp_path, None, write_policy=policy) as r:
        pages = r.store("a", "b")
        assert r.life.stranded == set(pages) and not r.debt.attached.is_set()
        conn = r.conn = MemStore()
        await r.backend.attach(conn, probe=False)
        assert r.debt.attached.is_set()
        assert r.records.events[-1] == ("l3", repr(("mem", "a")))
        assert all(p.dirty for p in pages) and not r.life.stranded
        assert r.backup.pending == (2 if policy == "write_through" else 0)  # write-back: on pressure
        r.backup.start()
        assert await r.debt.flush(5) == answer(True)
        assert r.in_l3() == {"a", "b"}


@pytest.mark.parametrize("other", [False, True])
async def test_another_store_attached_takes_no_page_for_in_it(tmp_path, other):
    async with Rig(tmp_path) as r:
        r.backup.start()
        (a,) = r.store("a")
        assert await r.debt.flush(5) == answer(True) and a.in_l3
        new = MemStore("b" if other else "a")  # another store, or the same one re-attached
        await r.backend.attach(new, probe=False)
        assert a.in_l3 is (not other) and not a.dirty  # not copied into the new store: stays evictable
        assert r.backup.pending == 0
        r.conn = new
        assert r.life.stored_again(a) is True  # stored again: written again, wherever L2 believed it was
        assert r.counters["store.rewritten"] == (0 if other else 1)
        assert await r.debt.flush(5) == answer(True)
        assert r.in_l3() == {"a"} and a.in_l3


async def test_a_backend_detached_strands_the_owed_pages(tmp_path):
    async with Rig(tmp_path) as r:
        pages = r.store("a", "b")
        r.backup.submit_many(pages[:1])  # one queued, one waiting: both owed
        await r.backend.attach(None)
        assert not r.debt.attached.is_set()
        assert r.life.stranded == set(pages) and not any(p.dirty for p in pages)
        assert r.index.stats()["dirty"] == 0 and r.debt.not_in_l3() == 2
        r.backup.start()
        assert await r.backup.drain(5) and r.conn.data == {}  # nothing written with no backend
        assert r.evict_all() == 16 and r.lost == [2]
        assert await r.debt.flush(5) == answer(False, lost=2)


# Regression: a page stored again while no backend is attached is written when the backend is back (its
# object may have left L3 behind the daemon meanwhile), and a flush with no backend does not answer flushed.
async def test_a_page_stored_again_while_detached_is_written_when_the_backend_is_back(tmp_path):
    async with Rig(tmp_path) as r:
        r.backup.start()
        (a,) = r.store("a")
        assert await r.debt.flush(5) == answer(True)
        conn = r.conn
        await r.backend.attach(None)
        del conn.data[(NS, "a")]  # the object left L3 behind the daemon
        r.life.stored_again(a)  # an engine stores it again: answered present, acknowledged
        await r.backend.attach(conn, probe=False)  # the same store comes back
        await r.debt.flush(5)
        assert r.in_l3() == {"a"}  # fails: never written again; evicted, it would be lost uncounted
