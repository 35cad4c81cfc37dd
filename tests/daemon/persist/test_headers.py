"""Slot headers (hicached.daemon.persist.headers): the record and front codec over bytes, and the scan that
rebuilds L2 over a small in-process pool after a crash (records written by a live Tiers, keep.restore)."""

from __future__ import annotations

import os

import pytest
import tiers_rig as rig
import xxhash
from hicached.connectors.file import FileConnector
from tiers_rig import PAGE, close_tiers, session, write

from hicached.daemon.l2.pool import Pool
from hicached.daemon.persist import headers as hd
from hicached.daemon.persist import keep
from hicached.daemon.persist.headers import Headers, MetaError, Record
from hicached.daemon.sched.tiers import Tiers

KEY = "a" * 64
REC = Record("llama.bf16.p64", KEY, 65536, 3 * 65536, 65000, 2**64 - 1, 123456789, True)


# The codec.


def test_record_round_trip():
    data = hd.pack_record(REC)
    assert len(data) == hd.RECORD
    assert hd.unpack_record(data) == REC
    longest = Record("n" * 128, "k" * 128, 4096, 0, 1, 0, 0, False)
    assert hd.unpack_record(hd.pack_record(longest)) == longest


def test_empty_slot_is_none():
    assert hd.unpack_record(bytes(hd.RECORD)) is None


@pytest.mark.parametrize(
    "at", [0, 4, 6, 7, 9, 16, 24, 32, 40, 48, 60, 100, 200, 300, 320, 400, hd.RECORD - 1]
)
def test_any_changed_byte_is_refused(at):
    data = bytearray(hd.pack_record(REC))
    data[at] ^= 0x10
    with pytest.raises(MetaError):
        hd.unpack_record(data)


def test_a_record_with_a_matching_checksum_is_still_checked():
    """Bytes that hash right but say what no daemon writes (a key with a slash, a size of another slot class,
    an unknown flag) are refused too."""
    for bad in (
        Record("ns", "a/b", 4096, 0, 100, 0, 0, False),
        Record("n s", KEY, 4096, 0, 100, 0, 0, False),
        Record("ns", KEY, 8192, 0, 100, 0, 0, False),
        Record("ns", KEY, 4096, 0, 0, 0, 0, False),
    ):
        with pytest.raises(MetaError):
            hd.unpack_record(hd.pack_record(bad))
    data = bytearray(hd.pack_record(REC))
    data[6] |= 0x80
    body = bytes(data[: hd._RECORD.size])
    data[hd._RECORD.size : hd._RECORD.size + 8] = hd._RECORD_SUM.pack(xxhash.xxh3_64_intdigest(body))
    with pytest.raises(MetaError, match="flags"):
        hd.unpack_record(data)


def test_front_round_trip_and_damage():
    data = hd.pack_front(1 << 30, 4 << 20, 256, 77, 12.5, "('file', '/data')")
    front = hd.unpack_front(data)
    assert front == hd.Front(1 << 30, 4 << 20, 256, 77, 12.5, "('file', '/data')")
    assert hd.unpack_front(hd.pack_front(1, 4096, 1, 1, 0.0, None)).l3 is None
    # A location too long to record is recorded as none (pages then not taken as in L3), never cut short.
    assert hd.unpack_front(hd.pack_front(1, 4096, 1, 1, 0.0, "x" * 2000)).l3 is None
    for at in (0, 8, 20, 60, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(MetaError):
            hd.unpack_front(bad)


def test_meta_size_is_dense_per_slab():
    # A record per possible slot of a slab, whatever the page size: 512 bytes of a 4 KiB-aligned slot.
    assert hd.meta_bytes(4, 1 << 20) == hd.FRONT_BYTES + 4096 + 4 * 256 * hd.RECORD


# The scan, over a pool written by a live Tiers.


async def _tiers(tmp_path) -> tuple[Tiers, Headers]:
    """A started Tiers with no backend attached (storage.backend "file": pages are owed to it), and the
    headers of its pool, wired in."""
    cfg = rig.cfg_for(tmp_path, "8MiB")
    pool = Pool(cfg.pool.capacity, prefault=False)
    h = Headers.create(pool, cfg.pool.slab_size)
    t = Tiers(cfg, pool, None, *hd.observers([h]))
    t.start()
    return t, h


async def _crash(t: Tiers, h: Headers) -> tuple[int, int]:
    """What a SIGKILL leaves: the pool's and the headers' memfds (dup'd, as systemd's store holds them)."""
    fds = os.dup(t.pool.fd), os.dup(h.fd)
    await t.stop()
    await t.backend.close()
    h.close()
    t.pool.close()
    return fds


async def _restart(tmp_path, fds: tuple[int, int]) -> tuple[Tiers, Headers, hd.Scanned, keep.Restored]:
    cfg = rig.cfg_for(tmp_path, "8MiB")
    pool = Pool(cfg.pool.capacity, prefault=False, fd=fds[0])
    h, snap = hd.adopt([fds[1]], pool, cfg.pool.slab_size, None)
    assert snap is None and h is not None
    h.mark_adopted()
    t = Tiers(cfg, pool, None, *hd.observers([h]))
    t.start()
    scanned = h.scan()
    restored = await keep.restore(t, pool, scanned.snapshot)
    h.restored(scanned.snapshot, restored.entries)
    return t, h, scanned, restored


def _bytes(t: Tiers, ns: str, key: str) -> bytes | None:
    e = t.index.get(ns, key)
    return None if e is None else bytes(t.pool.slot(e.offset, e.size))


async def test_scan_brings_back_every_committed_page(tmp_path):
    t, h = await _tiers(tmp_path)
    s = session(t)
    keys = [f"k{i}" for i in range(20)]
    for i, k in enumerate(keys):
        assert write(t, s, [k], fill=i + 1) == [True]
    # A page reached L3 (as the backup marks it); one was removed (a clear); one slot is being written.
    e3 = t.index.get("ns1", "k3")
    e3.in_l3 = True
    h.in_l3(e3)
    t.index.remove(t.index.get("ns1", "k4"))
    status, offsets = t.alloc(s, ["writing"])
    t.pool.view[offsets[0] : offsets[0] + PAGE] = b"\x99" * PAGE
    t.close_session(s)
    fds = await _crash(t, h)
    t, h, scanned, restored = await _restart(tmp_path, fds)
    try:
        assert scanned.dropped == 0 and scanned.records == 19
        assert restored.pages == 19 and restored.dropped == 0
        for i, k in enumerate(keys):
            assert _bytes(t, "ns1", k) == (None if k == "k4" else bytes([i + 1]) * PAGE), k
        assert t.index.get("ns1", "writing") is None
        assert t.index.get("ns1", "k3").in_l3
        assert not t.index.get("ns1", "k5").in_l3
        # Owed to the configured backend (not attached yet): queued for it when it attaches.
        assert t.index.get("ns1", "k5") in t.stranded and t.index.get("ns1", "k3") not in t.stranded
        # The least recently committed first in the LRU, as before the crash.
        assert [e.key for e in t.index.lru_lists()[0]] == [k for k in keys if k != "k4"]
        # The allocator knows the slots taken: a new page gets a slot of its own.
        s = session(t)
        assert write(t, s, ["new"], fill=0xEE) == [True]
        assert _bytes(t, "ns1", "new") == b"\xee" * PAGE
        assert all(_bytes(t, "ns1", k) == bytes([i + 1]) * PAGE for i, k in enumerate(keys) if k != "k4")
    finally:
        h.close()
        await close_tiers(t)


async def test_damaged_record_or_payload_is_dropped_and_counted(tmp_path):
    t, h = await _tiers(tmp_path)
    s = session(t)
    keys = [f"k{i}" for i in range(8)]
    assert write(t, s, keys, fill=5) == [True] * 8
    e1, e2 = t.index.get("ns1", "k1"), t.index.get("ns1", "k2")
    at = h._at(e1.offset, e1.cls.slot_bytes)
    h.mm[at + 100] ^= 0x01  # the record of k1 (its key)
    t.pool.view[e2.offset + 7] ^= 0x01  # the payload of k2
    fds = await _crash(t, h)
    t, h, scanned, restored = await _restart(tmp_path, fds)
    try:
        assert scanned.dropped == 1 and restored.dropped == 1 and restored.pages == 6
        assert t.counters["keep.dropped"] == 1  # what keep.restore counts; the lifecycle adds the scan's
        assert t.index.get("ns1", "k1") is None and t.index.get("ns1", "k2") is None
        # Their records are gone: a later scan does not count them again.
        again = h.scan()
        assert again.dropped == 0 and again.records == 6
    finally:
        h.close()
        await close_tiers(t)


async def test_evicted_slot_is_never_resurrected(tmp_path):
    """A full pool evicts: the records of the pages it evicted go with them, so a scan finds only the pages
    in L2 when the daemon died, each with its own bytes."""
    t, h = await _tiers(tmp_path)
    s = session(t)
    n = 8 * 1024 * 1024 // PAGE + 40  # more than fit
    for i in range(n):
        k = f"k{i}"
        assert write(t, s, [k], fill=i % 251) == [True]
        e = t.index.get("ns1", k)
        e.in_l3 = True  # clean, so evictable (no backend here to write it)
        t.index.update(e)
        h.in_l3(e)
    live = {e.key for e in t.index.entries.values()}
    assert len(live) < n and t.index.counters["evictions"] > 0
    fds = await _crash(t, h)
    t, h, scanned, restored = await _restart(tmp_path, fds)
    try:
        assert scanned.dropped == 0 and restored.dropped == 0
        assert {e.key for e in t.index.entries.values()} == live
        for k in live:
            assert _bytes(t, "ns1", k) == bytes([int(k[1:]) % 251]) * PAGE
    finally:
        h.close()
        await close_tiers(t)


async def test_adopt_refuses_headers_of_another_pool(tmp_path):
    cfg = rig.cfg_for(tmp_path, "8MiB")
    a, b = Pool(cfg.pool.capacity, prefault=False), Pool(cfg.pool.capacity, prefault=False)
    h = Headers.create(a, cfg.pool.slab_size)
    try:
        with pytest.raises(MetaError, match="another memfd"):
            Headers.adopt(h.fd, b, cfg.pool.slab_size)
        with pytest.raises(MetaError, match="in slabs of"):
            Headers.adopt(h.fd, a, cfg.pool.slab_size // 2)
        # Without a snapshot, headers that cannot be used are a refusal; with one, the snapshot is used.
        snap = keep.Snapshot(a.size, a.size, cfg.pool.slab_size, [0] * 8, [], inode=b.inode, written=1.0)
        with pytest.raises(MetaError):
            hd.adopt([os.dup(h.fd)], b, cfg.pool.slab_size, None)
        assert hd.adopt([os.dup(h.fd)], b, cfg.pool.slab_size, snap) == (None, snap)
        with pytest.raises(MetaError, match="neither"):
            hd.adopt([], b, cfg.pool.slab_size, None)
    finally:
        h.close()
        a.close()
        b.close()


async def test_snapshot_older_than_the_headers_is_not_used(tmp_path):
    cfg = rig.cfg_for(tmp_path, "8MiB")
    pool = Pool(cfg.pool.capacity, prefault=False)
    h = Headers.create(pool, cfg.pool.slab_size)
    snap = keep.Snapshot(pool.size, pool.size, cfg.pool.slab_size, [0] * 8, [], inode=pool.inode, written=1.0)
    try:
        h.mark_adopted()  # a daemon ran on the pool after the snapshot was taken (written=1.0)
        got, used = hd.adopt([os.dup(h.fd)], pool, cfg.pool.slab_size, snap)
        assert used is None and got is not None
        got.close()
        fresh = keep.Snapshot(
            pool.size, pool.size, cfg.pool.slab_size, [0] * 8, [], inode=pool.inode, written=h.adopted + 1
        )
        got, used = hd.adopt([os.dup(h.fd)], pool, cfg.pool.slab_size, fresh)
        assert used is fresh
        got.close()
    finally:
        h.close()
        pool.close()


async def test_restore_from_a_snapshot_into_fresh_headers_writes_every_record(tmp_path):
    """A snapshot with no headers beside it (a takeover, a release before them): the pages it brings back
    get their records in the new headers, so a crash after that keeps them too."""
    t, h = await _tiers(tmp_path)
    s = session(t)
    keys = [f"k{i}" for i in range(6)]
    assert write(t, s, keys, fill=9) == [True] * 6
    t.close_session(s)
    await t.stop()
    snap = keep.take(t, t.pool, None)
    pool_fd = os.dup(t.pool.fd)
    await t.backend.close()
    h.close()
    t.pool.close()
    cfg = rig.cfg_for(tmp_path, "8MiB")
    pool = Pool(cfg.pool.capacity, prefault=False, fd=pool_fd)
    assert hd.adopt([], pool, cfg.pool.slab_size, snap) == (None, snap)
    h = Headers.create(pool, cfg.pool.slab_size)
    t = Tiers(cfg, pool, None, *hd.observers([h]))
    t.start()
    try:
        restored = await keep.restore(t, pool, snap)
        h.restored(snap, restored.entries)
        scanned = h.scan()
        assert scanned.dropped == 0
        assert sorted(p.key for p in scanned.snapshot.pages) == keys
        assert scanned.snapshot.slabs == snap.slabs
    finally:
        h.close()
        await close_tiers(t)


async def test_a_page_read_from_l3_gets_its_record_and_outlives_a_crash(tmp_path):
    # A page that came back from L3 (a prefetch, a load, the warm list) is ready in L2 as a stored one is: a
    # crash keeps it too. Regression: such pages had no record, and a crash after a warm-list refill (or a
    # planned restart that kept them) lost every one of them from L2.
    cfg = rig.cfg_for(tmp_path, "8MiB")
    conn = FileConnector(cfg)
    await conn.start()
    pool = Pool(cfg.pool.capacity, prefault=False)
    h = Headers.create(pool, cfg.pool.slab_size)
    t = Tiers(cfg, pool, conn, *hd.observers([h]))
    t.start()
    s = session(t)
    assert write(t, s, ["from-l3"], fill=0x5A) == [True]
    assert await t.backup.drain(10)
    t.index.remove(t.index.get("ns1", "from-l3"))  # evicted: in L3 only
    lease, offsets = await t.acquire(s, ["from-l3"], fetch=True)  # read back from L3
    assert len(offsets) == 1
    t.release(s, lease)
    t.close_session(s)
    fds = await _crash(t, h)
    t, h, scanned, restored = await _restart(tmp_path, fds)
    try:
        assert scanned.records == 1 and restored.pages == 1
        assert _bytes(t, "ns1", "from-l3") == b"\x5a" * PAGE
        assert t.index.get("ns1", "from-l3").in_l3
    finally:
        h.close()
        await close_tiers(t)
