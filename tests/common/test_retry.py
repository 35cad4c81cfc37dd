"""Retry with exponential backoff and jitter."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from hicached.config.schema import RetryConfig

from hicached.common.retry import Backoff


class Flaky:
    """Fails `failures` times with the given exceptions, then returns "ok"."""

    def __init__(self, failures: int, exc: type[BaseException] = ConnectionError) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0
        self.raised: list[BaseException] = []

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            e = self.exc(f"failure {self.calls}")
            self.raised.append(e)
            raise e
        return "ok"


# Delays.


def test_delays_double_then_cap_at_max() -> None:
    b = Backoff(attempts=20, base=0.1, max=5.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])
    assert b.delay(7) == 5.0
    assert b.delay(8) == 5.0
    assert b.delay(60) == 5.0


def test_delay_equal_to_max_when_base_exceeds_it() -> None:
    assert Backoff(base=10.0, max=2.0, jitter=0.0).delay(1) == 2.0


def test_delay_caps_for_very_late_attempts() -> None:
    assert Backoff(attempts=2000, base=0.05, max=5.0, jitter=0.0).delay(1100) == 5.0


@pytest.mark.parametrize("attempt", [1, 3, 5])
def test_jitter_bounds(attempt: int, monkeypatch: pytest.MonkeyPatch) -> None:
    b = Backoff(base=0.1, max=100.0, jitter=0.2)
    d = 0.1 * 2 ** (attempt - 1)
    monkeypatch.setattr(random, "random", lambda: 0.0)
    assert b.delay(attempt) == pytest.approx(d * 0.8)
    monkeypatch.setattr(random, "random", lambda: 0.5)
    assert b.delay(attempt) == pytest.approx(d)
    monkeypatch.setattr(random, "random", lambda: 1.0 - 1e-12)
    assert b.delay(attempt) == pytest.approx(d * 1.2)


def test_jitter_around_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Backoff(base=1.0, max=4.0, jitter=0.5)
    monkeypatch.setattr(random, "random", lambda: 0.0)
    assert b.delay(10) == pytest.approx(2.0)


def test_jitter_spreads_within_bounds() -> None:
    b = Backoff(base=1.0, max=100.0, jitter=0.25)
    samples = [b.delay(3) for _ in range(500)]
    assert all(3.0 <= s <= 5.0 for s in samples)
    assert len(set(samples)) > 100  # jitter is applied, not a constant
    assert min(samples) < 3.5 and max(samples) > 4.5


def test_no_jitter_is_deterministic() -> None:
    b = Backoff(base=0.3, max=100.0, jitter=0.0)
    assert {b.delay(2) for _ in range(50)} == {0.6}


def test_from_config() -> None:
    b = Backoff.from_config(RetryConfig(attempts=9, base=0.01, max=2.0, jitter=0.5))
    assert b == Backoff(attempts=9, base=0.01, max=2.0, jitter=0.5)
    assert Backoff.from_config(RetryConfig()) == Backoff()


def test_backoff_is_immutable() -> None:
    b = Backoff()
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.attempts = 3  # type: ignore[misc]


# run().

FAST = Backoff(attempts=4, base=0.001, max=0.002, jitter=0.0)


async def test_run_returns_at_once_on_success() -> None:
    fn = Flaky(0)
    seen: list = []
    assert await FAST.run(fn, (ConnectionError,), lambda n, e: seen.append((n, e))) == "ok"
    assert fn.calls == 1
    assert seen == []


async def test_run_retries_then_succeeds() -> None:
    fn = Flaky(2)
    seen: list = []
    assert await FAST.run(fn, (ConnectionError,), lambda n, e: seen.append((n, e))) == "ok"
    assert fn.calls == 3
    assert [n for n, _ in seen] == [1, 2]
    assert [e for _, e in seen] == fn.raised


async def test_run_raises_the_last_error_after_attempts() -> None:
    fn = Flaky(100)
    seen: list = []
    with pytest.raises(ConnectionError) as e:
        await FAST.run(fn, (ConnectionError,), lambda n, e: seen.append(n))
    assert fn.calls == FAST.attempts
    assert e.value is fn.raised[-1]
    # No retry follows the last attempt, so it is not announced.
    assert seen == [1, 2, 3]


async def test_run_succeeds_on_the_last_attempt() -> None:
    fn = Flaky(FAST.attempts - 1)
    assert await FAST.run(fn, (ConnectionError,)) == "ok"
    assert fn.calls == FAST.attempts


async def test_run_does_not_retry_other_errors() -> None:
    fn = Flaky(100, exc=KeyError)
    seen: list = []
    with pytest.raises(KeyError):
        await FAST.run(fn, (ConnectionError, TimeoutError), lambda n, e: seen.append(n))
    assert fn.calls == 1
    assert seen == []


async def test_run_retries_any_listed_error() -> None:
    calls = 0
    excs = [TimeoutError("t"), ConnectionResetError("r")]

    async def fn() -> int:
        nonlocal calls
        calls += 1
        if excs:
            raise excs.pop(0)
        return calls

    # ConnectionResetError is caught as a subclass of ConnectionError.
    assert await FAST.run(fn, (TimeoutError, ConnectionError)) == 3


async def test_run_with_one_attempt_never_retries() -> None:
    fn = Flaky(1)
    with pytest.raises(ConnectionError):
        await Backoff(attempts=1, base=0.001).run(fn, (ConnectionError,))
    assert fn.calls == 1


async def test_run_sleeps_the_delay_of_each_retry() -> None:
    asked: list[int] = []

    class Recording(Backoff):
        def delay(self, attempt: int) -> float:
            asked.append(attempt)
            return 0.0

    fn = Flaky(3)
    assert await Recording(attempts=5).run(fn, (ConnectionError,)) == "ok"
    assert asked == [1, 2, 3]


async def test_cancel_during_backoff_is_not_retried() -> None:
    fn = Flaky(100)
    retrying = asyncio.Event()
    slow = Backoff(attempts=5, base=60.0, max=60.0, jitter=0.0)
    task = asyncio.create_task(slow.run(fn, (Exception,), lambda n, e: retrying.set()))
    await retrying.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fn.calls == 1
