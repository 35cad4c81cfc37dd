"""Keeping L2 over restarts and crashes: each arena's pool (the default tenant's alone without [tenants], or
each tenant's) with its index snapshot or slot headers, taken back from systemd's fd store or a takeover at
start, verified and served again, and handed to the fd store."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from hicached.config import Config
from hicached.daemon.l2.pool import DEFAULT_ARENA, Pool, arena_sizes, check_kept_fd
from hicached.daemon.persist import headers as slot_headers
from hicached.daemon.persist import keep
from hicached.daemon.service.notify import fd_store_max, passed_fds, take_passed

log = logging.getLogger("hicached.daemon")

# `daemon` below is a hicached.daemon.service.lifecycle.Daemon (not imported: the lifecycle imports this
# module).

# What an arena kept over a restart hands to the start: its pool, index snapshot and slot header fds.
Passed = tuple[list[int], list[int], list[int]]


def arena_layout(cfg: Config) -> list[tuple[str, int]]:
    """The pool's arenas (name, bytes) this configuration makes: the default tenant's alone, the whole pool,
    without [tenants]."""
    tenants = {name: t.capacity for name, t in cfg.tenants.items()}
    return arena_sizes(tenants, cfg.pool.capacity, cfg.pool.slab_size) or [(DEFAULT_ARENA, cfg.pool.capacity)]


def _fdname(name: str, arena: str, narenas: int) -> str:
    return keep.arena_fdname(name, arena, narenas)


def _whose(arena: str, narenas: int) -> str:
    """How the log names an arena's pool: the pool's alone, or a tenant's."""
    return "the" if narenas == 1 and arena == DEFAULT_ARENA else f"tenant {arena}'s"


def take(daemon: Any) -> Pool | None:
    """The pool, when systemd's fd store passed back the pool of an arena of this configuration (its memfd,
    with its index snapshot, a planned restart, or its slot headers, stored at start: a crash): those
    arenas taken back where they describe that arena's pool of this configuration, the others fresh; what
    restores each waits in the daemon's _kept (adopt). None when nothing was kept."""
    layout = arena_layout(daemon.cfg)
    passed: dict[str, Passed] = {}
    for name, _ in layout:
        names = [_fdname(n, name, len(layout)) for n in keep.FDNAMES]  # pool, index, slot headers
        fds = (take_passed(names[0]), take_passed(names[1]), take_passed(names[2]))
        if not any(fds):
            continue
        # Whatever comes of it, the snapshot goes: a later start (after a crash) must not be handed one
        # that no longer describes the pool. The pool and its slot headers stay stored while they are this
        # daemon's (a crash keeps them); _forget lets go of those that are not used.
        if fds[1]:
            daemon.notifier.remove_stored_fd(names[1])
        passed[name] = fds
    _drop_others(daemon)
    return adopt(daemon, passed) if passed else None


def adopt(daemon: Any, passed: dict[str, Passed], strict: bool = False) -> Pool | None:
    """The pool, from the arenas' pools of a previous instance (`passed`: arena -> its pool, index snapshot
    and slot header fds, from systemd's fd store or a takeover) where they describe that arena's pool of
    this configuration, fresh for the others; what restores each waits in the daemon's _kept. An arena
    whose pool does not fit starts empty (one log line), or, `strict` (a takeover), fails it all:
    ValueError, OSError or MemoryError. None when none was kept. Every fd passed is closed or owned by the
    Pool or the Headers."""
    cfg = daemon.cfg
    arenas = arena_layout(cfg)
    n = len(arenas)
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
                    raise ValueError(f"{_whose(name, n)} L2 pool: {e}") from None
                _forget(daemon, name, n)
                log.warning(
                    "%s L2 pool kept over the restart is not used: %s; it starts empty (the warm list "
                    "refills it from L3)",
                    _whose(name, n),
                    e,
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
                _forget(daemon, name, n)
            log.warning("the L2 pools kept over the restart are not used: %s; starting empty", e)
            return None
        daemon._kept = {}
        for name, snapshot in snapshots.items():
            arena = pool.arena(name).index
            try:
                headers, snapshot = slot_headers.adopt(
                    metas.pop(name), pool, cfg.pool.slab_size, snapshot, arena
                )
            except (ValueError, OSError) as e:  # neither a snapshot nor usable slot headers
                _forget(daemon, name, n, pool=False)
                log.warning(
                    "%s L2 pool kept over the restart is not used: %s; it starts empty", _whose(name, n), e
                )
                continue
            daemon._kept[arena] = (snapshot, headers)
        return pool
    finally:
        for fd in [fd for fds in passed.values() for some in fds for fd in some]:
            os.close(fd)
        for fd in [*kept.values(), *(fd for fds in metas.values() for fd in fds)]:
            os.close(fd)


def _forget(daemon: Any, name: str, narenas: int, pool: bool = True) -> None:
    """An arena's kept pool (or, `pool` False, only its slot headers) not used: out of systemd's fd store
    (which would keep its memory, and hand it to the next start beside the fresh one)."""
    daemon.notifier.remove_stored_fd(_fdname(keep.META_FDNAME, name, narenas))
    if pool:
        daemon.notifier.remove_stored_fd(_fdname(keep.POOL_FDNAME, name, narenas))


def _drop_others(daemon: Any) -> None:
    """Pools kept for arenas this configuration does not have (tenants added or removed: the pool of every
    engine kept for a configuration that now has [tenants], or a tenant's for one that no longer has it):
    let go (systemd keeps their memory while they are stored)."""
    for name in [n for n in passed_fds() if keep.is_kept_fdname(n)]:
        for fd in take_passed(name):
            os.close(fd)
        daemon.notifier.remove_stored_fd(name)
        log.warning("dropped %s kept over the restart: no arena of this pool is kept under that name", name)


def arena_headers(daemon: Any) -> None:
    """Each arena's slot headers (kept, or made here under a service manager whose fd store holds 3 fds an
    arena) in daemon.headers, for the tiers to be handed (headers.observers), and stored with the arena's
    pool. Before the tiers are built."""
    kept = {i: h for i, (_, h) in daemon._kept.items() if h is not None}
    arenas = daemon.pool.arenas
    room = daemon.notifier.enabled and _fd_store_has_room(3 * len(arenas), "over a crash")
    if room:
        # Only under a service manager: without one to keep them over a crash nothing reads them.
        for a in arenas:
            if a.index not in kept:
                kept[a.index] = slot_headers.Headers.create(daemon.pool, daemon.cfg.pool.slab_size, a.index)
    daemon.headers = [kept[i] for i in sorted(kept)]
    for h in daemon.headers:
        h.mark_adopted()
    if not room:
        return
    stored = []
    for h in daemon.headers:
        name = arenas[h.arena].name
        meta_name = _fdname(keep.META_FDNAME, name, len(arenas))
        if h.fresh:
            daemon.notifier.remove_stored_fd(meta_name)  # another of a pool not used: never two
        # Stored again after a restart: systemd keeps one copy of an fd it already holds.
        if daemon.notifier.store_fd(meta_name, h.fd) and daemon.notifier.store_fd(
            _fdname(keep.POOL_FDNAME, name, len(arenas)), arenas[h.arena].fd
        ):
            stored.append(name)
    if stored:
        log.info(
            "L2 (%s) and its slot headers handed to the service manager's fd store: kept over a crash",
            ", ".join(f"{_whose(name, len(arenas))} pool" for name in stored),
        )


async def restore(daemon: Any) -> None:
    """The arenas' kept pools (adopt) served again, each verified by keep.restore: from its index snapshot,
    or (none came with it: a crash) from its slot headers, scanned first. Before the backend attaches
    (which queues the kept pages not in L3 yet) and before the socket listens (a page is served only once
    verified)."""
    kept, daemon._kept = daemon._kept, {}
    loop = asyncio.get_running_loop()
    n = len(daemon.pool.arenas)
    for arena, (snap, headers) in sorted(kept.items()):
        whose = _whose(daemon.pool.arenas[arena].name, n)
        scanned = None
        if snap is None:
            # No index snapshot (a crash): the index is rebuilt from the slot headers.
            scanned = await loop.run_in_executor(None, headers.scan)
            snap = scanned.snapshot
        r = await keep.restore(daemon.tiers, daemon.pool, snap, arena=arena)
        if headers is not None:
            headers.restored(snap, r.entries)
        if scanned is not None:
            r.dropped += scanned.dropped
            daemon.tiers.counters["keep.dropped"] += scanned.dropped
            log.info(
                "no index snapshot came with %s kept pool (a crash): its index was rebuilt from %d slot "
                "headers in %.2fs; %d of them did not check and were dropped",
                whose,
                scanned.records,
                scanned.seconds,
                scanned.dropped,
            )
        total = daemon.restored
        if total is None:
            daemon.restored = r
        else:
            total.pages += r.pages
            total.dropped += r.dropped
            total.owed += r.owed
            total.seconds += r.seconds
            total.entries += r.entries
        log.info(
            "%sL2 kept over the restart: %d pages served again after %.2fs of verifying; %d did not verify "
            "and were dropped (keep.dropped); %d are owed to L3 and queued for it",
            "" if whose == "the" else f"{whose} ",
            r.pages,
            r.seconds,
            r.dropped,
            r.owed,
        )


def keep_l2(daemon: Any) -> None:
    """Hands each arena's pool memfd and a snapshot of its index to systemd's fd store, for the next start
    to serve the same pages (a planned restart keeps L2). Only under systemd, after a full start-up."""
    if not daemon.notifier.enabled or not daemon._started or daemon.pool is None or daemon.tiers is None:
        return
    arenas = daemon.pool.arenas
    if not _fd_store_has_room(2 * len(arenas)):
        return
    for a in arenas:
        whose = _whose(a.name, len(arenas))
        try:
            snapshot, fd = l2_snapshot(daemon, a.index)
        except OSError as e:
            log.warning("could not write the snapshot of %s L2 pool (%s): not kept", whose, e)
            continue
        try:
            # The index first: a pool stored without it is refused at the next start anyway.
            if daemon.notifier.store_fd(_fdname(keep.INDEX_FDNAME, a.name, len(arenas)), fd) and (
                daemon.notifier.store_fd(_fdname(keep.POOL_FDNAME, a.name, len(arenas)), a.fd)
            ):
                log.info(
                    "%s L2 pool (%d pages) and its index handed to the service manager's fd store: kept for "
                    "the next start if the unit sets FileDescriptorStoreMax=",
                    whose,
                    len(snapshot.pages),
                )
        finally:
            os.close(fd)


def l2_snapshot(daemon: Any, arena: int) -> tuple[keep.Snapshot, int]:
    """A snapshot of one arena's index (the whole pool's, without [tenants]), and a sealed memfd holding it
    (the caller's to close); once nothing changes L2 any more (tiers stopped)."""
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
