"""Each tenant's pool outlives a crash on its own: under a stand-in for systemd's notify socket and fd store,
a daemon with two tenants and the default tenant stores each tenant's pool beside its slot headers at start
(POOL_FDNAME.TENANT, META_FDNAME.TENANT); after a SIGKILL the next start rebuilds each tenant's index from
its headers and serves its pages again from L2 (no L3 here); a tenant whose pool changed size starts empty
while the others are kept."""

from __future__ import annotations

import os

import pytest

from hicached.daemon.l2.pool import Pool
from hicached.daemon.persist import headers as hd
from hicached.daemon.persist import keep
from hicached.engine.client import Client

PAGE = 32 * 1024
SLAB = 1 << 20
KEYS = [f"{i:064x}" for i in range(24)]
MORE = [f"{i:064x}" for i in range(100, 104)]
TENANTS = ("default", "a", "b")
SIZES = {"default": 32 << 20, "a": 16 << 20, "b": 16 << 20}


def page(tenant: str, key: str) -> bytes:
    seed = (tenant + key).encode()
    return (seed * (PAGE // len(seed) + 1))[:PAGE]


def config() -> dict:
    return {
        "pool": {"capacity": "64MiB", "slab_size": "1MiB"},
        "storage": {"backend": "none"},
        "warmup": {"enabled": False},
        "tenants": {
            "a": {"socket": "run/a.sock", "namespaces": ["a.*"], "capacity": "16MiB"},
            "b": {"socket": "run/b.sock", "namespaces": ["b.*"], "capacity": "16MiB"},
        },
    }


def socket_of(d, tenant: str) -> str:
    """Root on the main socket is the default tenant's; a and b have sockets of their own."""
    return d.socket if tenant == "default" else os.path.join(d.workdir, "run", f"{tenant}.sock")


def ns(tenant: str) -> str:
    return "d.m" if tenant == "default" else f"{tenant}.m"


def store(d, tenant: str, keys: list[str] = KEYS) -> None:
    with Client(socket_of(d, tenant), ns(tenant), PAGE, timeout=30) as c:
        assert c.store(keys, [page(tenant, k) for k in keys]) == [True] * len(keys)


def hits(d, tenant: str, keys: list[str] = KEYS) -> int:
    """How many of the tenant's pages come back, checking their bytes (a wrong one fails the test)."""
    with Client(socket_of(d, tenant), ns(tenant), PAGE, timeout=30) as c:
        bufs = [bytearray(PAGE) for _ in keys]
        n = c.load(keys, bufs)
    for i in range(n):
        assert bufs[i] == page(tenant, keys[i]), (tenant, i)
    return n


def stored_names(tenants=TENANTS) -> list[str]:
    return sorted(keep.tenant_fdname(n, t) for n in (keep.POOL_FDNAME, keep.META_FDNAME) for t in tenants)


def scan(d, tenant: str) -> keep.Snapshot:
    """What the tenant's slot headers, as the stand-in holds them, describe of its pool."""
    fds = {n: fd for n, fd in d.store.stored}
    pool_fd = fds[keep.tenant_fdname(keep.POOL_FDNAME, tenant)]
    pool = Pool(os.fstat(pool_fd).st_size, prefault=False, fd=os.dup(pool_fd))
    try:
        h = hd.Headers.adopt(os.dup(fds[keep.tenant_fdname(keep.META_FDNAME, tenant)]), pool, SLAB)
        try:
            return h.scan().snapshot
        finally:
            h.close()
    finally:
        pool.close()


@pytest.fixture
def unit(systemd):
    """make(fdstore=9): a daemon of config() under the stand-in (3 fds an arena: pool, slot headers, index
    snapshot)."""
    return lambda fdstore=9: systemd(config(), fdstore)


def test_every_tenants_pool_outlives_a_sigkill_on_its_own(unit):
    d = unit()
    for t in TENANTS:
        store(d, t)
    d.crash()
    assert sorted(d.store.names()) == stored_names(), d.store.names()
    for t in TENANTS:
        snap = scan(d, t)
        assert snap.pool_bytes == SIZES[t] and sorted(p.key for p in snap.pages) == KEYS, t
        assert {p.ns for p in snap.pages} == {ns(t)}
        assert all(0 <= p.offset < SIZES[t] for p in snap.pages)  # offsets within the tenant's own memfd

    d.start()
    for t in TENANTS:
        assert hits(d, t) == len(KEYS), t  # no L3: these can only be L2's
    counters = d.ctl("stats")["counters"]
    assert counters["keep.pages"] == 3 * len(KEYS) and counters.get("keep.dropped", 0) == 0, counters
    log = d.log()
    for t in TENANTS:
        assert f"no index snapshot came with tenant {t}'s kept pool (a crash)" in log, log
        assert f"tenant {t}'s L2 kept over the restart: {len(KEYS)} pages served again" in log, log
    # Crashed again after new pages: each tenant's records follow its pages (the new ones and the kept).
    store(d, "a", MORE)
    d.crash()
    d.start()
    assert hits(d, "a", KEYS + MORE) == len(KEYS + MORE)
    assert hits(d, "b") == len(KEYS) and hits(d, "default") == len(KEYS)


def test_a_tenant_whose_pool_changed_starts_empty_after_a_crash(unit):
    d = unit()
    for t in TENANTS:
        store(d, t)
    d.crash()
    d.config["tenants"]["b"]["capacity"] = "8MiB"
    d.config["pool"]["capacity"] = "56MiB"  # the default tenant's share stays 32 MiB
    d.write_config()
    d.start()
    assert hits(d, "a") == len(KEYS) and hits(d, "default") == len(KEYS)
    assert hits(d, "b") == 0  # a miss, never other bytes
    assert "tenant b's L2 pool kept over the restart is not used" in d.log()
    d.store.drain(0.2)
    # b's new pool and headers took the old ones' place in the store: one of each, never two.
    assert sorted(d.store.names()) == stored_names(), d.store.names()
    store(d, "b")
    d.crash()
    d.start()
    for t in TENANTS:
        assert hits(d, t) == len(KEYS), t


def test_without_room_in_the_fd_store_no_tenant_is_kept_over_a_crash(unit):
    """FileDescriptorStoreMax= below 3 fds an arena: one warning, nothing stored at start, a crash loses L2
    (a miss, never other bytes), and the daemon serves on."""
    d = unit(fdstore=8)
    store(d, "a")
    assert "keeping L2 over a crash takes 9" in d.log()
    d.crash()
    assert d.store.names() == []
    d.start()
    assert hits(d, "a") == 0


def test_a_crash_after_a_planned_restart_still_keeps_every_tenants_pool(unit):
    """A planned restart (each tenant's index snapshot beside its pool and slot headers) then a SIGKILL: the
    headers adopted over the restart still describe every page."""
    d = unit()
    for t in TENANTS:
        store(d, t)
    assert d.stop() == 0, d.log()
    d.store.drain(0.2)
    index = [keep.tenant_fdname(keep.INDEX_FDNAME, t) for t in TENANTS]
    assert sorted(d.store.names()) == sorted(stored_names() + index), d.store.names()
    d.start()
    for t in TENANTS:
        assert hits(d, t) == len(KEYS), t
    assert "no index snapshot came with" not in d.log()  # restored from the snapshots
    d.crash()
    assert sorted(d.store.names()) == stored_names(), d.store.names()  # the snapshots went at the start
    d.start()
    for t in TENANTS:
        assert hits(d, t) == len(KEYS), t
    assert "no index snapshot came with tenant b's kept pool (a crash)" in d.log()
