"""Tiers in-process, over a real pool and the real file connector: store, load, backup with retries,
write-back pressure, prefetch merging, sessions that die holding things."""

from __future__ import annotations

import asyncio

import pytest
from hicached.connectors.base import BackendUnavailable
from hicached.connectors.file import FileConnector
from tiers_rig import PAGE, cfg_for, close_tiers, make_tiers, session, write
from waits import wait_until

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
from hicached.daemon.l2.index import READY
from hicached.daemon.sched import loads as loads_mod
from hicached.daemon.sched import tiers as tiers_mod
from hicached.daemon.sched.loads import PREFETCH_STEP
from hicached.daemon.sched.tiers import Session, Tiers


class FlakyFile(FileConnector):
    """The real file connector with faults injected in front of it: the first `fail` puts raise."""

    def __init__(self, cfg, fail: int) -> None:
        super().__init__(cfg)
        self.fail = fail

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        if self.fail > 0:
            self.fail -= 1
            raise BackendUnavailable(self.name, "injected fault", "injected")
        return await super().put(namespace, keys, payloads, checksums, hold)


async def other_store(tmp_path) -> FileConnector:
    """A started file connector on a second root, tmp_path/b (made on first use): another store."""
    (tmp_path / "b").mkdir(exist_ok=True)
    conn = FileConnector(cfg_for(tmp_path / "b"))
    await conn.start()
    return conn


async def test_store_backup_and_reload_from_l3(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"k{i}" for i in range(20)]
        assert write(t, s, keys) == [True] * 20
        assert t.alloc(s, keys[:1])[0] == [ALLOC_PRESENT]
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 20
        assert t.index.stats()["dirty"] == 0
        assert await t.exists(s, keys) == 20
        # Drop L2 by hand: a load must come back from L3 with the same bytes.
        for k in keys:
            t.index.remove(t.index.get("ns1", k))
        lease, offsets = await t.acquire(s, keys, fetch=True)
        assert len(offsets) == 20
        assert all(bytes(t.pool.view[o : o + PAGE]) == bytes([7]) * PAGE for o in offsets)
        t.release(s, lease)
        with pytest.raises(HicachedError):
            t.release(s, lease)
    finally:
        await close_tiers(t)


async def test_backup_retries_then_succeeds(tmp_path):
    cfg = cfg_for(tmp_path)
    flaky = FlakyFile(cfg, fail=2)
    t = await make_tiers(tmp_path, connector=flaky)
    try:
        s = session(t)
        write(t, s, ["a", "b"])
        assert await t.backup.drain(10)
        assert t.counters["backup.retries"] == 2 and t.counters["backup.pages"] == 2
        assert "backup.failed" not in t.counters
    finally:
        await close_tiers(t)


async def test_backup_gives_up_after_attempts_and_counts(tmp_path):
    flaky = FlakyFile(cfg_for(tmp_path), fail=100)
    t = await make_tiers(tmp_path, connector=flaky)
    try:
        s = session(t)
        write(t, s, ["a", "b", "c"])
        assert await t.backup.drain(10)
        assert t.counters["backup.failed"] == 3
        assert t.index.stats()["dirty"] == 0  # no longer held for L3: evictable again
    finally:
        await close_tiers(t)


class RefusingFile(FileConnector):
    """The real file connector on a full disk: while `full`, every page of a put is refused (as ENOSPC is),
    without the call failing."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.full = True

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        if self.full:
            return [False] * len(keys)
        return await super().put(namespace, keys, payloads, checksums, hold)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_flush_reports_pages_given_up_and_writes_them_once_the_backend_takes_them(tmp_path, policy):
    refusing = RefusingFile(cfg_for(tmp_path))
    t = await make_tiers(tmp_path, connector=refusing, write_policy=policy)
    try:
        s = session(t)
        write(t, s, ["a", "b", "c"])
        # A full disk: the flush gives the pages up after the attempts; it must not say they are in L3.
        assert not await t.flush_dirty(10)
        assert t.counters["backup.failed"] == 3 and t.not_in_l3() == 3
        # Space freed: the next flush writes the pages given up before, and says so.
        refusing.full = False
        assert await t.flush_dirty(10)
        assert t.not_in_l3() == 0 and t.counters["backup.pages"] == 3
        assert sum(1 for p in (tmp_path / "data" / "ns1").rglob("*") if p.is_file()) == 3
    finally:
        await close_tiers(t)


async def test_a_page_stored_again_after_leaving_l2_is_written_again(tmp_path):
    """Regression (#28): a page that left L2 while in L3 and whose object then left L3 behind the daemon (a
    janitor, Redis eviction, another node's clear) is written again when stored again: once acknowledged
    and never written, it was lost."""
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        write(t, s, ["x", "y"])
        await t.backup.drain(10)
        t.index._evict(t.index.size_class(PAGE), 2)  # what a full pool does
        assert await t.connector.delete("ns1", ["x", "y"]) == 2  # behind the daemon's back
        assert write(t, s, ["x", "y"]) == [True, True]
        await t.backup.drain(10)
        assert t.counters["backup.pages"] == 4
        assert await t.connector.exists("ns1", ["x", "y"]) == 2
    finally:
        await close_tiers(t)


async def test_a_ready_page_stored_again_is_owed_to_l3_again(tmp_path):
    """Regression (#28): a page in L2 believed in L3 is written again when stored again (the object may be
    gone), and held in L2 until it is: the belief is never a reason to acknowledge without the write."""
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        write(t, s, ["x"])
        await t.backup.drain(10)
        assert await t.connector.delete("ns1", ["x"]) == 1
        e = t.index.get("ns1", "x")
        assert e.in_l3 and not e.dirty
        assert t.alloc(s, ["x"])[0] == [ALLOC_PRESENT]
        assert e.dirty and not e.evictable  # held for L3 again
        await t.backup.drain(10)
        assert t.counters["store.rewritten"] == 1 and e.in_l3 and not e.dirty
        assert await t.connector.exists("ns1", ["x"]) == 1
    finally:
        await close_tiers(t)


async def test_l2_only_pool_full_of_leased_pages_says_no_space(tmp_path):
    t = await make_tiers(tmp_path, connector=None, backend="none")
    try:
        s = session(t)
        n = t.index.alloc.nslabs * (t.cfg.pool.slab_size // PAGE)
        keys = [f"p{i}" for i in range(n)]
        assert all(write(t, s, keys))
        lease, offsets = await t.acquire(s, keys, fetch=False)
        assert len(offsets) == n
        assert t.alloc(s, ["one-more"])[0] == [ALLOC_NO_SPACE]
        t.release(s, lease)
        assert t.alloc(s, ["one-more"])[0] == [ALLOC_WRITE]  # now the LRU page can go
        assert t.index.counters["evictions"] == 1
        assert t.index.get("ns1", "p0") is None
    finally:
        await close_tiers(t)


async def test_backup_queue_bound_is_back_pressure(tmp_path):
    flaky = FlakyFile(cfg_for(tmp_path), fail=1000)
    t = await make_tiers(tmp_path, connector=flaky, backup_queue_pages=4, backup_concurrency=1)
    try:
        s = session(t)
        status, _ = t.alloc(s, [f"q{i}" for i in range(10)])
        assert status.count(ALLOC_WRITE) == 4 and status.count(ALLOC_BUSY) == 6
    finally:
        await close_tiers(t)


async def test_alloc_takes_a_requests_slots_together_as_one_by_one_would(tmp_path):
    # 8 MiB of 64 KiB pages: 128 slots. Keys asked twice, pages present, a pool that runs out half-way.
    t = await make_tiers(tmp_path, connector=None, backend="none")
    try:
        s = session(t)
        assert write(t, s, ["old"]) == [True]
        status, offsets = t.alloc(s, ["a", "old", "b", "a", "b"])
        assert status == [ALLOC_WRITE, ALLOC_PRESENT, ALLOC_WRITE, ALLOC_PRESENT, ALLOC_PRESENT]
        assert offsets[1] == offsets[3] == offsets[4] == -1 and -1 < offsets[0] != offsets[2] > -1
        assert sorted(s.writing) == ["a", "b"] and all(e.leases == 1 for e in s.writing.values())
        t.commit(s, ["a", "b"])
        lease, _ = await t.acquire(s, ["old", "a", "b"], fetch=False)  # nothing left that can be evicted
        keys = [f"k{i}" for i in range(130)]
        status, offsets = t.alloc(s, [*keys, "k0", "k129"])
        assert status == [ALLOC_WRITE] * 125 + [ALLOC_NO_SPACE] * 5 + [ALLOC_PRESENT, ALLOC_NO_SPACE]
        assert offsets[125:] == [-1] * 7 and len(set(offsets[:125])) == 125
        assert t.counters["store.no_space"] == 6
        t.abort(s, keys[:125])
        t.release(s, lease)
    finally:
        await close_tiers(t)


async def test_alloc_counts_a_key_asked_twice_against_the_backup_bound_once(tmp_path):
    flaky = FlakyFile(cfg_for(tmp_path), fail=1000)
    t = await make_tiers(tmp_path, connector=flaky, backup_queue_pages=2, backup_concurrency=1)
    try:
        s = session(t)
        status, _ = t.alloc(s, ["a", "a", "b", "c", "c"])
        assert status == [ALLOC_WRITE, ALLOC_PRESENT, ALLOC_WRITE, ALLOC_BUSY, ALLOC_BUSY]
        assert t.counters["store.busy"] == 2
    finally:
        await close_tiers(t)


async def test_put_into_reserved_slots_is_back_pressured_too(tmp_path):
    flaky = FlakyFile(cfg_for(tmp_path), fail=1000)
    t = await make_tiers(tmp_path, connector=flaky, backup_queue_pages=4, backup_concurrency=1)
    try:
        s = session(t)
        offsets, _ = t.reserve(s, 6)
        assert t.put(s, [f"q{i}" for i in range(6)], offsets) == [PUT_STORED] * 4 + [PUT_BUSY] * 2
        assert sorted(s.reserved) == sorted(offsets[4:])  # refused: still this connection's
    finally:
        await close_tiers(t)


async def test_reserved_slots_are_bounded_bound_by_put_and_given_back(tmp_path, monkeypatch):
    # 8 MiB pool, pages of 64 KiB: 8 slots a connection (512 KiB), 16 over all (1/8 of the pool).
    monkeypatch.setattr(tiers_mod, "CLOSED_SLOT_QUARANTINE_S", 0.05)
    t = await make_tiers(tmp_path)
    t.cfg.pool.reserve_per_connection = 512 * 1024
    try:
        s1, s2, s3 = session(t), session(t), session(t)
        off1, limit = t.reserve(s1, 100)
        assert len(off1) == 8 and limit == 8
        assert t.reserve(s1, 100) == ([], 8)  # holds all it may
        assert len(t.reserve(s2, 100)[0]) == 8
        assert t.reserve(s3, 100)[0] == []  # the pool-wide bound
        assert t.index.stats()["reserved"] == 16 and t.index.stats()["pages"] == 0
        keys = [f"r{i}" for i in range(8)]
        for i, off in enumerate(off1):
            t.pool.view[off : off + PAGE] = bytes([i]) * PAGE
        foreign = next(iter(s2.reserved))
        for bad in ([off1[0]] * 2, off1[:1] + [-1], off1[:1] + [foreign], off1[:1], [[1], off1[0]], off1[:3]):
            with pytest.raises(HicachedError) as e:
                t.put(s1, keys[:2], bad)
            assert e.value.code == "bad_request"
        assert t.put(s1, keys[:6], off1[:6]) == [PUT_STORED] * 6
        # A key that is there already: the slot stays reserved, nothing is overwritten.
        assert t.put(s1, keys[:1] + keys[6:7], off1[6:8]) == [PUT_PRESENT, PUT_STORED]
        assert list(s1.reserved) == [off1[6]]
        lease, offsets = t.acquire_ready(s1, keys[:7])
        assert offsets == off1[:6] + off1[7:]
        assert [t.pool.view[o] for o in offsets] == [0, 1, 2, 3, 4, 5, 7]
        t.release(s1, lease)
        assert t.counters["store.pages"] == 7
        used = t.index.stats()["used_bytes"]
        t.close_session(s2)
        t.hello(s1, "ns2", PAGE * 2)  # another page size: what s1 set aside is let go
        assert s1.reserved == {} and t.index.stats()["reserved"] == 0
        # Not reused at once: a copy the engine started before it saw the close may still be landing.
        assert t.index.stats()["used_bytes"] == used
        await wait_until(
            lambda: t.index.stats()["used_bytes"] < used, timeout=30, what="the quarantined slots to be freed"
        )
        assert t.index.stats()["used_bytes"] == used - 9 * PAGE
        assert await t.backup.drain(10)  # backed up like any store
        assert await t.exists(session(t), keys) == 7
    finally:
        await close_tiers(t)


async def test_write_back_keeps_pages_dirty_until_pressure(tmp_path):
    t = await make_tiers(tmp_path, write_policy="write_back")
    try:
        s = session(t)
        n = t.index.alloc.nslabs * (t.cfg.pool.slab_size // PAGE)
        keys = [f"w{i}" for i in range(n)]
        # Filling the pool with dirty pages: pressure makes write-back write the oldest ones out.
        results = []
        for i in range(0, n, 8):
            results += write(t, s, keys[i : i + 8])
            await asyncio.sleep(0)
        # The bound is generous: CI machines are shared and slow at times.
        await wait_until(
            lambda: t.counters["backup.pages"] > 0, timeout=30, what="pressure to write pages out"
        )
        assert t.counters["backup.pages"] > 0
        assert await t.flush_dirty(10)
        assert t.index.stats()["dirty"] == 0
        assert sum(1 for p in (tmp_path / "data" / "ns1").rglob("w*") if p.is_file()) == len(keys)
    finally:
        await close_tiers(t)


async def test_concurrent_prefetches_of_one_key_are_merged(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s1, s2 = session(t), session(t)
        keys = [f"m{i}" for i in range(8)]
        write(t, s1, keys)
        await t.backup.drain(10)
        for k in keys:
            t.index.remove(t.index.get("ns1", k))
        h1 = t.prefetch(s1, keys, 0)
        h2 = t.prefetch(s2, keys, 0)
        assert await t.wait(s1, h1, 10) == 8
        assert await t.wait(s2, h2, 10) == 8
        assert t.counters["prefetch.pages"] == 8  # each page read once
        assert t.index.stats()["leased"] == 0
    finally:
        await close_tiers(t)


async def test_a_fetch_takes_its_slots_in_one_go_and_leaves_nothing_behind(tmp_path):
    # Prefetcher.fetch finds what is in L2 (leased at once), then takes the slots for the rest in one go.
    # The same key twice gets one entry; a pool that runs out cuts the call there, and what it found after
    # that point, or took and did not use, is given back; without `lease` no lease is left behind.
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        slots = t.index.alloc.nslabs * (t.cfg.pool.slab_size // PAGE)
        keys = [f"f{i}" for i in range(12)]
        write(t, s, keys)
        assert await t.backup.drain(10)
        for k in keys[4:]:
            t.index.remove(t.index.get("ns1", k))
        asked = keys[:6] + [keys[5], keys[1]] + keys[6:]  # f5 and f1 twice
        got = t.prefetcher.fetch("ns1", asked, PAGE, 0, lease=True)
        assert [e.key for e in got] == asked
        assert got[5] is got[6] and got[1] is got[7]
        assert t.prefetcher.pending == 8  # f4..f11, each read once
        await asyncio.gather(*{e.fill for e in got if e.fill is not None})
        assert all(e.state == READY for e in got)
        assert got[1].leases == 2 and got[5].leases == 2 and got[0].leases == 1  # one per place asked
        for e in got:
            t.index.unlease(e)
        assert t.index.stats()["leased"] == 0
        # Without `lease` (the warmup's way): nothing stays leased.
        more = [f"g{i}" for i in range(4)]
        write(t, s, more)
        assert await t.backup.drain(10)
        for k in more:
            t.index.remove(t.index.get("ns1", k))
        got = t.prefetcher.fetch("ns1", keys[:2] + more, PAGE, 0)
        await asyncio.gather(*{e.fill for e in got if e.fill is not None})
        assert len(got) == 6 and t.index.stats()["leased"] == 0
        # A pool with room for 2 more pages: the call stops at the third missing key. The page found
        # after it (f0) is not handed back and keeps no lease; the slots taken are all in use.
        gone = [f"x{i}" for i in range(3)]
        write(t, s, gone)  # written to L3, then out of L2 again
        assert await t.backup.drain(10)
        for k in gone:
            t.index.remove(t.index.get("ns1", k))
        held = [f"h{i}" for i in range(slots - 2 - 16)]
        write(t, s, held)
        lease, _ = await t.acquire(s, keys + more + held, fetch=False)
        assert t.index.stats()["pages"] == slots - 2
        got = t.prefetcher.fetch("ns1", [keys[1], *gone, keys[0]], PAGE, 0, lease=True)
        assert [e.key for e in got] == [keys[1], "x0", "x1"]
        assert t.prefetcher.counters["prefetch.no_space"] == 2
        await asyncio.gather(*{e.fill for e in got if e.fill is not None})
        for e in got:
            t.index.unlease(e)
        t.release(s, lease)
        assert await t.backup.drain(10)
        assert t.index.stats()["leased"] == 0 and t.index.stats()["pages"] == slots
        assert t.index.stats()["used_bytes"] == slots * PAGE
    finally:
        await close_tiers(t)


class CountingFile(FileConnector):
    """The real file connector, recording how many pages each call carried."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls: list[tuple[str, int]] = []

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        self.calls.append(("put", len(keys)))
        return await super().put(namespace, keys, payloads, checksums, hold)

    async def get_into(self, namespace, keys, buffers, hold=None):
        self.calls.append(("get", len(keys)))
        return await super().get_into(namespace, keys, buffers, hold)


@pytest.mark.parametrize(
    "storage, pages_per_call",
    [
        ({"backup_batch_pages": 5, "prefetch_batch_pages": 5}, 5),  # the page cap binds
        ({"backup_batch_bytes": 3 * PAGE, "prefetch_batch_bytes": 3 * PAGE}, 3),  # the byte cap binds
        ({"backup_batch_bytes": PAGE // 2, "prefetch_batch_bytes": PAGE // 2}, 1),  # never less than a page
    ],
)
async def test_calls_carry_at_most_batch_pages_and_batch_bytes(tmp_path, storage, pages_per_call):
    cfg = cfg_for(tmp_path, backup_concurrency=1, **storage)
    conn = CountingFile(cfg)
    await conn.start()
    t = await make_tiers(tmp_path, connector=conn, backup_concurrency=1, **storage)
    try:
        s = session(t)
        keys = [f"b{i}" for i in range(20)]
        write(t, s, keys)
        assert await t.backup.drain(10)
        for k in keys:
            t.index.remove(t.index.get("ns1", k))
        assert await t.wait(s, t.prefetch(s, keys, 0), 10) == 20
        for op in ("put", "get"):
            sizes = [n for what, n in conn.calls if what == op]
            assert sum(sizes) == 20 and max(sizes) == pages_per_call, (op, sizes)
    finally:
        await close_tiers(t)


class SlowFile(FileConnector):
    """The real file connector with each put held a little, recording how many run at once."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.running = self.most = 0

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.01)
            return await super().put(namespace, keys, payloads, checksums, hold)
        finally:
            self.running -= 1


@pytest.mark.parametrize("busy", [False, True])
async def test_write_through_backups_yield_to_busy_engines(tmp_path, busy, monkeypatch):
    storage = {"backup_concurrency": 4, "backup_concurrency_busy": 1, "backup_batch_pages": 2}
    conn = SlowFile(cfg_for(tmp_path, **storage))
    await conn.start()
    t = await make_tiers(tmp_path, connector=conn, **storage)
    if busy:
        # Engines that keep storing: their last store stays within the busy window for the whole test.
        # (A task touching the clock every millisecond was not enough on a loaded machine, where the loop
        # can be held off for longer than the 10 ms window.)
        t.activity.window_s = 3600.0
    try:
        s = session(t)
        write(t, s, [f"y{i}" for i in range(24)])  # a store: sets the clock the backups watch
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 24  # held back, never stopped
        assert conn.most == (1 if busy else 4)
    finally:
        await close_tiers(t)


async def _in_l3_only(t, s, keys) -> None:
    write(t, s, keys)
    assert await t.backup.drain(10)
    for k in keys:
        t.index.remove(t.index.get("ns1", k))


async def test_a_long_prefetch_is_placed_step_by_step(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"p{i}" for i in range(PREFETCH_STEP + 36)]
        await _in_l3_only(t, s, keys)
        handle = t.prefetch(s, keys, 0)
        assert len(s.handles[handle].entries) == PREFETCH_STEP  # the first step; the rest on later turns
        assert await t.wait(s, handle, 10) == len(keys)
        lease, offsets = t.acquire_ready(s, keys)
        assert all(bytes(t.pool.view[o : o + PAGE]) == bytes([7]) * PAGE for o in offsets)
        t.release(s, lease)
        assert t.index.stats()["leased"] == 0
    finally:
        await close_tiers(t)


@pytest.mark.parametrize("how", ["best_effort", "close"])
async def test_a_prefetch_left_while_being_placed_leaks_nothing(tmp_path, how):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"q{i}" for i in range(3 * PREFETCH_STEP // 2)]
        await _in_l3_only(t, s, keys)
        handle = t.prefetch(s, keys, 0)
        h = s.handles[handle]
        assert h.placed is not None  # the rest is placed on a later turn
        if how == "best_effort":
            assert await t.wait(s, handle, 0) <= PREFETCH_STEP  # answered at once, from what was placed
        else:
            t.close_session(s)
        # The next step runs, sees the handle gone, and stops (or, wrongly, places the rest: placing ends).
        await wait_until(h.placed.done, what="the prefetch's next step")
        await wait_until(lambda: not t.prefetcher.pending, timeout=30, what="the reads queued to end")
        assert t.index.stats()["leased"] == 0
        assert t.counters["prefetch.pages"] <= PREFETCH_STEP  # nothing placed after the handle went
    finally:
        await close_tiers(t)


async def test_closing_a_session_releases_everything(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"c{i}" for i in range(6)]
        write(t, s, keys)
        await t.backup.drain(10)
        await t.acquire(s, keys[:3], fetch=False)
        t.prefetch(s, keys, 0)
        t.alloc(s, ["pending1", "pending2"])
        assert t.index.stats()["leased"] == 6 and t.index.stats()["writing"] == 2
        t.close_session(s)
        st = t.index.stats()
        assert st["leased"] == 0 and st["writing"] == 0
        assert t.index.get("ns1", "pending1") is None
    finally:
        await close_tiers(t)


async def test_cancelled_acquire_gives_its_leases_back(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"z{i}" for i in range(4)]
        write(t, s, keys)
        await t.backup.drain(10)
        for k in keys[2:]:
            t.index.remove(t.index.get("ns1", k))
        task = asyncio.ensure_future(t.acquire(s, keys, fetch=True))
        await asyncio.sleep(0)  # it now waits on the L3 reads
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await t.prefetcher.stop()
        assert all(e.leases == 0 for e in t.index.entries.values())
    finally:
        await close_tiers(t)


async def test_pins_are_bounded_and_keep_pages(tmp_path):
    t = await make_tiers(tmp_path, connector=None, backend="none")
    try:
        s = session(t)
        keys = [f"pin{i}" for i in range(80)]
        write(t, s, keys)
        assert t.pin(s, keys[:10]) == 10
        with pytest.raises(HicachedError) as e:
            t.pin(s, keys)  # more than pool.max_pinned_fraction of the pool
        assert e.value.code == "no_space"
        for i in range(200):
            write(t, s, [f"other{i}"])
        assert all(t.index.get("ns1", k) is not None for k in keys[:10])
        assert t.unpin(s, keys) == 64  # the limit: half of 128 slots
    finally:
        await close_tiers(t)


async def test_hello_checks_page_size(tmp_path):
    t = await make_tiers(tmp_path, connector=None, backend="none")
    try:
        s = Session()
        with pytest.raises(HicachedError):
            t.hello(s, "ns", 2 * 1024 * 1024)  # larger than a slab
        t.hello(s, "ns", PAGE)
        with pytest.raises(HicachedError):
            t.hello(Session(), "ns", PAGE * 2)
    finally:
        await close_tiers(t)


async def test_wait_policies(tmp_path):
    for policy, expect_all in (("best_effort", False), ("timeout", True), ("wait_complete", True)):
        t = await make_tiers(
            tmp_path / policy, prefetch={"policy": policy, "timeout_base": "30s", "timeout_per_page": "1s"}
        )
        try:
            s = session(t)
            keys = [f"w{i}" for i in range(8)]
            write(t, s, keys)
            await t.backup.drain(10)
            for k in keys:
                t.index.remove(t.index.get("ns1", k))
            h = t.prefetch(s, keys, 0)
            n = await t.wait(s, h, None)  # the policy decides how long
            # best_effort answers at once, with what has arrived (nothing yet: the reads are in flight).
            assert n == (8 if expect_all else 0), policy
            await t.prefetcher.stop()
        finally:
            await close_tiers(t)


@pytest.mark.parametrize("how", ["prefetch", "acquire"])
async def test_placing_a_missing_page_never_evicts_one_it_hands_back(tmp_path, how: str):
    # A full pool whose least recently used page is the first one asked for: making room for the missing
    # page after it must evict another page, not the one the request is about to hold.
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        keys = [f"f{i}" for i in range(128)]  # the whole pool: 8 MiB of 64 KiB pages
        assert write(t, s, keys) == [True] * 128
        assert await t.backup.drain(10)
        for k in keys:  # backups end in any order: used in key order, f0 least recently
            t.index.touch(t.index.get("ns1", k))
        assert write(t, s, ["x"]) == [True]  # evicts f0, clean: f0 is in L3 only, f1 is the oldest in L2
        assert await t.backup.drain(10)
        assert t.index.get("ns1", "f0") is None
        asked = ["f1", "f0"]
        if how == "prefetch":
            assert await t.wait(s, t.prefetch(s, asked, 0), None) == 2
        else:
            lease, offsets = await t.acquire(s, asked, fetch=True)
            assert len(offsets) == 2
            t.release(s, lease)
        assert t.index.get("ns1", "f1") is not None and t.index.get("ns1", "f0") is not None
        assert t.index.get("ns1", "f2") is None  # the next oldest made the room
    finally:
        await close_tiers(t)


async def test_write_through_backups_wait_for_busy_engines_to_pause(tmp_path, monkeypatch):
    # storage.backup_defer: while engines are busy, a backup waits, from when its page was stored, for a
    # pause or for the bound. Here the bound is an hour: nothing is written until the engines pause.
    storage = {"backup_defer": "1h", "backup_batch_pages": 4}
    conn = SlowFile(cfg_for(tmp_path, **storage))
    await conn.start()
    t = await make_tiers(tmp_path, connector=conn, **storage)
    t.activity.window_s = 3600.0  # engines that keep storing
    try:
        s = session(t)
        write(t, s, [f"d{i}" for i in range(12)])
        assert not await t.backup.drain(0.3)
        assert t.counters["backup.pages"] == 0 and t.index.stats()["dirty"] == 12
        t.activity.window_s = 0.0  # they paused
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 12 and t.index.stats()["dirty"] == 0
        # A bound of 0: written at once, busy engines or not (backup_concurrency_busy calls at a time).
        t.activity.window_s = 3600.0
        t.cfg.storage.backup_defer = 0.0
        conn.most = 0
        write(t, s, [f"e{i}" for i in range(12)])
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 24 and conn.most == 1
    finally:
        await close_tiers(t)


async def test_deferred_backups_still_run_once_their_bound_passes(tmp_path, monkeypatch):
    storage = {"backup_defer": "200ms"}
    t = await make_tiers(tmp_path, **storage)
    t.activity.window_s = 3600.0  # engines never pause
    try:
        s = session(t)
        write(t, s, [f"b{i}" for i in range(8)])
        assert await t.backup.drain(30)
        assert t.counters["backup.pages"] == 8
    finally:
        await close_tiers(t)


async def test_dirty_pages_are_counted_as_they_change(tmp_path):
    # stats and metrics read PageIndex.dirty_pages instead of walking every entry: it must agree with the
    # walk through stores, backups, removals, a failing backend and a detach.
    def walk(t: Tiers) -> int:
        return sum(1 for e in t.index.entries.values() if e.dirty)

    for policy in ("write_through", "write_back"):
        t = await make_tiers(tmp_path / policy, write_policy=policy)
        try:
            s = session(t)
            keys = [f"d{i}" for i in range(40)]
            write(t, s, keys[:30])
            assert t.index.dirty_pages == walk(t) > 0
            t.index.remove(t.index.get("ns1", keys[0]))  # a dirty page removed
            assert t.index.dirty_pages == walk(t)
            assert await t.flush_dirty(10)
            assert t.index.dirty_pages == walk(t) == 0
            write(t, s, keys[30:])
            assert t.index.dirty_pages == walk(t) == 10
            t._detached()  # no backend: dirty pages stop holding their slots
            assert t.index.dirty_pages == walk(t) == 0
            assert t.index.stats()["dirty"] == 0
        finally:
            await close_tiers(t)


async def test_a_page_backed_up_while_an_engine_holds_it_is_no_longer_counted_dirty(tmp_path):
    # Found by the model test (tests/test_index_model.py): the backup cleared `dirty` but the count followed
    # only when the last lease went, so stats and the dirty-pages metric over-counted while a load held it.
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        assert write(t, s, ["k"]) == [True]
        assert t.index.stats()["dirty"] == 1
        lease, _ = await t.acquire(s, ["k"], fetch=False)  # leased before its backup runs
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 1 and not t.index.get("ns1", "k").dirty
        assert t.index.dirty_pages == 0 and t.index.stats()["dirty"] == 0
        t.release(s, lease)
        entry = t.index.get("ns1", "k")
        assert entry.in_lru and t.index.dirty_pages == 0  # evictable once let go
    finally:
        await close_tiers(t)


async def test_requests_taken_before_a_hello_answer_for_their_own_namespace(tmp_path):
    # Found by the model test: the server runs acquire and exists as tasks, which used to read the session's
    # namespace when they first ran: after a hello that the engine pipelined behind them, they leased pages
    # (or counted keys) of the other namespace. They now take the namespace when the request is taken.
    t = await make_tiers(tmp_path, connector=None)
    try:
        a, b = session(t, "nsA"), session(t, "nsB")
        assert write(t, a, ["k"], fill=1) == [True]
        assert write(t, b, ["k", "k2"], fill=2) == [True, True]
        acquiring = t.acquire(a, ["k"], fetch=True)  # as the server's handler makes it: not run yet
        counting = t.exists(a, ["k", "k2"])
        h = t.prefetch(a, ["k"], 0)
        t.hello(a, "nsB", PAGE)  # pipelined behind them
        lease, offsets = await acquiring
        assert offsets == [t.index.get("nsA", "k").offset]
        assert bytes(t.pool.view[offsets[0] : offsets[0] + PAGE]) == bytes([1]) * PAGE
        assert await counting == 1  # nsA has k only
        assert await t.wait(a, h, 0) == 1
        t.release(a, lease)
    finally:
        await close_tiers(t)


async def test_prefetch_steps_after_a_hello_stay_in_the_prefetchs_namespace(tmp_path, monkeypatch):
    monkeypatch.setattr(loads_mod, "PREFETCH_STEP", 1)
    t = await make_tiers(tmp_path, connector=None)
    try:
        a, b = session(t, "nsA"), session(t, "nsB")
        assert write(t, a, ["k1", "k2"]) == [True, True]
        assert write(t, b, ["k1", "k2"]) == [True, True]
        h = t.prefetch(a, ["k1", "k2"], 0)  # k2 is placed on the next turn of the loop
        t.hello(a, "nsB", PAGE)
        await asyncio.sleep(0)
        assert await t.wait(a, h, 5) == 2  # both of nsA, not k1 of nsA then k2 of nsB
        assert all(not e.leases for e in t.index.entries.values())
    finally:
        await close_tiers(t)


async def test_hello_to_another_namespace_lets_go_of_slots_being_written(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t, "nsA")
        assert t.alloc(s, ["k"])[0] == [ALLOC_WRITE]
        t.hello(s, "nsB", PAGE)  # s.writing is keyed by key alone: nsA's k must not be orphaned
        assert t.alloc(s, ["k"])[0] == [ALLOC_WRITE]
        assert t.commit(s, ["k"]) == [True]
        t.close_session(s)
        assert t.index.get("nsA", "k") is None
        other = session(t, "nsA")
        assert t.alloc(other, ["k"])[0] == [ALLOC_WRITE]  # not "present": nothing of nsA/k is stored
    finally:
        await close_tiers(t)


async def test_swap_to_another_store_forgets_what_the_old_store_held(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        write(t, s, ["x", "y"])
        assert await t.backup.drain(10)
        new = await other_store(tmp_path)
        before = t.counters["backup.pages"]
        await t.backend.attach(new, probe=False)
        assert await t.backup.drain(10)
        # A swap does not copy L2 into the new store: x and y stay clean and evictable...
        assert t.counters["backup.pages"] == before and await new.exists("ns1", ["x"]) == 0
        assert not t.index.get("ns1", "x").dirty
        # ...but they are no longer taken for pages in L3: once they leave L2, a store of them again is
        # written to the new store (before, it was acknowledged as "known in L3" and never written).
        t.index._evict(t.index.size_class(PAGE), 2)
        assert write(t, s, ["x", "y"]) == [True, True]
        assert t.counters["store.known_in_l3"] == 0
        assert await t.backup.drain(10)
        assert await new.exists("ns1", ["x", "y"]) == 2
        # The same store again (a breaker re-attach, a reload of a timeout): what L2 knows of it holds.
        t.index._evict(t.index.size_class(PAGE), 2)
        await t.backend.attach(await other_store(tmp_path), probe=False)
        assert write(t, s, ["x"]) == [True]
        assert t.counters["store.known_in_l3"] == 0  # known_in_l3 is cleared by any attach...
        assert t.index.get("ns1", "x").in_l3 is False and t.index.get("ns1", "x").dirty
        assert await t.backup.drain(10)
        write(t, s, ["z"])
        assert await t.backup.drain(10)
        before = t.counters["backup.pages"]
        await t.backend.attach(await other_store(tmp_path), probe=False)
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == before  # ...but pages in L2 known to be in it stay so
        assert t.index.get("ns1", "z").in_l3
    finally:
        await close_tiers(t)


async def test_backup_in_flight_to_a_swapped_out_store_is_written_to_the_new_one(tmp_path):
    cfg = cfg_for(tmp_path)
    gate, putting = asyncio.Event(), asyncio.Event()

    class Slow(FileConnector):
        async def put(self, namespace, keys, payloads, checksums=None, hold=None):
            putting.set()
            await gate.wait()
            return await super().put(namespace, keys, payloads, checksums, hold)

    t = await make_tiers(tmp_path, connector=Slow(cfg), backup_defer=0)
    try:
        s = session(t)
        write(t, s, ["x"])
        await wait_until(putting.is_set, what="the put to be in flight on the old store")
        new = await other_store(tmp_path)
        swap = asyncio.create_task(t.backend.attach(new, probe=False))
        await wait_until(lambda: t.connector is new, what="the swap to the new store")
        gate.set()
        await swap
        assert await t.backup.drain(10)
        assert await new.exists("ns1", ["x"]) == 1
    finally:
        await close_tiers(t)


async def test_prefetch_from_a_swapped_out_store_is_not_taken_for_in_the_new_one(tmp_path):
    gate, reading = asyncio.Event(), asyncio.Event()

    class Slow(FileConnector):
        async def get_into(self, namespace, keys, buffers, hold=None):
            reading.set()
            await gate.wait()
            return await super().get_into(namespace, keys, buffers, hold)

    t = await make_tiers(tmp_path, connector=Slow(cfg_for(tmp_path)))
    try:
        s = session(t)
        write(t, s, ["x"])
        assert await t.backup.drain(10)
        t.index.remove(t.index.get("ns1", "x"))  # in the old store only
        h = t.prefetch(s, ["x"], 0)
        await wait_until(reading.is_set, what="the read to be in flight on the old store")
        new = await other_store(tmp_path)
        swap = asyncio.create_task(t.backend.attach(new, probe=False))
        await wait_until(lambda: t.connector is new, what="the swap to the new store")
        gate.set()
        await swap
        assert await t.wait(s, h, 5) == 1  # good bytes from the old store...
        entry = t.index.get("ns1", "x")
        assert entry.state == READY and not entry.in_l3  # ...not taken for a page in the new one
    finally:
        await close_tiers(t)


async def test_a_fetch_merged_into_a_batch_after_anothers_hole_still_gets_its_page(tmp_path):
    t = await make_tiers(tmp_path, prefetch_concurrency=1, prefetch_batch_pages=1)
    try:
        s = session(t)
        write(t, s, ["y"])
        assert await t.backup.drain(10)
        t.index.remove(t.index.get("ns1", "y"))  # y is in L3 only; x is nowhere
        h = t.prefetch(s, ["x", "y"], 0)  # engine 1: its read of y is after its hole (x)
        n, _ = await t.acquire(session(t), ["y"], fetch=True)  # engine 2 merges into that read of y
        assert n == 1  # engine 2 has no hole: its page is read, not skipped
        assert await t.wait(s, h, 5) == 0  # engine 1 still gets its leading prefix: none
        assert t.counters["prefetch.skipped_after_hole"] == 0
    finally:
        await close_tiers(t)
