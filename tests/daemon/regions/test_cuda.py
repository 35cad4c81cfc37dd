"""The CUDA side of the copy executor. Its batching (direct copies vs a page-major staging buffer with one
gather/scatter per segment) is plain torch and is checked here on CPU tensors; the IPC fields are checked
with bytes alone. The device thread, pinning and IPC open need a GPU: those tests skip without one."""

from __future__ import annotations

import asyncio
import mmap
import random

import pytest
import torch

from hicached.common import fence
from hicached.common.errors import HicachedError
from hicached.common.geometry import Geometry, Segment
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions import cuda as cuda_copier
from hicached.daemon.regions.cuda import copy_pages, normalize_uuid, parse_ipc, slot_runs

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA is not available on this machine: the CUDA copy thread, pinning and IPC need a GPU",
)


def page_bytes_of(geom: Geometry, region: torch.Tensor, i: int) -> bytes:
    return b"".join(
        region[s.offset + i * s.stride : s.offset + i * s.stride + s.length].numpy().tobytes()
        for s in geom.segments
    )


GEOMETRIES = {
    "contiguous": Geometry(4096, 64, (Segment(0, 4096, 4096),)),
    "k_v_halves": Geometry(4096, 64, (Segment(0, 2048, 2048), Segment(200_000, 2048, 2560))),
    "per_layer": Geometry(4096, 16, tuple(Segment(layer * 20_000, 512, 1024) for layer in range(8))),
    # [layer][k|v][page] rows of 256 bytes (SGLang's layer_first, vLLM's blocks): one gather kernel.
    "rows": Geometry(
        4096,
        16,
        tuple(Segment((2 * layer + kv) * 16 * 256, 256, 256) for layer in range(8) for kv in range(2)),
    ),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("layout", ["neighbours", "scattered_pages", "scattered_both"])
@pytest.mark.parametrize("pad", [128, 100, 101])  # the region's size: gathers of 8-, 4- and 1-byte elements
def test_copy_pages_on_cpu_tensors(name, layout, pad, monkeypatch):
    geom = GEOMETRIES[name]
    monkeypatch.setattr(cuda_copier, "STAGING_MAX", 5 * geom.page_bytes)  # several staging chunks
    rng = random.Random(3)
    size = geom.extent + pad
    dev = torch.randint(0, 256, (size + 64,), dtype=torch.uint8)[64:]  # a region with a storage offset
    assert cuda_copier.element_bytes(dev, geom) == {128: 8, 100: 4, 101: 1}[pad]
    host = torch.zeros(64 * 4096 * 2, dtype=torch.uint8)
    n = 12
    pages = list(range(n)) if layout == "neighbours" else rng.sample(range(geom.num_pages), n)
    slots = [k * 4096 for k in range(n)]
    if layout == "scattered_both":
        slots = [k * 8192 for k in range(n)]
        rng.shuffle(slots)
    staged = []

    def staging(nbytes):
        staged.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    marked = []
    moved = copy_pages(dev, host, geom, pages, slots, True, staging, False, [3, 7, n], marked.append)
    assert moved == n * geom.page_bytes
    assert marked == [3, 7, n]
    assert (cuda_copier.uniform_rows(geom) is not None) == (name in ("contiguous", "rows"))
    for i, q in zip(pages, slots, strict=True):
        assert host[q : q + 4096].numpy().tobytes() == page_bytes_of(geom, dev, i)
    # Staging only when it saves copies: not for neighbours in both places (one copy), nor for whole
    # pages into scattered slots (one copy per page either way).
    direct = name == "contiguous" and layout != "scattered_pages"
    assert (not staged) == direct
    assert all(nbytes <= 5 * geom.page_bytes for nbytes in staged)
    back = torch.zeros_like(dev)
    copy_pages(back, host, geom, pages, slots, False, staging, False)
    for i in range(geom.num_pages):
        want = page_bytes_of(geom, dev, i) if i in pages else bytes(geom.page_bytes)
        assert page_bytes_of(geom, back, i) == want


def test_slot_runs():
    assert slot_runs([], 4096) == []
    assert slot_runs([0, 4096, 8192, 20480, 24576, 0], 4096) == [(0, 3, 0), (3, 2, 20480), (5, 1, 0)]


def ipc_fields(**over):
    f = {
        "version": 1,
        "device_uuid": "GPU-0a1b",
        "ipc_handle": b"h" * 64,
        "storage_bytes": 1 << 20,
        "storage_offset": 0,
        "ref_counter_handle": b"/torch_123",
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
    }
    f.update(over)
    return f


def test_parse_ipc_fields():
    assert parse_ipc(ipc_fields())["storage_bytes"] == 1 << 20
    cases = [
        ("x", "needs a `cuda` map"),
        (ipc_fields(version=2), "cuda.version 2 is not supported"),
        (ipc_fields(version=None), "cuda.version None"),
        (ipc_fields(ipc_handle="pickled"), "cuda.ipc_handle must be bytes"),
        (ipc_fields(storage_bytes=True), "cuda.storage_bytes must be int"),
        (ipc_fields(storage_offset=-4), "cuda.storage_offset cannot be negative"),
        (ipc_fields(event_sync_required=1), "cuda.event_sync_required must be bool"),
        (ipc_fields(storage_bytes=0), "cuda.storage_bytes must be positive"),
    ]
    for value, needle in cases:
        with pytest.raises(HicachedError) as e:
            parse_ipc(value)
        assert e.value.code == "bad_request" and needle in e.value.message, (value, e.value.message)
    assert normalize_uuid(" GPU-AbC-1 ") == "abc-1" == normalize_uuid("abc-1")


@needs_cuda
async def test_cuda_copier_round_trip_in_process():
    # The region is a local tensor: an IPC handle cannot be opened by the process that exported it (the
    # e2e tests open one in a real daemon).
    from types import SimpleNamespace

    from hicached.daemon.regions.copier import Copier

    pool = Pool(64 << 20, prefault=True)
    c = Copier(pool, threads=1)
    try:
        geom = Geometry(1 << 16, 64, (Segment(0, 1 << 15, 1 << 15), Segment(4 << 20, 1 << 15, 1 << 16)))
        src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        c.cuda()
        region = SimpleNamespace(kind="cuda", device=src.device.index, tensor=src)
        pages = [5, 1, 63, 7]
        slots = [k * (1 << 16) for k in range(4)]
        await c.copy(region, True, geom, pages, slots)
        cpu = src.cpu()
        for i, q in zip(pages, slots, strict=True):
            assert bytes(pool.mm[q : q + (1 << 16)]) == page_bytes_of(geom, cpu, i)
        dst = torch.zeros_like(src)
        await c.copy(
            SimpleNamespace(kind="cuda", device=dst.device.index, tensor=dst), False, geom, pages, slots
        )
        back = dst.cpu()
        for i in pages:
            assert page_bytes_of(geom, back, i) == page_bytes_of(geom, cpu, i)
        assert c.stats()["cuda_devices"] == [src.device.index]
        assert c._cuda._pinned, "the pool is pinned in place before the first copy"
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


@needs_cuda
async def test_cuda_region_on_an_unknown_device_is_refused():
    from hicached.daemon.regions.copier import Copier

    pool = Pool(8 << 20, prefault=False)
    c = Copier(pool, threads=1)
    try:
        with pytest.raises(HicachedError) as e:
            await c.cuda().open(ipc_fields(device_uuid="GPU-00000000-dead"), 0, 4096)
        assert e.value.code == "bad_request" and "is not a device this daemon sees" in e.value.message
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


# The device thread with torch.cuda faked on CPU: what it answers when its device cannot be set up, and
# that a failed job still waits for the copies it issued.


class FakeStream:
    """A stream with copies in flight until someone waits for it."""

    made: list[FakeStream] = []

    def __init__(self, device=None):
        self.pending = 0
        FakeStream.made.append(self)

    def synchronize(self):
        self.pending = 0


class FakeEvent:
    def record(self, stream=None):
        self.stream = stream or FakeStream.made[-1]  # the current stream: the device thread's

    def synchronize(self):
        self.stream.pending = 0


def fake_cuda(monkeypatch, set_device=lambda index: None):
    import contextlib

    FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: None)  # nothing pinned: close() unpins nothing


async def test_a_device_that_cannot_be_set_up_answers_its_jobs(monkeypatch):
    from hicached.daemon.regions.jobs import Tracker

    def no_context(index):
        raise RuntimeError("CUDA error: out of memory")  # the daemon's context cannot be created

    fake_cuda(monkeypatch, no_context)
    pool = Pool(1 << 20, prefault=False)
    c = cuda_copier.CudaCopier(pool, Tracker())
    try:
        for _ in range(2):  # and the next one: the thread keeps answering
            with pytest.raises(HicachedError) as e:
                await asyncio.wait_for(c._call(0, lambda d: 1), 5)
            assert "CUDA device 0 could not be set up" in e.value.message
            assert "out of memory" in e.value.message
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


async def test_a_failed_cuda_job_is_answered_after_its_copies_ended(monkeypatch):
    from hicached.daemon.regions.jobs import Batch, Tracker

    fake_cuda(monkeypatch)
    pool = Pool(1 << 20, prefault=False)
    c = cuda_copier.CudaCopier(pool, Tracker())
    seen = {}

    def job(d):
        FakeStream.made[0].pending += 1  # a first chunk's copies, issued
        raise RuntimeError("CUDA out of memory")  # then a later chunk failed

    batch = Batch(asyncio.get_running_loop(), 1)

    def done(result, error):
        seen["in_flight"] = FakeStream.made[0].pending
        batch.job_done(error)

    try:
        c._device(0).jobs.put((job, done))
        with pytest.raises(HicachedError) as e:
            await asyncio.wait_for(batch.future, 5)
        assert e.value.code == "copy_failed" and "out of memory" in e.value.message
        # The answer aborts the store's slots (or releases the load's lease): no copy may still run on them.
        assert seen["in_flight"] == 0
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


def test_a_failed_pin_takes_the_error_it_left(monkeypatch):
    from hicached.daemon.regions.jobs import Tracker

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append("register")
            return 2  # cudaErrorMemoryAllocation: also this thread's last error now

        def cudaHostUnregister(self, ptr):
            calls.append("unregister")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(cuda_copier, "take_last_error", lambda: calls.append("take"))
    pool = Pool(1 << 20, prefault=False)
    try:
        c = cuda_copier.CudaCopier(pool, Tracker())
        c.ensure_pinned()
        assert calls == ["register", "take"] and c._pinned == []
        c.host = None
    finally:
        pool.close()


# Fenced CUDA jobs, on the device thread with torch.cuda faked on CPU: the job counts itself in before it
# enqueues a copy and out only once the stream's copies ended; a cancelled request's job copies nothing.

needs_fences = pytest.mark.skipif(not fence.AVAILABLE, reason="hicached.common._pageio is not built")


def fenced_copier(monkeypatch, board, seen):
    from hicached.daemon.regions.jobs import Tracker

    fake_cuda(monkeypatch)

    def fake_copy(dev, host, geom, pages, slots, to_pool, staging, non_blocking):
        seen.append(("copy", sum(fence.count(board, s) for s in range(len(board) // 8))))
        FakeStream.made[0].pending += 1  # copies in flight until the thread waits for its event
        return len(pages) * geom.page_bytes

    leave = fence.leave

    def leave_seen(b, s):
        seen.append(("leave", FakeStream.made[0].pending))
        leave(b, s)

    monkeypatch.setattr(cuda_copier, "copy_pages", fake_copy)
    monkeypatch.setattr(fence, "leave", leave_seen)
    pool = Pool(1 << 20, prefault=False)
    c = cuda_copier.CudaCopier(pool, Tracker())
    c._pin_tried = True  # nothing to pin: cudart is faked away
    return pool, c


@needs_fences
async def test_a_fenced_cuda_job_counts_out_only_once_its_copies_ended(monkeypatch):
    from types import SimpleNamespace

    from hicached.daemon.regions.jobs import Batch

    board, seen = mmap.mmap(-1, 64), []
    pool, c = fenced_copier(monkeypatch, board, seen)
    try:
        for to_pool in (True, False):
            seen.clear()
            batch = Batch(asyncio.get_running_loop(), 1)
            region = SimpleNamespace(device=0, tensor=None)
            c.copy(region, to_pool, GEOMETRIES["contiguous"], [0, 1], [0, 4096], batch, (board, 3))
            await asyncio.wait_for(batch.future, 5)
            assert seen == [("copy", 1), ("leave", 0)]  # inside while it copied; out after the wait
            assert fence.count(board, 3) == 0
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


@needs_fences
async def test_a_cancelled_cuda_request_copies_nothing(monkeypatch):
    from types import SimpleNamespace

    from hicached.daemon.regions.jobs import Batch, CopyCancelled

    board, seen = mmap.mmap(-1, 64), []
    pool, c = fenced_copier(monkeypatch, board, seen)
    try:
        assert fence.cancel(board, 5) == 0  # the engine gave up before the job started
        batch = Batch(asyncio.get_running_loop(), 1)
        c.copy(
            SimpleNamespace(device=0, tensor=None),
            False,
            GEOMETRIES["contiguous"],
            [0],
            [0],
            batch,
            (board, 5),
        )
        with pytest.raises(CopyCancelled):
            await asyncio.wait_for(batch.future, 5)
        assert seen == [] and fence.count(board, 5) == 0
        # Another slot of the same board is not affected.
        batch = Batch(asyncio.get_running_loop(), 1)
        c.copy(
            SimpleNamespace(device=0, tensor=None),
            True,
            GEOMETRIES["contiguous"],
            [0],
            [0],
            batch,
            (board, 6),
        )
        await asyncio.wait_for(batch.future, 5)
        assert seen == [("copy", 1), ("leave", 0)]
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


def test_the_pool_is_pinned_arena_by_arena(monkeypatch):
    from hicached.daemon.regions.jobs import Tracker

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append((ptr, n))
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(cuda_copier, "PIN_CHUNK", 3 << 20)
    pool = Pool(8 << 20, prefault=False, arenas=[("default", 2 << 20), ("a", 4 << 20), ("b", 2 << 20)])
    try:
        c = cuda_copier.CudaCopier(pool, Tracker())
        c.ensure_pinned()
        base = c.host.data_ptr()
        mib = 1 << 20
        want = [(0, 2 * mib), (2 * mib, 3 * mib), (5 * mib, mib), (6 * mib, 2 * mib)]
        assert [(p - base, n) for p, n in calls] == want  # never one register across two arenas
        assert c.pinned_bytes == 8 << 20
        c._unpin()
        assert c.pinned_bytes == 0
        c.host = None
    finally:
        pool.close()


def cpu_copier(monkeypatch, pool):
    """A Copier whose CUDA side runs on CPU tensors (torch.cuda faked): its batching, parts and checksums."""
    from hicached.daemon.regions.copier import Copier

    fake_cuda(monkeypatch)
    monkeypatch.setattr(cuda_copier._Device, "staging", lambda d, n: torch.empty(n, dtype=torch.uint8))
    c = Copier(pool, threads=1)
    c._cuda = cuda_copier.CudaCopier(pool, c.tracker)
    c._cuda._pin_tried = True
    return c


@pytest.mark.parametrize("c_module", [True, False])
async def test_a_cuda_store_takes_each_parts_checksums_once_its_copies_ended(monkeypatch, c_module):
    from types import SimpleNamespace

    import xxhash

    if not c_module:
        monkeypatch.setattr(cuda_copier, "_pageio", None)
    monkeypatch.setattr(cuda_copier, "PART_BYTES", 2 * 4096)
    geom = GEOMETRIES["k_v_halves"]
    pool = Pool(1 << 20, prefault=False)
    c = cpu_copier(monkeypatch, pool)
    try:
        src = torch.randint(0, 256, (geom.extent,), dtype=torch.uint8)
        pages = [9, 3, 40, 41, 7, 0, 63]
        slots = [k * 8192 for k in range(7)]  # 4 parts: 2 + 2 + 2 + 1 pages
        parts = c._cuda.parts(len(pages), geom.page_bytes)
        assert [len(part) for part in parts] == [2, 2, 2, 1]  # each part's checksums on two threads
        assert [h for part in parts for h in part] == [(k, k + 1) for k in range(7)]
        sums = await asyncio.wait_for(
            c.copy(SimpleNamespace(kind="cuda", device=0, tensor=src), True, geom, pages, slots), 10
        )
        for i, q, got in zip(pages, slots, sums, strict=True):
            page = page_bytes_of(geom, src, i)
            assert bytes(pool.mm[q : q + 4096]) == page
            assert got == xxhash.xxh3_64_intdigest(page)
    finally:
        await asyncio.to_thread(c.close)
        pool.close()


async def test_a_cuda_store_failing_in_a_later_part_is_answered_once_every_job_ended(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(cuda_copier, "PART_BYTES", 4096)
    real = cuda_copier.copy_pages
    calls = []

    def failing(dev, host, geom, pages, slots, to_pool, staging, non_blocking, marks, on_mark):
        def mark(k):
            calls.append(k)
            if len(calls) == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            on_mark(k)

        return real(dev, host, geom, pages, slots, to_pool, staging, non_blocking, marks, mark)

    monkeypatch.setattr(cuda_copier, "copy_pages", failing)
    geom = GEOMETRIES["contiguous"]
    pool = Pool(1 << 20, prefault=False)
    c = cpu_copier(monkeypatch, pool)
    try:
        src = torch.randint(0, 256, (geom.extent,), dtype=torch.uint8)
        with pytest.raises(HicachedError) as e:
            await asyncio.wait_for(
                c.copy(
                    SimpleNamespace(kind="cuda", device=0, tensor=src),
                    True,
                    geom,
                    [1, 2, 3, 4],
                    [0, 4096, 8192, 12288],
                ),
                10,
            )
        assert e.value.code == "copy_failed" and "illegal memory access" in e.value.message
        assert calls == [1, 2]  # the later parts were never issued
    finally:
        await asyncio.to_thread(c.close)
        pool.close()
