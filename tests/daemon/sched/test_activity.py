"""EngineActivity alone, on an injected clock: busy within its window of the last store or load."""

from __future__ import annotations

from hicached.daemon.sched.activity import BUSY_WINDOW_S, EngineActivity


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_busy_within_the_window_of_the_last_touch():
    clock = Clock()
    activity = EngineActivity(clock=clock)
    assert activity.window_s == BUSY_WINDOW_S
    assert not activity.busy()  # no engine stored or loaded yet
    activity.touch()
    assert activity.last == 0.0 and activity.busy()
    clock.now += BUSY_WINDOW_S
    assert activity.busy()  # the window's end counts
    clock.now += BUSY_WINDOW_S / 10
    assert not activity.busy()
    activity.touch()
    assert activity.last == clock.now and activity.busy()


def test_the_window_is_the_callers():
    clock = Clock(0.0)
    activity = EngineActivity(window_s=2.0, clock=clock)
    activity.touch()
    clock.now = 1.5
    assert activity.busy()
    clock.now = 2.5
    assert not activity.busy()
    activity.window_s = 3.0  # the tests' to set
    assert activity.busy()
