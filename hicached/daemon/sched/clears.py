"""clear(): a namespace forgotten in L2 and L3, on this node and, through its clear epoch in the shared L3
(epochs.py), on every node of the fleet; and the same forgetting when another node's clear is seen."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hicached.config import Config
from hicached.connectors.base import BackendError
from hicached.daemon.l2.index import READY
from hicached.daemon.l2.life import PageLife
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.epochs import Epochs
from hicached.daemon.sched.prefetch import Prefetcher
from hicached.daemon.sched.session import Session

log = logging.getLogger("hicached.tiers")


class Clears:
    def __init__(
        self,
        cfg: Callable[[], Config],
        life: PageLife,
        backend: Backend,
        prefetcher: Prefetcher,
        epochs: Epochs,
        counters: collections.Counter[str],
    ) -> None:
        self.cfg = cfg
        self.life = life
        self.index = life.index
        self.backend = backend
        self.prefetcher = prefetcher
        self.epochs = epochs
        self.counters = counters
        self._tasks: set[asyncio.Task[None]] = set()  # second passes of clears, forgetting seen clears

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def clear(self, s: Session) -> dict[str, Any]:
        """Forgets every page of the session's namespace, in L2 and in L3, on this node and across the fleet
        (an engine's `clear()`: SGLang's clear_hicache_storage, after which no page stored before it may be
        served; a weight update under the same model name needs it). Taken in the namespace the session has
        now.

        First a new clear epoch is written to L3 (epochs.py): other nodes sharing it forget their L2 pages
        of the namespace within storage.epoch_interval, and every node reads and writes its objects under
        the new epoch from then on. L2: each page leaves the index as soon as nothing holds it: at once for
        most; a page an engine is loading, that the backup is writing or that is being read from L3 once
        that ends (waited for up to server.request_timeout; what is still held then is counted in `busy`
        and stays, owed to L3 no more). Pages given up here are not lost: the engine asked for them to go.
        L3: every object of the epochs before is deleted, and again once the epoch interval and a store
        call have passed (writes that were in flight then, from this node or another). Reads from L3 of the
        namespace that overlap the clear are dropped (misses). Pages stored while the clear runs are new."""
        s.require_hello()
        ns = s.ns
        self.prefetcher.forgetting(ns, True)
        try:
            out: dict[str, Any] = {"l2": 0, "busy": 0, "l3": 0}
            names: list[str] = []
            l2 = asyncio.ensure_future(self._forget_l2(ns))  # meanwhile: pages held wait for their holders
            if self.backend.current is not None:
                try:
                    names = await self.epochs.bump(ns)
                except BackendError as e:
                    self.counters[f"clear.l3_errors.{e.reason}"] += 1
                    out["l3"], out["error"] = None, f"{e.reason}: {e}"
            out["l2"], out["busy"] = await l2
            for name in names:
                try:
                    out["l3"] += await self._clear_l3(name)
                except BackendError as e:
                    self.counters[f"clear.l3_errors.{e.reason}"] += 1
                    out["l3"], out["error"] = None, f"{e.reason}: {e}"
                    break
            if self.backend.current is None and self.cfg().storage.backend != "none":
                out["l3"], out["error"] = None, "detached: no L3 backend attached, nothing deleted there"
            if names and self.epochs.enabled:
                self._spawn(self._sweep(ns, names), f"hicached-sweep-{ns}")
        finally:
            self.prefetcher.forgetting(ns, False)
        self.counters["clear.requests"] += 1
        self.counters["clear.l2_pages"] += out["l2"]
        self.counters["clear.l3_objects"] += out["l3"] or 0
        log.info("namespace %s cleared by %s: %s", ns, s.peer or "an engine", out)
        return out

    async def _clear_l3(self, name: str) -> int:
        # A namespace may be many objects (a thousand a request on S3): the request's bound, not one page
        # operation's.
        timeout = max(self.cfg().storage.operation_timeout, self.cfg().server.request_timeout)
        return await self.backend.call("clear", lambda c: c.clear_namespace(name), timeout)

    async def _forget_l2(self, ns: str, disown: bool = False) -> tuple[int, int]:
        """The namespace's pages leave L2 as soon as nothing holds them, waited for up to
        server.request_timeout: (pages forgotten, pages still held then). With `disown`, a held page is owed
        to L3 no more from the start (a clear seen from another node: never written under the new epoch)."""
        forgotten = 0
        todo = list(self.index.ns_entries(ns).values())
        deadline = time.monotonic() + self.cfg().server.request_timeout
        disowned: set[int] = set()
        while todo:
            held = []
            for e in todo:
                if not self.index.live(e):
                    continue
                if e.state == READY and not e.leases:
                    self.life.forget(e)
                    forgotten += 1
                else:
                    if disown and e.state == READY and id(e) not in disowned:
                        self.life.disown(e)
                        disowned.add(id(e))
                    held.append(e)
            todo = held
            if todo and time.monotonic() >= deadline:
                return forgotten, len(todo)
            if todo:
                await asyncio.sleep(0.005)
        return forgotten, 0

    def cleared_elsewhere(self, ns: str) -> None:
        """Another node cleared `ns` (epochs.py): this node's L2 pages of it go, and reads from L3 that
        overlap are dropped."""
        self.prefetcher.forgetting(ns, True)

        async def forget() -> None:
            try:
                forgotten, busy = await self._forget_l2(ns, disown=True)
            finally:
                self.prefetcher.forgetting(ns, False)
            self.counters["fleet.cleared_l2_pages"] += forgotten
            if busy:
                self.counters["fleet.cleared_busy"] += busy
            log.info(
                "namespace %s cleared on another node: %d pages left L2 (%d still held)", ns, forgotten, busy
            )

        self._spawn(forget(), f"hicached-cleared-{ns}")

    async def _sweep(self, ns: str, names: list[str]) -> None:
        """The objects of the epochs before a clear, deleted again once every node has seen it: writes that
        were in flight then, or made by a node that had not read the new epoch yet, land there."""
        await asyncio.sleep(self.cfg().storage.epoch_interval + self.cfg().storage.operation_timeout)
        for name in names:
            try:
                n = await self._clear_l3(name)
            except BackendError as e:
                self.counters[f"clear.sweep_errors.{e.reason}"] += 1
                log.warning("clear of %s: the second pass over %s failed (%s)", ns, name, e)
                continue
            self.counters["clear.swept_objects"] += n
            if n:
                log.info("clear of %s: %d objects written under the old epoch since were deleted", ns, n)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
