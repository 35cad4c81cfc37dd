"""The daemon's lifecycle: build the parts from a config, start them in order, serve until asked to stop,
stop them in reverse; signals, the watchdog and the L3 backend's attach. The coordinator of its helpers:
hicached.daemon.persist (L2 over restarts and takeovers, the warm list), controls.py (the operator's
levers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any

from hicached import config
from hicached.common.errors import BACKEND_UNAVAILABLE, BAD_REQUEST, HicachedError
from hicached.config import Config
from hicached.connectors import BackendError, Connector, build
from hicached.daemon.l2.pool import Pool, available_memory, check_capacity
from hicached.daemon.persist import headers as slot_headers
from hicached.daemon.persist import keep, takeover
from hicached.daemon.persist import kept as kept_l2
from hicached.daemon.persist.warmlist import WarmList
from hicached.daemon.sched.tiers import Tiers
from hicached.daemon.server.listener import Server
from hicached.daemon.service import controls
from hicached.daemon.service.controls import shown
from hicached.daemon.service.metrics import MetricsServer
from hicached.daemon.service.notify import Notifier, watchdog_interval

log = logging.getLogger("hicached.daemon")


class Daemon:
    """startup -> serve until asked to stop -> shutdown. Signal handling is an ordinary method
    (`handle_signal`) that tests call directly; `shutdown_trigger` is an injectable event."""

    def __init__(
        self,
        cfg: Config,
        config_path: str | None = None,
        shutdown_trigger: asyncio.Event | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.should_exit = shutdown_trigger
        self.notifier = notifier or Notifier()
        self.pool: Pool | None = None
        self.tiers: Tiers | None = None
        self.server: Server | None = None
        self.metrics: MetricsServer | None = None
        self.last_reload = "none"
        self.reloads = {"ok": 0, "rejected": 0}
        self._reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving = False
        self._started = False  # start-up done: READY=1 sent
        self._reload_pending = False  # SIGHUP during start-up: reloaded once it is done
        self.warm = WarmList(self)  # replayed at start, snapshotted while serving, written at stop
        self.restored: keep.Restored | None = None  # L2 taken back from systemd's fd store at start
        # arena -> what restores its kept pool: its index snapshot, or its slot headers to scan
        self._kept: dict[int, tuple[keep.Snapshot | None, slot_headers.Headers | None]] = {}
        # Each arena's slot headers (what a crash keeps): the pool's one arena's, or each tenant's
        self.headers: list[slot_headers.Headers] = []
        self.takeover: takeover.Endpoint | None = None  # where a new instance asks to take over from this one

    # Lifecycle.

    async def startup(self, listen_sock: socket.socket | None = None) -> None:
        if self.should_exit is None:
            self.should_exit = asyncio.Event()
        cfg = self.cfg
        kept = kept_l2.take(self)
        handed = None
        if kept is None and listen_sock is None:
            # Another instance serving this socket hands it over, with L2 (before this one allocates a pool).
            path = config.resolve_path(cfg, cfg.server.socket)
            arenas = kept_l2.arena_layout(cfg)
            handed = await takeover.request(path, sum(n for _, n in arenas), cfg.pool.slab_size, arenas)
        if handed is None:
            await self._start(kept, listen_sock)
            return
        try:
            passed = {name: ([pool_fd], [index_fd], []) for name, pool_fd, index_fd in handed.arenas}
            kept = kept_l2.adopt(self, passed, strict=True)
            listen_sock = handed.listen
            log.info(
                "taking over from pid %d: its socket, L2 (%d pages, %d owed to L3%s) and its index",
                handed.pid,
                handed.pages,
                handed.owed,
                f"; {len(handed.arenas)} tenants' pools" if cfg.tenants else "",
            )
            await self._start(kept, listen_sock, handed)
        except BaseException as e:
            if handed.done:
                raise
            # Not confirmed yet: the old instance serves again, from the same sockets and L2. The tenants'
            # sockets are closed first: the old instance takes them back from its own fds.
            for s in handed.tenant_listen:
                s.close()
            await handed.abort(f"{type(e).__name__}: {e}")
            handed.listen.close()
            if not isinstance(e, Exception):
                raise
            raise takeover.TakeoverError(
                f"the takeover failed here ({e}); pid {handed.pid} serves again, this instance exits"
            ) from e

    async def _start(
        self, kept: Pool | None, listen_sock: socket.socket | None, handed: takeover.Handed | None = None
    ) -> None:
        cfg = self.cfg
        if kept is not None:
            self.pool = kept
        else:
            await self._memory_for_pool()
            arenas = kept_l2.arena_layout(cfg)
            try:
                self.pool = Pool(cfg.pool.capacity, prefault=cfg.pool.prefault, arenas=arenas)
            except MemoryError as e:
                raise RuntimeError(f"{e}; lower pool.capacity, or free memory") from None
        log.info("L2 pool of %d bytes ready (slabs of %d bytes)", self.pool.size, cfg.pool.slab_size)
        kept_l2.arena_headers(self)
        # The slot headers follow L2 from its first page: handed to the tiers as they are built.
        records, on_slab = slot_headers.observers(self.headers, len(self.pool.arenas))
        self.tiers = Tiers(cfg, self.pool, None, records=records, on_slab=on_slab)
        self.tiers.start()
        if self._kept:
            # Before the backend attaches (which queues the kept pages not in L3 yet) and before the socket
            # listens (a page is served only once verified).
            await kept_l2.restore(self)
        await self._attach_configured(startup=True)
        if self.restored is not None:
            keep.after_attach(self.tiers, self.restored)
        self.server = Server(cfg, self.tiers, control=self._control_handlers())
        if handed is not None:
            # From here on this instance serves: the old one exits once told, and the path is ours to remove.
            await handed.confirm()
        await self.server.start(
            listen_sock,
            owns_path=True if handed is not None else None,
            handed=handed.tenant_listen if handed is not None else takeover.passed_tenant_sockets(),
        )
        self._serving = True
        self.takeover = takeover.Endpoint(self, self.server.path)
        self.takeover.start()
        if cfg.metrics.listen:
            self.metrics = MetricsServer(self)
            await self.metrics.start(cfg.metrics.listen)
        if cfg.warmup.enabled and not (self.restored is not None and not self.restored.dropped):
            # After a kept L2 the warm list only has to bring back pages that did not verify (those in L2
            # are found there and cost nothing); with none dropped there is nothing to bring back.
            self._spawn(self.warm.replay())
        else:
            self.warm.pending = []
        self.warm.follow_snapshot_interval()
        interval = watchdog_interval()
        if interval:
            self._spawn(self._watchdog(interval))
        self.notifier.ready(self.status_line())
        self._started = True
        if self._reload_pending:
            self._reload_pending = False
            self._spawn(self.reload())

    async def quiesce(self, drain_timeout: float) -> list[socket.socket]:
        """Takeover, old side: stop serving without refusing anyone (requests in flight are answered, then
        connections close; engines reconnect to the next instance) and stop everything that changes L2.
        Returns the listening sockets, still open, for the next instance: server.socket's, then the
        tenants'."""
        if self.metrics is not None:
            await self.metrics.stop()  # its port is the next instance's
            self.metrics = None
        sock = await self.server.hand_over(drain_timeout)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tiers.stop()
        return sock

    async def _memory_for_pool(self) -> None:
        """Returns once the pool fits in the memory left (pool.capacity against MemAvailable and cgroup
        limits), waiting up to pool.memory_wait for it; RuntimeError if it does not come."""
        p = self.cfg.pool
        loop = asyncio.get_running_loop()
        deadline = loop.time() + p.memory_wait
        waited = False
        while True:
            try:
                short = check_capacity(p.capacity, p.prefault, available_memory())
                break
            except ValueError as e:
                if self.should_exit.is_set():
                    raise RuntimeError(f"stopped while waiting for memory for the pool: {e}") from None
                if loop.time() >= deadline:
                    why = f" (waited {p.memory_wait:.0f}s, pool.memory_wait)" if p.memory_wait else ""
                    raise RuntimeError(f"{e}{why}") from None
                if not waited:
                    waited = True
                    log.warning(
                        "%s; waiting up to %.0fs for memory (pool.memory_wait): engines that still map a "
                        "previous daemon's pool hold its memory until they reconnect",
                        e,
                        p.memory_wait,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.should_exit.wait(), min(1.0, max(0.0, deadline - loop.time()))
                    )
        if waited:
            log.info("memory for the pool is free; starting")
        if short:
            log.warning("%s", short)

    async def main_loop(self) -> None:
        await self.should_exit.wait()

    async def shutdown(self) -> None:
        self.notifier.stopping()
        if self.takeover is not None:
            self.takeover.close()
            if self.takeover.handed_to is not None:
                # Taken over: the socket, L2 and what it owes to L3 are the new instance's. Nothing is flushed
                # nor written (warm list, fd store): it does that now.
                await self.tiers.backend.close()
                self.pool.close()
                for h in self.headers:
                    h.close()
                self.notifier.close()
                log.info("stopped: pid %d serves in this instance's place", self.takeover.handed_to)
                return
        timeout = self.cfg.shutdown.flush_timeout
        if self.metrics is not None:
            await self.metrics.stop()
        if self.server is not None:
            await self.server.stop(timeout=min(timeout, self.cfg.server.request_timeout))
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.tiers is not None:
            if self.tiers.connector is not None:
                dirty = len(self.tiers.index.dirty) + self.tiers.backup.pending
                if dirty:
                    log.info("writing %d pages not yet in L3 before exit (up to %.0fs)", dirty, timeout)
            answer = await self.tiers.flush(timeout)
            if not answer["flushed"]:
                log.error(
                    "shutdown: %d acknowledged pages are not in L3 and go with L2 (%d still queued at "
                    "shutdown.flush_timeout, %d refused by the backend, %d with no backend attached); %d "
                    "were lost before, since the last flush",
                    answer["not_in_l3"],
                    self.tiers.backup.pending if self.tiers.connector is not None else 0,
                    len(self.tiers.life.given_up),
                    len(self.tiers.stranded),
                    answer["lost"],
                )
            await self.tiers.stop()
            self.warm.save()
            kept_l2.keep_l2(self)
            await self.tiers.backend.close()
        if self.pool is not None:
            self.pool.close()
        for h in self.headers:
            h.close()
        self.notifier.close()
        log.info("stopped")

    async def run(self, listen_sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if self.should_exit is None:
            self.should_exit = asyncio.Event()
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        # Installed before start-up and kept until the very end: a second Ctrl-C, or a service manager
        # signalling again, must not interrupt the final flush with a KeyboardInterrupt.
        for sig in sigs:
            loop.add_signal_handler(sig, self.handle_signal, sig)
        try:
            await self.startup(listen_sock)
            await self.main_loop()
        finally:
            try:
                await self.shutdown()
            finally:
                for sig in sigs:
                    loop.remove_signal_handler(sig)

    def handle_signal(self, sig: int) -> None:
        if self.should_exit.is_set():
            log.info("received %s while shutting down; still finishing", signal.Signals(sig).name)
            return
        if sig in (signal.SIGINT, signal.SIGTERM):
            log.info(
                "received %s: finishing requests in flight and backups, then exiting",
                signal.Signals(sig).name,
            )
            self.should_exit.set()
        elif sig == signal.SIGHUP:
            if not self._started:
                # The parts a reload points at the new configuration are not all built yet, and its
                # READY=1 would tell systemd the daemon is up before it listens.
                log.info("received SIGHUP while starting: reloading %s once started", self.config_path)
                self._reload_pending = True
                return
            log.info("received SIGHUP: reloading %s", self.config_path)
            self._spawn(self.reload())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watchdog(self, interval: float) -> None:
        # The ping comes from a coroutine on the event loop: a loop that is stuck stops pinging, and
        # systemd restarts the daemon. So does a copy executor with a job that never ends.
        stalled = False
        while True:
            age = self.server.regions.copier.oldest_age() if self.server else 0.0
            if age <= self.cfg.regions.copy_stall_timeout:
                self.notifier.watchdog()
                stalled = False
            elif not stalled:
                stalled = True
                log.error(
                    "a region copy has run for %.0fs (regions.copy_stall_timeout): no longer pinging the "
                    "watchdog",
                    age,
                )
            await asyncio.sleep(interval)

    # The L3 backend: attached at start, by a reload that changes it, and by `ctl backend attach`.

    async def _attach_configured(self, startup: bool = False) -> None:
        connector = build(self.cfg)
        if connector is None:
            log.info('no L3 backend (storage.backend = "none"): L2 only')
            await self.tiers.backend.attach(None)
            return
        try:
            await connector.start()
            await self.tiers.backend.attach(connector, probe=True)
        except BaseException as e:
            await _close_quietly(connector)
            if not startup or not isinstance(e, BackendError):
                raise
            log.error(
                "L3 backend %s is not usable (%s); serving from L2 only and retrying with backoff",
                connector.name,
                e,
            )
            cfg = self.cfg
            self.tiers.backend.attach_when_ready(lambda: build(cfg), e)
            return
        log.info("L3 backend %s attached", connector.name)

    async def _attach_named(self, name: Any) -> None:
        """`ctl backend attach [name]`: builds, starts and probes the backend (default: the configured one)
        from the running configuration, and swaps it in. Every refusal is a HicachedError saying why."""
        if name is None or name == "":
            name = self.cfg.storage.backend
        if name not in ("file", "redis", "s3"):
            raise HicachedError(BAD_REQUEST, f"cannot attach backend {shown(name)}: use file, redis or s3")
        try:
            config.check_backend(self.cfg, name)
        except config.ConfigError as e:
            raise HicachedError(BAD_REQUEST, f"cannot attach backend {name}: {e}") from None
        connector: Connector | None = None
        try:
            connector = build(self.cfg, name)
            await connector.start()
            await self.tiers.backend.attach(connector, probe=True)
        except Exception as e:
            if connector is not None:
                await _close_quietly(connector)
            self.tiers.counters["backend.swap_failures"] += 1
            if isinstance(e, BackendError):
                raise HicachedError(e.code, f"backend {name} was not attached: {e}") from None
            # Not a failure the connector foresaw (a bug, or a library refusing a setting): its traceback
            # goes to the log, and the operator still gets a refusal that says what happened.
            log.error("backend %s was not attached: unexpected %s", name, type(e).__name__, exc_info=True)
            raise HicachedError(
                BACKEND_UNAVAILABLE, f"backend {name} was not attached: unexpected {type(e).__name__}: {e}"
            ) from None
        self.tiers.counters["backend.swaps"] += 1
        log.info("backend %s attached by ctl", name)

    # The operator's levers (controls.py) and L2's snapshot (kept.py) as the daemon's own methods: signals,
    # the server's control requests, the takeover endpoint and tests call them here.

    async def reload(self) -> dict[str, Any]:
        """Re-read the configuration file and apply what can change live (controls.reload)."""
        return await controls.reload(self)

    def _control_handlers(self) -> dict[str, Any]:
        return controls.handlers(self)

    def status(self) -> dict[str, Any]:
        return controls.status(self)

    def status_line(self) -> str:
        """One line for `systemctl status` (controls.status_line)."""
        return controls.status_line(self)

    def l2_snapshot(self, arena: int) -> tuple[keep.Snapshot, int]:
        """A snapshot of one arena's index and a sealed memfd holding it (kept.l2_snapshot)."""
        return kept_l2.l2_snapshot(self, arena)


async def _close_quietly(connector: Connector) -> None:
    """Closes a connector that was not attached; a failure to close is logged, not raised over the error
    that is being reported."""
    try:
        await connector.close()
    except Exception:
        log.warning("closing backend %s that was not attached failed", connector.name, exc_info=True)
