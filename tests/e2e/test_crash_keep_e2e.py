"""A crash keeps L2 (issue #19, point 2): the daemon as a subprocess under a stand-in for systemd's notify
socket and fd store, killed with SIGKILL; the next start gets the pool and its slot headers back and rebuilds
its index from them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from churn import page_of
from systemd_notify import NotifySocket
from systemd_unit import SystemdDaemon

from hicached.daemon.l2.pool import Pool
from hicached.daemon.l2.slabs import slot_size
from hicached.daemon.persist import headers as hd
from hicached.daemon.persist import keep
from hicached.engine.client import Client

PAGE = 32 * 1024
SLAB = 4 << 20  # daemon_proc's pool.slab_size
SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")


def _crash(d: SystemdDaemon) -> None:
    """SIGKILL: its pool and slot headers stay stored."""
    d.crash()
    assert sorted(d.store.names()) == sorted([keep.POOL_FDNAME, keep.META_FDNAME]), d.store.names()


def _stored(store: NotifySocket, name: str) -> int:
    return next(fd for n, fd in store.stored if n == name)


def _store(d: SystemdDaemon, ns: str, keys: list[str]) -> None:
    with Client(d.socket, ns, PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)


def _loads(d: SystemdDaemon, tmp_path) -> list[tuple[subprocess.Popen, str, str]]:
    """Four engines storing and loading until they have reconnected once (the crash) and stored again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}
    env.pop("NOTIFY_SOCKET", None)
    procs = []
    for i in range(4):
        ns, out = f"crash.e{i}", str(tmp_path / f"load{i}.jsonl")
        argv = [sys.executable, "-m", "steady_load", d.socket, ns, str(PAGE), "30", out, "0.05", "4", "1"]
        procs.append((subprocess.Popen(argv, env=env), ns, out))
    return procs


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_sigkill_under_load_keeps_every_acknowledged_page(systemd, tmp_path, policy):
    """Four engine processes store and load while the daemon is killed with SIGKILL and started again with the
    stored fds: 0 wrong bytes, every page acknowledged (before and after the kill) is a hit from L2; under
    write-back the pages owed to L3 come back owed and a flush writes them: none lost."""
    d = systemd({"storage": {"write_policy": policy}})
    procs = _loads(d, tmp_path)
    deadline = time.monotonic() + 60
    while True:  # kill once every engine has stored a while (they start slowly on a busy machine)
        stats = d.ctl("stats")
        if len(stats["namespaces"]) == 4 and stats["counters"].get("store.pages", 0) >= 160:
            break
        assert time.monotonic() < deadline, stats["counters"]
        time.sleep(0.1)
    before = d.ctl("stats")["counters"]
    _crash(d)
    d.start()
    for p, _, _ in procs:
        assert p.wait(120) == 0
    acked: dict[str, list[str]] = {}
    wrong = 0
    for _, ns, out in procs:
        with open(out) as f:
            calls = [json.loads(line) for line in f]
        acked[ns] = [k for c in calls if c["op"] == "store" for k in c.get("keys", [])]
        wrong += sum(c.get("wrong", 0) for c in calls)
        assert calls[-1] == {"op": "end", "reconnects": 1}, calls[-3:]
        # A call in flight when the daemon died may fail with connection (not acknowledged); nothing else.
        assert not [c for c in calls if c.get("error") not in (None, "connection", "draining")], calls
    assert wrong == 0
    assert sum(map(len, acked.values())) >= before["store.pages"] >= 160
    log = d.log()
    assert "index was rebuilt from" in log and "0 of them did not check" in log, log
    assert "0 did not verify" in log, log
    owed = int(re.search(r"(\d+) are owed to L3 and queued for it", log).group(1))
    if policy == "write_back":
        assert owed > 0, log  # acknowledged, not in L3 yet when the daemon died: they came back owed
    for ns, keys in acked.items():
        with Client(d.socket, ns, PAGE) as c:
            got = c.get(keys)
            assert len(got) == len(keys), f"{ns}: {len(got)} of {len(keys)} acknowledged pages are hits"
            assert all(g == page_of(k, PAGE) for g, k in zip(got, keys, strict=True))
    stats = d.ctl("stats")
    assert stats["pool"].get("evictions", 0) == 0
    assert stats["counters"].get("prefetch.pages", 0) == 0, stats["counters"]  # every hit from L2
    assert stats["counters"]["keep.pages"] > 0 and stats["counters"].get("keep.dropped", 0) == 0
    assert stats["counters"]["backup.lost"] == 0
    flushed = d.ctl("flush")
    assert flushed["flushed"] and flushed["lost"] == 0 and flushed["not_in_l3"] == 0, flushed
    if policy == "write_back":
        # They reached L3: a fresh pool (nothing kept) finds every one of them there.
        assert d.stop() == 0, d.log()
        d.store.drain(0.2)
        for name in keep.FDNAMES:
            d.store.remove(name)
        d.start()
        for ns, keys in acked.items():
            with Client(d.socket, ns, PAGE) as c:
                got = c.get(keys)
                assert got == [page_of(k, PAGE) for k in keys], f"{ns}: {len(got)} of {len(keys)} from L3"
    assert d.stop() == 0, d.log()


def _records(store: NotifySocket) -> tuple[Pool, hd.Headers, dict[str, keep.KeptPage]]:
    """The kept pool and its slot headers as the stand-in holds them, mapped here, and the pages they
    describe by key."""
    pool_fd, meta_fd = _stored(store, keep.POOL_FDNAME), _stored(store, keep.META_FDNAME)
    pool = Pool(os.fstat(pool_fd).st_size, prefault=False, fd=os.dup(pool_fd))
    h = hd.Headers.adopt(os.dup(meta_fd), pool, SLAB)
    return pool, h, {p.key: p for p in h.scan().snapshot.pages}


def test_damaged_record_or_payload_is_a_miss(systemd):
    """After a crash, a slot whose header was damaged (bytes changed in the meta memfd) or whose payload
    changed in the pool is a miss, never other bytes, and counted (keep.dropped); the others are hits."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(16)]
    _store(d, "crash.dmg", keys)
    _crash(d)
    pool, h, pages = _records(d.store)
    try:
        rec = pages["k1"]
        at = h._at(rec.offset, slot_size(rec.size))
        h.mm[at + 100] ^= 0x01  # a byte of k1's record
        pool.view[pages["k2"].offset + 100] ^= 0x01  # a byte of k2's payload
    finally:
        h.close()
        pool.close()
    d.start()
    log = d.log()
    assert "index was rebuilt from 16 slot headers" in log and "1 of them did not check" in log, log
    assert "14 pages served again" in log and "2 did not verify" in log, log
    with Client(d.socket, "crash.dmg", PAGE) as c:
        assert c.get(keys[:1]) == [page_of("k0", PAGE)]
        assert c.get(["k1"]) == [] and c.get(["k2"]) == []
        assert c.get(keys[3:]) == [page_of(k, PAGE) for k in keys[3:]]
        assert c.stats()["counters"]["keep.dropped"] == 2
    assert d.stop() == 0, d.log()


def test_crash_with_a_pool_of_another_capacity_is_refused(systemd):
    """A crash, then a start with another pool.capacity: one log line says why, the kept fds are dropped from
    the store, and the daemon serves from a fresh pool (misses; no L3 here)."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(8)]
    _store(d, "crash.cap", keys)
    _crash(d)
    d.config["pool"]["capacity"] = "64MiB"
    d.write_config()
    d.start()
    assert (
        "kept over the restart is not used: the kept pool holds 128.0MiB but pool.capacity is 64.0MiB"
        in d.log()
    ), d.log()
    d.store.drain(0.3)
    assert os.fstat(_stored(d.store, keep.POOL_FDNAME)).st_size == 64 << 20
    with Client(d.socket, "crash.cap", PAGE) as c:
        assert c.get(keys) == []
    assert d.stop() == 0, d.log()


def test_a_snapshot_older_than_the_headers_is_not_used(systemd):
    """A planned restart hands a snapshot, which the next instance uses (no scan) and drops from the store.
    Should that drop not reach systemd before the instance dies (its notification read after its death), the
    start after the crash gets a snapshot older than the pool: it rebuilds from the slot headers instead,
    and the pages stored after the snapshot are hits too."""
    d = systemd({"storage": {"backend": "none"}})
    first = [f"a{i}" for i in range(8)]
    _store(d, "crash.old", first)
    assert d.stop() == 0, d.log()
    d.store.drain(0.2)
    stale = os.dup(_stored(d.store, keep.INDEX_FDNAME))
    d.start()
    log = d.log()
    assert "8 pages served again" in log and "rebuilt from" not in log, log
    later = [f"b{i}" for i in range(8)]
    _store(d, "crash.old", later)
    _crash(d)
    d.store.stored.append((keep.INDEX_FDNAME, stale))
    d.start()
    assert "older than its slot headers" in d.log() and "rebuilt from 16 slot headers" in d.log(), d.log()
    with Client(d.socket, "crash.old", PAGE) as c:
        assert c.get(first + later) == [page_of(k, PAGE) for k in first + later]
    assert d.stop() == 0, d.log()
