"""Slot headers of a pool of arenas ([tenants]): one meta memfd an arena, its records at offsets within that
arena's memfd, each page's transitions written into its own arena's (headers.ByArena); after a crash each
arena's index is rebuilt from its headers alone, into that arena."""

from __future__ import annotations

import os

import pytest

from hicached import config
from hicached.daemon.l2.pool import Pool, arena_sizes
from hicached.daemon.persist import headers as hd
from hicached.daemon.persist import keep
from hicached.daemon.sched.tiers import Session, Tiers

MiB = 1 << 20
PAGE = 64 * 1024
NS = {"default": "other", "a": "a.m", "b": "b.m"}


def tenant_cfg(tmp_path):
    return config.from_dict(
        {
            "pool": {"capacity": "8MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {"backend": "none"},
            "tenants": {
                "a": {"uids": [1001], "namespaces": ["a.*"], "capacity": "2MiB"},
                "b": {"uids": [1002], "namespaces": ["b.*"], "capacity": "4MiB"},
            },
        },
        base_dir=str(tmp_path),
    )


def arenas(cfg) -> list[tuple[str, int]]:
    return arena_sizes({n: t.capacity for n, t in cfg.tenants.items()}, cfg.pool.capacity, MiB)


def fill(tenant: str, key: str) -> int:
    return (ord(tenant[0]) + int(key[1:])) % 251


def store(t: Tiers, tenant: str, keys: list[str]) -> None:
    s = Session(peer="test", tenant=tenant)
    t.hello(s, NS[tenant], PAGE)
    _, offsets = t.alloc(s, keys)
    for k, off in zip(keys, offsets, strict=True):
        t.pool.view[off : off + PAGE] = bytes([fill(tenant, k)]) * PAGE
    assert t.commit(s, keys) == [True] * len(keys)


def started(cfg, pool: Pool, headers: list[hd.Headers]) -> Tiers:
    t = Tiers(cfg, pool, None, *hd.observers(headers, len(pool.arenas)))
    t.start()
    return t


async def test_each_arena_keeps_its_own_records_and_a_crash_rebuilds_each(tmp_path):
    cfg = tenant_cfg(tmp_path)
    pool = Pool(0, prefault=False, arenas=arenas(cfg))
    headers = [hd.Headers.create(pool, MiB, arena=a.index) for a in pool.arenas]
    t = started(cfg, pool, headers)
    keys = [f"k{i}" for i in range(6)]
    for tenant in NS:
        store(t, tenant, keys)
    t.index.remove(t.index.get("b.m", "k2"))  # its record goes from b's headers
    for a, h in zip(pool.arenas, headers, strict=True):
        snap = h.scan().snapshot
        want = [k for k in keys if (a.name, k) != ("b", "k2")]
        assert sorted(p.key for p in snap.pages) == want and {p.ns for p in snap.pages} == {NS[a.name]}
        assert snap.pool_bytes == a.size and all(0 <= p.offset < a.size for p in snap.pages)
    # A SIGKILL: what systemd's store holds is each arena's memfd and its headers' memfd.
    kept = {a.name: os.dup(a.fd) for a in pool.arenas}
    metas = {a.name: os.dup(h.fd) for a, h in zip(pool.arenas, headers, strict=True)}
    await t.stop()
    for h in headers:
        h.close()
    pool.close()

    pool = Pool(0, prefault=False, arenas=arenas(cfg), kept=kept)
    headers = []
    for a in pool.arenas:
        h, snap = hd.adopt([metas[a.name]], pool, MiB, None, arena=a.index)
        assert snap is None and h is not None and h.arena == a.index and h.base == a.base
        headers.append(h)
    t = started(cfg, pool, headers)
    try:
        for a, h in zip(pool.arenas, headers, strict=True):
            snap = h.scan().snapshot
            r = await keep.restore(t, pool, snap, arena=a.index)
            h.restored(snap, r.entries)
            assert r.dropped == 0
        for tenant, ns in NS.items():
            a = pool.arena(tenant)
            for k in keys:
                e = t.index.get(ns, k)
                if (tenant, k) == ("b", "k2"):
                    assert e is None
                    continue
                assert e.cls.arena == a.index and a.base <= e.offset < a.base + a.size
                assert bytes(pool.slot(e.offset, e.size)) == bytes([fill(tenant, k)]) * PAGE
        # New pages after the restore get records in their own arena's headers, not another's.
        store(t, "a", ["k9"])
        for h in headers:
            assert ("k9" in {p.key for p in h.scan().snapshot.pages}) == (h.arena == pool.arena("a").index)
    finally:
        await t.stop()
        for h in headers:
            h.close()
        pool.close()


def test_headers_of_one_arena_are_refused_for_another(tmp_path):
    cfg = tenant_cfg(tmp_path)
    pool = Pool(0, prefault=False, arenas=arenas(cfg))
    try:
        h = hd.Headers.create(pool, MiB, arena=pool.arena("a").index)
        fd = os.dup(h.fd)
        h.close()
        try:
            with pytest.raises(hd.MetaError, match="take .* bytes|describe a pool of|another memfd"):
                hd.Headers.adopt(fd, pool, MiB, arena=pool.arena("b").index)
            with pytest.raises(hd.MetaError, match="another memfd"):  # the default tenant's: same size
                hd.Headers.adopt(fd, pool, MiB, arena=pool.arena("default").index)
        finally:
            os.close(fd)
    finally:
        pool.close()
