"""A page acknowledged to an engine is never lost without a word (DESIGN.md, "A page's life"): regressions for
three ways in which the daemon answered a store True and then kept the page in neither L2 nor L3, while
`ctl flush` answered flushed: true, lost: 0. The real daemon (a subprocess) on each real L3 store (the file
backend, a redis-server, moto's S3; tests/support/page_life.py), engines through the public client, and
raw protocol requests where an engine misbehaves.

A. A store of keys that a load is reading from L3 (FILLING entries whose objects are missing): the read
   is held (a proxy keeps the daemon's request, or a FUSE mount holds the file operation) until the store
   has been answered; the read then misses. Through both store paths: alloc/commit, and put into the
   slots a client holds ahead (its reserve).
B. A store of keys whose slots a writer allocated and never committed, which then dies.
C. A page stored again after its L3 object was deleted behind the daemon (what the daemon remembers of L3
   is a hint, never a reason to skip the write an acknowledgement depends on).

Each checks: every page whose store answered True loads back with its exact bytes (a fresh client), and,
after `ctl flush` answered flushed: true, is in L3 (a second daemon on the same store, with an empty L2,
loads it; or the store's objects read behind the daemon's back, then a load once L2 no longer holds it)."""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable
from typing import Any

import pytest
from page_life import L3, loadable, open_l3, wait_for
from protocol_fuzz import RawConnection, short

from hicached import Client, page_keys
from hicached.common import protocol

PAGE = 16 << 10
TOKENS = 16  # tokens a page: keys as SGLang makes them
NS = "life.p16k"
FILLER_NS = "life.filler"
BACKENDS = ["file", "redis", "s3"]
# A daemon may answer a store of a page being read or written elsewhere at once (today: at once, wrongly
# "present") or once that read or writer is done: the test then lets the read go (or the writer die) after
# this long, and takes the store's answer after that.
STORE_WAIT_S = 5.0
POOL_C = {"capacity": "2MiB", "slab_size": "256KiB"}  # 128 slots of 16 KiB: 32 pages leave it quickly


def make_pages(seed: int, n: int) -> dict[str, bytes]:
    """n pages of one prompt: key -> random bytes."""
    rng = random.Random(seed)
    keys = page_keys([rng.randrange(1 << 17) for _ in range(n * TOKENS)], TOKENS)
    return {k: rng.randbytes(PAGE) for k in keys}


def pool(d) -> dict[str, Any]:
    return d.ctl("stats")["pool"]


def in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return ex.submit(fn)
    finally:
        ex.shutdown(wait=False)


def warm_reserve(d, c: Client, seed: int, n: int) -> None:
    """Makes `c`'s next store of n pages go through put: a store of n other pages first, after which the
    connection holds n reserved slots (it uses up to half of what it may hold, more than n here)."""
    warm = make_pages(seed, n)
    assert c.store(list(warm), list(warm.values())) == [True] * n
    assert pool(d)["reserved"] >= n, pool(d)
    assert d.ctl("flush")["flushed"]


def checked(d, daemon_factory, l3: L3, pages: dict[str, bytes], acked: list[bool]) -> dict[str, Any]:
    """What became of the pages whose store answered True: loadable from the daemon, what flush answered,
    and loadable from L3 alone (a second daemon on the same store, past any hold, with an empty L2)."""
    kept = {k: v for (k, v), ok in zip(pages.items(), acked, strict=True) if ok}
    exact, wrong = loadable(d.socket, NS, PAGE, kept)
    flush = d.ctl("flush")
    reader = daemon_factory({"storage": l3.storage(direct=True)}, name="reader")
    in_l3, wrong_l3 = loadable(reader.socket, NS, PAGE, kept)
    return {
        "acked": len(kept),
        "loadable": exact,
        "other_bytes": wrong,
        "flushed": flush["flushed"],
        "flush_lost": flush["lost"],
        "in_l3": in_l3,
        "other_bytes_l3": wrong_l3,
    }


def expect_all(n: int) -> dict[str, Any]:
    return {
        "acked": n,
        "loadable": n,
        "other_bytes": 0,
        "flushed": True,
        "flush_lost": 0,
        "in_l3": n,
        "other_bytes_l3": 0,
    }


def lost(got: dict[str, Any]) -> str:
    return f"lost {got['acked'] - got['loadable']} of {got['acked']} acknowledged pages: {got}"


@pytest.fixture(params=BACKENDS)
def l3(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch):
    with open_l3(request.param, tmp_path, monkeypatch, holdable=False) as store:
        yield store


@pytest.fixture(params=BACKENDS)
def held_l3(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """An L3 store whose calls a test can hold: the file backend on a FUSE mount (skipped where none can
    be mounted), Redis and S3 behind a proxy."""
    with open_l3(request.param, tmp_path, monkeypatch, holdable=True) as store:
        yield store


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["alloc", "put"])
def test_a_store_acknowledged_while_a_load_reads_the_keys_from_l3_is_kept(
    daemon_factory, held_l3: L3, path: str
) -> None:
    """Engine 1 loads 32 pages that L3 does not hold; the daemon's read of them is held (L3.hold) and, once
    the daemon shows them FILLING and the store shows a call waiting, engine 2 stores them; then the read
    goes on and misses. Today the store is answered "present" and its bytes dropped: 32 of 32 lost."""
    l3, n = held_l3, 32
    d = daemon_factory({"storage": l3.storage()})
    pages = make_pages(1, n)
    keys = list(pages)

    def load() -> list[bytes]:
        with Client(d.socket, NS, PAGE) as c:
            return c.get(keys)

    with Client(d.socket, NS, PAGE) as writer:
        if path == "put":
            warm_reserve(d, writer, 2, n)
        l3.hold()
        try:
            loader = in_background(load)  # engine 1: the keys are not in L2, so the daemon reads L3
            wait_for(
                lambda: loader.done() or (pool(d)["filling"] >= n and l3.holding()),
                "the load's read of L3 to be under way and held",
            )
            assert not loader.done(), "the load ended before its read of L3 was held"
            # Engine 2 stores the same keys while the read is held.
            store = in_background(lambda: writer.store(keys, list(pages.values())))
            concurrent.futures.wait([store], timeout=STORE_WAIT_S)
        finally:
            l3.release()
        acked = store.result(60)
        loaded = loader.result(60)
    assert all(got == pages[k] for k, got in zip(keys, loaded, strict=False)), "a load got other bytes"
    wait_for(lambda: pool(d)["filling"] == 0, "the read of L3 to end")
    got = checked(d, daemon_factory, l3, pages, acked)
    print(f"{l3.kind}/{path}: {got}")
    assert got == expect_all(n), f"{l3.kind}/{path}: {lost(got)}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["alloc", "put"])
def test_b_a_store_acknowledged_while_a_writer_that_dies_held_the_keys_is_kept(
    daemon_factory, l3: L3, path: str
) -> None:
    """Engine 1 (raw requests) allocates slots for 256 pages and never commits; engine 2 stores them; then
    engine 1's connection closes and its slots are let go. Today engine 2 is answered "present": all lost."""
    n = 256
    d = daemon_factory({"storage": l3.storage()})
    pages = make_pages(3, n)
    keys = list(pages)
    # Engine 1 allocates a slot for each page and never commits.
    dying = RawConnection(d.socket, "dying writer")
    try:
        ans = dying.call({"op": "hello", "namespace": NS, "page_bytes": PAGE})
        assert "error" not in ans, short(ans)
        ans = dying.call({"op": "alloc", "keys": keys})
        assert ans.get("status") == [protocol.ALLOC_WRITE] * n, short(ans)
        with Client(d.socket, NS, PAGE) as writer:
            if path == "put":
                warm_reserve(d, writer, 4, n)
            # Engine 2 stores the same pages, with their bytes.
            store = in_background(lambda: writer.store(keys, list(pages.values())))
            concurrent.futures.wait([store], timeout=STORE_WAIT_S)
            dying.close()  # engine 1 dies: its slots are let go
            dying = None
            acked = store.result(60)
    finally:
        if dying is not None:
            dying.close()
    wait_for(lambda: pool(d)["writing"] == 0, "the dead writer's slots to be let go")
    got = checked(d, daemon_factory, l3, pages, acked)
    print(f"{l3.kind}/{path}: {got}")
    assert got == expect_all(n), f"{l3.kind}/{path}: {lost(got)}"


def push_out(d, seed: int, n: int = 192) -> None:
    """Stores n pages of another namespace, 16 at a time, each batch flushed to L3: the pool (128 slots)
    evicts its least recently used clean pages for them, first those stored before."""
    filler = make_pages(seed, n)
    keys, data = list(filler), list(filler.values())
    with Client(d.socket, FILLER_NS, PAGE) as c:
        for i in range(0, n, 16):
            assert c.store(keys[i : i + 16], data[i : i + 16]) == [True] * 16
            assert d.ctl("flush")["flushed"]


def in_l2(d, keys: list[str]) -> int:
    with Client(d.socket, NS, PAGE) as c:
        return c.touch(keys)


@pytest.mark.timeout(120)
def test_c_a_page_stored_again_after_l3_lost_it_is_written_again(daemon_factory, l3: L3) -> None:
    """32 pages stored, flushed to L3, evicted from L2; their objects deleted behind the daemon; stored
    again and flushed; evicted again; loaded. Today the store again is not written (the daemon remembers
    them in L3: store.known_in_l3), flush says flushed all the same, and the load misses 32 of 32."""
    n = 32
    d = daemon_factory({"pool": POOL_C, "storage": l3.storage()})
    pages = make_pages(5, n)
    keys, data = list(pages), list(pages.values())
    with Client(d.socket, NS, PAGE) as c:
        assert c.store(keys, data) == [True] * n
    assert d.ctl("flush")["flushed"]
    assert l3.keys(NS) == set(keys)
    push_out(d, 6)
    assert in_l2(d, keys) == 0, "the pages did not leave L2"
    # L3 loses them behind the daemon's back (a janitor, Redis eviction, another node).
    assert l3.delete(NS) == n
    with Client(d.socket, NS, PAGE) as c:
        assert c.exists(keys) == 0
        acked = c.store(keys, data)  # stored again
    flush = d.ctl("flush")
    objects = len(l3.keys(NS) & set(keys))
    push_out(d, 7)
    left = in_l2(d, keys)
    exact, wrong = loadable(d.socket, NS, PAGE, pages)
    got = {
        "acked": sum(acked),
        "flushed": flush["flushed"],
        "in_l3_after_flush": objects,
        "in_l2_after_eviction": left,
        "loadable": exact,
        "other_bytes": wrong,
    }
    print(f"{l3.kind}: {got}")
    want = {
        "acked": n,
        "flushed": True,
        "in_l3_after_flush": n,
        "in_l2_after_eviction": 0,
        "loadable": n,
        "other_bytes": 0,
    }
    assert got == want, f"{l3.kind}: lost {n - exact} of {sum(acked)} pages stored again: {got}"
