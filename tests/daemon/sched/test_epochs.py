"""clear() across the nodes sharing one L3 (hicached.daemon.sched.epochs): two Tiers in one process, each
with its own pool and its own real file connector on one root, as two nodes on a shared file system.

The invariant: once clear() returned on one node, no node serves a page of the namespace stored before it
after the epoch interval plus one store call, from L2 or L3; pages stored after it are served."""

from __future__ import annotations

import asyncio
import time

import pytest
from hicached.connectors.file import FileConnector
from parts_rig import MemStore
from tiers_rig import PAGE, close_tiers, make_tiers, session, write
from waits import wait_until

from hicached.common.keys import stored_namespace, valid_stored_namespace
from hicached.daemon.sched import epochs
from hicached.daemon.sched.tiers import Tiers

KEYS = [f"k{i}" for i in range(8)]
FAST = {"epoch_interval": "50ms", "operation_timeout": "2s"}


async def load(t: Tiers, ns: str, keys: list[str]) -> list[bytes]:
    """The bytes a load of `keys` gives an engine of `t` (from L2, reading L3 first where missing)."""
    s = session(t, ns)
    lease, offsets = await t.acquire(s, keys, fetch=True)
    if not offsets:
        return []
    try:
        return [bytes(t.pool.view[o : o + PAGE]) for o in offsets]
    finally:
        t.release(s, lease)


async def two_nodes(tmp_path, **storage) -> tuple[Tiers, Tiers]:
    return await make_tiers(tmp_path, **{**FAST, **storage}), await make_tiers(
        tmp_path, **{**FAST, **storage}
    )


def test_stored_names() -> None:
    assert stored_namespace("m.1", "") == "m.1"
    name = stored_namespace("m.1", "0123456789abcdef")
    assert name == "m.1~0123456789abcdef" and valid_stored_namespace(name)
    for bad in ("m~", "m~0123", "m~0123456789ABCDEF", "~0123456789abcdef", ".trash~ab12cd34.0", "a/b"):
        assert not valid_stored_namespace(bad), bad
    assert epochs.decode(epochs.encode("0123456789abcdef", 12.5)) == ("0123456789abcdef", 12.5)
    assert epochs.decode(None) == ("", 0.0)
    for bad in (b"", b"junk", b"hicached-epoch nothex 1.0", b"hicached-epoch 0123456789abcdef"):
        assert epochs.decode(bad) is None


async def test_a_clear_on_one_node_is_seen_by_the_other(tmp_path) -> None:
    a, b = await two_nodes(tmp_path)
    try:
        sa = session(a)
        assert write(a, sa, KEYS, fill=1) == [True] * len(KEYS)
        assert await a.backup.drain(10)
        assert await load(b, "ns1", KEYS) == [bytes([1]) * PAGE] * len(KEYS)  # now in B's L2 too
        assert len(b.index.ns_entries("ns1")) == len(KEYS)

        out = await a.clear(sa)
        assert out["l2"] == len(KEYS) and out["l3"] == len(KEYS)
        # Within the epoch interval, B forgets its copies: nothing of before is served any more.
        await wait_until(lambda: not b.index.ns_entries("ns1"), what="B to forget the cleared namespace")
        assert b.counters["fleet.clears_seen"] == 1 and a.counters["fleet.clears_made"] == 1
        sb = session(b)
        assert await b.exists(sb, KEYS) == 0

        # Pages stored after the clear, on either node, are served by both, under the new epoch.
        assert write(a, sa, KEYS[:4], fill=2) == [True] * 4
        assert await a.backup.drain(10)
        assert await load(b, "ns1", KEYS[:4]) == [bytes([2]) * PAGE] * 4
        assert write(b, sb, KEYS[4:], fill=3) == [True] * 4
        assert await b.backup.drain(10)
        assert await load(a, "ns1", KEYS) == [bytes([2]) * PAGE] * 4 + [bytes([3]) * PAGE] * 4
        assert a.epochs.known("ns1") == b.epochs.known("ns1") != ""
        assert b.counters["fleet.clears_seen"] == 1  # its own stores are no clear
    finally:
        await close_tiers(a)
        await close_tiers(b)


async def test_a_write_under_the_old_epoch_is_never_read_and_is_swept(tmp_path) -> None:
    a, b = await two_nodes(tmp_path, operation_timeout="300ms")
    try:
        sa = session(a)
        assert write(a, sa, KEYS, fill=1) == [True] * len(KEYS)
        assert await a.backup.drain(10)
        old = await b.epochs.stored("ns1")
        await a.clear(sa)
        # A write of B's still in flight under the old name lands after the clear (or one of a node that
        # has not read the new epoch yet): no node reads it.
        stray = b.connector
        assert await stray.put(old, KEYS[:2], [memoryview(bytes([9]) * PAGE)] * 2) == [True, True]
        await wait_until(lambda: b.counters["fleet.clears_seen"] == 1, what="B to see the clear")
        for t in (a, b):
            assert await t.exists(session(t), KEYS) == 0
            assert await load(t, "ns1", KEYS[:2]) == []
        # The clearing node deletes the old name again once every node has seen the clear.
        await wait_until(lambda: a.counters["clear.swept_objects"] == 2, what="the second pass")
        assert await stray.exists(old, KEYS[:2]) == 0
    finally:
        await close_tiers(a)
        await close_tiers(b)


async def test_pages_a_node_had_before_its_first_read_of_a_younger_clear_are_forgotten(tmp_path) -> None:
    # B holds pages in L2 alone (write-back: no L3 call yet, so no epoch read) when A clears: B's first
    # read of the epoch finds a clear younger than its first use of the namespace.
    a = await make_tiers(tmp_path, **FAST)
    b = await make_tiers(tmp_path, **FAST, write_policy="write_back")
    try:
        sb = session(b)
        assert write(b, sb, KEYS, fill=4) == [True] * len(KEYS)
        assert b.epochs.known("ns1") is None
        await a.clear(session(a))
        await wait_until(lambda: not b.index.ns_entries("ns1"), what="B to forget its older pages")
        assert b.counters["fleet.clears_seen"] == 1
        # A node whose first use is younger than the clear (by more than the clocks' skew: the clear is
        # recorded as made a minute ago) keeps what it stores.
        epoch = a.epochs.known("ns1")
        await a.connector.write_mark(epochs.mark_name("ns1"), epochs.encode(epoch, time.time() - 60))
        c = await make_tiers(tmp_path, **FAST, write_policy="write_back")
        try:
            assert write(c, session(c), KEYS, fill=5) == [True] * len(KEYS)
            await wait_until(lambda: c.epochs.known("ns1") is not None, what="C to read the epoch")
            assert c.counters["fleet.clears_seen"] == 0 and len(c.index.ns_entries("ns1")) == len(KEYS)
        finally:
            await close_tiers(c)
    finally:
        await close_tiers(a)
        await close_tiers(b)


async def test_a_page_held_when_the_clear_is_seen_goes_when_let_go_and_is_never_written(tmp_path) -> None:
    a = await make_tiers(tmp_path, **FAST)
    b = await make_tiers(tmp_path, **FAST, write_policy="write_back")
    try:
        sb = session(b)
        assert write(b, sb, KEYS, fill=6) == [True] * len(KEYS)
        lease, _ = await b.acquire(sb, KEYS[:1], fetch=False)  # an engine copying one page out
        await a.clear(session(a))
        await wait_until(lambda: list(b.index.ns_entries("ns1")) == KEYS[:1], what="the idle pages to go")
        assert not b.index.ns_entries("ns1")["k0"].dirty  # owed to L3 no more: never under the new epoch
        b.release(sb, lease)
        await wait_until(lambda: not b.index.ns_entries("ns1"), what="the held page to go")
        assert await b.flush_dirty(5)
        assert await a.exists(session(a), KEYS) == 0 and b.counters["backup.lost"] == 0
    finally:
        await close_tiers(a)
        await close_tiers(b)


async def test_two_clears_at_once_settle_on_one_epoch(tmp_path) -> None:
    a, b = await two_nodes(tmp_path)
    try:
        sa, sb = session(a), session(b)
        assert write(a, sa, KEYS, fill=1) == [True] * len(KEYS)
        assert await a.backup.drain(10)
        await asyncio.gather(a.clear(sa), b.clear(sb))
        await wait_until(lambda: a.epochs.known("ns1") == b.epochs.known("ns1"), what="one epoch")
        assert await a.exists(sa, KEYS) == 0 and await b.exists(sb, KEYS) == 0
        assert write(a, sa, KEYS[:2], fill=7) == [True] * 2
        assert await a.backup.drain(10)
        assert await load(b, "ns1", KEYS[:2]) == [bytes([7]) * PAGE] * 2
    finally:
        await close_tiers(a)
        await close_tiers(b)


async def test_an_unreadable_mark_is_no_clear(tmp_path) -> None:
    a, b = await two_nodes(tmp_path)
    try:
        sb = session(b)
        assert write(b, sb, KEYS, fill=1) == [True] * len(KEYS)
        assert await b.backup.drain(10)
        assert isinstance(a.connector, FileConnector)
        await a.connector.write_mark(epochs.mark_name("ns1"), b"not an epoch")
        await wait_until(lambda: b.counters["fleet.epoch_unreadable"] >= 2, what="B to read it")
        assert b.counters["fleet.clears_seen"] == 0 and len(b.index.ns_entries("ns1")) == len(KEYS)
    finally:
        await close_tiers(a)
        await close_tiers(b)


class NoMarks(MemStore):
    """A store that can clear a namespace but keeps no marks (Connector's defaults)."""

    async def clear_namespace(self, namespace: str) -> int:
        gone = [k for k in self.data if k[0] == namespace]
        for k in gone:
            del self.data[k]
        return len(gone)


@pytest.mark.parametrize("why", ["no marks", "interval 0"])
async def test_clears_stay_on_the_node_where_no_epochs_are_kept(tmp_path, why) -> None:
    if why == "no marks":
        t = await make_tiers(tmp_path, connector=NoMarks(), **FAST)
    else:
        t = await make_tiers(tmp_path, epoch_interval="0s")
    try:
        s = session(t)
        assert write(t, s, KEYS, fill=1) == [True] * len(KEYS)
        assert await t.backup.drain(10)
        assert await t.epochs.stored("ns1") == "ns1"
        out = await t.clear(s)
        assert out["l2"] == len(KEYS) and out.get("error") is None
        assert await t.epochs.stored("ns1") == "ns1" and t.counters["fleet.clears_made"] == 0
        assert await t.exists(s, KEYS) == 0
        assert write(t, s, KEYS[:2], fill=2) == [True] * 2
        assert await t.backup.drain(10)
        assert await t.connector.exists("ns1", KEYS[:2]) == 2  # under the plain name, as before fleets
    finally:
        await close_tiers(t)
