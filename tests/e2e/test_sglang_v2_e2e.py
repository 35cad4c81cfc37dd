"""The v2 (multi-pool) interface for hybrid models, against SGLang's own HiCacheFile as the oracle: one
random sequence of calls (full and partial sets, gaps, every hit policy HiCacheFile knows, gets of present
and missing pages, several pools of SGLang's real host pool classes) goes to HiCacheFile and to
HicachedStorage, each with pools of its own that start alike; every return value and every byte of every
pool must agree."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hicached.common.keys import page_keys
from hicached.engine.sglang import HicachedStorage

TOKENS = 16
PAGES = 32  # host pages per pool (SGLang's padding page included)
CHAIN = 24  # keys of the prefix the calls pick from


@pytest.fixture(scope="module")
def sgl():
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    import sglang_pools

    try:
        sglang_pools.import_pool_modules()
    except ModuleNotFoundError as e:
        pytest.skip(f"SGLang's host pools do not import here: {e}")
    return sglang_pools


def storage_config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="org/hybrid", extra_config=extra,
    )  # fmt: skip


def pools(sgl, seed: int) -> dict:
    """The anchor KV pool and two extra pools, of SGLang's real classes, filled alike for a seed."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    out = {
        PoolName.KV: sgl.make_host_pool("mha", "page_first", "shm", page_size=TOKENS, pages=PAGES),
        PoolName.SWA: sgl.make_host_pool(
            "mha", "layer_first", "default", page_size=TOKENS, pages=PAGES, layers=2
        ),
        PoolName.MAMBA: sgl.make_host_pool(
            "mla", "page_first", "shm", page_size=TOKENS, pages=PAGES, layers=1
        ),
    }
    gen = torch.Generator().manual_seed(seed)
    for pool in out.values():
        data = sgl.backing(pool).data
        data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=gen))
    return out


def registered(backend, pools_: dict) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend.register_mem_pool_host(pools_[PoolName.KV])
    for name, pool in pools_.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * TOKENS + t for p in pages for t in range(TOKENS)], dtype=torch.int64)


class Calls:
    """A seeded random sequence of v2 calls, each made of fresh PoolTransfers (both backends get equal
    ones; the objects are not shared)."""

    def __init__(self, seed: int, keys: list[str]) -> None:
        self.rng = random.Random(seed)
        self.keys = keys

    def _pages(self, n: int) -> list[int]:
        return self.rng.sample(range(1, PAGES), n)  # page 0 is SGLang's padding page

    def next(self) -> tuple[str, dict]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

        r = self.rng
        kind = r.choice(["set", "set", "exists", "exists", "get"])
        a = 0 if r.random() < 0.6 else r.randrange(CHAIN)  # prefixes from the start, as SGLang stores them
        b = r.randrange(a + 1, CHAIN + 1)
        span = self.keys[a:b]
        if kind == "set":
            plan = []
            for name in (PoolName.KV, PoolName.SWA, PoolName.MAMBA):
                if name != PoolName.KV and r.random() < 0.3:
                    continue
                if name == PoolName.MAMBA:  # a state pool: the last page or two of what was stored
                    picked = span[-r.randint(1, 2) :]
                elif r.random() < 0.7:
                    picked = list(span)
                else:
                    picked = [k for k in span if r.random() < 0.85]  # gaps
                if picked:
                    plan.append((name, picked, self._pages(len(picked))))
            return "set", {"plan": plan}
        if kind == "exists":
            pools_ = []
            for name in (PoolName.SWA, PoolName.MAMBA):
                if r.random() < 0.7:
                    policy = r.choice([PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
                    trailing = r.randint(1, 3)
                    pools_.append((name, policy, trailing))
            return "exists", {"keys": self.keys[: r.randrange(CHAIN + 1)], "pools": pools_}
        plan = []
        for name in (PoolName.KV, PoolName.SWA, PoolName.MAMBA):
            if r.random() < 0.8:
                picked = list(span)
                if r.random() < 0.3:  # a key never stored, in the middle
                    picked.insert(r.randrange(len(picked) + 1), f"{r.getrandbits(256):064x}")
                plan.append((name, picked, self._pages(len(picked))))
        return "get", {"plan": plan}


def transfers(plan) -> list:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    return [PoolTransfer(name=n, keys=list(k), host_indices=indices(p)) for n, k, p in plan]


def call(backend, kind: str, args: dict):
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    if kind == "set":
        return backend.batch_set_v2(transfers(args["plan"]))
    if kind == "get":
        return backend.batch_get_v2(transfers(args["plan"]))
    pool_transfers = [
        PoolTransfer(name=n, keys=[f"t{i}" for i in range(t)], hit_policy=p) for n, p, t in args["pools"]
    ]
    return dataclasses.asdict(backend.batch_exists_v2(list(args["keys"]), pool_transfers))


def all_bytes(sgl, pools_: dict) -> dict:
    return {name: [sgl.raw_page_bytes(pool, i) for i in range(PAGES)] for name, pool in pools_.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hicached_answers_every_v2_call_as_hicachefile_does(daemon, sgl, tmp_path, seed):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    oracle_pools, ours_pools = pools(sgl, seed), pools(sgl, seed)
    oracle = HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "hicachefile")}))
    ours = HicachedStorage(storage_config({"socket": daemon.socket, "salt": f"diff{seed}"}), {})
    registered(oracle, oracle_pools)
    registered(ours, ours_pools)
    keys = page_keys(list(range(CHAIN * TOKENS)), TOKENS)
    calls = Calls(seed, keys)
    seen = {"set": 0, "get": 0, "exists": 0}
    hits = {"kv": 0, "narrowed": 0}
    for step in range(60):
        kind, args = calls.next()
        want, got = call(oracle, kind, args), call(ours, kind, args)
        assert got == want, f"step {step}: {kind} {args}: HiCacheFile {want}, hicached {got}"
        if kind == "exists":
            hits["kv"] += want["kv_hit_pages"] > 0
            hits["narrowed"] += 0 < len(want["restorable_prefix_pages"]) < want["kv_hit_pages"]
        if kind == "get":
            assert all_bytes(sgl, ours_pools) == all_bytes(sgl, oracle_pools), f"step {step}: bytes differ"
        seen[kind] += 1
    assert all(seen.values()), seen
    assert hits["kv"] and hits["narrowed"], hits  # the sequence reached prefixes that pools narrowed
    ours.close()


def test_block_groups_report_whole_groups_and_never_narrow_the_kv_hit(daemon, sgl, tmp_path):
    # HiCacheFile raises for this policy; SGLang documents it: a pool keyed at block boundaries from the
    # span start, whose leading complete groups it reports as its own verdict.
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer

    keys = page_keys(list(range(CHAIN * TOKENS)), TOKENS)
    t = PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=2)
    oracle = HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "hicachefile")}))
    registered(oracle, pools(sgl, 8))
    assert oracle.batch_set_v2(transfers([(PoolName.KV, keys[:1], [1])]))[PoolName.KV] == [True]
    with pytest.raises(ValueError, match="Unsupported pool hit policy"):
        oracle.batch_exists_v2(keys[:1], [t])
    b = HicachedStorage(storage_config({"socket": daemon.socket, "salt": "blocks"}), {})
    registered(b, pools(sgl, 9))
    assert (
        b.batch_set_v2(transfers([(PoolName.KV, keys[:12], list(range(1, 13)))]))[PoolName.KV] == [True] * 12
    )
    # Blocks of 2 pages, groups of 2 blocks: the pool holds the keys of pages 1, 3, 5 (block ends), not 7.
    ends = [keys[1], keys[3], keys[5]]
    assert b.batch_set_v2(transfers([(PoolName.SWA, ends, [1, 2, 3])]))[PoolName.SWA] == [True] * 3
    result = b.batch_exists_v2(keys[:12], [t])
    assert result.kv_hit_pages == 12  # never narrowed
    assert result.extra_pool_hit_pages[PoolName.SWA] == 4  # one whole group: two blocks of two pages
    b.close()
