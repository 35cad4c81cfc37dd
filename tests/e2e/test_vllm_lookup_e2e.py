"""HicachedTier's lookups against the real daemon (a subprocess) and vLLM 0.33's real offloading manager,
driven as vLLM's scheduler drives them, a step every 0.5 ms: a second engine finds every block the first
stored however many steps the daemon's answer takes; a daemon that answers late (SIGSTOP) holds no request
past lookup_wait_s, and its late keys are misses, counted; a daemon that is down is a miss at once."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (.ci/run installs it)"
)
from daemon_proc import DaemonProcess  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm_rig import Engine, chain_keys, hicached_tier, row_bytes_of  # noqa: E402

from hicached.engine.vllm import LATE_LOOKUPS  # noqa: E402

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
STEP_S = 0.0005  # the model-execution window between two scheduler steps


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


def store(e: Engine, tag: str, requests: int, per: int) -> list[list[bytes]]:
    """Requests of `per` blocks each, stored through the engine's primary tier into the daemon."""
    reqs = [chain_keys(f"{tag}-{i}", per) for i in range(requests)]
    ctxs = [e.request(f"store-{tag}-{i}") for i in range(requests)]
    for ctx, keys in zip(ctxs, reqs, strict=True):
        e.store(ctx, keys)
    e.settle()
    for ctx in ctxs:
        e.finish(ctx)
    assert e.job_results and all(r.success for r in e.job_results)
    return reqs


def late(e: Engine) -> int:
    return int(sum(e.tier.get_stats().data["data"].get(LATE_LOOKUPS, {}).values()))


def continue_after_steps(daemon: DaemonProcess, e: Engine, steps: int, done: threading.Event) -> None:
    """SIGCONT the (stopped) daemon once the engine's scheduler has started `steps` steps (or is done)."""
    try:
        while len(e.step_starts) < steps and not done.wait(0.001):
            pass
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_second_engine_stepping_every_half_millisecond_finds_every_stored_block(daemon, engines):
    """The daemon's answer comes 50 steps after the keys were asked (stopped until the engine has stepped 50
    times, as a busy daemon or a scheduler thread holding the GIL delays it): the tier answers RETRY on each
    of those steps, then every stored block is a hit (a RETRY and then a MISS, the rule before, lost all)."""
    requests, per, held = 8, 64, 50
    a = engines("fast-a", [hicached_tier(daemon.socket)], chunks=requests * per + 64)
    reqs = store(a, "fast", requests, per)
    # A bound far off: 50 steps of 512 lookups each may take a second on a loaded machine.
    b = engines("fast-b", [hicached_tier(daemon.socket, lookup_wait_s=30)], chunks=requests * per + 64)
    ctxs = [b.request(f"b-{i}") for i in range(requests)]
    daemon.proc.send_signal(signal.SIGSTOP)
    done = threading.Event()
    resume = threading.Thread(target=continue_after_steps, args=(daemon, b, held, done))
    resume.start()
    try:
        hits = b.paced_lookups(list(zip(ctxs, reqs, strict=True)), STEP_S)
    finally:
        done.set()
        resume.join()
    assert hits == [per] * requests
    for ctx, keys in zip(ctxs, reqs, strict=True):
        assert b.read(ctx, keys) == [row_bytes_of(k, b.row) for k in keys]
        b.finish(ctx)
    answers = list(b.tier_answers.values())
    assert len(answers) == requests * per
    assert all(a[-1] is HIT and set(a[:-1]) == {RETRY} and len(a) >= held for a in answers)
    assert late(b) == 0


def test_a_daemon_that_answers_late_holds_no_lookup_past_the_bound(daemon, engines):
    wait_s = 0.3
    a = engines("late-a", [hicached_tier(daemon.socket)])
    (stored,) = store(a, "late", 1, 4)
    b = engines("late-b", [hicached_tier(daemon.socket, lookup_wait_s=wait_s)])
    daemon.proc.send_signal(signal.SIGSTOP)  # takes requests, answers none
    try:
        ctx = b.request("r1")
        assert b.paced_lookups([(ctx, stored)], STEP_S) == [0]
        answers, times = b.tier_answers[stored[0]], b.tier_times[stored[0]]
        assert answers[-1] is MISS and set(answers[:-1]) == {RETRY}
        # RETRY until the bound, then MISS at the first step after it; the scheduler kept stepping.
        gap = max(later - earlier for earlier, later in itertools.pairwise(b.step_starts))
        assert wait_s - 0.01 <= times[-1] - times[0] <= wait_s + gap + 0.02, (times[-1] - times[0], gap)
        assert gap < wait_s
        # After the bound: the late key is a MISS at once for another request too, and so is a key never
        # asked before (it would queue behind the batch that is late), in the step that asks.
        steps = len(b.step_starts)
        ctx2, ctx3 = b.request("r2"), b.request("r3")
        fresh = chain_keys("late-fresh", 4)
        assert b.paced_lookups([(ctx2, stored), (ctx3, fresh)], STEP_S) == [0, 0]
        assert len(b.step_starts) == steps + 1 and b.tier_answers[fresh[0]] == [MISS]
        assert late(b) == 3
        with b.manager.lock:
            assert b.manager.has_pending_work()  # the batch the daemon holds
        for c in (ctx, ctx2, ctx3):
            b.finish(c)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    # Running again: once the late answer has landed, the tier answers from the daemon again.
    b.settle()
    ctx = b.request("r4")
    assert b.paced_lookups([(ctx, stored)], STEP_S) == [4]
    assert b.read(ctx, stored) == [row_bytes_of(k, b.row) for k in stored]
    b.finish(ctx)
    assert late(b) == 0  # counted once, above


def test_with_the_daemon_down_a_lookup_is_a_miss_at_once(daemon_factory, engines):
    daemon = daemon_factory(start=False)
    e = engines("down", [hicached_tier(daemon.socket, lookup_wait_s=30)])
    keys = chain_keys("down", 4)
    ctx = e.request("r1")
    assert e.paced_lookups([(ctx, keys)], STEP_S) == [0]
    assert e.tier_answers == {keys[0]: [MISS]} and len(e.step_starts) == 1
    e.finish(ctx)

    # Started: the tier connects again from its lookups alone (no job of its own asks for the daemon).
    daemon.start()
    (keys,) = store(engines("down-w", [hicached_tier(daemon.socket)]), "down", 1, 4)
    deadline = time.monotonic() + 30
    for attempt in itertools.count():
        assert time.monotonic() < deadline, "the tier did not use the daemon again"
        ctx = e.request(f"up-{attempt}")
        found = e.paced_lookups([(ctx, keys)], STEP_S)
        e.finish(ctx)
        if found == [4]:
            break

    # Killed: the first batch finds the connection gone at once (not after lookup_wait_s); from then on a
    # new key is a MISS at its first lookup.
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    ctx = e.request("r3")
    start = time.monotonic()
    assert e.paced_lookups([(ctx, chain_keys("down-killed", 4))], STEP_S) == [0]
    assert time.monotonic() - start < 5
    e.finish(ctx)
    ctx = e.request("r4")
    fresh = chain_keys("down-after", 4)
    assert e.paced_lookups([(ctx, fresh)], STEP_S) == [0]
    assert e.tier_answers[fresh[0]] == [MISS]
    e.finish(ctx)
    assert late(e) == 0  # a daemon down is not a late one
