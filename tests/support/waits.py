"""Waiting in a test for what it needs to have happened, rather than sleeping for a time hoped long enough."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# The first polls only give the event loop a turn (what a test waits for is most often a task's next step);
# after those, the loop is left alone for _POLL_S between polls (it then waits for threads and timers).
_SPINS = 100
_POLL_S = 0.002


async def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Returns once `cond()` is true, polling it between turns of the event loop; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    polls = 0
    while not cond():
        if time.monotonic() >= deadline:
            name = what or getattr(cond, "__qualname__", repr(cond))
            raise AssertionError(f"waited {timeout:g} s for {name}; it did not happen")
        polls += 1
        await asyncio.sleep(0 if polls <= _SPINS else _POLL_S)
