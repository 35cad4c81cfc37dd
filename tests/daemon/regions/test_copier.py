"""The host copy executor over a real pool: copies in both directions for any geometry, requests cut
across threads, a failed copy fails its request only, the job clock the watchdog reads, and shutdown."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xxhash

from hicached.common import ranges as ranges_mod
from hicached.common.errors import HicachedError
from hicached.common.geometry import Geometry, Segment, plan
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions import copier as copier_mod
from hicached.daemon.regions.copier import Copier
from hicached.daemon.regions.jobs import Tracker


def host_region(size: int, seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(kind="host", array=rng.integers(0, 256, size, dtype=np.uint8), may_shrink=False)


def expected_page(geom: Geometry, region: np.ndarray, i: int) -> bytes:
    return b"".join(
        region[s.offset + i * s.stride : s.offset + i * s.stride + s.length].tobytes() for s in geom.segments
    )


@pytest.fixture
def pool():
    p = Pool(16 << 20, prefault=False)
    yield p
    p.close()


@pytest.fixture(params=["native", "numpy"])
def ranges_impl(request, monkeypatch):
    """copy_ranges in C (hicached.common._pageio) and the numpy path used where it is not built."""
    if request.param == "numpy":
        monkeypatch.setattr(ranges_mod, "_copy_ranges", None)
    elif ranges_mod._copy_ranges is None:
        pytest.skip("hicached.common._pageio is not built (no C compiler)")
    return request.param


@pytest.mark.parametrize(
    "segments",
    [
        [(0, 4096, 4096)],  # one range a page
        [(0, 192 << 10, 192 << 10)],  # pages larger than the chunk the C copy hashes at a time (64 KiB)
        [(0, 96 << 10, 96 << 10), (3 << 20, 96 << 10, 96 << 10)],  # two segments far apart, each > a chunk
        [(0, 1000, 1000), (70_000, 2000, 2000), (140_000, 3000, 3000)],  # three odd-sized ones
    ],
    ids=["contiguous", "large", "two-segments", "three-odd"],
)
async def test_a_store_takes_each_pages_checksum_as_it_copies_it(pool, ranges_impl, segments):
    c = Copier(pool, threads=2)
    try:
        segs = tuple(Segment(*s) for s in segments)
        page_bytes = sum(s.length for s in segs)
        geom = Geometry(page_bytes, 8, segs)
        src = host_region(max(s.offset + 8 * s.stride for s in segs), seed=5)
        pages = [5, 0, 7, 2]
        slots = [k * (256 << 10) for k in (3, 0, 2, 1)]  # out of order, as the allocator hands them
        sums = await c.copy(src, True, geom, pages, slots)
        assert sums == [xxhash.xxh3_64_intdigest(expected_page(geom, src.array, i)) for i in pages]
    finally:
        await asyncio.to_thread(c.close)


@pytest.mark.parametrize(
    "runs",
    [
        [1 << 20, 1 << 20],  # K and V of SGLang's page_first: each run whole blocks of xxh3's loop (1 KiB)
        [128 << 10, 128 << 10],
        [8192] * 64,  # layer_first: a run per layer and K/V
        [1024, 1024, 64],  # the last run only the input's last stripe
        [1024, 2048, 63],  # ... one byte short of it: another path
        [1024, 1000, 4096],  # a run that is not whole blocks, not the last
        [4096, 4096, 100_000],  # a last run of blocks and a partial stripe
        [200, 40],  # an input xxh3 hashes as a short one
        [1024] * 300,  # more runs than the one-pass copy takes (PAGE_RUNS)
    ],
    ids=["page_first-2MiB", "page_first-256KiB", "layer_first", "last-64", "last-63", "odd-middle",
         "long-last", "short-input", "300-runs"],
)  # fmt: skip
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned-slots", "odd-slots"])
def test_a_page_of_several_runs_hashes_as_its_bytes_one_after_the_other(ranges_impl, runs, misaligned):
    # A page that is several runs of the region: the C copy carries one xxh3 state across its runs (in one
    # pass over each where their lengths allow); the checksum must be that of the page's bytes, whatever path
    # took it. Slots off 32-byte alignment take the copy that cannot stream.
    page_bytes, n = sum(runs), 3
    segs, off = [], 0
    for k in runs:
        segs.append(Segment(off, k, k + 64))  # a gap after each run: the runs are not one range
        off += n * (k + 64) + 64
    geom = Geometry(page_bytes, n, tuple(segs))
    region = host_region(geom.extent, seed=len(runs)).array
    stride = page_bytes + (8 if misaligned else 0) + 4096
    pool = np.zeros(4 * stride + 4096, dtype=np.uint8)
    pages, slots = [2, 0, 1], [k * stride + (8 if misaligned else 0) for k in (1, 3, 0)]
    sums = np.zeros(len(pages), dtype=np.uint64)
    ranges_mod.copy_ranges(pool, region, plan(geom, pages, slots), True, (page_bytes, sums))
    for i, slot in zip(pages, slots, strict=True):
        assert pool[slot : slot + page_bytes].tobytes() == expected_page(geom, region, i)
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(expected_page(geom, region, i)) for i in pages]


def test_checksums_need_whole_pages():
    if ranges_mod._copy_ranges is None:
        pytest.skip("hicached.common._pageio is not built (no C compiler)")
    pool, region = np.zeros(8192, dtype=np.uint8), np.ones(8192, dtype=np.uint8)
    offs = [np.array([0], dtype=np.int64)] * 2
    with pytest.raises(ValueError, match="whole pages"):
        ranges_mod._copy_ranges(
            pool, region, *offs, np.array([3000], dtype=np.int64), True, 4096, np.zeros(1, np.uint64)
        )


async def test_round_trip_through_the_pool(pool):
    c = Copier(pool, threads=2)
    try:
        geom = Geometry(6144, 32, (Segment(0, 4096, 4096), Segment(200_000, 2048, 3000)))
        src = host_region(300_000, seed=1)
        pages = random.Random(1).sample(range(32), 20)
        slots = [k * 8192 for k in range(20)]
        sums = await c.copy(src, True, geom, pages, slots)
        mem = np.frombuffer(pool.mm, dtype=np.uint8)
        for i, slot in zip(pages, slots, strict=True):
            assert mem[slot : slot + 6144].tobytes() == expected_page(geom, src.array, i)
        # Each page's checksum as it entered L2, as the page header keeps it: what L3 will hold it to.
        assert sums == [xxhash.xxh3_64_intdigest(expected_page(geom, src.array, i)) for i in pages]
        del mem
        dst = SimpleNamespace(kind="host", array=np.zeros(300_000, dtype=np.uint8), may_shrink=False)
        await c.copy(dst, False, geom, pages, slots)
        for i in pages:
            assert expected_page(geom, dst.array, i) == expected_page(geom, src.array, i)
        untouched = sorted(set(range(32)) - set(pages))
        assert all(not expected_page(geom, dst.array, i).strip(b"\0") for i in untouched)
        assert await c.copy(dst, False, geom, [], []) is None
        assert c.progress == 2 and c.stats()["bytes"] == 2 * 20 * 6144  # checksums taken in the copy
    finally:
        await asyncio.to_thread(c.close)


async def test_large_request_is_cut_across_threads(pool, monkeypatch):
    seen: set[str] = set()
    real = copier_mod.copy_ranges
    # Each job waits for the other to start: they must run at once, on two threads (and the executor,
    # which starts threads lazily, must not hand the second job to a thread that has finished the first).
    both = threading.Barrier(2, timeout=30)

    def spy(*args):
        seen.add(threading.current_thread().name)
        both.wait()
        real(*args)

    monkeypatch.setattr(copier_mod, "copy_ranges", spy)
    c = Copier(pool, threads=2)
    try:
        page = 1 << 20
        geom = Geometry(page, 12, (Segment(0, page, page),))
        src = host_region(12 * page, seed=2)
        sums = await c.copy(src, True, geom, list(range(12)), [k * page for k in range(12)])
        assert c.progress == 2  # 12 MiB in two jobs of 6 MiB (SPLIT_MIN_BYTES is 4 MiB)
        assert sums == [xxhash.xxh3_64_intdigest(src.array[k * page : (k + 1) * page]) for k in range(12)]
        assert len(seen) == 2 and all(n.startswith("hicached-copy") for n in seen)
        assert bytes(pool.mm[: 12 * page]) == src.array.tobytes()
    finally:
        await asyncio.to_thread(c.close)


async def test_a_failed_copy_fails_its_request_and_the_copier_goes_on(pool, ranges_impl):
    c = Copier(pool, threads=2)
    try:
        geom = Geometry(4096, 8, (Segment(0, 4096, 4096),))
        # Too small for page 3.
        short = SimpleNamespace(kind="host", array=np.zeros(4096, dtype=np.uint8), may_shrink=False)
        with pytest.raises(HicachedError) as e:
            await c.copy(short, True, geom, [3], [0])
        why = "IndexError: range 0" if ranges_impl == "native" else "could not broadcast"
        assert e.value.code == "copy_failed" and why in e.value.message
        assert c.stats()["jobs_failed"] == 1
        good = host_region(8 * 4096)
        await c.copy(good, True, geom, [3], [0])
        assert bytes(pool.mm[:4096]) == good.array[3 * 4096 : 4 * 4096].tobytes()
        await c.copy(good, True, geom, [], [])  # nothing to do: completes at once
    finally:
        await asyncio.to_thread(c.close)


async def test_the_watchdog_clock_sees_a_job_that_does_not_end(pool, monkeypatch):
    release = threading.Event()
    real = copier_mod.copy_ranges

    def stuck(*args):
        release.wait(10)
        real(*args)

    monkeypatch.setattr(copier_mod, "copy_ranges", stuck)
    c = Copier(pool, threads=1)
    try:
        geom = Geometry(4096, 1, (Segment(0, 4096, 4096),))
        fut = c.copy(host_region(4096), True, geom, [0], [0])
        for _ in range(3000):  # the copy thread has taken the job (bounded for slow CI machines)
            if c.stats()["jobs_running"] == 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert c.oldest_age() >= 0.15 and c.progress == 0 and c.stats()["jobs_running"] == 1
        release.set()
        await fut
        assert c.oldest_age() == 0.0 and c.progress == 1
    finally:
        release.set()
        await asyncio.to_thread(c.close)


def test_tracker():
    t = Tracker()
    assert t.oldest_age() == 0.0
    a, b = t.start(), t.start()
    assert t.running == 2 and t.oldest_age() >= 0.0
    t.end(a, 100, True)
    t.end(b, 50, False)
    assert (t.progress, t.failed, t.bytes, t.running) == (2, 1, 100, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal is not reachable")
async def test_cuda_region_without_cuda_is_unsupported(pool):
    c = Copier(pool, threads=1)
    try:
        with pytest.raises(HicachedError) as e:
            c.cuda()
        assert e.value.code == "unsupported" and "torch.cuda.is_available() is False" in e.value.message
    finally:
        await asyncio.to_thread(c.close)


def test_close_lets_the_pool_unmap(caplog):
    p = Pool(4 << 20, prefault=False)
    c = Copier(p, threads=1)
    c.close()
    with caplog.at_level(logging.WARNING, logger="hicached.pool"):
        p.close()
    assert "still exported" not in caplog.text


def test_copy_ranges_gathers_many_small_ranges_like_a_loop(ranges_impl):
    rng = random.Random(5)
    for _ in range(40):
        nseg = rng.choice([1, 4, 64])
        seg = rng.choice([64, 512, 4096, 20_000])
        num_pages = 48
        segs = tuple(Segment(j * num_pages * seg + rng.randint(0, 7), seg, seg) for j in range(nseg))
        geom = Geometry(nseg * seg, num_pages, segs)
        region = np.frombuffer(rng.randbytes(geom.extent), dtype=np.uint8).copy()
        n = rng.randint(1, num_pages)
        pages = rng.sample(range(num_pages), n)
        slot = geom.page_bytes + rng.choice([0, 4096 - geom.page_bytes % 4096])
        slots = [k * slot for k in range(n)]
        rng.shuffle(slots)
        want = np.zeros(n * slot, dtype=np.uint8)
        for i, q in zip(pages, slots, strict=True):
            want[q : q + geom.page_bytes] = np.frombuffer(expected_page(geom, region, i), dtype=np.uint8)
        got = np.zeros_like(want)
        copier_mod.copy_ranges(got, region, plan(geom, pages, slots), True)
        assert np.array_equal(got, want)
        back = np.zeros_like(region)
        copier_mod.copy_ranges(got, back, plan(geom, pages, slots), False)
        for i in pages:
            assert expected_page(geom, back, i) == expected_page(geom, region, i)


def test_gather_checks_bounds_that_as_strided_does_not(ranges_impl):
    geom = Geometry(64, 40, (Segment(0, 64, 64),))
    p = plan(geom, list(range(40)), [k * 64 for k in range(40)][::-1])
    pool = np.zeros(39 * 64, dtype=np.uint8)
    with pytest.raises(IndexError):
        copier_mod.copy_ranges(pool, np.ones(40 * 64, dtype=np.uint8), p, True)
    if ranges_impl == "native":  # checked before any byte moves
        assert not pool.any()


@pytest.mark.skipif(
    ranges_mod._copy_ranges is None, reason="hicached.common._pageio is not built (no C compiler)"
)
def test_native_copy_ranges_checks_every_range_and_its_arrays():
    from hicached.common._pageio import copy_ranges

    pool, region = (
        np.zeros(1 << 16, dtype=np.uint8),
        np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16],
    )
    i64 = lambda *xs: np.array(xs, dtype=np.int64)  # noqa: E731
    copy_ranges(pool, region, i64(8192, 0), i64(100, 5000), i64(6000, 1), True)
    assert bytes(pool[8192 : 8192 + 6000]) == bytes(region[100:6100]) and pool[0] == region[5000]
    assert not pool[1:8192].any() and not pool[8192 + 6000 :].any()
    bad = [
        ((i64(-1), i64(0), i64(1)), IndexError),
        ((i64(0), i64(0), i64(-1)), IndexError),
        ((i64((1 << 16) - 3), i64(0), i64(4)), IndexError),
        ((i64(0), i64(1 << 16), i64(1)), IndexError),
        ((i64(0, 1), i64(0), i64(1)), ValueError),  # lengths differ
        ((np.zeros(2, dtype=np.int32), i64(0), i64(1)), ValueError),  # not int64
    ]
    before = pool.copy()
    for (q, r, n), err in bad:
        with pytest.raises(err):
            copy_ranges(pool, region, q, r, n, True)
    assert np.array_equal(pool, before)
    with pytest.raises(BufferError):
        copy_ranges(bytes(16), region, i64(0), i64(0), i64(1), True)  # a read-only pool to write into
    out = np.zeros(6000, dtype=np.uint8)
    copy_ranges(pool, out, i64(8192), i64(0), i64(6000), False)
    assert bytes(out) == bytes(region[100:6100])
