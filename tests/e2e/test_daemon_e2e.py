"""The real daemon as a subprocess, with the file backend: stores, loads, restarts, corruption, bad
frames, leases of dead clients, refused uids, write-back on shutdown, eviction and L3 reads."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading

import msgpack
import pytest
from hicached.connectors import file as file_module

from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.common.keys import page_keys
from hicached.engine.client import AsyncClient, Client

PAGE = 64 * 1024


def make_pages(seed: int, n: int, size: int = PAGE) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * 16 + list(range(n * 16)), 16)[1:]


def page_file(d, ns: str, key: str) -> str:
    return os.path.join(d.workdir, "data", ns, key[:2], key[2:4], key)


def store_all(c: Client, keys: list[str], pages: list[bytes], batch: int = 20) -> None:
    for i in range(0, len(keys), batch):
        assert all(c.store(keys[i : i + batch], pages[i : i + batch]))


def test_two_namespaces_store_and_load_concurrently(daemon):
    # Same keys in both namespaces, different bytes: namespaces must keep them apart.
    keys = keys_for(1, 200)
    data = {"model-a.p16": make_pages(1, 200), "model-b.p16": make_pages(2, 200)}
    errors: list[BaseException] = []

    def engine(ns: str) -> None:
        try:
            with Client(daemon.socket, ns, PAGE) as c:
                store_all(c, keys, data[ns])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=engine, args=(ns,)) for ns in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for ns, pages in data.items():
        with Client(daemon.socket, ns, PAGE) as c:
            assert c.exists(keys) == 200
            bufs = [bytearray(PAGE) for _ in keys]
            assert c.load(keys, bufs) == 200
            assert [bytes(b) for b in bufs] == pages
            assert c.get(keys[:5]) == pages[:5]


def test_restart_finds_pages_in_l3_with_identical_bytes(daemon):
    keys, pages = keys_for(3, 200), make_pages(3, 200)
    with Client(daemon.socket, "restart.ns", PAGE) as c:
        store_all(c, keys, pages)
    assert daemon.ctl("flush")["flushed"] is True
    daemon.restart()
    with Client(daemon.socket, "restart.ns", PAGE) as c:
        assert c.stats()["pool"]["pages"] == 0  # L2 is new: everything comes from L3
        assert c.exists(keys) == 200
        bufs = [bytearray(PAGE) for _ in keys]
        assert c.load(keys, bufs) == 200
        assert [bytes(b) for b in bufs] == pages
        assert c.stats()["counters"]["prefetch.pages"] == 200


@pytest.mark.parametrize("where", ["payload", "header", "truncate"])
def test_corrupt_file_is_a_miss_never_wrong_bytes(daemon, where):
    keys, pages = keys_for(4, 10), make_pages(4, 10)
    with Client(daemon.socket, "corrupt.ns", PAGE) as c:
        store_all(c, keys, pages)
    daemon.ctl("flush")
    daemon.stop()
    path = page_file(daemon, "corrupt.ns", keys[4])
    with open(path, "r+b") as f:
        if where == "truncate":
            f.truncate(os.path.getsize(path) - 1)
        else:
            pos = 40 + PAGE // 2 if where == "payload" else 20
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x01]))
    daemon.start()
    with Client(daemon.socket, "corrupt.ns", PAGE) as c:
        bufs = [bytearray(PAGE) for _ in keys]
        assert c.load(keys, bufs) == 4  # the corrupt page ends the prefix
        assert [bytes(b) for b in bufs[:4]] == pages[:4]
        assert c.get(keys) == pages[:4]
        assert not os.path.exists(path), "a corrupt page is removed"
        assert c.exists(keys) == 4
        stats = c.stats()
        assert sum(v for k, v in stats["backend_counters"].items() if k.startswith("corrupt.")) == 1
        # The daemon ran the C page I/O wherever it is built (CI builds it): that path caught the flip.
        assert stats["backend_info"]["page_io"] == ("c" if file_module._pageio is not None else "python")
        # The engine stores the page again: it is whole again.
        assert c.store(keys[4:5], pages[4:5]) == [True]
        assert c.get(keys[:6]) == pages[:6]


def _raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    data, fds, _, _ = socket.recv_fds(s, 65536, 4)
    for fd in fds:
        os.close(fd)
    assert data
    return s


def _answer_or_close(s: socket.socket) -> dict | None:
    """The next answer on a raw connection, or None if the daemon closed it."""
    dec = protocol.FrameDecoder(1 << 20)
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return None
        if not data:
            return None
        msgs = dec.feed(data)
        if msgs:
            return msgs[0]


BAD_FRAMES = {
    "random bytes": os.urandom(300),
    "huge length": struct.pack(">I", 0xFFFFFFF0) + b"x" * 16,
    "not msgpack": struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1",
    "not a map": protocol.encode([1, 2, 3]),  # type: ignore[arg-type]
    "no id": protocol.encode({"op": "exists", "keys": []}),
    "bool id": protocol.encode({"id": True, "op": "status"}),
    "unknown op": protocol.encode({"id": 5, "op": "format_disk"}),
    "keys not a list": protocol.encode({"id": 6, "op": "exists", "keys": "abc"}),
    "exists before hello": protocol.encode({"id": 7, "op": "exists", "keys": ["a"]}),
    "bad namespace": protocol.encode({"id": 8, "op": "hello", "namespace": "../etc", "page_bytes": 4096}),
    "huge page": protocol.encode({"id": 9, "op": "hello", "namespace": "x", "page_bytes": 1 << 40}),
}


def test_bad_frames_get_an_error_or_a_closed_connection(daemon):
    keys, pages = keys_for(5, 20), make_pages(5, 20)
    with Client(daemon.socket, "good.ns", PAGE) as good:
        store_all(good, keys, pages)
        for name, frame in BAD_FRAMES.items():
            s = _raw_connect(daemon.socket)
            try:
                s.sendall(frame)
                answer = _answer_or_close(s)
            finally:
                s.close()
            if answer is not None:
                assert answer["error"]["code"] == "bad_request", (name, answer)
            assert good.get(keys) == pages, name
        # A truncated frame, then the peer goes away mid-frame.
        s = _raw_connect(daemon.socket)
        s.sendall(protocol.encode({"id": 1, "op": "status"})[:7])
        s.close()
        # Garbage after a good request: the good one is answered, then the connection closes.
        s = _raw_connect(daemon.socket)
        s.sendall(protocol.encode({"id": 1, "op": "status"}) + struct.pack(">I", 0xFFFFFFFF))
        first = _answer_or_close(s)
        s.close()
        assert first is not None and first["id"] == 1 and "pid" in first
        assert good.exists(keys) == 20
        assert good.store(keys_for(6, 3), make_pages(6, 3)) == [True] * 3
    assert daemon.alive


def test_client_errors_carry_codes(daemon):
    with Client(daemon.socket, "codes.ns", PAGE) as c:
        with pytest.raises(HicachedError) as e:
            c.store(["k1"], [b"short"])
        assert e.value.code == "bad_request"
        with pytest.raises(HicachedError) as e:
            c.wait(12345)
        assert e.value.code == "not_found"
        with pytest.raises(HicachedError) as e:
            c.exists(["bad/key"])
        assert e.value.code == "bad_request"
    with pytest.raises(HicachedError) as e:
        Client(daemon.socket, "codes.ns", PAGE * 2)  # a namespace has one page size
    assert e.value.code == "bad_request"


def test_disconnect_releases_everything_it_held(daemon):
    keys, pages = keys_for(7, 30), make_pages(7, 30)
    with Client(daemon.socket, "lease.ns", PAGE) as c:
        store_all(c, keys, pages)
    daemon.ctl("flush")  # backups in flight hold leases of their own
    s = _raw_connect(daemon.socket)
    reqs = [
        {"id": 1, "op": "hello", "namespace": "lease.ns", "page_bytes": PAGE},
        {"id": 2, "op": "acquire", "keys": keys[:10]},
        {"id": 3, "op": "prefetch", "keys": keys[10:20]},
        {"id": 4, "op": "alloc", "keys": keys_for(8, 5)},
        {"id": 5, "op": "reserve", "n": 3},
    ]
    s.sendall(b"".join(protocol.encode(r) for r in reqs))
    seen: dict[int, dict] = {}
    dec = protocol.FrameDecoder(1 << 20)
    while len(seen) < len(reqs):
        for m in dec.feed(s.recv(65536)):
            seen[m["id"]] = m
    assert len(seen[2]["offsets"]) == 10
    assert seen[4]["status"] == [protocol.ALLOC_WRITE] * 5
    assert len(seen[5]["offsets"]) == 3
    with Client(daemon.socket, "lease.ns", PAGE) as c:
        pool = c.stats()["pool"]
        # The slots being written are under no key until committed: counted in writing, not leased.
        assert pool["leased"] == 20 and pool["writing"] == 5 and pool["reserved"] == 3
        s.close()  # the engine dies holding read leases, a prefetch handle, slots it was writing and some
        for _ in range(1500):  # set aside for its next stores
            pool = c.stats()["pool"]
            if pool["leased"] == 0:
                break
            threading.Event().wait(0.02)
        assert pool["leased"] == 0 and pool["writing"] == 0 and pool["reserved"] == 0
        assert c.exists(keys_for(8, 5)) == 0  # the uncommitted pages are gone
        assert c.get(keys) == pages


def test_the_operator_is_admitted_whatever_allowed_uids_says(daemon_factory):
    # allowed_uids names the engines; root and the daemon's own uid are operators, never locked out (a peer in
    # no list is refused: tests/e2e/test_roles_e2e.py, with a process of another uid).
    d = daemon_factory({"server": {"allowed_uids": [4242], "allowed_gids": [4242]}})
    assert os.getuid() in (0, os.geteuid()) and os.getuid() != 4242
    with Client(d.socket, "x.ns", PAGE) as c:
        assert c.store(["k0"], [bytes(PAGE)]) == [True]
    assert d.ctl("status")["backend_state"] == "attached"
    assert d.alive


def test_socket_mode_and_stale_socket(daemon_factory):
    d = daemon_factory({"server": {"socket_mode": "0600"}}, start=False)
    os.makedirs(os.path.dirname(d.socket), exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.socket)  # a socket file nobody listens on, as a crashed daemon leaves it
    stale.close()
    d.start()
    assert os.stat(d.socket).st_mode & 0o777 == 0o600
    # A second daemon on the same socket takes over only through the first one's takeover endpoint (tested in
    # test_takeover_e2e); where the first has none (a release without it), it refuses to start instead of
    # stealing the socket.
    os.unlink(d.socket + ".takeover")
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--config", d.config_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "another daemon is listening" in out.stderr
    assert d.alive and d.ctl("status")["socket"] == d.socket


def test_a_pool_larger_than_the_memory_left_is_refused_at_start(daemon_factory):
    # 64 TiB prefaulted would have the kernel kill a process (likely an engine) to make room: the daemon
    # refuses to start instead, before it allocates anything, and says what to change.
    d = daemon_factory({"pool": {"capacity": "64TiB", "prefault": True, "memory_wait": "1s"}}, start=False)
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--config", d.config_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "pool.capacity is 64.0TiB but only" in out.stderr and "lower pool.capacity" in out.stderr
    assert "waiting up to 1s for memory" in out.stderr and "(waited 1s, pool.memory_wait)" in out.stderr
    assert not os.path.exists(d.socket)


def test_write_back_reaches_l3_on_shutdown(daemon_factory):
    d = daemon_factory({"storage": {"write_policy": "write_back"}})
    keys, pages = keys_for(9, 40), make_pages(9, 40)
    with Client(d.socket, "wb.ns", PAGE) as c:
        store_all(c, keys, pages)
        assert c.stats()["pool"]["dirty"] == 40  # write-back: nothing written yet
    assert not os.path.exists(page_file(d, "wb.ns", keys[0]))
    assert d.stop(signal.SIGTERM) == 0
    d.start()
    with Client(d.socket, "wb.ns", PAGE) as c:
        assert c.get(keys) == pages


def test_eviction_brings_pages_back_from_l3(daemon_factory):
    # 16 MiB of pool for 64 MiB of pages: most must be evicted after their backup, and read back from L3.
    # when_backlog_full = "refuse": a store is answered False while L3 is behind, so that every page
    # acknowledged reaches L3 (the default, drop_oldest, lets the oldest go to keep taking new ones).
    d = daemon_factory(
        {"pool": {"capacity": "16MiB", "slab_size": "2MiB"}, "storage": {"when_backlog_full": "refuse"}}
    )
    page = 256 * 1024
    keys, pages = keys_for(10, 256), make_pages(10, 256, page)
    with Client(d.socket, "evict.ns", page) as c:
        for i in range(0, 256, 16):
            ok = c.store(keys[i : i + 16], pages[i : i + 16])
            while not all(ok):  # no_space/busy while backups catch up: the engine retries
                d.ctl("flush")
                ok = c.store(keys[i : i + 16], pages[i : i + 16])
        d.ctl("flush")
        stats = c.stats()
        assert stats["pool"]["evictions"] > 0
        assert c.exists(keys) == 256
        for i in range(0, 256, 32):
            assert c.get(keys[i : i + 32]) == pages[i : i + 32]


def test_prefetch_and_wait_policies(daemon_factory):
    d = daemon_factory({"storage": {"prefetch": {"policy": "wait_complete"}}})
    keys, pages = keys_for(11, 50), make_pages(11, 50)
    with Client(d.socket, "pf.ns", PAGE) as c:
        store_all(c, keys, pages)
    d.ctl("flush")
    d.restart()
    with Client(d.socket, "pf.ns", PAGE) as c:
        missing = keys_for(12, 3)
        h = c.prefetch(keys[:30] + missing[:1] + keys[31:])
        assert c.wait(h) == 30  # leading prefix: the hole at 30 ends it
        assert c.stats()["pool"]["leased"] == 0
        h = c.prefetch(keys, priority=5)
        assert c.wait(h, timeout=20) == 50
        assert c.get(keys) == pages
        assert c.pin(keys[:10]) == 10
        assert c.stats()["pool"]["pinned"] == 10
        assert c.unpin(keys[:10]) == 10


def test_ctl_status_and_stats(daemon):
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", daemon.socket, "--json", "stats"],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(out.stdout)
    assert stats["backend"] == "file" and "pool" in stats
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", daemon.socket, "status"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "backend: file" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", daemon.socket + ".nope", "status"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "no hicached daemon" in out.stderr


def test_ctl_flush_that_did_not_finish_exits_1(daemon_factory):
    # Regression: `ctl flush` (and `ctl drain`) answered flushed: false with exit status 0, so a script
    # that flushes before taking the node down went on with pages not in L3.
    d = daemon_factory({"storage": {"write_policy": "write_back"}, "shutdown": {"flush_timeout": "1ms"}})
    keys, pages = keys_for(17, 200), make_pages(17, 200)
    with Client(d.socket, "flush.ns", PAGE) as c:
        store_all(c, keys, pages)
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", d.socket, "--json", "flush"],
        capture_output=True,
        text=True,
    )
    assert json.loads(out.stdout)["flushed"] is False and out.returncode == 1


def test_msgpack_answers_are_small():
    # Page bytes never travel on the socket: an alloc answer for 64 keys is offsets only.
    ans = {"id": 1, "status": [0] * 64, "offsets": [1 << 30] * 64}
    assert len(msgpack.packb(ans)) < 1024


def test_second_signal_does_not_interrupt_the_final_flush(daemon_factory):
    # Regression: handlers were removed before shutdown, so a second Ctrl-C (or `timeout` forwarding one)
    # raised KeyboardInterrupt in the middle of writing pages to L3.
    d = daemon_factory({"storage": {"write_policy": "write_back"}, "warmup": {"enabled": True}})
    keys, pages = keys_for(13, 60), make_pages(13, 60)
    with Client(d.socket, "sig.ns", PAGE) as c:
        store_all(c, keys, pages)
    d.proc.send_signal(signal.SIGINT)
    d.proc.send_signal(signal.SIGINT)
    d.proc.send_signal(signal.SIGTERM)
    assert d.stop() == 0
    assert "Traceback" not in d.log() and "still finishing" in d.log()
    d.start()
    with Client(d.socket, "sig.ns", PAGE) as c:
        assert c.get(keys) == pages


def test_a_stored_page_is_visible_at_once_to_other_connections(daemon):
    # Regression: a commit sent without waiting for its answer let store() return before the daemon had
    # the page, so an engine on another connection could miss a page another had just stored (seen when
    # the writer closed its connection right after storing).
    with Client(daemon.socket, "rw.ns", PAGE) as reader:
        for i in range(60):
            keys = keys_for(100 + i, 20)
            with Client(daemon.socket, "rw.ns", PAGE) as writer:
                assert all(writer.store(keys, make_pages(i, 20)))
            assert reader.exists(keys) == 20, f"round {i}"


def _pool_mappings() -> int:
    """This process's mappings of a daemon's pool."""
    with open("/proc/self/maps") as f:
        return sum("memfd:hicached-l2" in line for line in f)


def test_a_client_lets_go_of_the_pool_once_the_daemon_is_gone(daemon):
    # A restarted daemon allocates a new pool; the old one's memory stays allocated for as long as an
    # engine maps it (pool.memory_wait). A blocking client lets go at the end of the call that finds the
    # connection dead, without waiting for close().
    before = _pool_mappings()  # others this process may still hold (an earlier test's)
    c = Client(daemon.socket, "gone.ns", PAGE)
    try:
        assert c.store(["k"], [os.urandom(PAGE)]) == [True]
        assert _pool_mappings() == before + 1
        daemon.stop()
        with pytest.raises(HicachedError) as e:
            c.exists(["k"])
        assert e.value.code == "connection"
        assert _pool_mappings() == before
        with pytest.raises(HicachedError):
            c.store(["k2"], [os.urandom(PAGE)])  # nothing is copied into a mapping that is gone
    finally:
        c.close()


async def test_an_async_client_lets_go_of_the_pool_when_the_connection_drops(daemon):
    before = _pool_mappings()  # others this process may still hold (an earlier test's)
    async with AsyncClient(daemon.socket, "gone.ns", PAGE) as c:
        assert await c.store(["k"], [os.urandom(PAGE)]) == [True]
        assert _pool_mappings() == before + 1
        await asyncio.get_running_loop().run_in_executor(None, daemon.stop)
        for _ in range(500):  # the loop sees the connection close: no call needed
            if _pool_mappings() == before:
                break
            await asyncio.sleep(0.01)
        assert _pool_mappings() == before
        with pytest.raises(HicachedError) as e:
            await c.store(["k2"], [os.urandom(PAGE)])
        assert e.value.code == "connection"
