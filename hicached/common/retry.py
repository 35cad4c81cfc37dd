"""Retry with exponential backoff and jitter, as a small injectable object (built from storage.retry)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    attempts: int = 5
    base: float = 0.05
    max: float = 5.0
    jitter: float = 0.2

    @classmethod
    def from_config(cls, retry) -> Backoff:  # config.schema.RetryConfig
        return cls(attempts=retry.attempts, base=retry.base, max=retry.max, jitter=retry.jitter)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based)."""
        # Capped before and after the jitter: late attempts neither overflow nor exceed `max`, and at the
        # cap they still spread out below it.
        d = min(self.max, self.base * 2.0 ** min(attempt - 1, 64))
        if self.jitter:
            d *= 1.0 + self.jitter * (2.0 * random.random() - 1.0)
        return min(self.max, d)

    async def run(
        self,
        fn: Callable[[], Awaitable[T]],
        retry_on: tuple[type[BaseException], ...],
        on_retry: Callable[[int, BaseException], None] | None = None,
    ) -> T:
        """Calls `fn` until it succeeds or `attempts` calls have failed with one of `retry_on`."""
        attempt = 1
        while True:
            try:
                return await fn()
            except retry_on as e:
                if attempt >= self.attempts:
                    raise
                if on_retry is not None:
                    on_retry(attempt, e)
                await asyncio.sleep(self.delay(attempt))
                attempt += 1
