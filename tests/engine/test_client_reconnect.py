"""The clients reconnect by themselves (issue #19, point 4) against an in-process daemon that stops and
starts again: calls after a restart succeed on a new connection, regions keep their handles, prefetch
handles from before answer 0, a daemon that stays away costs one bounded wait."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from threaded_daemon import ThreadedDaemon, cfg

from hicached.common.errors import HicachedError
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient, Client, shared_buffer
from hicached.engine.regions import RegionBook

PAGE = 32 * 1024


@pytest.fixture
def daemon(tmp_path):
    d = ThreadedDaemon(tmp_path).start()
    yield d
    d.stop()


def test_calls_after_a_restart_reconnect_and_regions_keep_their_handles(daemon):
    sock = daemon.daemon.server.path
    keys = [f"r{i}" for i in range(8)]
    pages = [os.urandom(PAGE) for _ in keys]
    region = shared_buffer(8 * PAGE, name="reconnect-test")
    with Client(sock, "reconnect.ns", PAGE, timeout=10) as c:
        handle = c.register_region(region, PAGE)
        local = c.register_local_region(bytearray(8 * PAGE), PAGE)
        assert c.store(keys, pages) == [True] * 8
        prefetch = c.prefetch(keys)
        daemon.stop()
        daemon.start()
        assert c.exists(keys) == 0  # a fresh pool (no fd store here) and no L3: misses
        assert c.reconnects == 1
        assert c.wait(prefetch) == 0  # its prefetch went with the old connection
        assert c.store(keys, pages) == [True] * 8
        assert c.get(keys) == pages
        # The region was registered again under the same handle.
        assert c.load_pages(handle, list(range(8)), keys) == 8
        assert bytes(region.numpy()) == b"".join(pages)
        region[: 2 * PAGE] = 7
        assert c.store_pages(handle, [0, 1], ["rr0", "rr1"]) == [True, True]
        assert c.get(["rr0", "rr1"]) == [b"\x07" * PAGE] * 2
        assert c.load_pages(local, [0], keys[:1]) == 1  # local regions need nothing from the daemon
        h = c.prefetch(keys)
        assert c.wait(h) == 8  # a handle of the new connection
        c.unregister_region(handle)
        with pytest.raises(HicachedError) as e:
            c.store_pages(handle, [0], ["x"])
        assert e.value.code == "not_found"
        assert c.reconnects == 1


def test_a_region_registered_by_fd_is_registered_again_from_a_duplicate(daemon):
    sock = daemon.daemon.server.path
    fd = os.memfd_create("reconnect-fd")
    os.ftruncate(fd, 4 * PAGE)
    os.pwrite(fd, b"\x05" * PAGE, 0)
    with Client(sock, "fd.ns", PAGE, timeout=10) as c:
        handle = c.register_region(fd, PAGE)
        os.close(fd)  # the engine's own fd: the client holds a duplicate for registering again
        daemon.stop()
        daemon.start()
        assert c.store_pages(handle, [0], ["f0"]) == [True]
        assert c.get(["f0"]) == [b"\x05" * PAGE]


def test_a_daemon_that_stays_away_costs_one_bounded_wait_then_calls_fail_at_once(daemon):
    sock = daemon.daemon.server.path
    with Client(sock, "away.ns", PAGE, timeout=5, reconnect=0.6) as c:
        assert c.exists(["a"]) == 0
        daemon.stop()
        t0 = time.monotonic()
        with pytest.raises(HicachedError) as e:
            c.exists(["a"])
        waited = time.monotonic() - t0
        assert e.value.code == "connection" and "within 0.6s" in e.value.message
        assert 0.3 < waited < 2.0
        t0 = time.monotonic()
        with pytest.raises(HicachedError) as e:
            c.exists(["a"])
        assert time.monotonic() - t0 < 0.3 and "still not back" in e.value.message
        daemon.start()
        assert c.exists(["a"]) == 0 and c.reconnects == 1


def test_reconnect_zero_keeps_the_old_behaviour(daemon):
    sock = daemon.daemon.server.path
    with Client(sock, "zero.ns", PAGE, reconnect=0) as c:
        daemon.stop()
        daemon.start()
        for _ in range(2):
            with pytest.raises(HicachedError) as e:
                c.exists(["a"])
            assert e.value.code == "connection"


def test_threads_sharing_a_client_through_a_restart_see_one_reconnect(daemon):
    sock = daemon.daemon.server.path
    errors: list[BaseException] = []
    stop = threading.Event()
    done = [0] * 6
    with Client(sock, "threads.ns", PAGE, timeout=10, reconnect=20) as c:

        def worker(i: int) -> None:
            j = 0
            while not stop.is_set():
                keys = [f"t{i}-{j}-{k}" for k in range(4)]
                pages = [os.urandom(PAGE) for _ in keys]
                try:
                    ok = c.store(keys, pages)
                    got = c.get([k for k, good in zip(keys, ok, strict=True) if good])
                    assert got == [p for p, good in zip(pages, ok, strict=True) if good][: len(got)]
                    done[i] += 1
                except HicachedError as e:
                    if e.code != "draining":  # a store that reached the daemon while it stopped
                        errors.append(e)
                except BaseException as e:
                    errors.append(e)
                j += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        daemon.stop()
        daemon.start()
        before = list(done)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors[:3]
        assert all(a > b for a, b in zip(done, before, strict=True)), (before, done)
        assert c.reconnects == 1


def test_region_book_names_a_region_that_could_not_come_back():
    book = RegionBook()
    h = book.add(b"x", PAGE, None, None, gen=0, daemon=3, current_gen=0)
    assert h == 3 and book.daemon_handle(h, 0) == 3
    assert book.moved(h, 1, 7) and book.daemon_handle(h, 1) == 7
    h2 = book.add(b"y", PAGE, [[0, PAGE, PAGE]], 1, gen=1, daemon=3, current_gen=1)
    assert h2 != h and book.daemon_handle(h2, 1) == 3  # the engine's handles stay apart
    book.lose(h, "registering it again after a reconnect failed: no")
    with pytest.raises(HicachedError) as e:
        book.daemon_handle(h, 1)
    assert e.value.code == "not_found" and "register it again" in e.value.message
    assert book.daemon_handle(-1, 1) == -1  # local regions pass
    late = book.add(b"z", PAGE, None, None, gen=1, daemon=9, current_gen=2)
    with pytest.raises(HicachedError, match="restarted while it was being registered"):
        book.daemon_handle(late, 2)


async def test_async_client_reconnects_after_a_restart(tmp_path):
    c_cfg = cfg(tmp_path)
    d = Daemon(c_cfg)
    await d.startup()
    keys = [f"a{i}" for i in range(6)]
    pages = [os.urandom(PAGE) for _ in keys]
    region = shared_buffer(6 * PAGE, name="reconnect-async")
    try:
        async with AsyncClient(d.server.path, "async.rc", PAGE, timeout=10) as c:
            handle = await c.register_region(region, PAGE)
            assert await c.store(keys, pages) == [True] * 6
            h = await c.prefetch(keys)
            d.handle_signal(signal.SIGTERM)
            await d.shutdown()
            d = Daemon(c_cfg)
            await d.startup()
            # Calls at once, together: one reconnect serves them all.
            got = await asyncio.gather(c.exists(keys), c.exists(keys[:1]), c.wait(h))
            assert got == [0, 0, 0] and c.reconnects == 1
            assert await c.store(keys, pages) == [True] * 6
            assert await c.load_pages(handle, list(range(6)), keys) == 6
            assert bytes(region.numpy()) == b"".join(pages)
            # A call cancelled while the daemon is away does not cancel the reconnect for the others.
            d.handle_signal(signal.SIGTERM)
            await d.shutdown()
            first = asyncio.create_task(c.exists(keys))
            second = asyncio.create_task(c.exists(keys))
            await asyncio.sleep(0.2)
            first.cancel()
            d = Daemon(c_cfg)
            await d.startup()
            assert await second == 0 and c.reconnects == 2
            with pytest.raises(asyncio.CancelledError):
                await first
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_async_client_down_then_fails_fast(tmp_path):
    d = Daemon(cfg(tmp_path))
    await d.startup()
    c = await AsyncClient(d.server.path, "async.down", PAGE, timeout=5, reconnect=0.4).connect()
    try:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
        t0 = time.monotonic()
        with pytest.raises(HicachedError, match="within 0.4s"):
            await c.exists(["a"])
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(HicachedError, match="still not back"):
            await c.exists(["a"])
        assert time.monotonic() - t0 < 0.3
    finally:
        await c.close()
