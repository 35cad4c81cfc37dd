"""Engine memory regions through the real daemon (a subprocess): pages stored from one region come back,
after a restart, into another; segmented layouts (K and V halves, per-layer slices) round trip and mix with
the plain client; bad geometry is refused; fds that are not memfds are refused (memfds that can shrink
are not: tests/e2e/test_shrinking_region_e2e.py); a client killed while it holds regions leaves nothing
mapped. The CUDA variants need a GPU and skip without one."""

from __future__ import annotations

import fcntl
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from hicached.common.errors import HicachedError
from hicached.common.keys import page_keys
from hicached.common.memfd import SEALS
from hicached.engine.client import Client, shared_buffer

PAGE = 64 * 1024
HALF = PAGE // 2

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA is not available on this machine: CUDA regions (IPC handles, the copy stream) need a GPU",
)


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * 16 + list(range(n * 16)), 16)[1:]


def random_fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    data = np.random.default_rng(seed).integers(0, 256, t.numel(), dtype=np.uint8)
    t.copy_(torch.from_numpy(data).to(t.device))
    return t


def page_of(buf: torch.Tensor, segments: list[tuple[int, int, int]], i: int) -> bytes:
    cpu = buf.cpu()
    return b"".join(
        bytes(cpu[off + i * stride : off + i * stride + n].numpy()) for off, n, stride in segments
    )


def contiguous(page: int = PAGE) -> list[tuple[int, int, int]]:
    return [(0, page, page)]


def kv_halves(num_pages: int) -> list[tuple[int, int, int]]:
    # All K halves, then all V halves with a padded stride: two segments with different strides.
    return [(0, HALF, HALF), (num_pages * HALF + 4096, HALF, HALF + 512)]


def per_layer(num_pages: int, layers: int = 8) -> list[tuple[int, int, int]]:
    # [layer][k|v][page][slice]: one segment per layer and K/V, each PAGE / (2 * layers) bytes.
    n = PAGE // (2 * layers)
    return [((2 * layer + kv) * num_pages * n, n, n) for layer in range(layers) for kv in range(2)]


def extent(segments: list[tuple[int, int, int]], num_pages: int) -> int:
    return max(off + (num_pages - 1) * stride + n for off, n, stride in segments)


def test_store_pages_then_restart_then_load_pages_into_another_region(daemon):
    n = 48
    keys = keys_for(1, n)
    src = random_fill(shared_buffer(64 * PAGE, name="e2e-src"), seed=1)
    src_pages = random.Random(1).sample(range(64), n)
    with Client(daemon.socket, "regions.ns", PAGE) as c:
        h = c.register_region(src, PAGE)
        for i in range(0, n, 16):
            assert c.store_pages(h, src_pages[i : i + 16], keys[i : i + 16]) == [True] * 16
        c.unregister_region(h)
    assert daemon.ctl("flush")["flushed"] is True
    daemon.restart()
    dst = shared_buffer(100 * PAGE, name="e2e-dst")
    dst_pages = random.Random(2).sample(range(100), n)
    with Client(daemon.socket, "regions.ns", PAGE) as c:
        assert c.stats()["pool"]["pages"] == 0  # everything comes back from L3
        h = c.register_region(dst, PAGE)
        assert c.load_pages(h, dst_pages, keys) == n
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert bytes(dst[d * PAGE : (d + 1) * PAGE].numpy()) == bytes(
                src[s * PAGE : (s + 1) * PAGE].numpy()
            )
        untouched = sorted(set(range(100)) - set(dst_pages))
        assert not dst[untouched[0] * PAGE : (untouched[0] + 1) * PAGE].any()
        stats = c.stats()
        assert stats["counters"]["prefetch.pages"] == n and stats["regions"]["counters"]["load_pages"] == n


@pytest.mark.parametrize("layout", ["kv_halves", "per_layer"])
def test_segmented_layouts_round_trip_and_mix_with_plain_pages(daemon, layout):
    num_pages = 40
    segs = kv_halves(num_pages) if layout == "kv_halves" else per_layer(num_pages)
    keys = keys_for(3, 20)
    with Client(daemon.socket, "segments.ns", PAGE) as c:
        kv = random_fill(shared_buffer(extent(segs, num_pages), name="e2e-kv"), seed=3)
        h = c.register_region(kv, PAGE, segments=segs)
        pages = list(range(0, 40, 2))
        assert c.store_pages(h, pages, keys) == [True] * 20
        # A page in L2 is the concatenation of its segments: the plain client sees exactly that.
        assert c.get(keys) == [page_of(kv, segs, i) for i in pages]
        # Into a contiguous region, and back into the same layout at other pages.
        flat = shared_buffer(20 * PAGE, name="e2e-flat")
        hf = c.register_region(flat, PAGE)
        assert c.load_pages(hf, list(range(20)), keys) == 20
        assert [bytes(flat[k * PAGE : (k + 1) * PAGE].numpy()) for k in range(20)] == c.get(keys)
        other = shared_buffer(extent(segs, num_pages), name="e2e-kv2")
        ho = c.register_region(other, PAGE, segments=segs)
        assert c.load_pages(ho, list(range(1, 40, 2)), keys) == 20
        assert [page_of(other, segs, i) for i in range(1, 40, 2)] == [page_of(kv, segs, i) for i in pages]
        # Plain store, then load_pages into the segmented region: the bytes are split back.
        plain_keys = keys_for(4, 2)
        plain = [os.urandom(PAGE) for _ in plain_keys]
        assert c.store(plain_keys, plain) == [True, True]
        assert c.load_pages(ho, [0, 2], plain_keys) == 2
        assert [page_of(other, segs, 0), page_of(other, segs, 2)] == plain


def test_bad_geometry_and_page_indices_are_bad_requests(daemon):
    buf = shared_buffer(16 * PAGE)
    with Client(daemon.socket, "bad.ns", PAGE) as c:
        cases = [
            ({"segments": [(0, HALF, HALF), (8 * PAGE, HALF - 1, HALF)]}, "lengths add up to 65535"),
            ({"segments": [(0, PAGE, HALF)]}, "segments[0].stride (32768) is smaller than its length"),
            (
                {"segments": [(0, HALF, HALF), (15 * PAGE, HALF, HALF)], "num_pages": 16},
                "segments[1]: page 15 ends",
            ),
            ({"num_pages": 17}, "past the end of the region"),
            ({"segments": [(-1, PAGE, PAGE)]}, "segments[0].offset must be at least 0"),
        ]
        for kwargs, needle in cases:
            with pytest.raises(HicachedError) as e:
                c.register_region(buf, PAGE, **kwargs)
            assert e.value.code == "bad_request" and needle in e.value.message, (kwargs, e.value.message)
        h = c.register_region(buf, PAGE)
        for pages, needle in [
            ([16], "page_indices[0] = 16 is out of range"),
            ([3, -1], "page_indices[1] = -1"),
        ]:
            with pytest.raises(HicachedError) as e:
                c.store_pages(h, pages, keys_for(5, len(pages)))
            assert e.value.code == "bad_request" and needle in e.value.message
            with pytest.raises(HicachedError) as e:
                c.load_pages(h, pages, keys_for(5, len(pages)))
            assert e.value.code == "bad_request" and needle in e.value.message
        assert c.stats()["pool"]["writing"] == 0  # refused before any slot was taken
        assert c.store_pages(h, [15], keys_for(6, 1)) == [True]  # the region still works
    assert daemon.alive


def test_fds_that_are_not_shared_memory_are_refused(daemon, tmp_path):
    def memfd(seals: int, allow: bool = True) -> int:
        fd = os.memfd_create("e2e-unsealed", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow else 0))
        os.ftruncate(fd, 4 * PAGE)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    regular = tmp_path / "region.bin"
    regular.write_bytes(bytes(4 * PAGE))
    r, w = os.pipe()
    sealed = memfd(SEALS)
    unsealed = [memfd(0, allow=False), memfd(fcntl.F_SEAL_GROW)]  # they can shrink: accepted, copied guarded
    fds = {
        "regular file": (os.open(regular, os.O_RDWR), "must be a memfd"),
        "pipe": (r, "region refused"),
        "read-only memfd": (os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY), "cannot map it read-write"),
    }
    if os.path.isdir("/dev/shm"):  # a tmpfs file is accepted (vLLM's region) and copied guarded, as unsealed
        shm = os.open(f"/dev/shm/hicached-e2e-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(shm, 4 * PAGE)
        os.unlink(f"/dev/shm/hicached-e2e-{os.getpid()}")
        unsealed.append(shm)
    try:
        with Client(daemon.socket, "fds.ns", PAGE) as c:
            for name, (fd, needle) in fds.items():
                with pytest.raises(HicachedError) as e:
                    c.register_region(fd, PAGE, num_pages=4)
                assert e.value.code == "bad_request" and needle in e.value.message, (name, e.value.message)
            assert c.stats()["regions"]["count"] == 0
            assert c.register_region(sealed, PAGE) > 0  # the same memory, sealed and read-write
            for fd in unsealed:
                h = c.register_region(fd, PAGE)
                assert c.store_pages(h, [3], [f"{fd:064x}"]) == [True]
    finally:
        for fd, _ in fds.values():
            os.close(fd)
        for fd in unsealed:
            os.close(fd)
        os.close(w)
        os.close(sealed)
    assert daemon.alive


ENGINE = textwrap.dedent(
    """
    import sys, time
    import torch
    from hicached.engine.client import Client, shared_buffer
    sock, name, use_cuda = sys.argv[1], sys.argv[2], sys.argv[3] == "cuda"
    c = Client(sock, "killed.ns", 65536)
    if use_cuda:
        buf = torch.ones(8 * 65536, dtype=torch.uint8, device="cuda")
    else:
        buf = shared_buffer(8 * 65536, name=name)
    if use_cuda:
        torch.cuda.synchronize()
    h = c.register_region(buf, 65536)
    keys = [f"{i:064x}" for i in range(8)]
    assert c.store_pages(h, list(range(8)), keys) == [True] * 8
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _run_killed_engine(daemon, kind: str, name: str) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, daemon.socket, name, kind], stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout.readline().strip() == "ready"
        assert daemon.ctl("stats")["regions"]["count"] == 1
        if kind == "host":
            assert f"/memfd:{name}" in _maps(daemon.proc.pid)
        engine.kill()  # SIGKILL: no unregister, no close
        engine.wait(30)
        deadline = time.monotonic() + 30
        while daemon.ctl("stats")["regions"]["count"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = daemon.ctl("stats")
        assert stats["regions"]["count"] == 0 and stats["regions"]["bytes"] == 0
        assert f"/memfd:{name}" not in _maps(daemon.proc.pid)
        assert stats["pool"]["leased"] == 0 and stats["pool"]["writing"] == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    with Client(daemon.socket, "killed.ns", PAGE) as c:
        assert c.exists([f"{i:064x}" for i in range(8)]) == 8  # what it stored stays stored


def test_a_killed_client_leaves_nothing_mapped(daemon):
    _run_killed_engine(daemon, "host", f"e2e-killed-{os.getpid()}")


# CUDA: the same paths with device memory. The region is a CUDA tensor; the daemon opens its IPC handle.


@needs_cuda
def test_cuda_store_pages_then_restart_then_load_pages_into_another_region(daemon):
    n = 32
    keys = keys_for(11, n)
    src = random_fill(torch.empty(64 * PAGE, dtype=torch.uint8, device="cuda"), seed=11)
    torch.cuda.synchronize()
    src_pages = random.Random(11).sample(range(64), n)
    with Client(daemon.socket, "cuda.ns", PAGE) as c:
        h = c.register_region(src, PAGE)
        assert c.stats()["regions"]["copier"]["cuda_devices"]
        assert c.store_pages(h, src_pages, keys) == [True] * n
        assert c.get(keys[:3]) == [page_of(src, contiguous(), i) for i in src_pages[:3]]
    daemon.ctl("flush")
    daemon.restart()
    dst = torch.zeros(80 * PAGE, dtype=torch.uint8, device="cuda")
    dst_pages = random.Random(12).sample(range(80), n)
    with Client(daemon.socket, "cuda.ns", PAGE) as c:
        h = c.register_region(dst, PAGE)
        assert c.load_pages(h, dst_pages, keys) == n
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert page_of(dst, contiguous(), d) == page_of(src, contiguous(), s)


@needs_cuda
@pytest.mark.parametrize("layout", ["kv_halves", "per_layer"])
def test_cuda_segmented_layouts_round_trip(daemon, layout):
    num_pages = 40
    segs = kv_halves(num_pages) if layout == "kv_halves" else per_layer(num_pages)
    keys = keys_for(13, 20)
    kv = random_fill(torch.empty(extent(segs, num_pages), dtype=torch.uint8, device="cuda"), seed=13)
    other = torch.zeros_like(kv)
    torch.cuda.synchronize()
    with Client(daemon.socket, "cuda-seg.ns", PAGE) as c:
        h = c.register_region(kv, PAGE, segments=segs)
        assert c.store_pages(h, list(range(0, 40, 2)), keys) == [True] * 20
        assert c.get(keys) == [page_of(kv, segs, i) for i in range(0, 40, 2)]
        ho = c.register_region(other, PAGE, segments=segs)
        assert c.load_pages(ho, list(range(1, 40, 2)), keys) == 20
        assert [page_of(other, segs, i) for i in range(1, 40, 2)] == [
            page_of(kv, segs, i) for i in range(0, 40, 2)
        ]


@needs_cuda
def test_cuda_bad_geometry_and_page_indices_are_bad_requests(daemon):
    t = torch.zeros(16 * PAGE, dtype=torch.uint8, device="cuda")
    with Client(daemon.socket, "cuda-bad.ns", PAGE) as c:
        with pytest.raises(HicachedError) as e:
            c.register_region(t, PAGE, num_pages=17)
        assert e.value.code == "bad_request" and "past the end of the region" in e.value.message
        h = c.register_region(t, PAGE)
        with pytest.raises(HicachedError) as e:
            c.store_pages(h, [16], keys_for(14, 1))
        assert e.value.code == "bad_request" and "out of range" in e.value.message


@needs_cuda
def test_cuda_killed_client_leaves_nothing_registered(daemon):
    _run_killed_engine(daemon, "cuda", "unused")
