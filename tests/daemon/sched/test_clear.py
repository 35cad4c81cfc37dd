"""Tiers.clear in-process, over a real pool and the real file connector: a namespace forgotten in L2 and
L3 and no other, pages owed to L3 dropped without counting as lost, pages held waited for, and a read from
L3 that overlaps the clear turned into a miss."""

from __future__ import annotations

import asyncio
import inspect

from hicached.connectors.file import FileConnector
from tiers_rig import PAGE, cfg_for, close_tiers, make_tiers, session, write
from waits import wait_until

from hicached.daemon.sched.tiers import Tiers

KEYS = [f"k{i}" for i in range(12)]


async def in_l3(t: Tiers, ns: str, keys: list[str]) -> list[bool]:
    """Under the namespace's name in L3 now (its clear epoch: hicached.daemon.sched.epochs)."""
    return await t.connector.present(await t.epochs.stored(ns), keys)


async def test_a_clear_forgets_its_namespace_in_l2_and_l3_and_no_other(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        a, b = session(t, "ns1"), session(t, "ns2")
        assert write(t, a, KEYS, fill=1) == [True] * 12
        assert write(t, b, KEYS, fill=2) == [True] * 12
        assert await t.backup.drain(10)
        t.pin(a, KEYS[:2])
        assert await t.clear(a) == {"l2": 12, "busy": 0, "l3": 12}
        assert t.index.ns_entries("ns1") == {} and t.pinned_bytes == 0
        assert await t.exists(a, KEYS) == 0 and not any(await in_l3(t, "ns1", KEYS))
        # The other namespace, same keys: untouched in both tiers.
        assert await t.exists(b, KEYS) == 12 and all(await in_l3(t, "ns2", KEYS))
        lease, offsets = await t.acquire(b, KEYS, fetch=True)
        assert all(bytes(t.pool.view[o : o + PAGE]) == bytes([2]) * PAGE for o in offsets)
        t.release(b, lease)
        # Nothing was lost (the engine asked for the pages to go), and the namespace takes pages again.
        assert t.counters["backup.lost"] == 0 and t.counters["clear.l2_pages"] == 12
        assert write(t, a, KEYS[:3], fill=3) == [True] * 3
        assert await t.backup.drain(10)
        assert await in_l3(t, "ns1", KEYS[:4]) == [True, True, True, False]
    finally:
        await close_tiers(t)


async def test_pages_owed_to_l3_are_dropped_not_lost_and_never_written(tmp_path):
    t = await make_tiers(tmp_path, write_policy="write_back")
    try:
        s = session(t)
        write(t, s, KEYS)
        assert t.index.dirty_pages == 12
        assert (await t.clear(s))["l2"] == 12
        assert t.index.dirty_pages == 0 and not t.index.dirty
        assert await t.flush_dirty(10)
        assert t.counters["backup.lost"] == 0 and t.counters["backup.pages"] == 0
        assert not any(await in_l3(t, "ns1", KEYS))
    finally:
        await close_tiers(t)


async def test_a_page_being_loaded_goes_once_its_lease_ends(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s, reader = session(t), session(t)
        write(t, s, KEYS, fill=5)
        assert await t.backup.drain(10)
        lease, offsets = await t.acquire(reader, KEYS[:1], fetch=False)
        clearing = asyncio.create_task(t.clear(s))
        # The others go at once; the leased one stays, bytes intact, while the engine copies it.
        await wait_until(lambda: list(t.index.ns_entries("ns1")) == KEYS[:1], what="the others to go")
        assert not clearing.done()
        assert bytes(t.pool.view[offsets[0] : offsets[0] + PAGE]) == bytes([5]) * PAGE
        t.release(reader, lease)
        assert await asyncio.wait_for(clearing, 5) == {"l2": 12, "busy": 0, "l3": 12}
        assert t.index.ns_entries("ns1") == {}
    finally:
        await close_tiers(t)


async def test_a_page_held_past_the_request_timeout_is_reported_busy_and_stays(tmp_path):
    t = await make_tiers(tmp_path)
    t.cfg.server.request_timeout = 0.2
    try:
        s = session(t)
        write(t, s, KEYS)
        assert await t.backup.drain(10)
        lease, _ = await t.acquire(s, KEYS[:2], fetch=False)
        assert await t.clear(s) == {"l2": 10, "busy": 2, "l3": 12}
        assert sorted(t.index.ns_entries("ns1")) == sorted(KEYS[:2])  # still the engine's
        t.release(s, lease)
    finally:
        await close_tiers(t)


class GatedFile(FileConnector):
    """The real file connector whose reads wait for `gate` once it is armed."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.gate: asyncio.Event | None = None
        self.reading = asyncio.Event()

    async def get_into(self, namespace, keys, buffers, hold=None):
        got = await super().get_into(namespace, keys, buffers, hold)
        if self.gate is not None:
            self.reading.set()
            await self.gate.wait()
        return got


async def test_a_read_from_l3_that_overlaps_a_clear_is_a_miss(tmp_path):
    conn = GatedFile(cfg_for(tmp_path))
    t = await make_tiers(tmp_path, connector=conn)
    try:
        s = session(t)
        write(t, s, KEYS)
        assert await t.backup.drain(10)
        for k in KEYS:  # out of L2, in L3: a load reads them back
            t.index.remove(t.index.get("ns1", k))
        conn.gate = asyncio.Event()
        loading = asyncio.create_task(t.acquire(s, KEYS, fetch=True))
        await asyncio.wait_for(conn.reading.wait(), 5)  # the bytes are read: the old pages
        clearing = asyncio.create_task(t.clear(s))
        # Under way (waiting for the pages being read) before the read ends: the two overlap.
        await wait_until(
            lambda: inspect.getcoroutinestate(clearing.get_coro()) != inspect.CORO_CREATED,
            what="the clear to start",
        )
        conn.gate.set()
        assert await asyncio.wait_for(loading, 5) == (0, [])  # dropped: read before the clear deleted them
        assert (await asyncio.wait_for(clearing, 5))["l3"] == 12
        assert t.index.ns_entries("ns1") == {} and t.counters["prefetch.cleared"] == 12
        assert await t.exists(s, KEYS) == 0
    finally:
        await close_tiers(t)
