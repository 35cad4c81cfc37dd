"""The vLLM tier's lookups (hicached.engine.vllm.lookup): a step's keys resolved in one batch off the caller's
thread, RETRY while the answer is on its way up to a bound in time (a clock the tests move), MISS at once with
the daemon down, per-request references, mark_miss after a failed load; its touches queued, coalesced,
bounded and sent off the caller's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from hicached.engine.vllm.lookup import CONNECT_EVERY_S, Answer, Lookups, Touches

HIT, MISS, RETRY = Answer.HIT, Answer.MISS, Answer.RETRY
WAIT_S = 0.5


class Clock:
    """The lookups' clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lookups(
    resolve: Callable[[Sequence[bytes]], list[bool]],
    up: Callable[[], bool] = lambda: True,
    clock: Clock | None = None,
) -> Lookups:
    return Lookups(resolve, up, "test-lookups", WAIT_S, clock or Clock())


class Daemon:
    """What `resolve` answers (the keys present), each batch it got, and a gate to hold it."""

    def __init__(self, present: set[bytes]) -> None:
        self.present = present
        self.batches: list[list[bytes]] = []
        self.gate = threading.Event()
        self.gate.set()

    def resolve(self, keys: Sequence[bytes]) -> list[bool]:
        self.gate.wait(30)
        self.batches.append(list(keys))
        return [k in self.present for k in keys]


def settled(lookups: Lookups, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while lookups.pending():
        assert time.monotonic() < deadline, "the lookup batch did not come back"
        time.sleep(0.001)


def test_a_steps_keys_of_every_request_go_in_one_batch() -> None:
    d = Daemon({b"a", b"b"})
    lk = lookups(d.resolve)
    try:
        assert [lk.lookup(k, "r1") for k in (b"a", b"b", b"c")] == [RETRY] * 3
        assert lk.lookup(b"a", "r2") == RETRY  # another request, same step: shares the probe
        assert lk.pending() and not d.batches  # nothing leaves before the step ends
        lk.flush()
        settled(lk)
        assert d.batches == [[b"a", b"b", b"c"]]
        assert [lk.lookup(k, "r1") for k in (b"a", b"b", b"c")] == [HIT, HIT, MISS]
        assert lk.lookup(b"a", "r2") == HIT
        lk.flush()  # nothing new: no batch
        settled(lk)
        assert len(d.batches) == 1 and lk.late == 0
    finally:
        lk.shutdown()


def test_a_key_is_retry_step_after_step_until_its_answer_is_back() -> None:
    """The daemon answers after many steps, within the bound: every lookup until then is RETRY, then HIT (a
    RETRY once and then a MISS lost every hit of an engine whose steps were shorter than a round trip)."""
    d = Daemon({b"a"})
    d.gate.clear()
    clock = Clock()
    lk = lookups(d.resolve, clock=clock)
    try:
        assert lk.lookup(b"a", "r1") == RETRY
        lk.flush()
        for _ in range(100):  # steps 0.5 ms apart: 50 ms of a slow daemon
            clock.now += 0.0005
            assert lk.lookup(b"a", "r1") == RETRY
            assert lk.lookup(b"a", "r2") == RETRY  # another request shares the probe and its wait
            lk.flush()
        assert len(d.batches) == 0 and lk.pending()
        d.gate.set()
        settled(lk)
        assert lk.lookup(b"a", "r1") == HIT and lk.lookup(b"a", "r2") == HIT
        assert lk.late == 0 and d.batches == [[b"a"]]
    finally:
        d.gate.set()
        lk.shutdown()


def test_past_the_bound_a_key_is_a_miss_counted_until_its_answer_lands() -> None:
    d = Daemon({b"a", b"b"})
    d.gate.clear()
    clock = Clock()
    lk = lookups(d.resolve, clock=clock)
    try:
        assert lk.lookup(b"a", "r1") == RETRY
        lk.flush()
        clock.now += WAIT_S * 0.99
        assert lk.lookup(b"a", "r1") == RETRY
        clock.now += WAIT_S * 0.02  # the bound, from the key's first lookup, has passed
        assert lk.lookup(b"a", "r1") == MISS
        assert lk.lookup(b"a", "r2") == MISS  # a request joining now gets no wait the first had not
        assert lk.late == 2
        # A new key while a batch older than the bound is unanswered: it would queue behind it, so it is
        # a MISS at once, asked of no one.
        assert lk.lookup(b"b", "r3") == MISS and lk.late == 3
        lk.flush()
        d.gate.set()
        settled(lk)
        assert d.batches == [[b"a"]]
        assert lk.lookup(b"a", "r1") == HIT  # the answer landed: used from now on
        assert lk.lookup(b"b", "r3") == RETRY  # the daemon answers again: new keys wait for it
        lk.flush()
        settled(lk)
        assert lk.lookup(b"b", "r3") == HIT and lk.late == 3
    finally:
        d.gate.set()
        lk.shutdown()


def test_with_the_daemon_down_a_new_key_is_a_miss_at_once_and_a_connect_is_tried_off_the_lock() -> None:
    d = Daemon({b"a"})
    up = threading.Event()
    clock = Clock()
    lk = lookups(d.resolve, up=up.is_set, clock=clock)
    try:
        assert lk.lookup(b"a", "r1") == MISS  # and an empty batch: resolve([]) connects if it can
        settled(lk)
        assert lk.lookup(b"b", "r1") == MISS  # no probe was made: nothing to wait for
        lk.flush()  # nothing asked of the daemon: no batch
        settled(lk)
        assert d.batches == [[]] and lk.late == 0  # a connection asked for once in CONNECT_EVERY_S
        clock.now += CONNECT_EVERY_S
        assert lk.lookup(b"a", "r1") == MISS
        settled(lk)
        assert d.batches == [[], []]
        up.set()
        assert lk.lookup(b"a", "r2") == RETRY
        lk.flush()
        settled(lk)
        assert lk.lookup(b"a", "r2") == HIT and d.batches == [[], [], [b"a"]]
    finally:
        lk.shutdown()


def test_a_failed_load_marks_its_keys_missed_and_finished_requests_forget_theirs() -> None:
    d = Daemon({b"a", b"b"})
    lk = lookups(d.resolve)
    try:
        lk.lookup(b"a", "r1")
        lk.lookup(b"b", "r1")
        lk.flush()
        settled(lk)
        lk.mark_miss([b"a", b"unknown"])
        assert lk.lookup(b"a", "r1") == MISS and lk.lookup(b"b", "r1") == HIT
        lk.cleanup("r1")
        assert lk.lookup(b"a", "r3") == RETRY  # a new probe: the daemon is asked again
        lk.flush()
        settled(lk)
        assert lk.lookup(b"a", "r3") == HIT and d.batches[-1] == [b"a"]
    finally:
        lk.shutdown()


def test_a_probe_whose_requests_finished_in_flight_is_dropped_when_its_answer_lands() -> None:
    d = Daemon({b"a"})
    d.gate.clear()
    lk = lookups(d.resolve)
    try:
        lk.lookup(b"a", "r1")
        lk.flush()
        lk.cleanup("r1")  # while its batch is out
        d.gate.set()
        settled(lk)
        assert lk.lookup(b"a", "r2") == RETRY  # asked afresh, not answered from the dropped probe
        lk.cleanup("r2")
        lk.flush()  # its request went within the step: nothing is posted
        settled(lk)
        assert d.batches == [[b"a"]]
    finally:
        lk.shutdown()


def test_a_failing_resolve_turns_into_misses_and_lookups_go_on() -> None:
    calls = []

    def resolve(keys: Sequence[bytes]) -> list[bool]:
        calls.append(list(keys))
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return [True] * len(keys)

    lk = lookups(resolve)
    try:
        lk.lookup(b"a", "r1")
        lk.flush()
        settled(lk)
        assert lk.lookup(b"a", "r1") == MISS
        lk.lookup(b"b", "r1")
        lk.flush()
        settled(lk)
        assert lk.lookup(b"b", "r1") == HIT
    finally:
        lk.shutdown()


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_touches_queued_while_a_batch_is_out_go_in_one_batch_in_recency_order() -> None:
    d = Daemon(set())
    sent: list[list[bytes]] = []

    def send(keys: Sequence[bytes]) -> int:
        d.gate.wait(30)
        sent.append(list(keys))
        return len(keys)

    t = Touches(send, lambda: True, "test-touches")
    try:
        d.gate.clear()  # the daemon holds the first batch
        t.add([b"a"])
        wait_until(lambda: not t._keys)  # taken by the thread, waiting on the daemon
        start = time.perf_counter()
        t.add([b"b", b"c"])
        t.add([b"d", b"b"])  # b touched again: it moves behind d
        assert time.perf_counter() - start < 0.05  # never waits on the daemon
        d.gate.set()
        wait_until(lambda: t.sent == 4)
        assert sent == [[b"a"], [b"c", b"d", b"b"]]
        assert t.dropped == 0
    finally:
        t.shutdown()


def test_touches_are_bounded_and_dropped_while_the_daemon_is_down() -> None:
    up = threading.Event()
    gate = threading.Event()
    sent: list[list[bytes]] = []

    def send(keys: Sequence[bytes]) -> int | None:
        gate.wait(30)
        sent.append(list(keys))
        return None if keys == [b"lost"] else len(keys)

    t = Touches(send, up.is_set, "test-touches", bound=3)
    try:
        t.add([b"x", b"y"])  # the daemon is down: dropped at once, nothing queued
        assert t.dropped == 2 and not t._keys
        up.set()
        t.add([b"lost"])
        gate.set()
        wait_until(lambda: t.dropped == 3)  # the daemon could not be asked: dropped
        gate.clear()
        t.add([b"first"])
        wait_until(lambda: not t._keys)  # out, held by the daemon
        t.add([b"1", b"2", b"3", b"4", b"5"])  # past the bound: the two oldest dropped
        assert t.dropped == 5 and list(t._keys) == [b"3", b"4", b"5"]
        gate.set()
        wait_until(lambda: t.sent == 4)
        assert sent[-2:] == [[b"first"], [b"3", b"4", b"5"]]
        gate.clear()
        t.add([b"6"])
        wait_until(lambda: not t._keys)
        t.add([b"7"])
        # Shut down while [6] is out: it is answered, and [7], still queued, is dropped, not sent.
        stopping = threading.Thread(target=t.shutdown)
        stopping.start()
        wait_until(lambda: t._stop)
        gate.set()
        stopping.join(30)
        assert not stopping.is_alive()
        assert t.dropped == 6 and sent[-1] == [b"6"] and t.sent == 5
    finally:
        gate.set()
        t.shutdown()
