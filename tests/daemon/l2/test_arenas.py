"""Tenants' pools (arenas): one memfd a tenant, mapped back to back in the daemon; each tenant's pages are
allocated, evicted, pinned and bounded within its own arena, and engines see offsets within their arena."""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np
import pytest

from hicached import config
from hicached.common.errors import HicachedError
from hicached.daemon.l2.pool import Pool, arena_sizes
from hicached.daemon.sched.tiers import Session, Tiers

MiB = 1 << 20
PAGE = 64 * 1024


def test_arena_sizes():
    assert arena_sizes({}, 8 * MiB, MiB) is None
    assert arena_sizes({"a": 3 * MiB, "b": 2 * MiB + 5}, 8 * MiB, MiB) == [
        ("default", 2 * MiB),  # 8 - 3 - (2 MiB + 5), cut to whole slabs
        ("a", 3 * MiB),
        ("b", 2 * MiB),
    ]
    assert arena_sizes({"a": 8 * MiB}, 8 * MiB, MiB) == [("a", 8 * MiB)]  # no share left for the default
    with pytest.raises(ValueError, match="less than one slab"):
        arena_sizes({"a": MiB // 2}, 8 * MiB, MiB)


def test_each_arena_is_a_memfd_of_its_own():
    """What an engine of one tenant can map (its arena's fd, whole) never reaches another arena's bytes."""
    pool = Pool(0, prefault=False, arenas=[("default", MiB), ("a", 2 * MiB), ("b", MiB)])
    try:
        assert [(a.name, a.base, a.size) for a in pool.arenas] == [
            ("default", 0, MiB),
            ("a", MiB, 2 * MiB),
            ("b", 3 * MiB, MiB),
        ]
        assert pool.size == 4 * MiB and len({a.fd for a in pool.arenas}) == 3
        whole = np.frombuffer(pool.mm, dtype=np.uint8)
        whole[:] = 1
        b = pool.arena("b")
        assert os.fstat(b.fd).st_size == MiB  # all a member of b gets: its own arena
        with mmap.mmap(b.fd, b.size) as mine:
            mine[:] = b"\xee" * b.size  # b writes over everything it can map
        assert (whole[b.base : b.base + b.size] == 0xEE).all()
        assert (whole[: b.base] == 1).all()  # the default tenant's and a's bytes are untouched
        with pytest.raises((ValueError, OSError)):
            mmap.mmap(b.fd, b.size + mmap.PAGESIZE)  # and it cannot map past its end
        del whole
    finally:
        pool.close()


def tenant_cfg(tmp_path, **pool):
    return config.from_dict(
        {
            "pool": {"capacity": "8MiB", "slab_size": "1MiB", "prefault": False, **pool},
            "storage": {"backend": "none"},
            "tenants": {
                "a": {"uids": [1001], "namespaces": ["a.*"], "capacity": "2MiB"},
                "b": {"uids": [1002], "namespaces": ["b.*"], "capacity": "4MiB"},
            },
        },
        base_dir=str(tmp_path),
    )


@contextlib.asynccontextmanager
async def tenant_tiers(tmp_path):
    cfg = tenant_cfg(tmp_path)
    caps = {n: t.capacity for n, t in cfg.tenants.items()}
    t = Tiers(cfg, Pool(0, prefault=False, arenas=arena_sizes(caps, cfg.pool.capacity, MiB)), None)
    t.start()
    try:
        yield t
    finally:
        await t.stop()
        t.pool.close()


def session(t: Tiers, tenant: str, ns: str) -> Session:
    s = Session(peer="test", tenant=tenant)
    t.hello(s, ns, PAGE)
    return s


def store(t: Tiers, s: Session, keys: list[str], fill: int) -> list[int]:
    """Stores as an engine does; returns the engine's offsets (within its arena)."""
    status, offsets = t.alloc(s, keys)
    local = t.engine_offsets(s, offsets)
    base = t.pool.arena(s.tenant).base
    for off in local:
        if off >= 0:
            t.pool.view[base + off : base + off + PAGE] = bytes([fill]) * PAGE
    t.commit(s, [k for k, o in zip(keys, offsets, strict=True) if o >= 0])
    return local


async def test_pages_live_in_their_tenants_arena(tmp_path):
    async with tenant_tiers(tmp_path) as t:
        assert [a.name for a in t.pool.arenas] == ["default", "a", "b"]
        a, b, d = session(t, "a", "a.model"), session(t, "b", "b.model"), session(t, "default", "other")
        for s in (a, b, d):
            local = store(t, s, ["k1", "k2"], 3)
            arena = t.pool.arena(s.tenant)
            assert all(0 <= o < arena.size for o in local)
            for key in ("k1", "k2"):
                e = t.index.get(s.ns, key)
                assert arena.base <= e.offset < arena.base + arena.size and e.cls.arena == arena.index
        assert t.arena("b") == (t.pool.arena("b").fd, 4 * MiB)
        st = t.tenant_stats("a")
        assert st["capacity_bytes"] == 2 * MiB and st["pages"] == 2 and set(st["namespaces"]) == {"a.model"}


async def test_a_tenant_filling_its_pool_evicts_only_its_own_pages(tmp_path):
    async with tenant_tiers(tmp_path) as t:
        a, b = session(t, "a", "a.m"), session(t, "b", "b.m")
        store(t, b, [f"b{i}" for i in range(8)], 5)
        for i in range(200):  # a stores far more than its 2 MiB (32 pages of 64 KiB)
            store(t, a, [f"a{i}"], 6)
        assert all(t.index.get("b.m", f"b{i}") is not None for i in range(8))  # b's pages all stay
        held = sum(1 for i in range(200) if t.index.get("a.m", f"a{i}") is not None)
        assert 0 < held <= 2 * MiB // PAGE  # a holds at most its own pool's worth
        assert t.index.used_bytes(t.pool.arena("a").index) <= 2 * MiB


async def test_fractions_apply_within_a_tenants_pool(tmp_path):
    """pool.max_pinned_fraction (0.5) of a's 2 MiB is 16 pages, whatever b's pool holds."""
    async with tenant_tiers(tmp_path) as t:
        a = session(t, "a", "a.m")
        keys = [f"p{i}" for i in range(24)]
        store(t, a, keys, 1)
        with pytest.raises(HicachedError, match="max_pinned_fraction"):
            t.pin(a, keys)
        assert t.life.arena_pinned[t.pool.arena("a").index] == 16 * PAGE
        b = session(t, "b", "b.m")
        store(t, b, ["q"], 2)
        assert t.pin(b, ["q"]) == 1  # b's own bound is untouched by a's pins


async def test_engine_offsets_never_name_another_arena(tmp_path):
    async with tenant_tiers(tmp_path) as t:
        a = session(t, "a", "a.m")
        store(t, a, ["k"], 1)
        e = t.index.get("a.m", "k")
        wrong = Session(peer="test", tenant="b", ns="a.m", page_bytes=PAGE)  # as after a reload moved a.m
        with pytest.raises(HicachedError, match="outside tenant 'b'"):
            t.engine_offsets(wrong, [e.offset])
        assert t.pool_offsets(a, [e.offset - t.pool.arena("a").base]) == [e.offset]


async def test_reload_moving_a_namespace_lets_its_idle_pages_go(tmp_path):
    async with tenant_tiers(tmp_path) as t:
        a = session(t, "a", "a.m")
        store(t, a, ["k1", "k2"], 1)
        t.cfg.tenants["b"].namespaces.append("a.m")  # as a reload would give b the namespace
        t.cfg.tenants["a"].namespaces.remove("a.*")
        t.cfg.tenants["a"].namespaces.append("a.other")
        assert t.retenant() == 2
        assert t.index.get("a.m", "k1") is None and t.arena_of("a.m") == t.pool.arena("b").index


async def test_without_a_default_share_the_default_tenant_gets_no_pool(tmp_path):
    cfg = config.from_dict(
        {
            "pool": {"capacity": "4MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {"backend": "none"},
            "tenants": {"a": {"uids": [1001], "namespaces": ["a.*"], "capacity": "4MiB"}},
        },
        base_dir=str(tmp_path),
    )
    t = Tiers(cfg, Pool(0, prefault=False, arenas=arena_sizes({"a": 4 * MiB}, 4 * MiB, MiB)), None)
    try:
        assert t.arena("a")[1] == 4 * MiB
        with pytest.raises(HicachedError, match="no share of L2"):
            t.arena("default")
        s = Session(peer="test", tenant="default")
        t.hello(s, "elsewhere", PAGE)
        status, offsets = t.alloc(s, ["k"])
        assert offsets == [-1]  # nothing of a namespace no arena holds is stored
    finally:
        t.pool.close()


async def test_write_back_writes_out_the_tenant_whose_pool_fills(tmp_path):
    """Under write-back, the watermark is each tenant's: a's pool full of pages not yet in L3 is written out
    (and takes new pages) while b's pool, and so the pool as a whole, is nearly empty."""
    import asyncio

    from hicached.connectors.file import FileConnector

    cfg = config.from_dict(
        {
            "pool": {"capacity": "8MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {
                "write_policy": "write_back",
                "file": {"root": "data"},
                "breaker": {"stall_timeout": "60s"},
            },
            "tenants": {
                "a": {"uids": [1001], "namespaces": ["a.*"], "capacity": "2MiB"},
                "b": {"uids": [1002], "namespaces": ["b.*"], "capacity": "4MiB"},
            },
        },
        base_dir=str(tmp_path),
    )
    caps = {n: t.capacity for n, t in cfg.tenants.items()}
    conn = FileConnector(cfg)
    await conn.start()
    t = Tiers(cfg, Pool(0, prefault=False, arenas=arena_sizes(caps, cfg.pool.capacity, MiB)), conn)
    t.start()
    try:
        a = session(t, "a", "a.m")
        arena = t.pool.arena("a").index
        deadline = asyncio.get_running_loop().time() + 60
        for i in range(64):  # twice a's pool: a keeps taking pages, its own written out to make room
            while store(t, a, [f"k{i}"], 1)[0] < 0:  # a's pool full of pages owed to L3, being written out
                assert asyncio.get_running_loop().time() < deadline, "a's pages were never written out"
                await asyncio.sleep(0.01)
        assert t.index.reclaimable_fraction() <= t.index.reclaimable_fraction(t.pool.arena("b").index)
        assert t.counters["backup.pages"] > 0 or t.index.arena_dirty[arena] < 2 * MiB
    finally:
        await t.stop()
        await t.backend.close()
        t.pool.close()
