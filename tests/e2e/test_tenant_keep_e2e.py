"""Each tenant's pool is kept across a planned restart on its own (issue #23, point 6): under a stand-in for
systemd's notify socket and fd store, a stop stores every tenant's pool memfd beside a snapshot of its pages
(POOL_FDNAME.TENANT, INDEX_FDNAME.TENANT), and the next start serves them again from L2 (no L3 here); a
tenant whose pool changed size over the restart starts empty while the others are kept."""

from __future__ import annotations

import os

from hicached.daemon.persist import keep
from hicached.engine.client import Client

PAGE = 32 * 1024
KEYS = [f"{i:064x}" for i in range(24)]


def page(tenant: str, i: int) -> bytes:
    return (tenant.encode() + bytes([i])) * (PAGE // 2)


def config(b_capacity: str = "16MiB") -> dict:
    return {
        "pool": {"capacity": "64MiB", "slab_size": "1MiB"},
        "storage": {"backend": "none"},
        "warmup": {"enabled": False},
        "tenants": {
            "a": {"uids": [0], "namespaces": ["a.*"], "capacity": "16MiB"},
            "b": {"socket": "run/b.sock", "namespaces": ["b.*"], "capacity": b_capacity},
        },
    }


def store_all(d) -> None:
    """Root stores in tenant a (its uid) through the main socket, and in tenant b through b's socket."""
    for tenant, path in (("a", d.socket), ("b", os.path.join(d.workdir, "run", "b.sock"))):
        with Client(path, f"{tenant}.m", PAGE, timeout=30) as c:
            assert c.store(KEYS, [page(tenant, i) for i in range(len(KEYS))]) == [True] * len(KEYS)


def hits(d, tenant: str) -> int:
    """How many of the tenant's pages come back, checking their bytes (a wrong one fails the test)."""
    path = d.socket if tenant == "a" else os.path.join(d.workdir, "run", "b.sock")
    with Client(path, f"{tenant}.m", PAGE, timeout=30) as c:
        bufs = [bytearray(PAGE) for _ in KEYS]
        n = c.load(KEYS, bufs)
    for i in range(n):
        assert bufs[i] == page(tenant, i), (tenant, i)
    return n


def test_each_tenants_pool_is_kept_over_a_restart_on_its_own(systemd):
    d = systemd(config(), fdstore=8)
    store_all(d)
    assert d.stop() == 0, d.log()
    d.store.drain(0.2)
    names = sorted(d.store.names())
    fdnames = (keep.POOL_FDNAME, keep.INDEX_FDNAME)
    want = sorted(keep.tenant_fdname(n, t) for n in fdnames for t in ("a", "b", "default"))
    assert names == want, (names, d.log())
    for tenant, size in (("a", 16 << 20), ("b", 16 << 20)):
        fd = next(fd for n, fd in d.store.stored if n == keep.tenant_fdname(keep.INDEX_FDNAME, tenant))
        snap = keep.decode(keep.read_fd(fd))
        assert snap.pool_bytes == size and len(snap.pages) == len(KEYS)
        assert all(0 <= p.offset < size for p in snap.pages)  # offsets within the tenant's own memfd

    d.start()
    assert hits(d, "a") == len(KEYS) and hits(d, "b") == len(KEYS)  # no L3: these can only be L2's
    assert d.ctl("stats")["counters"]["keep.pages"] == 2 * len(KEYS)
    assert "tenant a's L2 kept over the restart" in d.log()


def test_a_tenant_whose_pool_changed_starts_empty_and_the_others_are_kept(systemd):
    d = systemd(config(), fdstore=8)
    store_all(d)
    assert d.stop() == 0, d.log()
    d.config["tenants"]["b"]["capacity"] = "8MiB"
    d.write_config()
    d.start()
    assert hits(d, "a") == len(KEYS)
    assert hits(d, "b") == 0  # a miss, never other bytes
    assert "tenant b's L2 pool kept over the restart is not used" in d.log()
