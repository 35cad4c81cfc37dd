"""The daemon's lifecycle: build the parts from a config, start them in order, stop them in reverse;
and the operator's levers on a running daemon: reload, backend attach/detach, drain, flush."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any

from hicached import config
from hicached.common.errors import BACKEND_UNAVAILABLE, BAD_REQUEST, HicachedError
from hicached.config import Config
from hicached.config.diff import plan
from hicached.connectors import BackendError, Connector, build
from hicached.daemon.l2 import headers as slot_headers
from hicached.daemon.l2 import keep
from hicached.daemon.l2.pool import Pool, arena_sizes, available_memory, check_capacity, check_kept_fd
from hicached.daemon.sched import warmup
from hicached.daemon.sched.tiers import Tiers
from hicached.daemon.server.listener import Server
from hicached.daemon.service import takeover
from hicached.daemon.service.metrics import MetricsServer
from hicached.daemon.service.notify import Notifier, fd_store_max, passed_fds, take_passed, watchdog_interval

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
        # The warm list read at start until it has been replayed: kept in the lists written meanwhile, so
        # that a stop (or a backend late at start) before the replay is done does not lose it. None until it
        # is read: nothing is written over it then.
        self._warm_pending: list[warmup.WarmPage] | None = None
        self._snapshot_task: asyncio.Task[Any] | None = None
        self.restored: keep.Restored | None = None  # L2 taken back from systemd's fd store at start
        # [tenants]: arena -> what restores its kept pool: its index snapshot, or its slot headers to scan
        self._kept_tenants: dict[int, tuple[keep.Snapshot | None, slot_headers.Headers | None]] = {}
        self.headers: slot_headers.Headers | None = None  # the pool's slot headers (what a crash keeps)
        self.arena_headers: list[slot_headers.Headers] = []  # [tenants]: each arena's slot headers
        self.takeover: takeover.Endpoint | None = None  # where a new instance asks to take over from this one

    # Lifecycle.

    async def startup(self, listen_sock: socket.socket | None = None) -> None:
        if self.should_exit is None:
            self.should_exit = asyncio.Event()
        cfg = self.cfg
        kept = self._take_kept()
        handed = None
        if kept is None and listen_sock is None:
            # Another instance serving this socket hands it over, with L2 (before this one allocates a pool).
            path = config.resolve_path(cfg, cfg.server.socket)
            arenas = self._arenas()
            pool_bytes = sum(n for _, n in arenas) if arenas else cfg.pool.capacity
            handed = await takeover.request(path, pool_bytes, cfg.pool.slab_size, arenas)
        if handed is None:
            await self._start(kept, listen_sock)
            return
        try:
            if handed.arenas:
                passed = {name: ([pool_fd], [index_fd], []) for name, pool_fd, index_fd in handed.arenas}
                kept = self._adopt_tenants(passed, strict=True)
            else:
                kept = self._adopt_kept([handed.pool_fd], [handed.index_fd])
            listen_sock = handed.listen
            log.info(
                "taking over from pid %d: its socket, L2 (%d pages, %d owed to L3%s) and its index",
                handed.pid,
                handed.pages,
                handed.owed,
                f"; {len(handed.arenas)} tenants' pools" if handed.arenas else "",
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
        self,
        kept: tuple[Pool, keep.Snapshot | None, slot_headers.Headers | None] | None,
        listen_sock: socket.socket | None,
        handed: takeover.Handed | None = None,
    ) -> None:
        cfg = self.cfg
        snapshot = headers = None
        if kept is not None:
            self.pool, snapshot, headers = kept
        else:
            await self._memory_for_pool()
            tenants = {name: t.capacity for name, t in cfg.tenants.items()}
            arenas = arena_sizes(tenants, cfg.pool.capacity, cfg.pool.slab_size)
            try:
                self.pool = Pool(cfg.pool.capacity, prefault=cfg.pool.prefault, arenas=arenas)
            except MemoryError as e:
                raise RuntimeError(f"{e}; lower pool.capacity, or free memory") from None
        log.info("L2 pool of %d bytes ready (slabs of %d bytes)", self.pool.size, cfg.pool.slab_size)
        self.tiers = Tiers(cfg, self.pool, None)
        if self.tiers.tenanted:
            self._tenants_headers()
        elif headers is None and self.notifier.enabled:
            # Only under a service manager: without one to keep them over a crash nothing reads them.
            headers = slot_headers.Headers.create(self.pool, cfg.pool.slab_size)
        self.headers = headers
        if headers is not None:
            headers.mark_adopted()
            headers.attach(self.tiers)
            self._store_l2()
        self.tiers.start()
        scanned = None
        if headers is not None and snapshot is None and kept is not None:
            # No index snapshot (a crash): the index is rebuilt from the slot headers.
            scanned = await asyncio.get_running_loop().run_in_executor(None, headers.scan)
            snapshot = scanned.snapshot
        if snapshot is not None:
            # Before the backend attaches (which queues the kept pages not in L3 yet) and before the socket
            # listens (a page is served only once verified).
            r = self.restored = await keep.restore(self.tiers, self.pool, snapshot)
            if headers is not None:
                headers.restored(snapshot, r.entries)
            if scanned is not None:
                r.dropped += scanned.dropped
                self.tiers.counters["keep.dropped"] += scanned.dropped
                log.info(
                    "no index snapshot came with the kept pool (a crash): its index was rebuilt from %d slot "
                    "headers in %.2fs; %d of them did not check and were dropped",
                    scanned.records,
                    scanned.seconds,
                    scanned.dropped,
                )
            log.info(
                "L2 kept over the restart: %d pages served again after %.2fs of verifying; %d did not verify "
                "and were dropped (keep.dropped); %d are owed to L3 and queued for it",
                r.pages,
                r.seconds,
                r.dropped,
                r.owed,
            )
        if self._kept_tenants:
            await self._restore_tenants()
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
            self._spawn(self._warmup())
        else:
            self._warm_pending = []
        self._follow_snapshot_interval()
        interval = watchdog_interval()
        if interval:
            self._spawn(self._watchdog(interval))
        self.notifier.ready(self.status_line())
        self._started = True
        if self._reload_pending:
            self._reload_pending = False
            self._spawn(self.reload())

    def _take_kept(self) -> tuple[Pool, keep.Snapshot | None, slot_headers.Headers | None] | None:
        """The previous daemon's pool, with its index snapshot or its slot headers, passed back by systemd's
        fd store, when they describe a pool of this configuration; None otherwise (one log line says why)."""
        pool_fds, index_fds = take_passed(keep.POOL_FDNAME), take_passed(keep.INDEX_FDNAME)
        meta_fds = take_passed(keep.META_FDNAME)
        if self.cfg.tenants:
            for fd in pool_fds + index_fds + meta_fds:
                os.close(fd)
            if pool_fds or index_fds or meta_fds:
                for name in keep.FDNAMES:
                    self.notifier.remove_stored_fd(name)
                log.warning(
                    "the L2 pool kept over the restart is not used: it was one pool for every engine, and "
                    "[tenants] give each tenant a pool of its own; starting with fresh pools"
                )
            return self._take_kept_tenants()
        self._drop_kept_tenants()
        if not pool_fds and not index_fds and not meta_fds:
            return None
        # Whatever comes of it, the snapshot goes: a later start (after a crash) must not be handed one that
        # no longer describes the pool. The pool and its slot headers stay stored while they are this
        # daemon's (a crash keeps them), and go if they are not used: systemd would keep their memory.
        self.notifier.remove_stored_fd(keep.INDEX_FDNAME)
        try:
            return self._adopt_kept(pool_fds, index_fds, meta_fds)
        except (ValueError, OSError, MemoryError) as e:
            self.notifier.remove_stored_fd(keep.POOL_FDNAME)
            self.notifier.remove_stored_fd(keep.META_FDNAME)
            log.warning(
                "the L2 pool kept over the restart is not used: %s; starting with a fresh pool (the warm "
                "list refills it from L3)",
                e,
            )
            return None

    def _arenas(self) -> list[tuple[str, int]] | None:
        """The pool's arenas (name, bytes) this configuration makes; None without [tenants]."""
        cfg = self.cfg
        tenants = {name: t.capacity for name, t in cfg.tenants.items()}
        return arena_sizes(tenants, cfg.pool.capacity, cfg.pool.slab_size)

    def _take_kept_tenants(self) -> tuple[Pool, None, None] | None:
        """With [tenants]: each tenant's pool kept over the restart (systemd's fd store: POOL_FDNAME.TENANT)
        with its index snapshot (INDEX_FDNAME.TENANT, a planned restart) or its slot headers
        (META_FDNAME.TENANT, stored at start: a crash), taken back where they describe that tenant's pool of
        this configuration; the others start empty. The pool of every tenant, kept or fresh (_adopt_tenants);
        None when nothing was kept."""
        passed: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for name, _ in self._arenas() or []:
            names = [keep.tenant_fdname(n, name) for n in keep.FDNAMES]  # pool, index, slot headers
            fds = (take_passed(names[0]), take_passed(names[1]), take_passed(names[2]))
            if not any(fds):
                continue
            # Whatever comes of it, the snapshot goes: a later start (after a crash) must not be handed one
            # that no longer describes the pool. The pool and its slot headers stay stored while they are this
            # daemon's (a crash keeps them); _forget_tenant lets go of those that are not used.
            if fds[1]:
                self.notifier.remove_stored_fd(names[1])
            passed[name] = fds
        self._drop_kept_tenants()
        return self._adopt_tenants(passed) if passed else None

    def _adopt_tenants(
        self, passed: dict[str, tuple[list[int], list[int], list[int]]], strict: bool = False
    ) -> tuple[Pool, None, None] | None:
        """The pool of every tenant, from the tenants' pools of a previous instance (`passed`: tenant ->
        its pool, index snapshot and slot header fds, from systemd's fd store or a takeover) where they
        describe that tenant's pool of this configuration, fresh for the others; what restores each waits in
        _kept_tenants. A tenant whose pool does not fit starts empty (one log line), or, `strict` (a
        takeover), fails it all: ValueError, OSError or MemoryError. None when none was kept. Every fd
        passed is closed or owned by the Pool or the Headers."""
        cfg = self.cfg
        arenas = self._arenas() or []
        sizes = dict(arenas)
        kept: dict[str, int] = {}
        snapshots: dict[str, keep.Snapshot | None] = {}
        metas: dict[str, list[int]] = {}
        try:
            for name, (pool_fds, index_fds, meta_fds) in passed.items():
                try:
                    if name not in sizes:
                        raise ValueError("no such tenant here")
                    if len(pool_fds) != 1 or len(index_fds) > 1 or len(meta_fds) > 1:
                        raise ValueError(
                            f"{len(pool_fds)} pool fds, {len(index_fds)} index fds and {len(meta_fds)} slot "
                            "header fds were passed, not 1 each"
                        )
                    if not index_fds and not meta_fds:
                        raise ValueError("neither an index snapshot nor slot headers were kept with it")
                    check_kept_fd(pool_fds[0], sizes[name])
                    snapshot = None
                    if index_fds:
                        snapshot = keep.decode(keep.read_fd(index_fds[0]))
                        keep.check(snapshot, sizes[name], cfg.pool.slab_size, os.fstat(pool_fds[0]).st_ino)
                    kept[name], snapshots[name] = pool_fds.pop(), snapshot
                    metas[name] = [meta_fds.pop()] if meta_fds else []
                except (ValueError, OSError) as e:
                    if strict:
                        raise ValueError(f"tenant {name}'s L2 pool: {e}") from None
                    self._forget_tenant(name)
                    log.warning(
                        "tenant %s's L2 pool kept over the restart is not used: %s; it starts empty", name, e
                    )
            if not kept:
                return None
            taken, kept = kept, {}  # the Pool's from here, whatever comes of it
            try:
                pool = Pool(cfg.pool.capacity, prefault=cfg.pool.prefault, arenas=arenas, kept=taken)
            except (ValueError, OSError, MemoryError) as e:
                if strict:
                    raise
                for name in taken:
                    self._forget_tenant(name)
                log.warning("the tenants' L2 pools kept over the restart are not used: %s; starting empty", e)
                return None
            self._kept_tenants = {}
            for name, snapshot in snapshots.items():
                arena = pool.arena(name).index
                try:
                    headers, snapshot = slot_headers.adopt(
                        metas.pop(name), pool, cfg.pool.slab_size, snapshot, arena
                    )
                except (ValueError, OSError) as e:  # neither a snapshot nor usable slot headers
                    self._forget_tenant(name, pool=False)
                    log.warning(
                        "tenant %s's L2 pool kept over the restart is not used: %s; it starts empty", name, e
                    )
                    continue
                self._kept_tenants[arena] = (snapshot, headers)
            return pool, None, None
        finally:
            for fd in [fd for fds in passed.values() for some in fds for fd in some]:
                os.close(fd)
            for fd in [*kept.values(), *(fd for fds in metas.values() for fd in fds)]:
                os.close(fd)

    def _forget_tenant(self, name: str, pool: bool = True) -> None:
        """A tenant's kept pool (or, `pool` False, only its slot headers) not used: out of systemd's fd
        store (which would keep its memory, and hand it to the next start beside the fresh one)."""
        self.notifier.remove_stored_fd(keep.tenant_fdname(keep.META_FDNAME, name))
        if pool:
            self.notifier.remove_stored_fd(keep.tenant_fdname(keep.POOL_FDNAME, name))

    def _drop_kept_tenants(self) -> None:
        """Tenants' pools kept for a configuration that no longer has them: let go (systemd keeps their
        memory while they are stored)."""
        for name in [n for n in passed_fds() if keep.is_kept_fdname(n) and n not in keep.FDNAMES]:
            for fd in take_passed(name):
                os.close(fd)
            self.notifier.remove_stored_fd(name)
            log.info("dropped %s kept over the restart: no such tenant's pool now", name)

    def _tenants_headers(self) -> None:
        """With [tenants]: each arena's slot headers (kept, or made here under a service manager whose fd
        store holds 3 fds an arena), wired into the page lifecycle and stored with the arena's pool."""
        kept = {i: h for i, (_, h) in self._kept_tenants.items() if h is not None}
        arenas = self.pool.arenas
        room = self.notifier.enabled and _fd_store_has_room(3 * len(arenas), "over a crash")
        if room:
            for a in arenas:
                if a.index not in kept:
                    kept[a.index] = slot_headers.Headers.create(self.pool, self.cfg.pool.slab_size, a.index)
        self.arena_headers = [kept[i] for i in sorted(kept)]
        if not self.arena_headers:
            return
        for h in self.arena_headers:
            h.mark_adopted()
        slot_headers.attach_arenas(self.tiers, self.arena_headers)
        if not room:
            return
        stored = 0
        for h in self.arena_headers:
            name = arenas[h.arena].name
            meta_name = keep.tenant_fdname(keep.META_FDNAME, name)
            if h.fresh:
                self.notifier.remove_stored_fd(meta_name)  # another of a pool not used: never two
            # Stored again after a restart: systemd keeps one copy of an fd it already holds.
            stored += self.notifier.store_fd(meta_name, h.fd) and self.notifier.store_fd(
                keep.tenant_fdname(keep.POOL_FDNAME, name), arenas[h.arena].fd
            )
        if stored:
            log.info(
                "%d tenants' L2 pools and their slot headers handed to the service manager's fd store: kept "
                "over a crash",
                stored,
            )

    async def _restore_tenants(self) -> None:
        """The tenants' kept pools (_adopt_tenants) served again, each verified as keep.restore does: from its
        index snapshot, or from its slot headers (scanned first: a crash)."""
        kept, self._kept_tenants = self._kept_tenants, {}
        loop = asyncio.get_running_loop()
        for arena, (snap, headers) in sorted(kept.items()):
            name = self.pool.arenas[arena].name
            scanned = None
            if snap is None:
                scanned = await loop.run_in_executor(None, headers.scan)
                snap = scanned.snapshot
            r = await keep.restore(self.tiers, self.pool, snap, arena=arena)
            if headers is not None:
                headers.restored(snap, r.entries)
            if scanned is not None:
                r.dropped += scanned.dropped
                self.tiers.counters["keep.dropped"] += scanned.dropped
                log.info(
                    "no index snapshot came with tenant %s's kept pool (a crash): its index was rebuilt from "
                    "%d slot headers in %.2fs; %d of them did not check and were dropped",
                    name,
                    scanned.records,
                    scanned.seconds,
                    scanned.dropped,
                )
            total = self.restored
            if total is None:
                total = self.restored = keep.Restored(l3=r.l3)
            total.pages += r.pages
            total.dropped += r.dropped
            total.owed += r.owed
            total.seconds += r.seconds
            total.entries += r.entries
            log.info(
                "tenant %s's L2 kept over the restart: %d pages served again after %.2fs of verifying; %d "
                "did not verify and were dropped; %d are owed to L3 and queued for it",
                name,
                r.pages,
                r.seconds,
                r.dropped,
                r.owed,
            )

    def _adopt_kept(
        self, pool_fds: list[int], index_fds: list[int], meta_fds: list[int] | None = None
    ) -> tuple[Pool, keep.Snapshot | None, slot_headers.Headers | None]:
        """The pool of a previous instance (systemd's fd store, or a takeover) with its index snapshot, or
        its slot headers to rebuild the index from (snapshot None), checked against this configuration and
        the memfd itself; ValueError, OSError or MemoryError saying why otherwise. Every fd passed is closed
        or owned by the Pool or Headers returned."""
        p = self.cfg.pool
        meta_fds = list(meta_fds or [])
        try:
            if len(pool_fds) != 1 or len(index_fds) > 1:
                raise ValueError(
                    f"{len(pool_fds)} pool fds and {len(index_fds)} index fds were passed, not 1 each"
                )
            check_kept_fd(pool_fds[0], p.capacity)
            snapshot = None
            if index_fds:
                snapshot = keep.decode(keep.read_fd(index_fds[0]))
                keep.check(snapshot, p.capacity, p.slab_size, os.fstat(pool_fds[0]).st_ino)
            elif not meta_fds:
                raise ValueError("neither an index snapshot nor slot headers were kept with it")
            pool = Pool(p.capacity, prefault=p.prefault, fd=pool_fds.pop())
            try:
                headers, snapshot = slot_headers.adopt(meta_fds, pool, p.slab_size, snapshot)
            except BaseException:
                pool.close()
                raise
            return pool, snapshot, headers
        finally:
            for fd in pool_fds + index_fds + meta_fds:
                os.close(fd)

    def _store_l2(self) -> None:
        """The pool and its slot headers go to systemd's fd store at start and stay there while the daemon
        runs: after a crash the next start gets them back and rebuilds the index from the headers (with
        [tenants]: _tenants_headers, each tenant's on its own)."""
        if not self.notifier.enabled:
            return
        if not _fd_store_has_room():
            return
        # Stored again after a restart: systemd keeps one copy of an fd it already holds.
        if self.notifier.store_fd(keep.META_FDNAME, self.headers.fd) and self.notifier.store_fd(
            keep.POOL_FDNAME, self.pool.fd
        ):
            log.info("L2 and its slot headers handed to the service manager's fd store: kept over a crash")

    def _keep_l2(self) -> None:
        """Hands the pool memfd and a snapshot of its index to systemd's fd store, for the next start to
        serve the same pages (a planned restart keeps L2). Only under systemd, after a full start-up."""
        if not self.notifier.enabled or not self._started or self.pool is None or self.tiers is None:
            return
        if self.tiers.tenanted:
            self._keep_tenants()
            return
        if not _fd_store_has_room():
            return
        try:
            snapshot, fd = self.l2_snapshot()
        except OSError as e:
            log.warning("could not write the snapshot of L2's index (%s): L2 not kept", e)
            return
        try:
            # The index first: a pool stored without it is refused at the next start anyway.
            if self.notifier.store_fd(keep.INDEX_FDNAME, fd) and self.notifier.store_fd(
                keep.POOL_FDNAME, self.pool.fd
            ):
                log.info(
                    "L2 (%d pages) and its index handed to the service manager's fd store: kept for the next "
                    "start if the unit sets FileDescriptorStoreMax=",
                    len(snapshot.pages),
                )
        finally:
            os.close(fd)

    def _keep_tenants(self) -> None:
        """_keep_l2 with [tenants]: each tenant's pool and its index snapshot, stored on their own."""
        if not _fd_store_has_room(2 * len(self.pool.arenas)):
            return
        conn = self.tiers.connector
        l3 = repr(conn.location()) if conn is not None else None
        for a in self.pool.arenas:
            try:
                snapshot = keep.take(self.tiers, self.pool, l3, arena=a.index)
                fd = keep.to_memfd(keep.encode(snapshot))
            except OSError as e:
                log.warning("could not write the snapshot of tenant %s's L2 (%s): not kept", a.name, e)
                continue
            try:
                if self.notifier.store_fd(keep.tenant_fdname(keep.INDEX_FDNAME, a.name), fd) and (
                    self.notifier.store_fd(keep.tenant_fdname(keep.POOL_FDNAME, a.name), a.fd)
                ):
                    log.info(
                        "tenant %s's L2 (%d pages) and its index handed to the service manager's fd store",
                        a.name,
                        len(snapshot.pages),
                    )
            finally:
                os.close(fd)

    def l2_snapshot(self, arena: int = 0) -> tuple[keep.Snapshot, int]:
        """A snapshot of L2's index (of one arena's pages, with [tenants]), and a sealed memfd holding it (the
        caller's to close); once nothing changes L2 any more (tiers stopped)."""
        conn = self.tiers.connector
        l3 = repr(conn.location()) if conn is not None else None
        snapshot = keep.take(self.tiers, self.pool, l3, arena=arena)
        return snapshot, keep.to_memfd(keep.encode(snapshot))

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

    def _warm_path(self) -> str:
        return config.resolve_path(self.cfg, self.cfg.warmup.state_file)

    def _warm_limit(self) -> warmup.Budget:
        """warmup.max_fraction of the pool; with tenants, of each tenant's pool."""
        fraction = self.cfg.warmup.max_fraction
        if not self.tiers.tenanted:
            return warmup.Budget(int(fraction * self.pool.size))
        return warmup.Budget([int(fraction * a.size) for a in self.pool.arenas], self.tiers.arena_of)

    async def _warmup(self) -> None:
        loop = asyncio.get_running_loop()
        pages = await loop.run_in_executor(None, warmup.load, self._warm_path())
        self._warm_pending = pages
        if not pages:
            return
        if self.tiers.connector is None:
            # Down at start (the breaker retries it), or detached: the list waits for a backend to read from.
            log.info("warmup: %d pages listed; waiting for an L3 backend to read them from", len(pages))
            await self.tiers.attached.wait()
        await warmup.warm(self.tiers, pages, self._warm_limit())
        self._warm_pending = []

    def _follow_snapshot_interval(self) -> None:
        """Runs the periodic snapshot of the warm list as warmup.enabled and snapshot_interval say (at start,
        and after a reload that changed them)."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            self._snapshot_task = None
        w = self.cfg.warmup
        if w.enabled and w.snapshot_interval > 0:
            self._snapshot_task = self._spawn(self._snapshots(w.snapshot_interval))

    async def _snapshots(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self._warm_pending is None:
                continue  # the list of the last run is not read yet: not written over
            pages = await warmup.snapshot_async(self.tiers.index, self._warm_limit())
            pages = warmup.merge(pages, self._warm_pending or [], self._warm_limit())
            try:
                await loop.run_in_executor(None, warmup.save, self._warm_path(), pages)
            except OSError as e:
                log.warning("could not write the warm list %s: %s", self._warm_path(), e)

    def _save_warm_list(self) -> None:
        if not self.cfg.warmup.enabled or self.tiers is None or self._warm_pending is None:
            # A start-up that failed (another daemon on the socket, the metrics port taken) or a stop before
            # the list was read must not touch the list.
            return
        pages = warmup.snapshot(self.tiers.index, self._warm_limit())
        pages = warmup.merge(pages, self._warm_pending, self._warm_limit())
        try:
            warmup.save(self._warm_path(), pages)
            log.info("warm list of %d pages written to %s", len(pages), self._warm_path())
        except OSError as e:
            log.warning("could not write the warm list %s: %s", self._warm_path(), e)

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
                if self.headers is not None:
                    self.headers.close()
                for h in self.arena_headers:
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
                    len(self.tiers.backup.abandoned),
                    len(self.tiers.stranded),
                    answer["lost"],
                )
            await self.tiers.stop()
            self._save_warm_list()
            self._keep_l2()
            await self.tiers.backend.close()
        if self.pool is not None:
            self.pool.close()
        if self.headers is not None:
            self.headers.close()
        for h in self.arena_headers:
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

    # Reload.

    async def reload(self) -> dict[str, Any]:
        """Re-read the configuration file and apply what can change live. Whatever fails, the daemon keeps
        running with the configuration it had, says why (the answer, `ctl status`, the systemd status line)
        and sends READY=1 after its RELOADING=1."""
        async with self._reload_lock:
            self.notifier.reloading()
            try:
                result = await self._reload()
            except (config.ConfigError, BackendError, HicachedError, OSError) as e:
                result = self._rejected(str(e))
            except Exception as e:
                # A bug rather than a bad file: logged with its traceback, and still a refusal, so that the
                # daemon goes on serving with what it had and systemd hears READY=1.
                result = self._rejected(f"unexpected {type(e).__name__}: {e}", exc_info=True)
            finally:
                self.notifier.ready(self.status_line())
            return result

    def _rejected(self, reason: str, exc_info: bool = False) -> dict[str, Any]:
        self.reloads["rejected"] += 1
        self.last_reload = f"rejected: {reason}"
        log.error("reload rejected, keeping the running configuration: %s", reason, exc_info=exc_info)
        return {"ok": False, "reason": reason}

    async def _reload(self) -> dict[str, Any]:
        if not self.config_path:
            raise HicachedError(BAD_REQUEST, "the daemon was not started from a configuration file")
        new = config.load(self.config_path)
        p = plan(self.cfg, new)
        old = self.cfg
        try:
            self._apply(p.config)
            if p.swap_backend:
                await self._attach_configured()
        except BaseException:
            self._apply(old)  # a refusal leaves nothing of the new file applied
            if p.swap_backend:
                self.tiers.counters["backend.swap_failures"] += 1
            raise
        if p.swap_backend:
            self.tiers.counters["backend.swaps"] += 1
        was, now = old.warmup, self.cfg.warmup
        if (was.enabled, was.snapshot_interval) != (now.enabled, now.snapshot_interval):
            self._follow_snapshot_interval()
        if p.restart:
            log.warning("reload: %s changed but need a restart; kept as they were", ", ".join(p.restart))
        self.reloads["ok"] += 1
        self.last_reload = "ok" + (f" (restart needed for {', '.join(p.restart)})" if p.restart else "")
        log.info("reload applied: %s", ", ".join(p.live) or "nothing changed")
        return {
            "ok": True,
            "applied": p.live,
            "restart_required": p.restart,
            "backend": self.tiers.backend.name,
        }

    def _apply(self, cfg: Config) -> None:
        """Point every part at `cfg` and adjust what runs (workers, policy, log level)."""
        was_write_back = self.tiers.write_back
        self.cfg = cfg
        self.tiers.cfg = cfg
        self.tiers.retenant()  # namespaces that moved to another tenant leave the old one's pool
        self.server.cfg = cfg
        self.tiers.backend.cfg = cfg
        st = cfg.storage
        b = self.tiers.backup
        b.batch_pages, b.batch_bytes, b.queue_pages = (
            st.backup_batch_pages,
            st.backup_batch_bytes,
            st.backup_queue_pages,
        )
        b.backoff = b.backoff.from_config(st.retry)
        b.resize(st.backup_concurrency)
        pf = self.tiers.prefetcher
        pf.batch_pages, pf.batch_bytes = st.prefetch_batch_pages, st.prefetch_batch_bytes
        pf.queue_pages = st.prefetch_queue_pages
        pf.resize(st.prefetch_concurrency)
        self.tiers.set_policy(was_write_back)
        logging.getLogger().setLevel(cfg.logging.level.upper())

    # Operator commands (hicached ctl).

    async def _attach_named(self, name: Any) -> None:
        """`ctl backend attach [name]`: builds, starts and probes the backend (default: the configured one)
        from the running configuration, and swaps it in. Every refusal is a HicachedError saying why."""
        if name is None or name == "":
            name = self.cfg.storage.backend
        if name not in ("file", "redis", "s3"):
            raise HicachedError(BAD_REQUEST, f"cannot attach backend {_shown(name)}: use file, redis or s3")
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

    def _control_handlers(self) -> dict[str, Any]:
        async def reload(session, req) -> dict:
            return await self.reload()

        async def backend(session, req) -> dict:
            action = req.get("action", "show")
            if action == "show":
                return self.tiers.backend.stats()
            if action == "detach":
                await self.tiers.backend.attach(None)
                self.tiers.counters["backend.swaps"] += 1
                log.info("backend detached by ctl: serving from L2 only")
                return self.tiers.backend.stats()
            if action == "attach":
                await self._attach_named(req.get("name"))
                return self.tiers.backend.stats()
            raise HicachedError(
                BAD_REQUEST, f"unknown backend action {_shown(action)}: show, attach or detach"
            )

        async def drain(session, req) -> dict:
            if req.get("cancel"):
                self.server.draining = False
                return {"draining": False}
            self.server.draining = True
            return {"draining": True, **await self.tiers.flush(self.cfg.shutdown.flush_timeout)}

        async def flush(session, req) -> dict:
            return await self.tiers.flush(self.cfg.shutdown.flush_timeout)

        return {
            "reload": reload,
            "backend": backend,
            "drain": drain,
            "flush": flush,
            "status": lambda session, req: self.status(),
        }

    def status(self) -> dict[str, Any]:
        out = self.server.status() if self.server else {}
        out.update(
            {
                "backend_state": self.tiers.backend.state,
                "last_reload": self.last_reload,
                "reloads": dict(self.reloads),
                "config": self.config_path or "",
            }
        )
        backend = self.tiers.backend.stats()
        if "why" in backend:  # not attached: why, and since when (a stall, failures, ctl, not started yet)
            out["backend_why"] = backend["why"]
            out["backend_since"] = backend.get("since", "")
        return out

    def status_line(self) -> str:
        """One line for `systemctl status`. The outcome of the last reload comes last: a long reason is what
        the notifier cuts, not the figures."""
        idx = self.tiers.index
        used = idx.used_bytes()
        pct = 100.0 * used / idx.capacity
        return (
            f"backend {self.tiers.backend.configured} ({self.tiers.backend.state}); "
            f"pool {pct:.0f}% of {idx.capacity >> 20} MiB, {len(idx.entries)} pages; "
            f"pid {os.getpid()}; last reload: {self.last_reload}"
        )


def _fd_store_has_room(needed: int = len(keep.FDNAMES), over: str = "over a restart") -> bool:
    """Whether the unit's fd store takes what keeping L2 hands it; a warning says so when it does not."""
    room = fd_store_max()
    if room is not None and room < needed:
        log.warning(
            "the unit's FileDescriptorStoreMax= is %d; keeping L2 %s takes %d: L2 not kept %s",
            room,
            over,
            needed,
            over,
        )
        return False
    return True


async def _close_quietly(connector: Connector) -> None:
    """Closes a connector that was not attached; a failure to close is logged, not raised over the error
    that is being reported."""
    try:
        await connector.close()
    except Exception:
        log.warning("closing backend %s that was not attached failed", connector.name, exc_info=True)


def _shown(value: Any, limit: int = 80) -> str:
    """repr of a value from a request, cut short: an answer does not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
