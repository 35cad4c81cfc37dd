"""Local regions (hicached.engine.local): memory of the engine's own process whose pages the client copies
between it and the pool itself, with store_pages / load_pages as for a region the daemon maps."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

from hicached import config
from hicached.common import ranges
from hicached.common.errors import HicachedError
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient

PAGE = 8192
HALF = PAGE // 2


def daemon_cfg(tmp_path):
    return config.from_dict(
        {
            "server": {"socket": "run/d.sock"},
            "pool": {"capacity": "16MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {"file": {"root": "data"}},
        },
        base_dir=str(tmp_path),
    )


@pytest.fixture(params=["native", "numpy"])
def copy_impl(request, monkeypatch):
    """The client's copies in C (hicached.common._pageio) and with numpy where it is not built."""
    if request.param == "numpy":
        monkeypatch.setattr(ranges, "_copy_ranges", None)
    elif ranges._copy_ranges is None:
        pytest.skip("hicached.common._pageio is not built (no C compiler)")
    return request.param


def halves(mem: np.ndarray, page: int) -> bytes:
    """Page `page` of a region laid out as two halves: K of every page, then V of every page."""
    k = mem[page * HALF : (page + 1) * HALF]
    v = mem[32 * HALF + page * HALF : 32 * HALF + (page + 1) * HALF]
    return k.tobytes() + v.tobytes()


SEGS = [(0, HALF, HALF), (32 * HALF, HALF, HALF)]


async def test_store_and_load_pages_of_private_memory_through_l2_and_l3(tmp_path, copy_impl):
    src = torch.randint(0, 256, (32 * PAGE,), dtype=torch.uint8)  # private memory: no memfd
    keys = [f"local{i}" for i in range(12)]
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "local.ns", PAGE) as c:
            h = await c.register_local_region(src, PAGE, SEGS, num_pages=32)
            assert h < 0
            assert await c.store_pages(h, list(range(3, 15)), keys) == [True] * 12
            assert await c.get(keys[:2]) == [halves(src.numpy(), 3), halves(src.numpy(), 4)]
            dst = torch.zeros(32 * PAGE, dtype=torch.uint8)
            hd = await c.register_local_region(dst, PAGE, SEGS, num_pages=32)
            assert await c.load_pages(hd, list(range(20, 32)), keys) == 12
            assert [halves(dst.numpy(), 20 + i) for i in range(12)] == [
                halves(src.numpy(), 3 + i) for i in range(12)
            ]
            assert await d.tiers.backup.drain(30)
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    # Each page's checksum was taken as the client copied it: L3 took every page (it publishes only pages
    # whose bytes hash to theirs), and they load back after a restart, from L3.
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "local.ns", PAGE) as c:
            dst = torch.zeros(32 * PAGE, dtype=torch.uint8)
            hd = await c.register_local_region(dst, PAGE, SEGS, num_pages=32)
            assert await c.load_pages(hd, list(range(12)), keys) == 12
            assert [halves(dst.numpy(), i) for i in range(12)] == [
                halves(src.numpy(), 3 + i) for i in range(12)
            ]
            assert (await c.stats())["counters"].get("backup.changed", 0) == 0
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_local_regions_are_checked_as_the_daemon_checks_regions(tmp_path):
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "local.ns", PAGE) as c:
            mem = bytearray(4 * PAGE)
            for bad in ([(0, HALF, HALF)], [(0, PAGE, PAGE - 1)], [(0, HALF, HALF), (HALF, HALF, HALF)]):
                with pytest.raises(HicachedError) as e:
                    await c.register_local_region(mem, PAGE, bad, num_pages=4)
                assert e.value.code == "bad_request"
            with pytest.raises(HicachedError, match="page"):
                await c.register_local_region(mem, PAGE // 2)  # not this connection's page size
            with pytest.raises(HicachedError, match="writable"):
                await c.register_local_region(bytes(4 * PAGE), PAGE)
            h = await c.register_local_region(mem, PAGE)
            with pytest.raises(HicachedError) as e:
                await c.store_pages(h, [4], ["k"])  # out of range
            assert e.value.code == "bad_request"
            with pytest.raises(HicachedError) as e:
                await c.load_pages(h, [1, 1], ["a", "b"])  # one page twice
            assert e.value.code == "bad_request"
            await c.unregister_region(h)
            with pytest.raises(HicachedError) as e:
                await c.store_pages(h, [0], ["k"])
            assert e.value.code == "not_found"
            assert await c.store_pages(await c.register_local_region(mem, PAGE), [], []) == []
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


def test_checksums_of_the_numpy_path_match_the_c_path(monkeypatch):
    if ranges._copy_ranges is None:
        pytest.skip("hicached.common._pageio is not built (no C compiler)")
    from hicached.common.geometry import Geometry, Segment, plan

    geom = Geometry(PAGE, 32, tuple(Segment(o, n, s) for o, n, s in SEGS))
    region = np.random.default_rng(1).integers(0, 256, 32 * PAGE, dtype=np.uint8)
    out = []
    for impl in (ranges._copy_ranges, None):
        monkeypatch.setattr(ranges, "_copy_ranges", impl)
        pool = np.zeros(16 * PAGE, dtype=np.uint8)
        sums = np.zeros(4, dtype=np.uint64)
        ranges.copy_ranges(
            pool, region, plan(geom, [7, 1, 30, 2], [0, 3 * PAGE, PAGE, 9 * PAGE]), True, (PAGE, sums)
        )
        out.append((pool.tobytes(), sums.tolist()))
    assert out[0] == out[1]
