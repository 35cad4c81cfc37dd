"""A planned restart keeps L2 (issue #19, first increment): the daemon as a subprocess under a stand-in for
systemd's notify socket and file-descriptor store; what it stores at stop comes back at the next start."""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import time

import pytest
from churn import page_of
from systemd_notify import NotifySocket
from systemd_unit import SystemdDaemon

from hicached.daemon.persist import keep
from hicached.engine.client import Client, control

PAGE = 32 * 1024
SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")


def _stop(d: SystemdDaemon) -> None:
    assert d.stop() == 0, d.log()
    d.store.drain(0.2)
    assert sorted(d.store.names()) == sorted(keep.FDNAMES), d.log()


def _stored(store: NotifySocket, name: str) -> int:
    return next(fd for n, fd in store.stored if n == name)


def _snapshot(store: NotifySocket) -> keep.Snapshot:
    return keep.decode(keep.read_fd(_stored(store, keep.INDEX_FDNAME)))


def _loads(d: SystemdDaemon, tmp_path, seconds: float) -> list[tuple[subprocess.Popen, str, str]]:
    """Four engines storing and loading until they have reconnected once (the restart) and stored again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}
    env.pop("NOTIFY_SOCKET", None)
    procs = []
    for i in range(4):
        ns, out = f"keep.e{i}", str(tmp_path / f"load{i}.jsonl")
        argv = [
            sys.executable,
            "-m",
            "steady_load",
            d.socket,
            ns,
            str(PAGE),
            str(seconds),
            out,
            "0.05",
            "4",
            "1",
        ]
        procs.append((subprocess.Popen(argv, env=env), ns, out))
    return procs


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_restart_under_load_keeps_every_acknowledged_page(systemd, tmp_path, policy):
    """Four engine processes store and load while the daemon restarts: every page acknowledged is a hit
    after it, from L2 (not refilled from L3: the warm list is off), with the bytes it was stored with; under
    write-back nothing is lost."""
    d = systemd({"storage": {"write_policy": policy}})
    procs = _loads(d, tmp_path, seconds=15.0)
    # Restart once every engine has stored a while (they start slowly on a busy machine), not at a fixed time.
    deadline = time.monotonic() + 60
    while True:
        stats = d.ctl("stats")
        if len(stats["namespaces"]) == 4 and stats["counters"].get("store.pages", 0) >= 160:
            break
        assert time.monotonic() < deadline, stats["counters"]
        time.sleep(0.1)
    _stop(d)
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
        # The restart was under load: each engine's client dialled the daemon again by itself, and went on.
        assert calls[-1] == {"op": "end", "reconnects": 1}, calls[-3:]
        assert not [c for c in calls if c.get("error") not in (None, "draining")], calls
    assert wrong == 0
    assert sum(map(len, acked.values())) >= 160
    log = d.log()
    assert "L2 kept over the restart" in log and "0 did not verify" in log, log
    for ns, keys in acked.items():
        with Client(d.socket, ns, PAGE) as c:
            got = c.get(keys)
            assert len(got) == len(keys), f"{ns}: {len(got)} of {len(keys)} acknowledged pages are hits"
            assert all(g == page_of(k, PAGE) for g, k in zip(got, keys, strict=True))
    stats = d.ctl("stats")
    assert stats["pool"].get("evictions", 0) == 0
    # Every hit came from L2: nothing was read back from L3 after the restart.
    assert stats["counters"].get("prefetch.pages", 0) == 0, stats["counters"]
    assert stats["counters"]["keep.pages"] > 0
    flushed = d.ctl("flush")
    assert flushed["flushed"] and flushed["lost"] == 0, flushed
    _stop(d)


def test_kept_pool_of_another_capacity_is_refused(systemd, tmp_path):
    """A restart that changed pool.capacity: one log line says why, the kept pool is dropped from the store
    (which then holds the fresh pool and its slot headers), the daemon starts on a fresh pool and the warm
    list refills it from L3."""
    d = systemd({"warmup": {"enabled": True}})
    keys = [f"k{i}" for i in range(32)]
    with Client(d.socket, "keep.cap", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    _stop(d)
    d.config["pool"]["capacity"] = "64MiB"
    d.write_config()
    d.start()
    log = d.log()
    assert (
        "kept over the restart is not used: the kept pool holds 128.0MiB but pool.capacity is 64.0MiB" in log
    )
    d.store.drain(0.3)
    assert sorted(d.store.names()) == sorted([keep.POOL_FDNAME, keep.META_FDNAME])
    assert os.fstat(_stored(d.store, keep.POOL_FDNAME)).st_size == 64 << 20, "the refused pool was dropped"
    with Client(d.socket, "keep.cap", PAGE) as c:
        got = c.get(keys)
    assert got == [page_of(k, PAGE) for k in keys]
    _stop(d)


def test_damaged_snapshot_is_a_fresh_pool(systemd):
    """A snapshot whose bytes were changed is refused whole (its checksum): misses, never other bytes."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(16)]
    with Client(d.socket, "keep.dmg", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    _stop(d)
    data = bytearray(keep.read_fd(_stored(d.store, keep.INDEX_FDNAME)))
    data[len(data) // 2] ^= 0xFF
    d.store.remove(keep.INDEX_FDNAME)
    fd = os.memfd_create("damaged")
    os.write(fd, data)
    d.store.stored.append((keep.INDEX_FDNAME, fd))
    d.start()
    assert "checksum does not match its bytes" in d.log()
    with Client(d.socket, "keep.dmg", PAGE) as c:
        assert c.get(keys) == []
    _stop(d)


def test_changed_payload_in_the_kept_pool_is_a_miss(systemd):
    """A page whose bytes changed in the kept memfd while the daemon was away does not verify: dropped and
    counted, a miss; every other page is a hit."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(16)]
    with Client(d.socket, "keep.pay", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    _stop(d)
    snap = _snapshot(d.store)
    victim = next(p for p in snap.pages if p.key == "k5")
    pool_fd = _stored(d.store, keep.POOL_FDNAME)
    with mmap.mmap(pool_fd, snap.pool_bytes) as mm:
        mm[victim.offset + 100] ^= 0x01
    d.start()
    assert "15 pages served again" in d.log() and "1 did not verify" in d.log(), d.log()
    with Client(d.socket, "keep.pay", PAGE) as c:
        assert c.get(keys[:5]) == [page_of(k, PAGE) for k in keys[:5]]
        assert c.get(["k5"]) == []
        assert c.get(keys[6:]) == [page_of(k, PAGE) for k in keys[6:]]
        assert c.stats()["counters"]["keep.dropped"] == 1
    _stop(d)


def test_restarts_in_a_row_and_a_crash(systemd):
    """Kept over two restarts in a row, and over a crash (SIGKILL): the pool and its slot headers stay in the
    store while the daemon runs (the snapshot was dropped at start), and the index is rebuilt from them."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(8)]
    with Client(d.socket, "keep.row", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    for _ in range(2):
        _stop(d)
        d.start()
        with Client(d.socket, "keep.row", PAGE) as c:
            assert c.get(keys) == [page_of(k, PAGE) for k in keys]
    d.store.drain(0.3)
    assert sorted(d.store.names()) == sorted([keep.POOL_FDNAME, keep.META_FDNAME])
    d.stop(sig=9)
    d.start()
    assert "index was rebuilt from 8 slot headers" in d.log(), d.log()
    with Client(d.socket, "keep.row", PAGE) as c:
        assert c.get(keys) == [page_of(k, PAGE) for k in keys]
    _stop(d)


def test_activated_socket_and_kept_pool_together(systemd, tmp_path):
    """Socket activation and the fd store at once, told apart by LISTEN_FDNAMES: the socket is served, the
    pool is adopted."""
    d = systemd({"storage": {"backend": "none"}})
    keys = [f"k{i}" for i in range(8)]
    with Client(d.socket, "keep.act", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    _stop(d)
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    d.sockets = [("hicached.socket", listener.fileno())]
    d.socket = path
    try:
        d.start()
    finally:
        listener.close()
    assert "8 pages served again" in d.log(), d.log()
    assert control(path, "status")["socket"] == path
    with Client(path, "keep.act", PAGE) as c:
        assert c.get(keys) == [page_of(k, PAGE) for k in keys]
    _stop(d)
