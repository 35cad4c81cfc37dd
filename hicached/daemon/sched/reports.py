"""Counts of pages that went wrong, logged at once, then at most once a minute."""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger("hicached.tiers")

LOG_INTERVAL_S = 60.0  # at most one line about such pages this often; it says how many since


class EveryMinute:
    """A counter of pages that went wrong, logged at once, then at most once a minute: each line says how many
    came since the previous one (what comes meanwhile is in the next line, written at the next event)."""

    def __init__(
        self, counters: collections.Counter[str], key: str, level: int, message: str = "%d %s %d"
    ) -> None:
        self.counters, self.key, self.level, self.message = counters, key, level, message
        self.logged = 0  # the count at the last line
        self.next = 0.0  # time.monotonic() from which the next line may be written
        counters[key] += 0  # counted from 0, so that the metric exists before the first one

    def add(self, n: int, message: str | None = None) -> None:
        """Counts `n`; `message` (default: the one given at construction) takes the number since the last
        line, "start" or "the last report", and the total."""
        self.counters[self.key] += n
        now = time.monotonic()
        if now < self.next:
            return
        total = self.counters[self.key]
        since = "the last report" if self.logged else "start"
        log.log(self.level, message or self.message, total - self.logged, since, total)
        self.logged, self.next = total, now + LOG_INTERVAL_S
