"""The SGLang storage backend adapter against the real daemon, with a small stand-in for SGLang's host
pool: round trips, the leading prefix, a daemon restart, namespaces, and SGLang's own loader if installed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from hicached.common.keys import page_keys, valid_namespace
from hicached.engine.sglang import HicachedStorage

TOKENS = 4  # tokens per page
NUMEL = 2048  # bfloat16 elements per flat page: 4 KiB


class FakeHostPool:
    """Just what the adapter calls on SGLang's host pool (page-first, indices in tokens)."""

    def __init__(self, pages: int, seed: int | None = None) -> None:
        self.page_size = TOKENS
        self.layout = "page_first"
        self.dtype = torch.bfloat16
        self.raw = torch.zeros((pages, NUMEL * 2), dtype=torch.uint8)
        if seed is not None:
            self.raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
        self.kv = self.raw.view(torch.bfloat16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.kv[index // TOKENS].flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(NUMEL, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv[index // TOKENS].copy_(data_page)

    def page(self, i: int) -> bytes:
        return self.raw[i].numpy().tobytes()


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * TOKENS + t for p in pages for t in range(TOKENS)], dtype=torch.int64)


def config(socket: str, model: str = "org/Llama 3.1-8B", **kw) -> SimpleNamespace:
    extra = {"socket": socket, "timeout_s": 5, "reconnect_s": 0.05, **kw.pop("extra", {})}
    base = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False
    )
    return SimpleNamespace(model_name=model, extra_config=extra, **{**base, **kw})


def backend(socket: str, pool: FakeHostPool, **kw) -> HicachedStorage:
    b = HicachedStorage(config(socket, **kw), {})
    b.register_mem_pool_host(pool)
    return b


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * TOKENS + list(range(n * TOKENS)), TOKENS)[1:]


def test_set_then_get_round_trips_identical_bytes(daemon):
    src, dst = FakeHostPool(16, seed=1), FakeHostPool(16)
    keys = keys_for(1, 10)
    writer, reader = backend(daemon.socket, src), backend(daemon.socket, dst)
    assert writer.batch_set_v1(keys, indices(list(range(10)))) == [True] * 10
    assert reader.batch_exists(keys) == 10
    # Into other host pages than they came from: the adapter must follow host_indices.
    assert reader.batch_get_v1(keys, indices(list(range(6, 16)))) == [True] * 10
    for i in range(10):
        assert dst.page(6 + i) == src.page(i)
    assert reader.get_stats() is None
    writer.close()
    reader.close()


def test_leading_prefix_stops_at_a_hole(daemon):
    src, dst = FakeHostPool(8, seed=2), FakeHostPool(8)
    keys = keys_for(2, 5)
    b = backend(daemon.socket, src)
    assert b.batch_set_v1(keys[:2] + keys[3:], indices([0, 1, 3, 4])) == [True] * 4
    assert b.batch_exists(keys) == 2
    r = backend(daemon.socket, dst)
    assert r.batch_get_v1(keys, indices([0, 1, 2, 3, 4])) == [True, True, False, False, False]
    assert dst.page(1) == src.page(1) and dst.page(3) == bytes(NUMEL * 2)
    assert r.batch_exists([]) == 0 and r.batch_get_v1([], indices([])) == []


def test_legacy_methods(daemon):
    pool = FakeHostPool(4, seed=3)
    b = backend(daemon.socket, pool)
    k = keys_for(3, 3)
    assert b.set(k[0], pool.get_data_page(0)) and b.batch_set(
        k[1:], [pool.get_data_page(4), pool.get_data_page(8)]
    )
    assert b.exists(k[0]) and not b.exists(keys_for(4, 1)[0])
    got = b.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == [pool.page(i) for i in range(3)]
    copies = b.batch_get(k[:1] + keys_for(4, 1))
    assert copies[1] is None and copies[0].view(torch.uint8).numpy().tobytes() == pool.page(0)
    assert b.get(k[2], pool.get_dummy_flat_data_page()).view(torch.uint8).numpy().tobytes() == pool.page(2)
    b.clear()


def test_daemon_restart_answers_misses_then_recovers(daemon):
    src, dst = FakeHostPool(8, seed=5), FakeHostPool(8)
    keys = keys_for(5, 6)
    b = backend(daemon.socket, src)
    assert b.batch_set_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    daemon.stop()
    # Down: every call answers a miss, quickly, and none raises (SGLang's threads would die).
    t0 = time.monotonic()
    for _ in range(3):
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys[:3], indices([0, 1, 2])) == [False] * 3
        assert b.batch_set_v1(keys[3:], indices([3, 4, 5])) == [False] * 3
        assert (
            not b.exists(keys[0])
            and b.batch_get(keys[:1]) == [None]
            and not b.batch_set(keys[:1], [src.kv[0]])
        )
    assert time.monotonic() - t0 < 5
    daemon.start()
    deadline = time.monotonic() + 10
    while b.batch_exists(keys) != 3:  # pages stored before the restart come back from L3
        assert time.monotonic() < deadline, "the adapter did not reconnect"
        time.sleep(0.05)
    assert b.batch_set_v1(keys[3:], indices([3, 4, 5])) == [True] * 3
    r = backend(daemon.socket, dst)
    assert r.batch_get_v1(keys, indices(list(range(6)))) == [True] * 6
    assert all(dst.page(i) == src.page(i) for i in range(6))


def test_no_daemon_and_no_pool_answer_misses(tmp_path):
    b = HicachedStorage(config(str(tmp_path / "absent.sock")), {})
    assert b.batch_exists(keys_for(6, 2)) == 0  # no host pool registered yet
    b.register_mem_pool_host(FakeHostPool(2))
    assert b.batch_exists(keys_for(6, 2)) == 0
    assert b.batch_set_v1(keys_for(6, 2), indices([0, 1])) == [False, False]
    assert b.batch_get_v1(keys_for(6, 2), indices([0])) == [False, False]  # too few indices: refused
    b.close()


def test_namespace_from_the_storage_config(tmp_path):
    sock = str(tmp_path / "s.sock")
    pool = FakeHostPool(1)
    tp = backend(sock, pool, tp_rank=1, tp_size=2)
    assert tp.namespace == "org-Llama-3.1-8B.bfloat16.p4.page_first.tp1of2"
    assert tp.page_bytes == NUMEL * 2
    mla = backend(sock, pool, tp_rank=1, tp_size=2, is_mla_model=True, extra={"salt": "tenant/a"})
    assert mla.namespace.startswith("org-Llama-3.1-8B.bfloat16.p4.page_first.tenant-a-")
    pp = backend(sock, pool, model=None, pp_rank=1, pp_size=4)
    assert pp.namespace == "model.bfloat16.p4.page_first.tp0of1.pp1of4"
    long = backend(sock, pool, model="m" * 300)
    assert len(long.namespace) <= 128 and long.namespace.endswith(".tp0of1")
    assert long.namespace != backend(sock, pool, model="m" * 299).namespace


def test_salts_stay_apart_and_any_length_builds_a_namespace(tmp_path):
    sock = str(tmp_path / "s.sock")
    pool = FakeHostPool(1)
    names = {
        backend(sock, pool, extra={"salt": salt}).namespace for salt in ("tenant/a", "tenant:a", "tenant a")
    }
    assert len(names) == 3  # salts that differ only in characters a namespace cannot hold still isolate
    assert backend(sock, pool, extra={"salt": "tenant-a"}).namespace.endswith(".tp0of1.tenant-a")
    for n in (85, 200, 1000):  # a long salt: a valid namespace, not a RecursionError at start-up
        b = backend(sock, pool, model="meta-llama/Llama-3.1-8B-Instruct", extra={"salt": "t" * n})
        assert len(b.namespace) <= 128 and valid_namespace(b.namespace)
    assert (
        backend(sock, pool, extra={"salt": "t" * 200}).namespace
        != backend(sock, pool, extra={"salt": "t" * 201}).namespace
    )


def test_sglang_dynamic_loader_builds_it(daemon):
    hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    assert issubclass(HicachedStorage, hs.HiCacheStorage)
    extra = {
        "backend_name": "hicached",
        "module_path": "hicached.engine.sglang",
        "class_name": "HicachedStorage",
        "interface_v1": 1,
        "socket": daemon.socket,
    }
    cfg = hs.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="m", extra_config=extra,
    )  # fmt: skip
    pool = FakeHostPool(2, seed=7)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    assert isinstance(b, HicachedStorage)
    assert b.batch_set_v1(keys_for(7, 2), indices([0, 1])) == [True, True]
    assert b.batch_exists(keys_for(7, 2)) == 2
