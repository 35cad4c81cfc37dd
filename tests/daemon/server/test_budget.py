"""The pending-bytes budget (server.max_pending_bytes, issue #23 point 3): whom it pauses, resumes and
closes, and side connections refused past it."""

from __future__ import annotations

import asyncio

from hicached.config.schema import ServerConfig

from hicached.daemon.server.budget import PendingBudget


class FakeConn:
    def __init__(self) -> None:
        self.paused = self.closed = False

    def budget_pause(self) -> bool:
        self.paused = True
        return True

    def budget_resume(self) -> None:
        self.paused = False

    def budget_refresh(self) -> None:
        pass

    def budget_close(self) -> None:
        self.closed = True


async def test_the_budget_pauses_the_holders_past_the_bound_and_closes_the_biggest_overdue_first():
    cfg = ServerConfig(max_frame=4096, max_pending_bytes=1000, request_timeout=1.0)
    b = PendingBudget(lambda: cfg)
    big, mid, small, idle = FakeConn(), FakeConn(), FakeConn(), FakeConn()
    assert b.set(big, 600) and b.set(mid, 300)
    assert not b.set(small, 200)  # past 1000: every holder stops being read
    assert big.paused and mid.paused and small.paused and not idle.paused
    assert b.set(idle, 0) and not idle.paused  # a connection holding nothing is served on
    now = asyncio.get_running_loop().time()
    b._sweep_once(now + 0.5)  # within request_timeout: nobody closed
    assert not (big.closed or mid.closed or small.closed)
    b._sweep_once(now + 2.0)  # overdue: the biggest goes first, and closing it is enough (1100 - 600 <= 750)
    assert big.closed and not mid.closed and not small.closed
    b.forget(big)  # its connection_lost
    assert b.total == 500 and not b.over and not (mid.paused or small.paused)
    assert b.stats()["pending_closed"] == 1 and b.stats()["pending_peak"] == 1100


async def test_a_side_connection_past_the_bound_is_refused():
    cfg = ServerConfig(max_frame=4096, max_pending_bytes=1000)
    b = PendingBudget(lambda: cfg)
    holder = FakeConn()
    b.set(holder, 990)
    side = b.side()
    assert side.hold(5)  # still under
    assert not side.hold(50)  # past: answered busy, never paused
    side.hold(0)
    assert b.total == 990 and b.stats()["pending_busy"] == 1
