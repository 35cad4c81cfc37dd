"""SGLang's real HiCache host KV pools (MHA and MLA, every layout with flat pages, default or shm allocator),
built on CPU for the adapter's tests, and the bytes of a page as SGLang's own `get_data_page` returns them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# Layouts whose pools have the flat-page interface (get_data_page, set_from_flat_data_page) that L3 backends
# use: SGLang's --hicache-mem-layout choices, less page_first_kv_split (Ascend NPU only, MLA on native split
# buffers) and page_head for MLA (MHA only). page_unified is internal and has no flat page.
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
LAYOUTS = {"mha": MHA_LAYOUTS, "mla": MLA_LAYOUTS}
ALLOCATORS = ("default", "shm")

# What `pip install --no-deps sglang` lacks for sglang.srt.mem_cache.pool_host to import on CPU, beyond the
# packages that hicache_storage needs (shared/NOTES.md): SGLang's own requirements (pinned where it pins
# them), dill (sglang.srt.sampling imports it without declaring it) and loguru (for compressed-tensors).
EXTRA_PACKAGES = "dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru gguf"

# The extra config SGLang's `dynamic` loader reads; `allocator` is what pool_host.common.get_allocator_type
# looks at, the rest is how README.md and docs/engines.md launch hicached.
_DYNAMIC_CONFIG = {
    "backend_name": "hicached",
    "module_path": "hicached.engine.sglang",
    "class_name": "HicachedStorage",
    "interface_v1": 1,
}

# SGLang books host pools against free RAM less a 10 GiB reserve (pool_host.base); these pools are a few
# MiB, so they are booked against a fixed budget instead, through SGLang's own scope for that.
_TEST_BUDGET_BYTES = 1 << 30

_NO_TORCHVISION = (
    "torchvision has no build for this CPU torch; hicached's tests import SGLang's host pools with a "
    "stand-in that only lets sglang.srt.configs import (tests/support/sglang_pools.py)"
)


class _NoTorchvision:
    """A torchvision name that SGLang's image helpers read at import; any use of it says why there is none."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(f"{self._name}.{attr}: {_NO_TORCHVISION}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(_NO_TORCHVISION, name="torchvision")

    def __repr__(self) -> str:
        return f"<{self._name}: no torchvision here>"


def _torchvision_modules() -> dict[str, types.ModuleType]:
    # Exactly the names the import of pool_host reads: sglang.srt.configs pulls in internvl_utils
    # (`import torchvision.transforms as T`, `from torchvision.transforms.functional import
    # InterpolationMode`) and deepseek_ocr (`from torchvision.transforms import InterpolationMode,
    # functional`). Both use them only inside image preprocessing functions.
    mods = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name, f"Stand-in: {_NO_TORCHVISION}")
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=not name.endswith("functional"))
        mods[name] = mod
    transforms, functional = mods["torchvision.transforms"], mods["torchvision.transforms.functional"]
    mods["torchvision"].transforms = transforms
    transforms.functional = functional
    transforms.InterpolationMode = functional.InterpolationMode = _NoTorchvision("InterpolationMode")
    return mods


@contextlib.contextmanager
def _torchvision_stand_in() -> Iterator[None]:
    """torchvision in sys.modules for the length of one import, then gone again, so that the rest of the
    process (and any later `import torchvision`) sees that it is not installed."""
    # transformers decides once (lru_cache) whether torchvision is there, from importlib.util.find_spec: let
    # it decide before the stand-in exists, or it would import torchvision.transforms.v2 from it.
    from transformers.utils.import_utils import is_torchvision_available

    is_torchvision_available()
    mods = _torchvision_modules()
    for name, mod in mods.items():
        sys.modules.setdefault(name, mod)
    try:
        yield
    finally:
        for name, mod in mods.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


def import_pool_modules() -> types.SimpleNamespace:
    """SGLang's modules that build host pools: pool_host.{base,common,mha,mla} and memory_pool (the device
    pools whose buffer infos the host pools are built from), and runtime_context (the published config).

    Raises ModuleNotFoundError naming the missing package when sglang or one of its light dependencies is
    not installed (see EXTRA_PACKAGES)."""
    names = {
        "base": "sglang.srt.mem_cache.pool_host.base",
        "common": "sglang.srt.mem_cache.pool_host.common",
        "mha": "sglang.srt.mem_cache.pool_host.mha",
        "mla": "sglang.srt.mem_cache.pool_host.mla",
        "memory_pool": "sglang.srt.mem_cache.memory_pool",
        "runtime_context": "sglang.srt.runtime_context",
    }
    need_stand_in = names["mha"] not in sys.modules and importlib.util.find_spec("torchvision") is None
    with contextlib.ExitStack() as stack:
        if need_stand_in:
            stack.enter_context(_torchvision_stand_in())
        # Import-time noise: CUDA-only quantization kernels (AWQ, GGUF) absent on CPU, deprecations inside
        # torch.jit and sentencepiece's SWIG types.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            return types.SimpleNamespace(**{key: importlib.import_module(mod) for key, mod in names.items()})
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] in ("sglang", "torchvision"):
                raise
            raise ModuleNotFoundError(
                f"SGLang's host pools need {e.name!r} here: pip install {EXTRA_PACKAGES}", name=e.name
            ) from e


def dynamic_extra_config(allocator: str, **extra: Any) -> str:
    """The --hicache-storage-backend-extra-config JSON that loads hicached, asking for `allocator`."""
    config = dict(_DYNAMIC_CONFIG, **extra)
    if allocator != "default":
        config["allocator"] = allocator
    return json.dumps(config)


@contextlib.contextmanager
def published_hicache_config(extra_config: str | None, backend: str | None = "dynamic") -> Iterator[None]:
    """SGLang's published server config with --hicache-storage-backend `backend` and its extra config, as a
    launch publishes it, through SGLang's own test hook (RuntimeContext.override_server_args); the previous
    config is put back on exit."""
    sgl = import_pool_modules()
    override = sgl.runtime_context.get_context().override_server_args(
        hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra_config
    )
    with override:
        yield


def make_host_pool(
    kind: str,
    layout: str,
    allocator: str = "default",
    *,
    page_size: int = 16,
    pages: int = 8,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 64,
    v_head_dim: int | None = None,
    kv_lora_rank: int = 64,
    qk_rope_head_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """One of SGLang's real host KV pools, `pages` pages of `page_size` tokens (SGLang's padding page
    included), built the way hybrid_pool_assembler.build_kv_host_pool builds it from SGLang's real device pool
    on CPU: the class SGLang picks for the buffer info (MHATokenToKVPoolHost, AsymmetricMHATokenToKVPoolHost
    when `v_head_dim` differs from `head_dim`, MLATokenToKVPoolHost), the same arguments, and the allocator
    that get_allocator_type() reads from the published dynamic extra config.

    One difference, because this machine has no CUDA: pin_memory=False. build_kv_host_pool leaves it at the
    constructor's default True, and then pool_host.common.alloc_with_host_register calls
    _cuda_host_register -> torch.cuda.cudart().cudaHostRegister, which fails on CPU torch ("Torch not
    compiled with CUDA enabled"). Pinning registers the memory in place; it changes no layout or byte.

    kind: "mha" (heads x head_dim, v_head_dim) or "mla" (one latent row of kv_lora_rank + qk_rope_head_dim).
    layout: any --hicache-mem-layout SGLang accepts for that kind; LAYOUTS[kind] have flat pages.
    allocator: "default" (anonymous shared mmap, no fd) or "shm" (a memfd: pool.fd, pool.allocator.fds).
    """
    if kind not in LAYOUTS:
        raise ValueError(f"kind must be one of {sorted(LAYOUTS)}, not {kind!r}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, not {allocator!r}")
    if pages < 2:
        raise ValueError("pages counts SGLang's padding page too: at least 2")
    sgl = import_pool_modules()
    # SGLang sizes a host pool as device tokens x ratio, plus one padding page: this gives exactly `pages`.
    device_tokens = (pages - 1) * page_size
    with (
        published_hicache_config(dynamic_extra_config(allocator)),
        sgl.base.host_memory_budget_scope(_TEST_BUDGET_BYTES),
    ):
        common = dict(
            host_to_device_ratio=1.0,
            host_size=0,
            page_size=page_size,
            layout=layout,
            pin_memory=False,
            device="cpu",
            allocator_type=sgl.common.get_allocator_type(),
            pool_label="kv",
        )
        if kind == "mha":
            device_pool = sgl.memory_pool.MHATokenToKVPool(
                device_tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, v_head_dim=v_head_dim
            )
            info = device_pool.get_device_pool_infos()[0].buffer_info
            return sgl.mha.get_mha_host_pool_cls(info)(
                info,
                device_capacity_tokens=device_pool.size,
                start_layer=device_pool.start_layer,
                end_layer=device_pool.end_layer,
                draft_buffer_infos=(),
                write_back_staging=device_pool.hicache_write_back_staging,
                **common,
            )
        device_pool = sgl.memory_pool.MLATokenToKVPool(
            device_tokens, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layers, "cpu", False
        )
        return sgl.mla.MLATokenToKVPoolHost(
            device_pool.get_device_pool_infos()[0].buffer_info,
            override_kv_cache_dim=device_pool.kv_cache_dim,
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            draft_buffer_infos=(),
            layer_shard_enabled=device_pool.layer_shard_enabled,
            target_layer_num=device_pool.layer_num,
            **common,
        )


def page_start(pool: Any, page_index: int) -> int:
    """The token index SGLang's flat-page methods take for page `page_index` (host indices are tokens)."""
    return page_index * pool.page_size


def raw_page_bytes(pool: Any, page_index: int) -> bytes:
    """Page `page_index` exactly as `pool.get_data_page(page_index * page_size, flat=True)` returns it."""
    page = pool.get_data_page(page_start(pool, page_index), flat=True)
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def page_nbytes(pool: Any) -> int:
    """The length of one flat page: what get_dummy_flat_data_page() holds."""
    dummy = pool.get_dummy_flat_data_page()
    return dummy.numel() * dummy.element_size()


@dataclasses.dataclass(frozen=True)
class Backing:
    """One host allocation of a pool: `data` is all of it as a flat uint8 tensor over the same memory (no
    copy; `.numpy()` gives a writable array, `memoryview(data.numpy())` a buffer). For the shm allocator,
    `fd` is its memfd and `file_size` the memfd's size: data.numel() rounded up to the OS page."""

    data: torch.Tensor
    fd: int | None
    file_size: int | None


def backings(pool: Any) -> list[Backing]:
    """The pool's host allocations in the order SGLang made them: one (`pool.kv_buffer`) for MHA and MLA; K
    then V for AsymmetricMHATokenToKVPoolHost, whose kv_buffer is the pair (k_buffer, v_buffer)."""
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, tuple | list) else (pool.kv_buffer,)
    fds = list(getattr(pool.allocator, "fds", ())) or [None] * len(buffers)
    if len(fds) != len(buffers):
        raise AssertionError(f"{len(buffers)} host buffers but {len(fds)} memfds")
    out = []
    for buf, fd in zip(buffers, fds, strict=True):
        if not buf.is_contiguous():
            raise AssertionError(f"host buffer of shape {tuple(buf.shape)} is not contiguous")
        data = buf.reshape(-1).view(torch.uint8)
        out.append(Backing(data, fd, None if fd is None else os.fstat(fd).st_size))
    return out


def backing(pool: Any) -> Backing:
    """The pool's one host allocation (every pool with flat pages has exactly one)."""
    (only,) = backings(pool)
    return only
