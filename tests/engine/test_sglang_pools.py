"""SGLang's real host KV pools as tests/support/sglang_pools.py builds them on CPU: they are SGLang's classes,
their flat pages round-trip, each layout's page is the (offset, stride, length) runs of its one backing buffer
that the notes below give, and the shm allocator's memfd is the pool's memory."""

from __future__ import annotations

import errno
import fcntl
import gc
import importlib
import inspect
import itertools
import json
import mmap
import os
import sys

import pytest
import torch

pytest.importorskip("sglang", reason="sglang is not installed")

import sglang_pools as sp  # noqa: E402

CASES = [
    pytest.param((kind, layout, allocator, dtype), id=f"{kind}-{layout}-{allocator}-{str(dtype)[6:]}")
    for kind, layouts in sp.LAYOUTS.items()
    for layout, allocator, dtype in itertools.product(layouts, sp.ALLOCATORS, (torch.bfloat16, torch.float16))
]


@pytest.fixture(scope="module")
def sgl():
    # Imported on first use, not at collection: importing SGLang's pools makes more of sglang importable in
    # this process (sglang.srt.configs and what follows it), which tests collected earlier must not see.
    try:
        return sp.import_pool_modules()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(params=CASES)
def pool(request, sgl):
    kind, layout, allocator, dtype = request.param
    return sp.make_host_pool(kind, layout, allocator, dtype=dtype)


def noted_segments(pool) -> list[tuple[int, int, int]]:
    """A page as (offset, stride, length) byte runs of the pool's backing buffer, from its geometry alone:
    page p is the concatenation of [offset + p * stride, + length) over the runs in order.

    MHA: one (2, ...) tensor, K half then V half (V at `v`, half the buffer); token rows of t bytes.
      layer_first (2, L, S, H, D): 2L runs, K layers then V layers, each P rows.
      page_first (2, S, L, H, D), page_first_direct (2, N, L, P, H, D), page_head (2, N, H, P, L, D): 2 runs,
      K then V, each P * L rows; same runs, different order inside a run (token-, layer-, head-major).
    MLA: one (.., 1, C) latent tensor, rows of r bytes, no K/V axis.
      layer_first (L, S, 1, C): L runs of P rows. page_first (S, L, 1, C), page_first_direct (N, L, P, 1, C):
      1 run of P * L rows."""
    e, p, layers, size = pool.dtype.itemsize, pool.page_size, pool.layer_num, pool.size
    if type(pool).__name__ == "MLATokenToKVPoolHost":
        r = pool.kv_cache_dim * e
        if pool.layout == "layer_first":
            return [(layer * size * r, p * r, p * r) for layer in range(layers)]
        return [(0, p * layers * r, p * layers * r)]
    t = pool.head_num * pool.head_dim * e
    v = layers * size * t
    if pool.layout == "layer_first":
        return [(kv * v + layer * size * t, p * t, p * t) for kv in (0, 1) for layer in range(layers)]
    return [(kv * v, p * layers * t, p * layers * t) for kv in (0, 1)]


def fill_random(pool, seed: int = 0) -> None:
    data = sp.backing(pool).data
    data.copy_(
        torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )


def test_pools_are_sglangs_own_classes(pool, sgl):
    cls = type(pool)
    kind = "mla" if cls.__name__.startswith("MLA") else "mha"
    assert cls.__module__ == f"sglang.srt.mem_cache.pool_host.{kind}"
    assert cls.__name__ == {"mha": "MHATokenToKVPoolHost", "mla": "MLATokenToKVPoolHost"}[kind]
    assert isinstance(pool, sgl.base.HostKVCache)
    assert inspect.getfile(cls).startswith(os.path.dirname(sys.modules["sglang"].__file__))
    for name in ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page"):
        assert getattr(cls, name).__module__ == cls.__module__
    assert pool.page_num == 8 and pool.size == 8 * pool.page_size and pool.page_size == 16
    assert sp.page_nbytes(pool) == sum(length for _, _, length in noted_segments(pool))
    if pool.fd is None:
        assert type(pool.allocator) is sgl.common.HostTensorAllocator
    else:
        assert type(pool.allocator) is sgl.common.ShmHostTensorAllocator
        assert pool.fd == pool.allocator.fd == pool.allocator.fds[0] and len(pool.allocator.fds) == 1


def test_flat_pages_round_trip_through_sglangs_methods(pool):
    n = sp.page_nbytes(pool)
    pages = {
        i: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        for i in range(pool.page_num)
    }
    for i, page in pages.items():
        pool.set_from_flat_data_page(sp.page_start(pool, i), page.view(pool.dtype))
    for i, page in pages.items():
        got = pool.get_data_page(sp.page_start(pool, i), flat=True)
        assert got.dtype == pool.dtype and got.numel() * got.element_size() == n
        assert sp.raw_page_bytes(pool, i) == page.numpy().tobytes()


def test_a_page_is_the_noted_runs_of_the_backing_buffer(pool):
    fill_random(pool)
    data = sp.backing(pool).data.numpy()
    segments = noted_segments(pool)
    assert max(off + (pool.page_num - 1) * stride + length for off, stride, length in segments) <= data.size
    for page in range(pool.page_num):
        runs = [data[off + page * stride : off + page * stride + length] for off, stride, length in segments]
        assert b"".join(run.tobytes() for run in runs) == sp.raw_page_bytes(pool, page)


def test_the_backing_buffer_is_the_pools_memory(pool):
    b = sp.backing(pool)
    buffer = pool.kv_buffer
    assert b.data.data_ptr() == buffer.data_ptr()
    assert b.data.numel() == buffer.numel() * buffer.element_size()
    b.data.zero_()
    b.data[: sp.page_nbytes(pool)] = 0xAB  # the start of page 0 in every layout
    assert sp.raw_page_bytes(pool, 0)[:1] == b"\xab"


@pytest.mark.parametrize("kind", sorted(sp.LAYOUTS))
def test_flat_page_byte_order_per_layout(kind, sgl):
    """The same KV content as a flat page: layer_first and page_first_direct give the same bytes (layer-major:
    [K,V] x layer x token), page_first (token-major) and page_head (head-major) each another order of them. A
    page stored from one layout is a page of another only between layer_first and page_first_direct."""
    pools = {layout: sp.make_host_pool(kind, layout) for layout in sp.LAYOUTS[kind]}
    any_pool = next(iter(pools.values()))
    n, p, layers = any_pool.page_num, any_pool.page_size, any_pool.layer_num
    gen = torch.Generator().manual_seed(1)
    if kind == "mla":
        # (page, token, layer, 1, row) views of each layout's buffer.
        row = (1, any_pool.kv_cache_dim)
        content = torch.randn((n, p, layers, *row), generator=gen).to(any_pool.dtype)
        views = {
            "layer_first": lambda b: b.view(layers, n, p, *row).permute(1, 2, 0, 3, 4),
            "page_first": lambda b: b.view(n, p, layers, *row),
            "page_first_direct": lambda b: b.permute(0, 2, 1, 3, 4),
        }
    else:
        # (kv, page, token, layer, head, dim) views.
        h, d = any_pool.head_num, any_pool.head_dim
        content = torch.randn((2, n, p, layers, h, d), generator=gen).to(any_pool.dtype)
        views = {
            "layer_first": lambda b: b.view(2, layers, n, p, h, d).permute(0, 2, 3, 1, 4, 5),
            "page_first": lambda b: b.view(2, n, p, layers, h, d),
            "page_first_direct": lambda b: b.permute(0, 1, 3, 2, 4, 5),
            "page_head": lambda b: b.permute(0, 1, 3, 4, 2, 5),
        }
    for layout, host in pools.items():
        views[layout](host.kv_buffer)[...] = content
    flat = {layout: sp.raw_page_bytes(host, 3) for layout, host in pools.items()}
    assert flat["layer_first"] == flat["page_first_direct"]
    others = [flat[layout] for layout in sp.LAYOUTS[kind] if layout != "page_first_direct"]
    assert len(set(others)) == len(others)
    assert len({bytes(sorted(page)) for page in flat.values()}) == 1  # the same bytes in another order


def test_shm_pool_fd_is_an_unsealable_memfd_that_is_the_pools_memory(sgl):
    # A geometry whose bytes are not a whole number of OS pages: the memfd is rounded up.
    host = sp.make_host_pool(
        "mla", "page_first", "shm", page_size=3, pages=5, layers=1, kv_lora_rank=7, qk_rope_head_dim=2
    )
    b = sp.backing(host)
    assert b.fd == host.fd == host.allocator.fd
    assert os.readlink(f"/proc/self/fd/{b.fd}").startswith("/memfd:sglang_host_pool_")
    assert fcntl.fcntl(b.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    # MFD_CLOEXEC without MFD_ALLOW_SEALING: the memfd is born with F_SEAL_SEAL and can never be sealed.
    assert fcntl.fcntl(b.fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        fcntl.fcntl(b.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    nbytes = 15 * 9 * host.dtype.itemsize
    assert b.data.numel() == nbytes and b.file_size == mmap.PAGESIZE == os.fstat(b.fd).st_size
    off, stride, length = noted_segments(host)[0]
    os.pwrite(b.fd, b"\x5a" * length, off + 2 * stride)  # through the fd, into page 2
    assert sp.raw_page_bytes(host, 2) == b"\x5a" * length
    host.set_from_flat_data_page(
        sp.page_start(host, 4), torch.full((length // 2,), 7, dtype=torch.int16).view(host.dtype)
    )
    with mmap.mmap(b.fd, b.file_size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
        assert mm[off + 4 * stride : off + 4 * stride + length] == sp.raw_page_bytes(host, 4)


def test_shm_fd_is_closed_with_the_pool(sgl):
    """ShmHostTensorAllocator.__del__ closes its memfds; the mapping lives on with the tensor. Whoever keeps
    the memory beyond the pool (another process, a dup) must take its own reference while the pool lives."""
    host = sp.make_host_pool("mha", "page_first", "shm")
    fd, name = host.fd, os.readlink(f"/proc/self/fd/{host.fd}")
    kept = os.dup(fd)
    try:
        data = sp.backing(host).data
        del host
        gc.collect()
        try:
            assert os.readlink(f"/proc/self/fd/{fd}") != name  # the number may be reused by now
        except OSError as e:
            assert e.errno == errno.ENOENT
        data[:4] = 9
        assert os.pread(kept, 4, 0) == b"\x09" * 4
    finally:
        os.close(kept)


def test_shm_allocator_comes_from_the_dynamic_extra_config(sgl):
    """pool_host.common.get_allocator_type: "shm" for --hicache-storage-backend shm, or dynamic with
    "allocator": "shm" in an inline extra-config JSON; otherwise the backend name, which
    get_allocator_from_storage turns into the plain mmap allocator."""
    get_type = sgl.common.get_allocator_type
    with sp.published_hicache_config(sp.dynamic_extra_config("shm")):
        assert get_type() == "shm"
    with sp.published_hicache_config(sp.dynamic_extra_config("default")):
        assert get_type() == "dynamic"
    with sp.published_hicache_config(None, backend="shm"):
        assert get_type() == "shm"
    with sp.published_hicache_config(None, backend=None):
        assert get_type() == "default"
    assert type(sgl.common.get_allocator_from_storage("dynamic")) is sgl.common.HostTensorAllocator


def test_extra_config_from_a_file_does_not_select_shm(tmp_path, sgl):
    """SGLang accepts --hicache-storage-backend-extra-config @file, but get_allocator_type json.loads the raw
    string and ignores the failure: `"allocator": "shm"` in a file leaves the default allocator (no fd)."""
    config = tmp_path / "hicache.json"
    config.write_text(sp.dynamic_extra_config("shm"))
    with sp.published_hicache_config(f"@{config}"):
        assert sgl.common.get_allocator_type() == "dynamic"
    assert json.loads(config.read_text())["allocator"] == "shm"


def test_asymmetric_mha_has_two_allocations_and_no_flat_pages(sgl):
    """head_dim != v_head_dim: SGLang picks AsymmetricMHATokenToKVPoolHost, K and V in separate buffers, two
    memfds under shm of which pool.fd names only K's, and no flat-page interface."""
    host = sp.make_host_pool("mha", "page_first", "shm", head_dim=64, v_head_dim=32)
    assert type(host) is sgl.mha.AsymmetricMHATokenToKVPoolHost
    k, v = sp.backings(host)
    assert host.fd == k.fd != v.fd and host.allocator.fds == [k.fd, v.fd]
    assert k.data.numel() == 2 * v.data.numel()
    with pytest.raises(NotImplementedError):
        host.get_data_page(0)
    with pytest.raises(NotImplementedError):
        host.get_dummy_flat_data_page()


@pytest.mark.parametrize(
    ("kind", "layout"), [("mha", "page_unified"), ("mla", "page_unified"), ("mla", "page_head")]
)
def test_other_layouts_have_no_flat_pages(kind, layout, sgl):
    with pytest.raises(ValueError, match=f"Unsupported layout: {layout}"):
        sp.make_host_pool(kind, layout).get_data_page(0)


def test_torchvision_stand_in_is_gone_after_the_import(sgl):
    """The rest of the process sees what is installed: no torchvision, and transformers agrees."""
    assert not any(name == "torchvision" or name.startswith("torchvision.") for name in sys.modules)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torchvision")
    from transformers.utils.import_utils import is_torchvision_available

    assert not is_torchvision_available()
