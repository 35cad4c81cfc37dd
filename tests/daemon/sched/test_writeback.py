"""WritePolicy alone, over a real page index, backup and backend (an in-memory store), on a test's clock."""

from __future__ import annotations

import asyncio
import collections
import logging

import pytest
from parts_rig import PAGE, SLAB, MemStore, World, small_cfg, store
from waits import wait_until

from hicached.common.retry import Backoff
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.pool import Pool
from hicached.daemon.l2.slabs import SlabAllocator
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.reports import EveryMinute
from hicached.daemon.sched.writeback import WritePolicy

NS = "ns"
HALF = 128 * 1024  # each arena of the tenants' pool: 8 slots of PAGE


def writeback_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "writeback" and not t.done()]


class Rig(World):
    """A WritePolicy built alone over the world's collaborators (the world asks it as Tiers does)."""

    def __init__(self, tmp_path, connector="mem", **storage) -> None:
        self.conn = MemStore() if connector == "mem" else connector
        super().__init__(tmp_path, self.conn, **storage)
        dropped = EveryMinute(self.counters, "backup.dropped", logging.WARNING)
        self.policy = WritePolicy(self.cfg, self.index, self.backup, self.backend, self.activity, dropped)

    def store(self, *keys: str) -> list:
        return [page for page, _ in store(self.life, NS, list(keys))]


class Tenants:
    """A WritePolicy over a pool of two arenas (tenants' pools of HALF each): namespaces "t.*" live in the
    second."""

    def __init__(self, tmp_path, **storage) -> None:
        self.cfg = small_cfg(tmp_path, 2 * HALF, **storage)
        self.pool = Pool(2 * HALF, prefault=False)
        self.counters: collections.Counter[str] = collections.Counter()
        allocs = [SlabAllocator(HALF, SLAB, 0, 0), SlabAllocator(HALF, SLAB, HALF, 1)]
        self.life = PageLife(
            allocs,
            self.pool,
            self.counters,
            attached=lambda: True,
            configured=lambda: True,
            lost=lambda n: None,
            arena_of=lambda ns: 1 if ns.startswith("t.") else 0,
        )
        self.index = self.life.index
        self.backend = Backend(self.cfg, self.counters)
        self.backend.current = MemStore()
        st = self.cfg.storage
        self.backup = Backup(
            self.life, self.pool, self.backend, self.counters, 1, 64, 1 << 20, 1000, Backoff()
        )
        dropped = EveryMinute(self.counters, "backup.dropped", logging.WARNING)
        self.policy = WritePolicy(self.cfg, self.index, self.backup, self.backend, EngineActivity(), dropped)
        assert st.max_unbacked_fraction == 0.5

    def queued(self, ns: str, *keys: str) -> list:
        pages = [page for page, _ in store(self.life, ns, list(keys))]
        self.backup.submit_many(pages)
        return pages


def test_the_backlog_is_bounded_per_arena(tmp_path):
    t = Tenants(tmp_path, max_unbacked_fraction=0.5)
    try:
        assert t.policy.backlog_limit() == HALF  # half of the whole pool
        assert t.policy.backlog_limit(0) == t.policy.backlog_limit(1) == HALF / 2
        assert t.policy.backlog_room("x", PAGE) == t.policy.backlog_room("t.x", PAGE) == 4
        assert t.policy.backlog_room("x", 20000) == 3  # slots of 20 KiB
        t.queued("t.a", "a0", "a1", "a2")
        assert t.policy.backlog_room("t.x", PAGE) == 1 and t.policy.backlog_room("x", PAGE) == 4
        # Past its bound, one arena's oldest queued pages stop being held; the other arena's stay.
        other = t.queued("b", "b0", "b1")
        mine = t.queued("t.a", "a3", "a4", "a5")
        assert t.policy.backlog_full(PAGE, arena=1) == 2
        assert {e.key for e in t.life.dropped} == {"a0", "a1"}
        assert all(e.dirty for e in other + mine) and t.index.arena_dirty == [2 * PAGE, 4 * PAGE]
        assert t.counters["backup.dropped"] == 2 and t.backup.pending == 6
    finally:
        t.pool.close()


async def test_backlog_full_drops_the_oldest_queued_pages_down_to_the_bound(tmp_path):
    # A quarter of 16 slots may wait for L3: 4 pages.
    async with Rig(tmp_path, max_unbacked_fraction=0.25) as r:
        pages = r.store(*[f"p{i}" for i in range(6)])
        r.backup.submit_many(pages)
        assert r.policy.backlog_full(PAGE) == 2
        assert r.life.dropped == set(pages[:2]) and all(p.dirty for p in pages[2:])
        assert r.index.dirty_bytes == 4 * PAGE and r.backup.pending == 4
        assert r.counters["backup.dropped"] == 2
        assert r.policy.backlog_full(PAGE) == 0  # within the bound now
        assert r.counters["backup.dropped"] == 2


@pytest.mark.parametrize(
    "storage", [{"write_policy": "write_back"}, {"when_backlog_full": "refuse"}], ids=["write_back", "refuse"]
)
async def test_backlog_full_drops_nothing_but_under_write_through_drop_oldest(tmp_path, storage):
    async with Rig(tmp_path, max_unbacked_fraction=0.25, **storage) as r:
        pages = r.store(*[f"p{i}" for i in range(6)])
        r.backup.submit_many(pages)  # as a flush queues them under write-back
        assert r.policy.backlog_full(PAGE) == 0
        assert not r.life.dropped and r.index.dirty_bytes == 6 * PAGE and r.counters["backup.dropped"] == 0


async def test_a_full_pool_drops_the_oldest_waiting_pages_to_take_new_ones(tmp_path):
    async with Rig(tmp_path, max_unbacked_fraction=0.25) as r:
        r.make_policy()  # the index's shortage asks it, as in Tiers
        pages = r.store(*[f"p{i}" for i in range(16)])
        r.backup.submit_many(pages)
        assert r.life.start_writes(NS, ["new"], PAGE) != []
        assert r.counters["backup.dropped"] == 12  # down to the bound: 4 pages still held
        assert r.index.get(NS, "p0") is None and r.counters["backup.dropped_gone"] == 1
        assert r.lost == [] and all(p.dirty for p in pages[12:])


async def test_calls_allowed_and_defer_follow_the_engines_activity(tmp_path):
    async with Rig(tmp_path, backup_concurrency_busy=2, backup_defer="100ms") as r:
        assert (r.policy.calls_allowed(), r.policy.defer()) == (0, 0.0)  # no engine yet
        r.now = 10.0
        r.activity.touch()
        assert (r.policy.calls_allowed(), r.policy.defer()) == (2, 0.1)
        r.now = 10.0 + 2 * r.activity.window_s
        assert (r.policy.calls_allowed(), r.policy.defer()) == (0, 0.0)  # they paused
        r.activity.touch()
        r.store(*[f"p{i}" for i in range(5)])  # more than half of what may wait for L3 (8 pages)
        assert (r.policy.calls_allowed(), r.policy.defer()) == (2, 0.0)


async def test_write_back_writes_are_never_held_for_the_engines(tmp_path):
    async with Rig(tmp_path, write_policy="write_back", backup_concurrency_busy=2) as r:
        r.activity.touch()
        assert r.activity.busy()
        assert (r.policy.calls_allowed(), r.policy.defer()) == (0, 0.0)


async def test_the_write_back_loop_writes_on_pressure_and_stops_on_stop(tmp_path):
    async with Rig(tmp_path, write_policy="write_back") as r:
        r.backup.start()
        r.policy.start()
        assert len(writeback_tasks()) == 1
        r.store("a", "b")
        r.policy.stored()
        assert not r.policy.pressure.is_set()  # plenty free: pages wait in L2
        pages = r.store(*[f"p{i}" for i in range(14)])  # the pool is full now
        assert r.index.stats()["dirty"] == 16 and r.conn.puts == 0
        r.policy.stored()
        assert r.policy.pressure.is_set()
        await wait_until(lambda: r.index.stats()["dirty"] == 0)
        assert all(p.in_l3 for p in pages) and len(r.conn.data) == 16
        assert r.index.evictable_bytes == 16 * PAGE
        await r.policy.stop()
        assert writeback_tasks() == []
        r.evict_all()
        r.store("late")
        r.policy.short()
        assert r.index.stats()["dirty"] == 1 and r.backup.pending == 0  # nobody writes it now


async def test_write_through_sets_no_pressure(tmp_path):
    async with Rig(tmp_path) as r:
        r.policy.start()
        assert writeback_tasks() == []
        r.store(*[f"p{i}" for i in range(16)])
        r.policy.stored()
        r.policy.short()
        assert not r.policy.pressure.is_set()


async def test_a_switch_to_write_through_queues_the_pages_waiting_in_l2(tmp_path):
    async with Rig(tmp_path, write_policy="write_back") as r:
        r.policy.start()
        pages = r.store("a", "b")
        assert r.backup.pending == 0
        r.cfg.storage.write_policy = "write_through"
        r.policy.set_policy(was_write_back=True)
        assert r.backup.pending == 2 and all(p.queued for p in pages)
        await wait_until(lambda: not writeback_tasks())
        r.cfg.storage.write_policy = "write_back"
        r.policy.set_policy(was_write_back=False)
        assert len(writeback_tasks()) == 1
