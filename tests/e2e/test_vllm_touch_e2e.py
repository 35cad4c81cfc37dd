"""HicachedTier's touch and store byte counts against the real daemon (a subprocess, a small pool) and vLLM
0.33's real TieringOffloadingManager: blocks vLLM touches survive the eviction that takes the others; a store
job's transfer_bytes counts only what the daemon copied."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (.ci/run installs it)"
)
from vllm_rig import Engine, chain_keys, hicached_tier  # noqa: E402

from hicached.engine.client import Client  # noqa: E402
from hicached.engine.vllm import DROPPED_TOUCHES  # noqa: E402
from hicached.engine.vllm.rows import daemon_keys  # noqa: E402

# 128 pages of 64 KiB (the rig's rows) and no L3: a page evicted from L2 is gone.
SMALL = {"pool": {"capacity": "8MiB", "slab_size": "1MiB"}, "storage": {"backend": "none"}}


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(engine_id: str, tiers: list[dict], **config) -> Engine:
        e = Engine(f"{engine_id}-{os.getpid()}", tiers, **config)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def store(e: Engine, req: str, keys: list[bytes]) -> None:
    ctx = e.request(req)
    e.store(ctx, keys)
    e.settle()
    e.finish(ctx)


def wait_sent(e: Engine, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while e.tier._touches.sent < n:
        assert time.monotonic() < deadline, "the touches were not sent"
        time.sleep(0.005)


def test_blocks_vllm_touches_survive_an_eviction_that_takes_the_untouched(daemon_factory, engines):
    daemon = daemon_factory(SMALL)
    e = engines("touch", [hicached_tier(daemon.socket)])
    old = [chain_keys(f"old{b}", 32) for b in range(4)]  # 128 blocks: L2 full
    for b, keys in enumerate(old):
        store(e, f"old{b}", keys)
    assert all(r.success for r in e.job_results)
    oldest = old[0]
    # vLLM's own fan-out: TieringOffloadingManager.touch -> the primary tier and every secondary tier.
    ctx = e.request("touch")
    with e.manager.lock:
        e.manager.touch(oldest[:16], ctx)
    e.finish(ctx)
    wait_sent(e, 16)
    store(e, "new", chain_keys("new", 16))  # 16 pages evicted to make room
    assert all(r.success for r in e.job_results)
    with Client(daemon.socket, e.tier.namespace, e.row) as c:
        here = c.present(daemon_keys(oldest, 1))
    assert here[:16] == [True] * 16  # touched: the most recently used
    assert here[16:] == [False] * 16  # the least recently used once the others were touched: evicted


def test_touch_returns_at_once_and_drops_while_the_daemon_is_down(daemon_factory, engines):
    daemon = daemon_factory(SMALL)
    e = engines("touch-down", [hicached_tier(daemon.socket)])
    keys = chain_keys("down", 8)
    store(e, "s", keys)
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    ctx = e.request("t")
    for i in range(3):  # the first finds the daemon gone (its send fails); the next are dropped at once
        start = time.perf_counter()
        with e.manager.lock:
            e.manager.touch(keys, ctx)
        assert time.perf_counter() - start < 0.05
        deadline = time.monotonic() + 30
        while e.tier._touches.dropped < 8 * (i + 1):
            assert time.monotonic() < deadline, "the touches were neither sent nor dropped"
            time.sleep(0.005)
    e.finish(ctx)
    stats = e.tier.get_stats()
    assert sum(stats.data["data"][DROPPED_TOUCHES].values()) == 24


def test_a_store_jobs_transfer_bytes_count_only_blocks_the_daemon_copied(daemon, engines):
    a = engines("bytes-a", [hicached_tier(daemon.socket)])
    b = engines("bytes-b", [hicached_tier(daemon.socket)])
    keys = chain_keys("bytes", 8)
    store(a, "a", keys[:5])
    assert [(r.success, r.transfer_bytes) for r in a.job_results] == [(True, 5 * a.row)]
    # Engine B stores the whole prefix: the daemon holds 5 of its 8 blocks already (A's) and copies 3.
    store(b, "b", keys)
    assert [(r.success, r.transfer_bytes) for r in b.job_results] == [(True, 3 * b.row)]
    store(a, "again", keys)  # A's primary tier stores only the 3 it lacks; the daemon has them from B
    assert [(r.success, r.transfer_bytes) for r in a.job_results[1:]] == [(True, 0)]
