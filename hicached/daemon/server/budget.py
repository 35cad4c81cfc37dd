"""The bound on the bytes the server holds for its peers (server.max_pending_bytes): unfinished request
frames and answers not yet read, over all connections; who to stop reading from past it, and whom to close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from hicached.config.schema import ServerConfig

log = logging.getLogger("hicached.server")


class Holder(Protocol):
    """A connection as the budget sees it (hicached.daemon.server.connection.Connection)."""

    def budget_pause(self) -> bool: ...  # stop reading; False when there is nothing to pause

    def budget_resume(self) -> None: ...

    def budget_refresh(self) -> None: ...  # report what it holds now (its peer may have read answers)

    def budget_close(self) -> None: ...


class SideHold:
    """The unfinished frame of a region-attach side connection: bounded in time by server.handshake_timeout,
    so it is never paused nor closed by the budget, only answered busy when the bound is reached."""

    def __init__(self, budget: PendingBudget) -> None:
        self.budget = budget

    def hold(self, n: int) -> bool:
        """Records `n` bytes held; False when the bound is past and the frame should be refused."""
        return self.budget.set(self, n)

    def budget_pause(self) -> bool:
        return False

    def budget_resume(self) -> None:
        pass

    def budget_refresh(self) -> None:
        pass

    def budget_close(self) -> None:
        pass


class PendingBudget:
    """Past server.max_pending_bytes every connection that holds bytes stops being read (reading more would
    only grow what it holds; connections that hold nothing, whose requests arrive whole, are served on).
    Reading resumes once the total is back under three quarters of the bound. A paused connection that
    keeps its bytes longer than server.request_timeout is closed, those holding the most first."""

    def __init__(self, cfg: Callable[[], ServerConfig]) -> None:
        self._cfg = cfg
        self.total = 0
        self.peak = 0
        self.over = False
        self.closed = 0  # connections closed for keeping their share too long
        self.busy = 0  # side connections refused past the bound
        self._held: dict[Any, int] = {}
        self._paused: dict[Any, float] = {}  # holder -> when reading from it stopped
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep(), name="pending-budget")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def side(self) -> SideHold:
        return SideHold(self)

    def set(self, holder: Any, held: int) -> bool:
        """Records that `holder` now holds `held` bytes. False when the total is past the bound and
        `holder` holds some: the caller stops reading from it (done here for connections)."""
        old = self._held.pop(holder, 0)
        if held:
            self._held[holder] = held
        self.total += held - old
        self.peak = max(self.peak, self.total)
        limit = self._cfg().max_pending_bytes
        if self.total > limit:
            if not self.over:
                self.over = True
                log.warning(
                    "peers hold %d bytes of unfinished requests and unread answers, past "
                    "server.max_pending_bytes (%d): not reading from the %d connections that hold them",
                    self.total,
                    limit,
                    len(self._held),
                )
                for h in list(self._held):
                    self._pause(h)
            elif held:
                self._pause(holder)
            if held and isinstance(holder, SideHold):
                self.busy += 1
            return not held
        if self.over and self.total <= limit * 3 // 4:
            self._resume_all()
        return True

    def forget(self, holder: Any) -> None:
        """`holder` is gone: what it held is free."""
        self._paused.pop(holder, None)
        self.set(holder, 0)

    def _pause(self, holder: Any) -> None:
        if holder not in self._paused and holder.budget_pause():
            self._paused[holder] = asyncio.get_running_loop().time()

    def _resume_all(self) -> None:
        self.over = False
        paused, self._paused = self._paused, {}
        log.info(
            "pending bytes back to %d: reading from %d paused connections again", self.total, len(paused)
        )
        for h in paused:
            h.budget_resume()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            cfg = self._cfg()
            await asyncio.sleep(min(0.5, cfg.request_timeout / 4))
            try:
                self._sweep_once(loop.time())
            except Exception:  # a bug here must not end the bound for good
                log.exception("internal error in the pending-bytes sweep")

    def _sweep_once(self, now: float) -> None:
        for h in list(self._held):
            h.budget_refresh()
        cfg = self._cfg()
        if self.over and self.total <= cfg.max_pending_bytes * 3 // 4:
            self._resume_all()
            return
        overdue = [h for h, since in self._paused.items() if now - since > cfg.request_timeout]
        overdue.sort(key=lambda h: self._held.get(h, 0), reverse=True)
        left = self.total
        for h in overdue:
            if left <= cfg.max_pending_bytes * 3 // 4:
                break
            held = self._held.get(h, 0)
            if not held:
                continue
            left -= held
            self.closed += 1
            log.warning(
                "closing a connection that kept %d bytes of unfinished requests or unread answers longer "
                "than server.request_timeout (%.0fs) while past server.max_pending_bytes",
                held,
                cfg.request_timeout,
            )
            h.budget_close()

    def stats(self) -> dict[str, int]:
        return {
            "pending_bytes": self.total,
            "pending_peak": self.peak,
            "pending_paused": len(self._paused),
            "pending_closed": self.closed,
            "pending_busy": self.busy,
        }
