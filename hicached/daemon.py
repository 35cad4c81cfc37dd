"""The daemon's lifecycle: build the parts from a config, start them in order, stop them in reverse."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from config import Config
from connectors import BackendError, Connector, build

from .pool import Pool
from .server import Server
from .tiers import Tiers

log = logging.getLogger("hicached.daemon")


class Daemon:
    """startup -> serve until asked to stop -> shutdown. Signal handling is an ordinary method
    (`handle_signal`) that tests call directly; `shutdown_trigger` is an injectable event."""

    def __init__(
        self, cfg: Config, config_path: str | None = None, shutdown_trigger: asyncio.Event | None = None
    ):
        self.cfg = cfg
        self.config_path = config_path
        self.should_exit = shutdown_trigger
        self.pool: Pool | None = None
        self.connector: Connector | None = None
        self.tiers: Tiers | None = None
        self.server: Server | None = None

    async def startup(self, listen_sock: socket.socket | None = None) -> None:
        if self.should_exit is None:
            self.should_exit = asyncio.Event()
        cfg = self.cfg
        self.pool = Pool(cfg.pool.capacity, prefault=cfg.pool.prefault)
        log.info("L2 pool of %d bytes ready (slabs of %d bytes)", self.pool.size, cfg.pool.slab_size)
        self.connector = await self._start_connector()
        self.tiers = Tiers(cfg, self.pool, self.connector)
        self.tiers.start()
        self.server = Server(cfg, self.tiers, control={"flush": self._ctl_flush})
        await self.server.start(listen_sock)

    async def _start_connector(self) -> Connector | None:
        connector = build(self.cfg)
        if connector is None:
            log.info('no L3 backend (storage.backend = "none"): L2 only')
            return None
        try:
            await connector.start()
        except BackendError as e:
            await connector.close()
            log.error("L3 backend %s could not start (%s); serving from L2 only", connector.name, e)
            return None
        log.info("L3 backend %s attached", connector.name)
        return connector

    async def main_loop(self) -> None:
        await self.should_exit.wait()

    async def shutdown(self) -> None:
        timeout = self.cfg.shutdown.flush_timeout
        if self.server is not None:
            self.server.stop_accepting()
            await self.server.stop(timeout=min(timeout, self.cfg.server.request_timeout))
        if self.tiers is not None:
            if self.connector is not None:
                dirty = len(self.tiers.index.dirty) + self.tiers.backup.pending
                if dirty:
                    log.info("writing %d pages not yet in L3 before exit (up to %.0fs)", dirty, timeout)
                if not await self.tiers.flush_dirty(timeout):
                    log.error("shutdown: %d pages did not reach L3 in time", self.tiers.backup.pending)
            await self.tiers.stop()
        if self.connector is not None:
            await self.connector.close()
        if self.pool is not None:
            self.pool.close()
        log.info("stopped")

    async def run(self, listen_sock: socket.socket | None = None) -> None:
        await self.startup(listen_sock)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_signal, sig)
        try:
            await self.main_loop()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self.shutdown()

    def handle_signal(self, sig: int) -> None:
        if sig in (signal.SIGINT, signal.SIGTERM):
            log.info(
                "received %s: finishing requests in flight and backups, then exiting",
                signal.Signals(sig).name,
            )
            self.should_exit.set()

    async def _ctl_flush(self, session, req) -> dict:
        ok = await self.tiers.flush_dirty(self.cfg.shutdown.flush_timeout)
        return {"flushed": ok, "backup_pending": self.tiers.backup.pending}
