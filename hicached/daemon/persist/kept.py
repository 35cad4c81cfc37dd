"""Keeping L2 over restarts and crashes: the pools (and their index snapshots or slot headers) taken back
from systemd's fd store or a takeover at start, verified and served again, and handed to the fd store."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from hicached.config import Config
from hicached.daemon.l2.pool import Pool, arena_sizes, check_kept_fd
from hicached.daemon.persist import headers as slot_headers
from hicached.daemon.persist import keep
from hicached.daemon.service.notify import fd_store_max, passed_fds, take_passed

log = logging.getLogger("hicached.daemon")

# `daemon` below is a hicached.daemon.service.lifecycle.Daemon (not imported: the lifecycle imports this
# module).


def take(daemon: Any) -> tuple[Pool, keep.Snapshot | None, slot_headers.Headers | None] | None:
    """The previous daemon's pool, with its index snapshot or its slot headers, passed back by systemd's
    fd store, when they describe a pool of this configuration; None otherwise (one log line says why)."""
    pool_fds, index_fds = take_passed(keep.POOL_FDNAME), take_passed(keep.INDEX_FDNAME)
    meta_fds = take_passed(keep.META_FDNAME)
    if daemon.cfg.tenants:
        for fd in pool_fds + index_fds + meta_fds:
            os.close(fd)
        if pool_fds or index_fds or meta_fds:
            for name in keep.FDNAMES:
                daemon.notifier.remove_stored_fd(name)
            log.warning(
                "the L2 pool kept over the restart is not used: it was one pool for every engine, and "
                "[tenants] give each tenant a pool of its own; starting with fresh pools"
            )
        return _take_tenants(daemon)
    _drop_tenants(daemon)
    if not pool_fds and not index_fds and not meta_fds:
        return None
    # Whatever comes of it, the snapshot goes: a later start (after a crash) must not be handed one that
    # no longer describes the pool. The pool and its slot headers stay stored while they are this
    # daemon's (a crash keeps them), and go if they are not used: systemd would keep their memory.
    daemon.notifier.remove_stored_fd(keep.INDEX_FDNAME)
    try:
        return adopt(daemon.cfg, pool_fds, index_fds, meta_fds)
    except (ValueError, OSError, MemoryError) as e:
        daemon.notifier.remove_stored_fd(keep.POOL_FDNAME)
        daemon.notifier.remove_stored_fd(keep.META_FDNAME)
        log.warning(
            "the L2 pool kept over the restart is not used: %s; starting with a fresh pool (the warm "
            "list refills it from L3)",
            e,
        )
        return None


def arena_layout(cfg: Config) -> list[tuple[str, int]] | None:
    """The pool's arenas (name, bytes) this configuration makes; None without [tenants]."""
    tenants = {name: t.capacity for name, t in cfg.tenants.items()}
    return arena_sizes(tenants, cfg.pool.capacity, cfg.pool.slab_size)


def _take_tenants(daemon: Any) -> tuple[Pool, None, None] | None:
    """With [tenants]: each tenant's pool kept over the restart (systemd's fd store: POOL_FDNAME.TENANT)
    with its index snapshot (INDEX_FDNAME.TENANT, a planned restart) or its slot headers
    (META_FDNAME.TENANT, stored at start: a crash), taken back where they describe that tenant's pool of
    this configuration; the others start empty. The pool of every tenant, kept or fresh (adopt_tenants);
    None when nothing was kept."""
    passed: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for name, _ in arena_layout(daemon.cfg) or []:
        names = [keep.tenant_fdname(n, name) for n in keep.FDNAMES]  # pool, index, slot headers
        fds = (take_passed(names[0]), take_passed(names[1]), take_passed(names[2]))
        if not any(fds):
            continue
        # Whatever comes of it, the snapshot goes: a later start (after a crash) must not be handed one
        # that no longer describes the pool. The pool and its slot headers stay stored while they are this
        # daemon's (a crash keeps them); _forget_tenant lets go of those that are not used.
        if fds[1]:
            daemon.notifier.remove_stored_fd(names[1])
        passed[name] = fds
    _drop_tenants(daemon)
    return adopt_tenants(daemon, passed) if passed else None


def adopt_tenants(
    daemon: Any, passed: dict[str, tuple[list[int], list[int], list[int]]], strict: bool = False
) -> tuple[Pool, None, None] | None:
    """The pool of every tenant, from the tenants' pools of a previous instance (`passed`: tenant ->
    its pool, index snapshot and slot header fds, from systemd's fd store or a takeover) where they
    describe that tenant's pool of this configuration, fresh for the others; what restores each waits in
    the daemon's _kept_tenants. A tenant whose pool does not fit starts empty (one log line), or, `strict` (a
    takeover), fails it all: ValueError, OSError or MemoryError. None when none was kept. Every fd
    passed is closed or owned by the Pool or the Headers."""
    cfg = daemon.cfg
    arenas = arena_layout(cfg) or []
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
                _forget_tenant(daemon, name)
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
                _forget_tenant(daemon, name)
            log.warning("the tenants' L2 pools kept over the restart are not used: %s; starting empty", e)
            return None
        daemon._kept_tenants = {}
        for name, snapshot in snapshots.items():
            arena = pool.arena(name).index
            try:
                headers, snapshot = slot_headers.adopt(
                    metas.pop(name), pool, cfg.pool.slab_size, snapshot, arena
                )
            except (ValueError, OSError) as e:  # neither a snapshot nor usable slot headers
                _forget_tenant(daemon, name, pool=False)
                log.warning(
                    "tenant %s's L2 pool kept over the restart is not used: %s; it starts empty", name, e
                )
                continue
            daemon._kept_tenants[arena] = (snapshot, headers)
        return pool, None, None
    finally:
        for fd in [fd for fds in passed.values() for some in fds for fd in some]:
            os.close(fd)
        for fd in [*kept.values(), *(fd for fds in metas.values() for fd in fds)]:
            os.close(fd)


def _forget_tenant(daemon: Any, name: str, pool: bool = True) -> None:
    """A tenant's kept pool (or, `pool` False, only its slot headers) not used: out of systemd's fd
    store (which would keep its memory, and hand it to the next start beside the fresh one)."""
    daemon.notifier.remove_stored_fd(keep.tenant_fdname(keep.META_FDNAME, name))
    if pool:
        daemon.notifier.remove_stored_fd(keep.tenant_fdname(keep.POOL_FDNAME, name))


def _drop_tenants(daemon: Any) -> None:
    """Tenants' pools kept for a configuration that no longer has them: let go (systemd keeps their
    memory while they are stored)."""
    for name in [n for n in passed_fds() if keep.is_kept_fdname(n) and n not in keep.FDNAMES]:
        for fd in take_passed(name):
            os.close(fd)
        daemon.notifier.remove_stored_fd(name)
        log.info("dropped %s kept over the restart: no such tenant's pool now", name)


def tenants_headers(daemon: Any) -> None:
    """With [tenants]: each arena's slot headers (kept, or made here under a service manager whose fd
    store holds 3 fds an arena) in daemon.headers, for the tiers to be handed (headers.observers),
    and stored with the arena's pool. Before the tiers are built."""
    kept = {i: h for i, (_, h) in daemon._kept_tenants.items() if h is not None}
    arenas = daemon.pool.arenas
    room = daemon.notifier.enabled and _fd_store_has_room(3 * len(arenas), "over a crash")
    if room:
        for a in arenas:
            if a.index not in kept:
                kept[a.index] = slot_headers.Headers.create(daemon.pool, daemon.cfg.pool.slab_size, a.index)
    daemon.headers = [kept[i] for i in sorted(kept)]
    if not daemon.headers:
        return
    for h in daemon.headers:
        h.mark_adopted()
    if not room:
        return
    stored = 0
    for h in daemon.headers:
        name = arenas[h.arena].name
        meta_name = keep.tenant_fdname(keep.META_FDNAME, name)
        if h.fresh:
            daemon.notifier.remove_stored_fd(meta_name)  # another of a pool not used: never two
        # Stored again after a restart: systemd keeps one copy of an fd it already holds.
        stored += daemon.notifier.store_fd(meta_name, h.fd) and daemon.notifier.store_fd(
            keep.tenant_fdname(keep.POOL_FDNAME, name), arenas[h.arena].fd
        )
    if stored:
        log.info(
            "%d tenants' L2 pools and their slot headers handed to the service manager's fd store: kept "
            "over a crash",
            stored,
        )


async def restore(daemon: Any, snapshot: keep.Snapshot | None, headers: slot_headers.Headers | None) -> None:
    """The pool kept over a restart (without [tenants]) served again, verified by keep.restore: from its
    index snapshot, or (none came with it: a crash) from its slot headers, scanned first. Before the
    backend attaches (which queues the kept pages not in L3 yet) and before the socket listens (a page is
    served only once verified)."""
    scanned = None
    if headers is not None and snapshot is None:
        # No index snapshot (a crash): the index is rebuilt from the slot headers.
        scanned = await asyncio.get_running_loop().run_in_executor(None, headers.scan)
        snapshot = scanned.snapshot
    if snapshot is None:
        return
    r = daemon.restored = await keep.restore(daemon.tiers, daemon.pool, snapshot)
    if headers is not None:
        headers.restored(snapshot, r.entries)
    if scanned is not None:
        r.dropped += scanned.dropped
        daemon.tiers.counters["keep.dropped"] += scanned.dropped
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


async def restore_tenants(daemon: Any) -> None:
    """The tenants' kept pools (adopt_tenants) served again, each verified as keep.restore does: from its
    index snapshot, or from its slot headers (scanned first: a crash)."""
    kept, daemon._kept_tenants = daemon._kept_tenants, {}
    loop = asyncio.get_running_loop()
    for arena, (snap, headers) in sorted(kept.items()):
        name = daemon.pool.arenas[arena].name
        scanned = None
        if snap is None:
            scanned = await loop.run_in_executor(None, headers.scan)
            snap = scanned.snapshot
        r = await keep.restore(daemon.tiers, daemon.pool, snap, arena=arena)
        if headers is not None:
            headers.restored(snap, r.entries)
        if scanned is not None:
            r.dropped += scanned.dropped
            daemon.tiers.counters["keep.dropped"] += scanned.dropped
            log.info(
                "no index snapshot came with tenant %s's kept pool (a crash): its index was rebuilt from "
                "%d slot headers in %.2fs; %d of them did not check and were dropped",
                name,
                scanned.records,
                scanned.seconds,
                scanned.dropped,
            )
        total = daemon.restored
        if total is None:
            total = daemon.restored = keep.Restored(l3=r.l3)
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


def adopt(
    cfg: Config, pool_fds: list[int], index_fds: list[int], meta_fds: list[int] | None = None
) -> tuple[Pool, keep.Snapshot | None, slot_headers.Headers | None]:
    """The pool of a previous instance (systemd's fd store, or a takeover) with its index snapshot, or
    its slot headers to rebuild the index from (snapshot None), checked against this configuration and
    the memfd itself; ValueError, OSError or MemoryError saying why otherwise. Every fd passed is closed
    or owned by the Pool or Headers returned."""
    p = cfg.pool
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


def store_l2(daemon: Any) -> None:
    """The pool and its slot headers go to systemd's fd store at start and stay there while the daemon
    runs: after a crash the next start gets them back and rebuilds the index from the headers (with
    [tenants]: tenants_headers, each tenant's on its own)."""
    if not daemon.notifier.enabled:
        return
    if not _fd_store_has_room():
        return
    # Stored again after a restart: systemd keeps one copy of an fd it already holds.
    if daemon.notifier.store_fd(keep.META_FDNAME, daemon.headers[0].fd) and daemon.notifier.store_fd(
        keep.POOL_FDNAME, daemon.pool.fd
    ):
        log.info("L2 and its slot headers handed to the service manager's fd store: kept over a crash")


def keep_l2(daemon: Any) -> None:
    """Hands the pool memfd and a snapshot of its index to systemd's fd store, for the next start to
    serve the same pages (a planned restart keeps L2). Only under systemd, after a full start-up."""
    if not daemon.notifier.enabled or not daemon._started or daemon.pool is None or daemon.tiers is None:
        return
    if daemon.tiers.tenanted:
        _keep_tenants(daemon)
        return
    if not _fd_store_has_room():
        return
    try:
        snapshot, fd = l2_snapshot(daemon)
    except OSError as e:
        log.warning("could not write the snapshot of L2's index (%s): L2 not kept", e)
        return
    try:
        # The index first: a pool stored without it is refused at the next start anyway.
        if daemon.notifier.store_fd(keep.INDEX_FDNAME, fd) and daemon.notifier.store_fd(
            keep.POOL_FDNAME, daemon.pool.fd
        ):
            log.info(
                "L2 (%d pages) and its index handed to the service manager's fd store: kept for the next "
                "start if the unit sets FileDescriptorStoreMax=",
                len(snapshot.pages),
            )
    finally:
        os.close(fd)


def _keep_tenants(daemon: Any) -> None:
    """keep_l2 with [tenants]: each tenant's pool and its index snapshot, stored on their own."""
    if not _fd_store_has_room(2 * len(daemon.pool.arenas)):
        return
    conn = daemon.tiers.connector
    l3 = repr(conn.location()) if conn is not None else None
    for a in daemon.pool.arenas:
        try:
            snapshot = keep.take(daemon.tiers, daemon.pool, l3, arena=a.index)
            fd = keep.to_memfd(keep.encode(snapshot))
        except OSError as e:
            log.warning("could not write the snapshot of tenant %s's L2 (%s): not kept", a.name, e)
            continue
        try:
            if daemon.notifier.store_fd(keep.tenant_fdname(keep.INDEX_FDNAME, a.name), fd) and (
                daemon.notifier.store_fd(keep.tenant_fdname(keep.POOL_FDNAME, a.name), a.fd)
            ):
                log.info(
                    "tenant %s's L2 (%d pages) and its index handed to the service manager's fd store",
                    a.name,
                    len(snapshot.pages),
                )
        finally:
            os.close(fd)


def l2_snapshot(daemon: Any, arena: int = 0) -> tuple[keep.Snapshot, int]:
    """A snapshot of L2's index (of one arena's pages, with [tenants]), and a sealed memfd holding it (the
    caller's to close); once nothing changes L2 any more (tiers stopped)."""
    conn = daemon.tiers.connector
    l3 = repr(conn.location()) if conn is not None else None
    snapshot = keep.take(daemon.tiers, daemon.pool, l3, arena=arena)
    return snapshot, keep.to_memfd(keep.encode(snapshot))


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
