"""The SGLang storage adapter against the real daemon and SGLang's real host KV pools (MHA and MLA, every
layout with flat pages, the default and the shm allocator): bytes as SGLang's own get_data_page makes them,
the leading prefix, zero-copy through the daemon's regions, a daemon restart, namespaces, metrics, SGLang's
dynamic loader."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hicached.common.keys import page_keys, valid_namespace
from hicached.engine.sglang import KV, HicachedStorage

TOKENS = 16  # tokens per page of the pools built here


@pytest.fixture(scope="module")
def sgl():
    """tests/support/sglang_pools, once SGLang's pool modules import here (they need sglang and its light
    dependencies; .ci/run installs them)."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    import sglang_pools

    try:
        sglang_pools.import_pool_modules()
    except ModuleNotFoundError as e:
        pytest.skip(f"SGLang's host pools do not import here: {e}")
    return sglang_pools


def make_pool(sgl, kind="mha", layout="page_first", allocator="shm", pages=24, seed=None):
    pool = sgl.make_host_pool(kind, layout, allocator, page_size=TOKENS, pages=pages)
    if seed is not None:
        data = sgl.backing(pool).data
        data.copy_(
            torch.randint(
                0, 256, data.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
            )
        )
    return pool


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * TOKENS + t for p in pages for t in range(TOKENS)], dtype=torch.int64)


def config(socket: str, model: str = "org/Llama 3.1-8B", **kw) -> SimpleNamespace:
    extra = {"socket": socket, "timeout_s": 5, "reconnect_s": 0.05, **kw.pop("extra", {})}
    base = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False
    )
    return SimpleNamespace(model_name=model, extra_config=extra, **{**base, **kw})


def backend(socket: str, pool, **kw) -> HicachedStorage:
    b = HicachedStorage(config(socket, **kw), {})
    b.register_mem_pool_host(pool)
    return b


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * TOKENS + list(range(n * TOKENS)), TOKENS)[1:]


@pytest.mark.parametrize("allocator", ["shm", "default"])
@pytest.mark.parametrize(
    "kind, layout",
    [("mha", lay) for lay in ("layer_first", "page_first", "page_first_direct", "page_head")]
    + [("mla", lay) for lay in ("layer_first", "page_first", "page_first_direct")],
)
def test_pages_round_trip_as_sglang_makes_them(daemon, sgl, kind, layout, allocator):
    src, dst = make_pool(sgl, kind, layout, allocator, seed=1), make_pool(sgl, kind, layout, allocator)
    keys = keys_for(1, 10)
    writer, reader = backend(daemon.socket, src), backend(daemon.socket, dst)
    link = writer.links[KV]
    assert link.geom is not None  # described as segments of the pool's buffer: no copy on SGLang's side
    assert link.zero_copy == (allocator == "shm")  # the daemon maps SGLang's memfd, unsealed as it is
    assert writer.batch_set_v1(keys, indices(list(range(1, 11)))) == [True] * 10
    assert reader.batch_exists(keys) == 10
    # Into other host pages than they came from: the adapter follows host_indices.
    assert reader.batch_get_v1(keys, indices(list(range(12, 22)))) == [True] * 10
    for i in range(10):
        assert sgl.raw_page_bytes(dst, 12 + i) == sgl.raw_page_bytes(src, 1 + i)
    writer.close()
    reader.close()


def test_a_shm_pool_and_a_default_pool_share_pages_byte_for_byte(daemon, sgl):
    # Same model, dtype, page size and layout: the same namespace, whichever allocator each engine used.
    shm, private = make_pool(sgl, allocator="shm", seed=2), make_pool(sgl, allocator="default")
    a, b = backend(daemon.socket, shm), backend(daemon.socket, private)
    assert a.namespace == b.namespace
    keys = keys_for(2, 6)
    assert a.batch_set_v1(keys, indices(list(range(6)))) == [True] * 6
    assert b.batch_get_v1(keys, indices(list(range(6, 12)))) == [True] * 6
    assert all(sgl.raw_page_bytes(private, 6 + i) == sgl.raw_page_bytes(shm, i) for i in range(6))


def test_leading_prefix_stops_at_a_hole(daemon, sgl):
    src, dst = make_pool(sgl, seed=3), make_pool(sgl)
    keys = keys_for(3, 5)
    b = backend(daemon.socket, src)
    assert b.batch_set_v1(keys[:2] + keys[3:], indices([0, 1, 3, 4])) == [True] * 4
    assert b.batch_exists(keys) == 2
    r = backend(daemon.socket, dst)
    assert r.batch_get_v1(keys, indices([0, 1, 2, 3, 4])) == [True, True, False, False, False]
    assert sgl.raw_page_bytes(dst, 1) == sgl.raw_page_bytes(src, 1)
    assert not any(sgl.raw_page_bytes(dst, 3))
    assert r.batch_exists([]) == 0 and r.batch_get_v1([], indices([])) == []


def test_legacy_methods(daemon, sgl):
    pool = make_pool(sgl, seed=4)
    b = backend(daemon.socket, pool)
    k = keys_for(4, 3)
    page = [pool.get_data_page(i * TOKENS, flat=True) for i in range(3)]
    assert b.set(k[0], page[0]) and b.batch_set(k[1:], page[1:])
    assert b.exists(k[0]) and not b.exists(keys_for(5, 1)[0])
    got = b.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == [
        sgl.raw_page_bytes(pool, i) for i in range(3)
    ]
    copies = b.batch_get(k[:1] + keys_for(5, 1))
    assert copies[1] is None and copies[0].view(torch.uint8).numpy().tobytes() == sgl.raw_page_bytes(pool, 0)


def test_daemon_restart_answers_misses_then_recovers(daemon, sgl):
    src, dst = make_pool(sgl, seed=6), make_pool(sgl)
    keys = keys_for(6, 6)
    b = backend(daemon.socket, src)
    assert b.batch_set_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    daemon.stop()
    # Down: every call answers a miss, quickly, and none raises (SGLang's threads would die).
    t0 = time.monotonic()
    for _ in range(3):
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys[:3], indices([0, 1, 2])) == [False] * 3
        assert b.batch_set_v1(keys[3:], indices([3, 4, 5])) == [False] * 3
        assert not b.exists(keys[0]) and b.batch_get(keys[:1]) == [None]
    assert time.monotonic() - t0 < 5
    daemon.start()
    deadline = time.monotonic() + 10
    while b.batch_exists(keys) != 3:  # pages stored before the restart come back from L3
        assert time.monotonic() < deadline, "the adapter did not reconnect"
        time.sleep(0.05)
    assert b.links[KV].zero_copy  # its region registered again on the new connection
    assert b.batch_set_v1(keys[3:], indices([3, 4, 5])) == [True] * 3
    r = backend(daemon.socket, dst)
    assert r.batch_get_v1(keys, indices(list(range(6)))) == [True] * 6
    assert all(sgl.raw_page_bytes(dst, i) == sgl.raw_page_bytes(src, i) for i in range(6))


def test_a_pool_whose_registration_fails_answers_misses_and_never_raises(daemon, sgl):
    # Regression: a registration that failed on a fresh connection (the daemon going away between the hello
    # and the registration, memory the client refuses) raised out of SGLang's storage call, which kills
    # SGLang's thread, and left the connection open.
    pool = make_pool(sgl, allocator="default", seed=11)
    keys = keys_for(11, 3)
    daemon.stop()
    b = backend(daemon.socket, pool)
    link = b.links[KV]
    good = link.geom
    link.geom = dataclasses.replace(good, num_pages=good.num_pages * 4)  # past the pool's memory: refused
    daemon.start()
    # For ten times reconnect_s: connects are tried (after 0.05, 0.1 and 0.2 s), each refused.
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, indices([0, 1, 2])) == [False] * 3
    deadline = time.monotonic() + 10
    while daemon.ctl("status")["connections"] > 1:  # the status request's own; the refused ones closed
        assert time.monotonic() < deadline, "a connection whose registration failed was left open"
        time.sleep(0.05)
    link.geom = good
    while b.batch_set_v1(keys, indices([0, 1, 2])) != [True] * 3:
        assert time.monotonic() < deadline, "the adapter did not connect once its pool could be registered"
        time.sleep(0.05)
    assert b.batch_exists(keys) == 3
    b.close()


def test_an_sglang_restart_finds_its_pages(daemon, sgl):
    keys = keys_for(7, 4)
    first = make_pool(sgl, seed=7)
    b = backend(daemon.socket, first)
    assert b.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    b.close()
    again = make_pool(sgl)  # a new process: a new pool, a new memfd, a new backend
    b2 = backend(daemon.socket, again)
    assert b2.batch_exists(keys) == 4
    assert b2.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True] * 4
    assert all(sgl.raw_page_bytes(again, 4 + i) == sgl.raw_page_bytes(first, i) for i in range(4))


def test_tensor_parallel_ranks_keep_apart_and_mla_ranks_share(daemon, sgl):
    keys = keys_for(8, 2)
    r0 = backend(daemon.socket, make_pool(sgl, seed=8), tp_rank=0, tp_size=2)
    r1 = backend(daemon.socket, make_pool(sgl, seed=9), tp_rank=1, tp_size=2)
    assert r0.namespace != r1.namespace
    assert r0.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert r1.batch_exists(keys) == 0  # rank 1 holds other heads: rank 0's pages are not its pages
    mla = [make_pool(sgl, "mla", seed=10), make_pool(sgl, "mla")]
    m0 = backend(daemon.socket, mla[0], tp_rank=0, tp_size=2, is_mla_model=True)
    m1 = backend(daemon.socket, mla[1], tp_rank=1, tp_size=2, is_mla_model=True)
    assert m0.namespace == m1.namespace  # MLA's latent KV is the same on every rank
    assert m0.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert m1.batch_get_v1(keys, indices([2, 3])) == [True, True]
    assert sgl.raw_page_bytes(mla[1], 3) == sgl.raw_page_bytes(mla[0], 1)


def test_no_daemon_and_no_pool_answer_misses(tmp_path, sgl):
    b = HicachedStorage(config(str(tmp_path / "absent.sock")), {})
    assert b.batch_exists(keys_for(9, 2)) == 0  # no host pool registered yet
    assert b.batch_set_v1(keys_for(9, 2), indices([0, 1])) == [False, False]
    b.register_mem_pool_host(make_pool(sgl))
    assert b.batch_exists(keys_for(9, 2)) == 0
    assert b.batch_set_v1(keys_for(9, 2), indices([0, 1])) == [False, False]
    assert b.batch_get_v1(keys_for(9, 2), indices([0])) == [False, False]  # too few indices: refused
    b.close()


def test_storage_metrics_are_measured_per_call_and_handed_over_once(daemon, sgl):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    src, dst = make_pool(sgl, seed=11), make_pool(sgl)
    keys = keys_for(11, 8)
    b, r = backend(daemon.socket, src), backend(daemon.socket, dst)
    assert b.batch_set_v1(keys, indices(list(range(8)))) == [True] * 8
    assert r.batch_get_v1(keys[:5], indices(list(range(5)))) == [True] * 5
    written, read = b.get_stats(), r.get_stats()
    assert isinstance(written, StorageMetrics) and isinstance(read, StorageMetrics)
    assert written.backup_pgs == [8] and written.prefetch_pgs == []
    assert read.prefetch_pgs == [5] and read.backup_pgs == []
    assert written.backup_bandwidth[0] > 0 and read.prefetch_bandwidth[0] > 0
    assert b.get_stats().backup_pgs == []  # handed over once


def test_namespace_from_the_storage_config(tmp_path, sgl):
    sock = str(tmp_path / "s.sock")
    pool = make_pool(sgl)
    tp = backend(sock, pool, tp_rank=1, tp_size=2)
    assert tp.namespace == "org-Llama-3.1-8B.bfloat16.p16.page_first.tp1of2"
    assert tp.page_bytes == sgl.page_nbytes(pool)
    mla = backend(sock, pool, tp_rank=1, tp_size=2, is_mla_model=True, extra={"salt": "tenant/a"})
    assert mla.namespace.startswith("org-Llama-3.1-8B.bfloat16.p16.page_first.tenant-a-")
    pp = backend(sock, pool, model=None, pp_rank=1, pp_size=4)
    assert pp.namespace == "model.bfloat16.p16.page_first.tp0of1.pp1of4"
    long = backend(sock, pool, model="m" * 300)
    assert len(long.namespace) <= 128 and long.namespace.endswith(".tp0of1")
    assert long.namespace != backend(sock, pool, model="m" * 299).namespace


def test_salts_stay_apart_and_any_length_builds_a_namespace(tmp_path, sgl):
    sock = str(tmp_path / "s.sock")
    pool = make_pool(sgl)
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


def test_sglang_dynamic_loader_builds_it_from_the_readmes_json(daemon, sgl):
    import json

    from sglang.srt.mem_cache import hicache_storage as hs
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    assert issubclass(HicachedStorage, hs.HiCacheStorage)
    extra = json.loads(sgl.dynamic_extra_config("shm", socket=daemon.socket))
    cfg = hs.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=True, is_page_first_layout=True, model_name="m", extra_config=extra,
    )  # fmt: skip
    pool = make_pool(sgl, seed=12)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    assert isinstance(b, HicachedStorage) and b.links[KV].zero_copy
    assert b.batch_set_v1(keys_for(12, 2), indices([0, 1])) == [True, True]
    assert b.batch_exists(keys_for(12, 2)) == 2


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_a_cold_batch_is_one_request_whose_l3_reads_run_together(daemon, sgl, monkeypatch, allocator):
    # Not a round trip per page (or per staging chunk): one load_pages for the whole batch, and the daemon
    # reads the missing pages from L3 in its own concurrent batches.
    from hicached.engine.client import Client

    src, dst = (
        make_pool(sgl, allocator=allocator, pages=72, seed=13),
        make_pool(sgl, allocator=allocator, pages=72),
    )
    keys = keys_for(13, 64)
    b = backend(daemon.socket, src)
    assert b.batch_set_v1(keys, indices(list(range(1, 65)))) == [True] * 64
    assert daemon.ctl("flush")["flushed"]
    daemon.stop()
    daemon.start()  # L2 empty: every page comes from L3
    calls = []
    real = Client.load_pages
    monkeypatch.setattr(Client, "load_pages", lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    r = backend(daemon.socket, dst)
    assert r.batch_get_v1(keys, indices(list(range(1, 65)))) == [True] * 64
    assert calls == [64]
    assert all(sgl.raw_page_bytes(dst, i) == sgl.raw_page_bytes(src, i) for i in range(1, 65))
    counters = daemon.ctl("stats")["counters"]
    assert counters["prefetch.pages"] == 64  # every page read from L3 by the daemon, none missed
    assert counters.get("prefetch.misses", 0) == 0


def test_clear_forgets_the_engines_pages_in_l2_and_l3_and_no_other_namespaces(daemon, sgl):
    # SGLang's clear_hicache_storage: nothing stored before is served after, not from L2, not from L3
    # after a restart; another engine's namespace (another salt: another tenant) keeps every page.
    src, dst = make_pool(sgl, pages=40, seed=21), make_pool(sgl, pages=40)
    keys, pages = keys_for(21, 32), indices(list(range(1, 33)))
    b = backend(daemon.socket, src)
    other = backend(daemon.socket, src, extra={"salt": "tenant-b"})
    assert b.batch_set_v1(keys, pages) == [True] * 32
    assert other.batch_set_v1(keys, pages) == [True] * 32
    assert daemon.ctl("flush")["flushed"]
    assert b.clear() is True
    assert b.batch_exists(keys) == 0 and other.batch_exists(keys) == 32
    daemon.stop()
    daemon.start()
    r = backend(daemon.socket, dst)
    assert r.batch_exists(keys) == 0 and r.batch_get_v1(keys, pages) == [False] * 32
    o = backend(daemon.socket, dst, extra={"salt": "tenant-b"})
    assert o.batch_get_v1(keys, pages) == [True] * 32
    assert all(sgl.raw_page_bytes(dst, i) == sgl.raw_page_bytes(src, i) for i in range(1, 33))
    # The engine stores again after it, as before.
    assert r.batch_set_v1(keys[:4], pages[: 4 * TOKENS]) == [True] * 4
    assert r.batch_exists(keys) == 4
    counters = daemon.ctl("stats")["counters"]
    assert counters["backup.lost"] == 0


def test_a_daemon_killed_mid_traffic_is_misses_then_hits_again_by_itself(daemon, sgl):
    # SGLang's storage threads keep calling while the daemon dies (SIGKILL: no goodbye) and comes back:
    # nothing raises, a get answers pages byte for byte or misses (never other bytes), and hits come back
    # without any call from SGLang beyond its usual ones.
    src, dst = make_pool(sgl, pages=72, seed=31), make_pool(sgl, pages=72)
    keys = keys_for(31, 64)
    w, r = backend(daemon.socket, src), backend(daemon.socket, dst)
    assert w.batch_set_v1(keys[:8], indices(list(range(1, 9)))) == [True] * 8
    assert daemon.ctl("flush")["flushed"]
    stop, errors, hits_after = threading.Event(), [], []
    restarted = threading.Event()

    def writer() -> None:
        i = 8
        while not stop.is_set():
            try:
                w.batch_set_v1(keys[i : i + 4], indices(list(range(i + 1, i + 5))))
            except BaseException as e:  # noqa: BLE001 - any exception would kill SGLang's thread
                errors.append(e)
            i = 8 if i + 4 >= 64 else i + 4

    def reader() -> None:
        while not stop.is_set():
            try:
                got = r.batch_get_v1(keys[:8], indices(list(range(1, 9))))
                for n, ok in enumerate(got):
                    if ok and sgl.raw_page_bytes(dst, n + 1) != sgl.raw_page_bytes(src, n + 1):
                        errors.append(AssertionError(f"page {n + 1}: other bytes"))
                if restarted.is_set() and all(got):
                    hits_after.append(True)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=fn) for fn in (writer, reader)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        daemon.stop(signal.SIGKILL)
        time.sleep(0.5)
        daemon.start()
        restarted.set()
        deadline = time.monotonic() + 15
        while not hits_after and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert hits_after, "the adapter did not come back to hits by itself"
