"""When engines last stored or loaded: write-through backups leave them the CPU while they are busy."""

from __future__ import annotations

import time
from collections.abc import Callable

BUSY_WINDOW_S = 0.01  # engines that stored or loaded within this are busy (storage.backup_concurrency_busy)


class EngineActivity:
    """The time of the last store or load; `clock` and `window_s` are the tests' to set."""

    __slots__ = ("clock", "last", "window_s")

    def __init__(self, window_s: float = BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.window_s = window_s
        self.last = float("-inf")

    def touch(self) -> None:
        """An engine stored or loaded now."""
        self.last = self.clock()

    def busy(self) -> bool:
        """An engine stored or loaded within the window."""
        return self.clock() - self.last <= self.window_s
