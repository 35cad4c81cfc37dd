"""Fenced region copies against the real daemon (a subprocess): a load_pages or store_pages whose answer
times out while the daemon still copies does not return before no copy of it touches the engine's memory
(a late copy would write rows the engine reuses, or store bytes it wrote since under the old keys); a
daemon stopped mid-copy (SIGSTOP) holds the call until it continues or dies; a copy job queued behind
others is skipped once cancelled, and counted; requests without fences still work, and a hostile board
only skips or runs the engine's own copies.

Regression tests for the late copy after a client time-out (the engine got wrong KV)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import numpy as np
import pytest
from mid_copy import COUNT, board_count, stop_mid_copy

from hicached.common import fence
from hicached.common.errors import HicachedError
from hicached.common.keys import page_keys
from hicached.engine import regions as engine_regions
from hicached.engine.client import AsyncClient, Client, shared_buffer

pytestmark = pytest.mark.skipif(not fence.AVAILABLE, reason="hicached.common._pageio is not built")

PAGE = 1 << 20
N = 384  # 384 MiB a request: tens of milliseconds of copying, against a client time-out of 5 ms
MARK = 0xAB
NEW = 0xEE
SAMPLE = 64 << 10  # a byte every 64 KiB: a snapshot taken in microseconds, right as the call returns


def config(copy_threads: int = 2) -> dict:
    return {"pool": {"capacity": "1GiB", "slab_size": "4MiB"}, "regions": {"copy_threads": copy_threads}}


def keys_for(seed: int, n: int = N) -> list[str]:
    return page_keys([seed] * 16 + list(range(n * 16)), 16)[1:]


def page_values(n: int = N, seed: int = 0) -> np.ndarray:
    """The byte each page of the original pattern is filled with (never MARK nor NEW)."""
    v = (np.arange(n) * 7 + seed) % 200 + 1
    return v.astype(np.uint8)


def fill_pages(arr: np.ndarray, values: np.ndarray) -> None:
    arr.reshape(len(values), PAGE)[:] = values[:, None]


def wait_settled(arr: np.ndarray, seconds: float = 1.0) -> None:
    """Fails if any byte of `arr` changes over `seconds` (first a sample, then the whole of it)."""
    first = arr[::SAMPLE].copy()
    whole = arr.copy()
    time.sleep(seconds)
    assert np.array_equal(arr[::SAMPLE], first), "the region changed after the call returned (a late copy)"
    assert np.array_equal(arr, whole), "the region changed after the call returned (a late copy)"


def stored(c: Client, keys: list[str]) -> dict[int, bytes]:
    """The pages L2 or L3 holds of `keys`, by index."""
    out = {}
    for i, present in enumerate(c.present(keys)):
        if present:
            got = c.get([keys[i]])
            if got:
                out[i] = got[0]
    return out


@pytest.fixture
def big(daemon_factory):
    return daemon_factory(config())


def prepared(d, seed: int) -> tuple[Client, int, np.ndarray, list[str]]:
    """A client with N pages of `seed` in L2, and a destination region of N rows filled with MARK."""
    keys = keys_for(seed)
    src = shared_buffer(N * PAGE, name="fence-src")
    fill_pages(src.numpy(), page_values(seed=seed))
    dst = shared_buffer(N * PAGE, name="fence-dst")
    dst.numpy()[:] = MARK
    c = Client(d.socket, "fence.ns", PAGE, timeout=60)
    hs = c.register_region(src, PAGE)
    assert c.store_pages(hs, list(range(N)), keys) == [True] * N
    c.unregister_region(hs)
    del src
    hd = c.register_region(dst, PAGE)
    c._dst = dst  # kept alive with the client
    return c, hd, dst.numpy(), keys


def test_load_pages_timed_out_writes_nothing_after_it_raised(big):
    c, hd, rows, keys = prepared(big, seed=1)
    with c:
        assert c._wire.ops.fences is not None and c._wire.ops.fences.registered
        c.timeout = 0.005
        with pytest.raises(HicachedError) as e:
            c.load_pages(hd, list(range(N)), keys)
        assert e.value.code == "timeout"
        wait_settled(rows)
        c.timeout = 60
        # Whatever was copied before the call returned is the right page; the rest is untouched.
        values = page_values(seed=1)
        for i in range(N):
            row = rows[i * PAGE : (i + 1) * PAGE : 4096]
            assert (row == MARK).all() or (row == values[i]).all()
        assert c.load_pages(hd, list(range(N)), keys) == N  # the connection still serves


def test_store_pages_timed_out_never_stores_bytes_written_after_it_raised(big):
    keys = keys_for(2)
    values = page_values(seed=2)
    src = shared_buffer(N * PAGE, name="fence-src")
    rows = src.numpy()
    fill_pages(rows, values)
    with Client(big.socket, "fence.ns", PAGE, timeout=60) as c:
        h = c.register_region(src, PAGE)
        c.timeout = 0.005
        with pytest.raises(HicachedError) as e:
            c.store_pages(h, list(range(N)), keys)
        assert e.value.code == "timeout"
        rows[:] = NEW  # the engine reuses the rows at once
        c.timeout = 60
        time.sleep(0.5)
        got = stored(c, keys)
        for i, page in got.items():
            assert page == bytes([values[i]]) * PAGE, f"key {i} holds bytes written after the store returned"


def test_cancelled_job_queued_behind_another_copies_nothing(daemon_factory, caplog):
    """One copy thread: a small load queued behind a large one times out before its job starts; the job
    is skipped (not one byte of its rows changes, ever), the request fails on the daemon, and the daemon
    counts it."""
    d = daemon_factory(config(copy_threads=1))
    busy, hb, _, bkeys = prepared(d, seed=3)
    small, hs, rows, skeys = prepared(d, seed=4)
    with busy, small:
        t = threading.Thread(target=busy.load_pages, args=(hb, list(range(N)), bkeys))
        t.start()
        deadline = time.monotonic() + 10
        while board_count(busy) == 0 and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0002)
        small.timeout = 0.005
        with pytest.raises(HicachedError) as e:
            small.load_pages(hs, list(range(16)), skeys[:16])
        assert e.value.code == "timeout"
        t.join()
        wait_settled(rows, 0.5)
        assert (rows == MARK).all()
        small.timeout = 60
        cancelled = small.stats()["regions"]["copies_cancelled"]
        assert cancelled >= 1
    assert "copy jobs skipped" in d.log()


@pytest.mark.parametrize("end", ["SIGCONT", "SIGKILL"])
def test_daemon_stopped_mid_copy_holds_the_call_until_it_continues_or_dies(daemon_factory, caplog, end):
    d = daemon_factory(config(copy_threads=1))  # one job a request: the stop lands inside it, or after
    caplog.set_level(logging.WARNING, logger="hicached.engine.fences")
    c, hd, rows, keys = prepared(d, seed=5)
    held = False
    try:
        for _ in range(5):  # the stop may land after the copy ended: then the call returns, and we try again
            rows[:] = MARK
            t, out = stop_mid_copy(d.proc, c, lambda: c.load_pages(hd, list(range(N)), keys), timeout=0.2)
            time.sleep(1.5)  # the client's time-out has passed long ago
            inside = board_count(c)
            if inside:
                held = True
                assert t.is_alive(), "the call returned while a copy job was inside the rows"
                assert "does not progress" in caplog.text  # said once, while it waits
                break
            d.proc.send_signal(signal.SIGCONT)
            t.join(30)
            assert not t.is_alive()
            c.timeout = 60
        assert held, "the daemon never stopped mid-copy in 5 tries"
        d.proc.send_signal(getattr(signal, end))
        if end == "SIGKILL":
            d.proc.wait()
        t.join(30)
        assert not t.is_alive(), f"the call is still blocked after {end}"
        # SIGKILL: the call is retried on a new connection (the old one is gone), which finds no daemon.
        assert isinstance(out[0], HicachedError) and out[0].code in ("timeout", "connection")
        wait_settled(rows)
    finally:
        if d.alive:
            d.proc.send_signal(signal.SIGCONT)
        c.close()


async def test_async_client_load_timed_out_writes_nothing_after_it_raised(big):
    c, hd, rows, keys = prepared(big, seed=6)
    c.close()
    async with AsyncClient(big.socket, "fence.ns", PAGE, timeout=60) as ac:
        h = await ac.register_region(c._dst, PAGE)
        ac.timeout = 0.005
        with pytest.raises(HicachedError) as e:
            await ac.load_pages(h, list(range(N)), keys)
        assert e.value.code == "timeout"
        await asyncio.to_thread(wait_settled, rows)
        rows[:] = MARK
        # A caller that cancels its call (asyncio.wait_for) gets its CancelledError only once no copy runs.
        ac.timeout = 60
        try:
            await asyncio.wait_for(ac.load_pages(h, list(range(N)), keys), 0.005)
        except TimeoutError:
            pass
        # Either way (on a loaded machine the load may end while its cancellation waits for the copy, and
        # wait_for then returns its answer: fresh-clone CI), nothing is copied once the call is over.
        await asyncio.to_thread(wait_settled, rows)
        assert await ac.load_pages(h, list(range(N)), keys, fetch=False) == N


def raw(req: dict):
    return (yield req)


def test_requests_without_fences_still_work(big, monkeypatch):
    monkeypatch.setattr(engine_regions, "USE_FENCES", False)
    keys = keys_for(7, 16)
    src = shared_buffer(16 * PAGE, name="fence-src")
    fill_pages(src.numpy(), page_values(16, seed=7))
    dst = shared_buffer(16 * PAGE, name="fence-dst")
    with Client(big.socket, "fence.ns", PAGE) as c:
        hs, hd = c.register_region(src, PAGE), c.register_region(dst, PAGE)
        assert c._wire.ops.fences is None
        assert c.store_pages(hs, list(range(16)), keys) == [True] * 16
        assert c.load_pages(hd, list(range(16)), keys) == 16
        assert np.array_equal(src.numpy(), dst.numpy())
        # A fence named on a connection that registered no board: refused.
        with pytest.raises(HicachedError, match="no fence board") as e:
            c._run(raw({"op": "load_pages", "handle": hd, "page_indices": [0], "keys": keys[:1], "fence": 0}))
        assert e.value.code == "bad_request"


def test_hostile_board_only_skips_or_runs_its_own_copies(big):
    keys = keys_for(8, 16)
    src = shared_buffer(16 * PAGE, name="fence-src")
    fill_pages(src.numpy(), page_values(16, seed=8))
    dst = shared_buffer(16 * PAGE, name="fence-dst")
    rows = dst.numpy()
    with Client(big.socket, "fence.ns", PAGE) as c:
        hs, hd = c.register_region(src, PAGE), c.register_region(dst, PAGE)
        assert c.store_pages(hs, list(range(16)), keys) == [True] * 16
        board = c._wire.ops.fences
        load = {"op": "load_pages", "handle": hd, "page_indices": list(range(16)), "keys": keys}
        for slot in (-1, board.slots, 1 << 40, "3", True):
            with pytest.raises(HicachedError) as e:
                c._run(raw({**load, "fence": slot}))
            assert e.value.code == "bad_request"
        for word in (fence.CANCELLED, COUNT, fence.CANCELLED | 7):  # skipped: copy_failed, rows untouched
            rows[:] = MARK
            slot = board.take()
            board._words[slot] = word
            with pytest.raises(HicachedError) as e:
                c._run(raw({**load, "fence": slot}))
            assert e.value.code == "copy_failed"
            assert (rows == MARK).all()
        slot = board.take()
        board._words[slot] = 5  # a garbage count: the copies run, and leave it as it was
        assert c._run(raw({**load, "fence": slot}))["n"] == 16
        assert int(board._words[slot]) == 5
        assert np.array_equal(rows, src.numpy())
        stats = c.stats()["regions"]
        assert stats["copies_cancelled"] >= 3
        assert c.status()  # the daemon is up
    assert big.alive
