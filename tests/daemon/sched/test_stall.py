"""A stalled or slow L3 in-process: the breaker detaches a backend that stalls (and abandons its calls),
counts calls far slower than usual, re-attaches it once it answers; the backlog of pages waiting for L3 stays
within storage.max_unbacked_fraction of the pool (drop_oldest or refuse), so that L2 keeps caching."""

from __future__ import annotations

import asyncio
import collections
import re
import time
from types import SimpleNamespace

from hicached.connectors.base import BackendUnavailable
from hicached.connectors.file import FileConnector
from tiers_rig import cfg_for, close_tiers, make_tiers, session, write
from waits import wait_until

from hicached import config
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.tiers import Tiers
from hicached.daemon.service.metrics import MetricsServer


class StallingFile(FileConnector):
    """The real file connector in front of which every call waits while `stalled` is set (a hung store: the
    calls neither finish nor fail)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.stalled = False
        self._open = asyncio.Event()
        self.waiting = 0  # calls waiting at the gate now

    def stall(self) -> None:
        self.stalled = True
        self._open = asyncio.Event()

    def resume(self) -> None:
        self.stalled = False
        self._open.set()

    async def _gate(self) -> None:
        if self.stalled:
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1

    async def put(self, namespace, keys, payloads, sums=None, hold=None):
        await self._gate()
        return await super().put(namespace, keys, payloads, sums, hold=hold)

    async def get_into(self, namespace, keys, buffers, hold=None):
        await self._gate()
        return await super().get_into(namespace, keys, buffers, hold)

    async def exists(self, namespace, keys):
        await self._gate()
        return await super().exists(namespace, keys)

    async def probe(self, timeout: float = 10.0) -> None:
        await self._gate()
        await super().probe(timeout)


async def stalling_tiers(tmp_path, **storage) -> tuple[Tiers, StallingFile]:
    storage.setdefault(
        "breaker", {"stall_timeout": "300ms", "probe_interval": "50ms", "probe_max_interval": "100ms"}
    )
    conn = StallingFile(cfg_for(tmp_path, **storage))
    return await make_tiers(tmp_path, connector=conn, **storage), conn


async def until(cond, timeout: float = 10.0) -> float:
    """Waits for `cond()`; the seconds it took."""
    start = time.monotonic()
    await wait_until(cond, timeout)
    return time.monotonic() - start


KEYS = [f"k{i:03d}" for i in range(100)]


async def test_a_stalled_backend_is_detached_and_reattached_and_l2_keeps_taking_pages(tmp_path):
    t, conn = await stalling_tiers(tmp_path, operation_timeout="30s")
    try:
        s = session(t)
        assert write(t, s, KEYS[:10]) == [True] * 10
        assert await t.backup.drain(10)
        conn.stall()
        assert write(t, s, KEYS[10:20]) == [True] * 10
        await until(lambda: conn.waiting > 0)
        # Detached long before the operation time-out (30 s) would have ended the call.
        assert await until(lambda: t.backend.state == "stalled") < 10
        stats = t.backend.stats()
        assert stats["why"].startswith("stalled: ") and "since" in stats
        assert t.counters["backend.stalls"] == 1 and t.counters["backend.breaker_trips"] == 1
        # The metrics say so too: state, since when, how often.
        text = MetricsServer(SimpleNamespace(tiers=t, server=None, reloads={})).render().decode()
        assert 'hicached_backend_attached{backend="file",state="stalled"} 0.0' in text
        assert "hicached_backend_stalls_total 1.0" in text
        since = re.search(r"^hicached_backend_detached_since_seconds (\S+)$", text, re.M)
        assert since and abs(float(since.group(1)) - time.time()) < 60
        # The put in flight was abandoned: its pages stopped holding their slots (owed to L3, stranded).
        await until(lambda: t.backup.pending == 0)
        assert t.index.dirty_pages == 0 and len(t.stranded) == 10
        # L2 goes on taking pages: far more than the pool could hold if they waited for L3.
        more = [f"m{i:03d}" for i in range(300)]
        for i in range(0, 300, 30):
            assert write(t, s, more[i : i + 30]) == [True] * 30
        # The store answers again: re-attached by the probe, the pages not in L3 backed up.
        conn.resume()
        await until(lambda: t.backend.state == "attached")
        assert "why" not in t.backend.stats()
        assert (await t.flush(10))["flushed"] is False  # evicted before reaching L3: lost, and said so
        assert t.counters["backup.lost"] > 0
        assert await t.exists(s, more[-5:]) == 5
        assert all(await conn.present("ns1", more[-20:]))
    finally:
        conn.resume()
        await close_tiers(t)


async def test_a_lookup_through_a_stalled_backend_ends_at_the_stall_not_the_operation_timeout(tmp_path):
    t, conn = await stalling_tiers(tmp_path, operation_timeout="30s")
    try:
        s = session(t)
        conn.stall()
        start = time.monotonic()
        assert await asyncio.wait_for(t.exists(s, KEYS[:4]), 20) == 0  # a miss, not an error
        assert time.monotonic() - start < 20
        assert t.backend.state == "stalled" and t.counters["lookup.l3_errors.stalled"] == 1
        assert t.counters["backend.failures.file.stalled"] == 1
    finally:
        conn.resume()
        await close_tiers(t)


async def test_a_slow_backend_that_keeps_finishing_calls_is_not_stalled(tmp_path):
    class Slow(FileConnector):
        async def put(self, namespace, keys, payloads, sums=None, hold=None):
            await asyncio.sleep(0.1)
            return await super().put(namespace, keys, payloads, sums, hold=hold)

    breaker = {"stall_timeout": "1s", "slow_factor": 0}
    conn = Slow(cfg_for(tmp_path, breaker=breaker, backup_batch_pages=1))
    t = await make_tiers(tmp_path, connector=conn, breaker=breaker, backup_batch_pages=1)
    try:
        s = session(t)
        assert write(t, s, KEYS[:20]) == [True] * 20
        assert await t.backup.drain(30)
        assert t.backend.state == "attached" and t.counters["backend.stalls"] == 0
    finally:
        await close_tiers(t)


class Named:
    name = "fake"
    progress = 0


async def test_calls_far_slower_than_usual_count_as_failures_and_one_that_ends_resets_them():
    cfg = config.from_dict({"storage": {"breaker": {"failures": 2, "stall_timeout": 0, "slow_factor": 10}}})
    b = Backend(cfg, collections.Counter())
    b.current = conn = Named()
    for _ in range(8):  # its typical put: a few ms
        await b.call("put", lambda c: asyncio.sleep(0.002))
    gates = [asyncio.Event() for _ in range(3)]
    calls = [asyncio.create_task(b.call("put", lambda c, g=g: g.wait())) for g in gates]
    await wait_until(lambda: all(task in b._calls for task in calls), what="the three calls to be in flight")
    # One slow call counts once, however often it is looked at; a call that ends resets the count.
    now = time.monotonic()
    b._calls[calls[0]].start = now - 5
    b.check(now)
    b.check(now)
    assert b._failures == 1 and b.current is conn
    gates[0].set()
    await calls[0]
    assert b._failures == 0
    # Two slow calls in a row: detached, and why says so.
    for task in calls[1:]:
        b._calls[task].start = now - 5
    b.check(now)
    assert b.current is None and b.state == "breaker_open"
    assert b.why.startswith("failed 2 calls in a row (last: slow: a put call ran")
    for g in gates:
        g.set()
    await asyncio.gather(*calls)
    await b.close()


async def test_no_stall_while_idle_nor_before_stall_timeout():
    cfg = config.from_dict({"storage": {"breaker": {"stall_timeout": "2s"}}})
    b = Backend(cfg, collections.Counter())
    b.current = conn = Named()
    now = time.monotonic()
    b.check(now + 3600)  # idle for an hour: no call in flight, no stall
    gate = asyncio.Event()
    call = asyncio.create_task(b.call("get", lambda c: gate.wait()))
    await asyncio.sleep(0)
    b.check(time.monotonic() + 1.5)
    assert b.current is conn
    b.check(time.monotonic() + 2.5)
    assert b.current is None and b.state == "stalled"
    try:
        await call
    except BackendUnavailable as e:
        assert e.reason == "stalled"
    else:
        raise AssertionError("an abandoned call must fail")
    await b.close()


async def test_a_task_cancelled_by_its_caller_during_a_stall_stays_cancelled():
    cfg = config.from_dict({"storage": {"breaker": {"stall_timeout": "2s"}}})
    b = Backend(cfg, collections.Counter())
    b.current = Named()
    gate = asyncio.Event()
    call = asyncio.create_task(b.call("get", lambda c: gate.wait()))
    await asyncio.sleep(0)
    call.cancel()  # its caller gave up (an engine's connection closed) ...
    b.check(time.monotonic() + 3)  # ... and the stall abandons it in the same turn
    try:
        await call
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the caller's cancel must stand")
    await b.close()


async def test_the_backlog_drops_its_oldest_pages_when_the_pool_needs_their_slots(tmp_path):
    # 8 MiB pool, 64 KiB pages: at most 2 MiB (32 pages) may hold slots for L3; the store never answers.
    t, conn = await stalling_tiers(tmp_path, max_unbacked_fraction=0.25, breaker={"stall_timeout": 0})
    try:
        s = session(t)
        conn.stall()
        many = [f"p{i:04d}" for i in range(400)]  # 25 MiB through an 8 MiB pool
        for i in range(0, 120, 20):
            assert write(t, s, many[i : i + 20]) == [True] * 20
        # Nothing dropped while the pool had room: a backend only behind for a burst loses nothing.
        assert t.counters["backup.dropped"] == 0 and t.index.dirty_pages == 120
        for i in range(120, 400, 20):
            # Each time the pool needs slots, the pages waiting for L3 are cut to the bound (2 MiB).
            assert write(t, s, many[i : i + 20]) == [True] * 20
        assert t.counters["backup.dropped"] > 0 and t.counters["store.no_space"] == 0
        assert t.counters["backup.dropped_gone"] > 0 and t.counters["backup.lost"] == 0
        # The newest pages are the ones still held, and in L2.
        assert all(t.index.get("ns1", k).dirty for k in many[-20:])
        assert await t.exists(s, many[-100:]) == 100
        # The store comes back: a flush backs up the pages still in L2 (dropped ones too) and reports, once,
        # the dropped pages that left L2 before reaching L3.
        conn.resume()
        answer = await t.flush(30)
        assert answer["flushed"] is False and answer["dropped"] == t.counters["backup.dropped_gone"]
        assert all(await conn.present("ns1", many[-100:]))
        assert (await t.flush(30))["flushed"] is True
    finally:
        conn.resume()
        await close_tiers(t)


async def test_the_backlog_refuses_new_stores_when_asked_to(tmp_path):
    t, conn = await stalling_tiers(
        tmp_path, max_unbacked_fraction=0.25, when_backlog_full="refuse", breaker={"stall_timeout": 0}
    )
    try:
        s = session(t)
        conn.stall()
        answers = []
        for i in range(0, 100, 10):
            answers += write(t, s, KEYS[i : i + 10])
        assert 0 < sum(answers) < 100 and t.counters["backup.dropped"] == 0
        assert t.index.dirty_bytes <= t.index.alloc.capacity // 4
        assert answers[:20] == [True] * 20  # the first ones were taken; later ones refused
    finally:
        conn.resume()
        await close_tiers(t)


async def test_write_back_keeps_its_own_rule(tmp_path):
    t, conn = await stalling_tiers(
        tmp_path, write_policy="write_back", max_unbacked_fraction=0.25, breaker={"stall_timeout": 0}
    )
    try:
        s = session(t)
        conn.stall()
        assert write(t, s, KEYS[:60]) == [True] * 60  # 3.75 MiB of an 8 MiB pool, in L2 only by design
        assert t.index.dirty_pages == 60 and t.counters["backup.dropped"] == 0
    finally:
        conn.resume()
        await close_tiers(t)
