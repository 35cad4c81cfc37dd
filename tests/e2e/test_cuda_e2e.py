"""CUDA regions through the real daemon (a subprocess), as engines use them: scattered pages of SGLang's
`layer_first` / `page_first` and vLLM's block layouts stored from a CUDA tensor and loaded into another,
byte-exact against a CPU copy; several regions (on every device present) on one connection; a region the
engine unregisters and frees gives its GPU memory back; a daemon restarted under a client that registers its
CUDA region again; tenants' arenas pinned; and fenced CUDA copies: a load_pages or store_pages whose answer
times out returns only once no copy of it can touch the engine's memory, also with the daemon stopped
mid-copy. Every test needs a GPU and skips without one (bench/gpu_check runs them on one)."""

from __future__ import annotations

import random
import re
import signal
import time

import pytest
import torch
from mid_copy import board_count, stop_mid_copy

from hicached.common import fence
from hicached.common.errors import HicachedError
from hicached.common.keys import page_keys
from hicached.engine.client import Client

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA is not available on this machine: CUDA regions (IPC handles, the copy stream) need a GPU",
)

PAGE = 64 * 1024
LAYERS = 8
Segments = list[tuple[int, int, int]]


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * 16 + list(range(n * 16)), 16)[1:]


def random_fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device=t.device).manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device, generator=g))
    torch.cuda.synchronize(t.device)  # the daemon's stream does not wait on ours
    return t


def page_of(cpu: torch.Tensor, segments: Segments, i: int) -> bytes:
    return b"".join(
        bytes(cpu[off + i * stride : off + i * stride + n].numpy()) for off, n, stride in segments
    )


def extent(segments: Segments, num_pages: int) -> int:
    return max(off + (num_pages - 1) * stride + n for off, n, stride in segments)


def layout(name: str, num_pages: int) -> Segments:
    """The segments of one page (PAGE bytes) in one engine buffer of `num_pages` pages."""
    per = PAGE // (2 * LAYERS)  # one layer's K (or V) of a page
    if name == "sglang_layer_first":  # [k|v][layer][token][head*dim]: a segment per layer and K/V
        return [
            ((kv * LAYERS + layer) * num_pages * per, per, per) for kv in range(2) for layer in range(LAYERS)
        ]
    if name == "sglang_page_first":  # [k|v][token][layer][head*dim]: a page's K together, then its V
        half = PAGE // 2
        return [(0, half, half), (num_pages * half, half, half)]
    if name == "vllm_blocks":  # per layer [k|v][block][block_size*head*dim], the layers back to back
        return [((layer * 2 + kv) * num_pages * per, per, per) for layer in range(LAYERS) for kv in range(2)]
    if name == "vllm_flashinfer":  # per layer [block][k|v][...]: a block's K and V adjacent
        return [(layer * num_pages * 2 * per, 2 * per, 2 * per) for layer in range(LAYERS)]
    if name == "padded":  # two halves with a padded stride and a gap before the second
        half = PAGE // 2
        return [(0, half, half + 512), (num_pages * (half + 512) + 4096, half, half + 1024)]
    assert name == "contiguous"
    return [(0, PAGE, PAGE)]


LAYOUTS = [
    "contiguous",
    "sglang_layer_first",
    "sglang_page_first",
    "vllm_blocks",
    "vllm_flashinfer",
    "padded",
]


def segments_arg(segs: Segments) -> Segments | None:
    return None if segs == [(0, PAGE, PAGE)] else segs


@pytest.mark.parametrize("name", LAYOUTS)
def test_scattered_pages_of_engine_layouts_round_trip_byte_exact(daemon, name):
    num_pages = 96
    n = 40
    segs = layout(name, num_pages)
    keys = keys_for(21, n)
    src = random_fill(torch.empty(extent(segs, num_pages), dtype=torch.uint8, device="cuda"), seed=21)
    dst = torch.zeros_like(src)
    src_pages = random.Random(1).sample(range(num_pages), n)
    dst_pages = random.Random(2).sample(range(num_pages), n)
    cpu = src.cpu()
    with Client(daemon.socket, f"cuda-{name}.ns", PAGE) as c:
        hs = c.register_region(src, PAGE, segments=segments_arg(segs), num_pages=num_pages)
        for i in range(0, n, 16):  # several requests, pages in no order
            assert c.store_pages(hs, src_pages[i : i + 16], keys[i : i + 16]) == [True] * len(
                keys[i : i + 16]
            )
        assert c.get(keys) == [page_of(cpu, segs, i) for i in src_pages]
        hd = c.register_region(dst, PAGE, segments=segments_arg(segs), num_pages=num_pages)
        assert c.load_pages(hd, dst_pages, keys) == n
        back = dst.cpu()
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert page_of(back, segs, d) == page_of(cpu, segs, s)
        for i in sorted(set(range(num_pages)) - set(dst_pages)):
            assert page_of(back, segs, i) == bytes(PAGE), f"page {i} was written, and was not asked for"
        stats = c.stats()["regions"]["copier"]
        assert stats["cuda_pinned_bytes"] > 0, "the pool is pinned for CUDA copies"


def test_several_regions_on_every_device_share_one_connection(daemon):
    devices = list(range(torch.cuda.device_count()))
    n = 24
    with Client(daemon.socket, "cuda-many.ns", PAGE) as c:
        regions = []
        for dev in devices:
            for k in range(2):
                t = random_fill(
                    torch.empty(32 * PAGE, dtype=torch.uint8, device=f"cuda:{dev}"), 100 * dev + k
                )
                regions.append((t, c.register_region(t, PAGE)))
        stored = []
        for j, (t, h) in enumerate(regions):
            keys = keys_for(200 + j, n)
            pages = random.Random(j).sample(range(32), n)
            assert c.store_pages(h, pages, keys) == [True] * n
            stored.append((t.cpu(), pages, keys))
        # Each region's pages come back into the next region (another device where there are several).
        for j, (src_cpu, pages, keys) in enumerate(stored):
            t, h = regions[(j + 1) % len(regions)]
            assert c.load_pages(h, list(range(n)), keys) == n
            got = t.cpu()
            for d, s in enumerate(pages):
                assert page_of(got, [(0, PAGE, PAGE)], d) == page_of(src_cpu, [(0, PAGE, PAGE)], s)
        assert c.stats()["regions"]["copier"]["cuda_devices"] == devices


def _reserved_after_collect(device: int, baseline: int, deadline: float) -> int:
    """torch's reserved bytes on `device`, once its IPC limbo was collected, waiting (bounded) for it to
    come down to `baseline`: a block exported over IPC is only freed once every importer gave its reference
    back."""
    while True:
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        now = torch.cuda.memory_reserved(device)
        if now <= baseline or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["unregister", "close"])
def test_a_region_the_engine_lets_go_gives_its_gpu_memory_back(daemon, how):
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved(0)
    keys = keys_for(31, 16)
    t = random_fill(torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0"), 31)
    want = [page_of(t[: 16 * PAGE].cpu(), [(0, PAGE, PAGE)], i) for i in range(16)]
    c = Client(daemon.socket, "cuda-free.ns", PAGE)
    try:
        h = c.register_region(t, PAGE)
        assert c.store_pages(h, list(range(16)), keys) == [True] * 16
        if how == "unregister":
            c.unregister_region(h)
        else:
            c.close()
        deadline = time.monotonic() + 30
        while daemon.ctl("stats")["regions"]["count"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.ctl("stats")["regions"]["count"] == 0
        del t
        reserved = _reserved_after_collect(0, baseline, time.monotonic() + 30)
        assert reserved <= baseline, f"{reserved - baseline} bytes of the freed region are still reserved"
    finally:
        c.close()
    with Client(daemon.socket, "cuda-free.ns", PAGE) as c2:
        assert c2.get(keys) == want  # what it stored stays stored


def test_daemon_restarted_under_a_client_that_registers_its_cuda_region_again(daemon):
    n = 32
    keys = keys_for(41, n)
    src = random_fill(torch.empty(64 * PAGE, dtype=torch.uint8, device="cuda"), 41)
    dst = torch.zeros_like(src)
    with Client(daemon.socket, "cuda-restart.ns", PAGE, timeout=30) as c:
        hs = c.register_region(src, PAGE)
        hd = c.register_region(dst, PAGE)
        assert c.store_pages(hs, list(range(n)), keys) == [True] * n
        assert daemon.ctl("flush")["flushed"] is True
        daemon.restart()
        # The same handles: the client registers both regions again on its new connection.
        assert c.load_pages(hd, list(range(n, 2 * n)), keys) == n
        assert torch.equal(dst[n * PAGE : 2 * n * PAGE].cpu(), src[: n * PAGE].cpu())
        more = keys_for(42, 8)
        assert c.store_pages(hs, list(range(n, n + 8)), more) == [True] * 8
        assert c.get(more) == [bytes(src[i * PAGE : (i + 1) * PAGE].cpu().numpy()) for i in range(n, n + 8)]


def test_tenants_arenas_are_pinned_and_serve_cuda_regions(daemon_factory):
    d = daemon_factory(
        {
            "pool": {"capacity": "256MiB", "slab_size": "1MiB"},
            "storage": {"backend": "none"},
            "tenants": {
                "a": {"uids": [0], "namespaces": ["a.*"], "capacity": "64MiB"},
                "b": {"uids": [4242], "namespaces": ["b.*"], "capacity": "64MiB"},
            },
        }
    )
    n = 32
    keys = keys_for(51, n)
    src = random_fill(torch.empty(n * PAGE, dtype=torch.uint8, device="cuda"), 51)
    dst = torch.zeros_like(src)
    with Client(d.socket, "a.model", PAGE) as c:
        h = c.register_region(src, PAGE)
        assert c.store_pages(h, list(range(n)), keys) == [True] * n
        hd = c.register_region(dst, PAGE)
        assert c.load_pages(hd, list(range(n))[::-1], keys) == n
        for i in range(n):
            assert torch.equal(dst[(n - 1 - i) * PAGE : (n - i) * PAGE], src[i * PAGE : (i + 1) * PAGE])
    log = d.log()
    assert "could not pin" not in log
    m = re.search(r"pinned the L2 pool \((\d+) bytes, (\d+) arenas\)", log)
    assert m is not None, log[-2000:]
    assert int(m.group(1)) == 256 << 20 and int(m.group(2)) == 3  # a, b and the default tenant's share


# Fences: a call whose answer timed out returns only once no copy of its request can touch the engine's
# memory. 1 GiB a request: tens of milliseconds of PCIe, against a client time-out of 2 ms.

FENCE_PAGE = 1 << 20
FENCE_N = 1024
MARK = 0xAB
NEW = 0xEE
needs_fences = pytest.mark.skipif(not fence.AVAILABLE, reason="hicached.common._pageio is not built")


def fence_config() -> dict:
    return {"pool": {"capacity": "3GiB", "slab_size": "4MiB"}, "storage": {"backend": "none"}}


def page_values(seed: int) -> torch.Tensor:
    return ((torch.arange(FENCE_N) * 7 + seed) % 200 + 1).to(torch.uint8)


def filled(values: torch.Tensor) -> torch.Tensor:
    t = values.to("cuda").repeat_interleave(FENCE_PAGE)
    torch.cuda.synchronize()
    return t


def assert_settled(t: torch.Tensor, seconds: float = 1.0) -> None:
    """Fails if any byte of `t` changes over `seconds` after the call returned (a late copy)."""
    snap = t.clone()
    torch.cuda.synchronize()
    time.sleep(seconds)
    assert torch.equal(t, snap), "the region changed after the call returned (a late copy)"


def prepared(d, seed: int) -> tuple[Client, int, torch.Tensor, list[str]]:
    """A client with FENCE_N pages of `seed` in L2, and a CUDA destination of FENCE_N rows of MARK."""
    keys = keys_for(seed, FENCE_N)
    c = Client(d.socket, "cuda-fence.ns", FENCE_PAGE, timeout=60)
    src = filled(page_values(seed))
    hs = c.register_region(src, FENCE_PAGE)
    assert c.store_pages(hs, list(range(FENCE_N)), keys) == [True] * FENCE_N
    c.unregister_region(hs)
    del src
    dst = torch.full((FENCE_N * FENCE_PAGE,), MARK, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    hd = c.register_region(dst, FENCE_PAGE)
    assert c._wire.ops.fences is not None and c._wire.ops.fences.registered, (
        "a CUDA-only connection has a board"
    )
    return c, hd, dst, keys


@needs_fences
def test_cuda_load_timed_out_writes_nothing_after_it_raised(daemon_factory):
    d = daemon_factory(fence_config())
    c, hd, dst, keys = prepared(d, seed=1)
    with c:
        c.timeout = 0.002
        with pytest.raises(HicachedError) as e:
            c.load_pages(hd, list(range(FENCE_N)), keys)
        assert e.value.code == "timeout"
        assert_settled(dst)
        c.timeout = 60
        rows = dst.view(FENCE_N, FENCE_PAGE)
        first, values = rows[:, 0].cpu(), page_values(1)
        for i in range(FENCE_N):  # each page is whole: the value it should have, or untouched
            assert first[i] in (MARK, values[i])
        assert torch.equal(rows, first.to("cuda")[:, None].expand(-1, FENCE_PAGE))
        assert c.load_pages(hd, list(range(FENCE_N)), keys) == FENCE_N  # the connection still serves
        assert torch.equal(rows[:, 0].cpu(), values)


@needs_fences
def test_cuda_store_timed_out_never_stores_bytes_written_after_it_raised(daemon_factory):
    d = daemon_factory(fence_config())
    keys = keys_for(2, FENCE_N)
    values = page_values(2)
    src = filled(values)
    with Client(d.socket, "cuda-fence.ns", FENCE_PAGE, timeout=60) as c:
        h = c.register_region(src, FENCE_PAGE)
        c.timeout = 0.002
        with pytest.raises(HicachedError) as e:
            c.store_pages(h, list(range(FENCE_N)), keys)
        assert e.value.code == "timeout"
        src.fill_(NEW)  # the engine reuses the rows at once
        torch.cuda.synchronize()
        c.timeout = 60
        present = c.present(keys)
        for i in [i for i, p in enumerate(present) if p][:64] + [i for i, p in enumerate(present) if p][-64:]:
            got = c.get([keys[i]])
            if got:
                assert got[0] == bytes([int(values[i])]) * FENCE_PAGE, f"key {i} holds bytes written later"


@needs_fences
@pytest.mark.parametrize("end", ["SIGCONT", "SIGKILL"])
def test_cuda_daemon_stopped_mid_copy_holds_the_call_until_it_continues_or_dies(daemon_factory, end):
    d = daemon_factory(fence_config())
    c, hd, dst, keys = prepared(d, seed=5)
    held = False
    try:
        for _ in range(8):  # the stop may land outside the copy: then the call returns, and we try again
            dst.fill_(MARK)
            torch.cuda.synchronize()
            t, out = stop_mid_copy(
                d.proc, c, lambda: c.load_pages(hd, list(range(FENCE_N)), keys), timeout=0.2
            )
            time.sleep(1.5)  # the client's time-out has passed long ago
            if board_count(c):
                held = True
                assert t.is_alive(), "the call returned while a CUDA copy job was inside the region"
                break
            d.proc.send_signal(signal.SIGCONT)
            t.join(30)
            assert not t.is_alive()
            c.timeout = 60
        assert held, "the daemon never stopped mid-copy in 8 tries"
        d.proc.send_signal(getattr(signal, end))
        if end == "SIGKILL":
            d.proc.wait()
        t.join(60)
        assert not t.is_alive(), f"the call is still blocked after {end}"
        assert isinstance(out[0], HicachedError) and out[0].code in ("timeout", "connection")
        assert_settled(dst)
    finally:
        if d.alive:
            d.proc.send_signal(signal.SIGCONT)
        c.close()
