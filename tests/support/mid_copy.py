"""A daemon stopped (SIGSTOP) while a region copy job of an engine's call is inside the engine's memory: what
the fence tests of host and CUDA regions do alike (tests/e2e/test_fence_e2e.py, test_cuda_e2e.py)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicached.common import fence
from hicached.common.errors import HicachedError
from hicached.engine.client import Client

COUNT = fence.CANCELLED - 1  # a fence word's count of copy jobs inside the memory


def board_count(c: Client) -> int:
    """Copy jobs inside the client's regions now, over every word of its fence board."""
    b = c._wire.ops.fences
    return int((b._words & np.uint64(COUNT)).sum()) if b is not None else 0


def stop_mid_copy(
    proc: Any, c: Client, call: Callable[[], Any], timeout: float
) -> tuple[threading.Thread, list[Any]]:
    """Runs `call` (a load_pages or store_pages of `c`, time-out `timeout`) in a thread, and SIGSTOPs the
    daemon `proc` as soon as a copy job counts itself in (or the call ended, or 10 s passed: the stop may
    then land outside the copy, and the caller tries again). The thread, and a list that gets its answer or
    its error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except HicachedError as e:
            out.append(e)

    c.timeout = timeout
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while board_count(c) == 0 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.0001)
    proc.send_signal(signal.SIGSTOP)
    return t, out
