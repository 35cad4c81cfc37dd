"""The warm list: read and replayed into L2 at start, snapshotted while the daemon runs, written at stop, so
that a restart finds the pages engines used last."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hicached import config
from hicached.daemon.persist import warmup

log = logging.getLogger("hicached.daemon")


class WarmList:
    """One daemon's warm list. `daemon` is a hicached.daemon.service.lifecycle.Daemon (not imported: the
    lifecycle imports this module): its configuration, tiers and pool are read as they are now."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        # The warm list read at start until it has been replayed: kept in the lists written meanwhile, so
        # that a stop (or a backend late at start) before the replay is done does not lose it. None until it
        # is read: nothing is written over it then.
        self.pending: list[warmup.WarmPage] | None = None
        self._snapshot_task: asyncio.Task[Any] | None = None

    def path(self) -> str:
        cfg = self.daemon.cfg
        return config.resolve_path(cfg, cfg.warmup.state_file)

    def limit(self) -> warmup.Budget:
        """warmup.max_fraction of each arena (each tenant's pool; without tenants, the whole pool)."""
        d = self.daemon
        fraction = d.cfg.warmup.max_fraction
        return warmup.Budget([int(fraction * a.size) for a in d.pool.arenas], d.tiers.arena_of)

    async def replay(self) -> None:
        tiers = self.daemon.tiers
        loop = asyncio.get_running_loop()
        pages = await loop.run_in_executor(None, warmup.load, self.path())
        self.pending = pages
        if not pages:
            return
        if tiers.connector is None:
            # Down at start (the breaker retries it), or detached: the list waits for a backend to read from.
            log.info("warmup: %d pages listed; waiting for an L3 backend to read them from", len(pages))
            await tiers.attached.wait()
        await warmup.warm(tiers, pages, self.limit())
        self.pending = []

    def follow_snapshot_interval(self) -> None:
        """Runs the periodic snapshot of the warm list as warmup.enabled and snapshot_interval say (at start,
        and after a reload that changed them)."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            self._snapshot_task = None
        w = self.daemon.cfg.warmup
        if w.enabled and w.snapshot_interval > 0:
            self._snapshot_task = self.daemon._spawn(self._snapshots(w.snapshot_interval))

    async def _snapshots(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self.pending is None:
                continue  # the list of the last run is not read yet: not written over
            pages = await warmup.snapshot_async(self.daemon.tiers.index, self.limit())
            pages = warmup.merge(pages, self.pending or [], self.limit())
            try:
                await loop.run_in_executor(None, warmup.save, self.path(), pages)
            except OSError as e:
                log.warning("could not write the warm list %s: %s", self.path(), e)

    def save(self) -> None:
        tiers = self.daemon.tiers
        if not self.daemon.cfg.warmup.enabled or tiers is None or self.pending is None:
            # A start-up that failed (another daemon on the socket, the metrics port taken) or a stop before
            # the list was read must not touch the list.
            return
        pages = warmup.snapshot(tiers.index, self.limit())
        pages = warmup.merge(pages, self.pending, self.limit())
        try:
            warmup.save(self.path(), pages)
            log.info("warm list of %d pages written to %s", len(pages), self.path())
        except OSError as e:
            log.warning("could not write the warm list %s: %s", self.path(), e)
