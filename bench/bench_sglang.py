"""Benchmark of the SGLang adapter: HicachedStorage with SGLang's real host pool (the shm allocator, and the
default one), beside hicached's plain client moving the same pages and beside SGLang's own HiCacheFile.

Same pages (512 MiB of 2 MiB or 256 KiB pages), interleaved in each run, min/median/max over runs: set,
get from L2, get from L3 after a daemon restart with the page cache dropped, batch_exists of 64 keys, and
the v2 path with one extra pool. Targets (ratios in one run): with the shm allocator, set and L2 get >= 0.8x
the plain client; set and cold get >= 2x HiCacheFile."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests" / "support"))

import sglang_pools  # noqa: E402
from benchlib import Daemon  # noqa: E402

from hicached import Client  # noqa: E402
from hicached.common.keys import page_keys  # noqa: E402
from hicached.engine.sglang import KV, HicachedStorage  # noqa: E402

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call
# page bytes -> (tokens per page, layers, heads, head_dim) of an MHA bf16 pool whose flat page is that size
SHAPES = {2 << 20: (64, 32, 4, 64), 256 << 10: (16, 16, 4, 64)}


def config(work: Path, pool_bytes: int) -> str:
    return (
        f'[server]\nsocket = "run/hicached.sock"\n[pool]\ncapacity = {pool_bytes}\nslab_size = "32MiB"\n'
        '[storage]\nbackend = "file"\n[storage.file]\nroot = "data"\nio_threads = 8\n'
        "[warmup]\nenabled = false\n"
        '[logging]\nlevel = "warning"\n'
    )


def storage_config(extra: dict) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="bench", extra_config=extra,
    )  # fmt: skip


def indices(pages: list[int], tokens: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * tokens + torch.arange(tokens)).reshape(-1)


def drop_page_cache(*dirs: Path) -> None:
    """The files' pages out of the page cache: the kernel's whole page cache where we may (root), else
    fadvise DONTNEED on each file (after fsync: only clean pages are dropped)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return
    except OSError:
        pass
    for d in dirs:
        for dirpath, _, files in os.walk(d):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def raw_read(files: list[str], threads: int = 8) -> int:
    """Reads every file whole with `threads` threads (the daemon's io_threads here): bytes read."""

    def one(path: str) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = bytearray(os.fstat(fd).st_size)
            return os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, files))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def batches(n: int) -> list[range]:
    return [range(i, min(n, i + BATCH)) for i in range(0, n, BATCH)]


class Run:
    """One run at one page size: every implementation on fresh keys, one after the other."""

    def __init__(self, work: Path, page: int, total: int, seed: int) -> None:
        tokens, layers, heads, dim = SHAPES[page]
        self.page, self.tokens = page, tokens
        self.n = total // page
        shape = dict(page_size=tokens, pages=self.n + 1, layers=layers, heads=heads, head_dim=dim)
        self.pools = {
            (role, alloc): sglang_pools.make_host_pool("mha", "page_first", alloc, **shape)
            for role in ("src", "dst")
            for alloc in ("shm", "default")
        }
        extra = {**shape, "layers": 4}
        self.extra = {
            r: sglang_pools.make_host_pool("mha", "layer_first", "default", **extra) for r in ("src", "dst")
        }
        gen = torch.Generator().manual_seed(seed)
        for pool in [*self.pools.values(), *self.extra.values()]:
            data = sglang_pools.backing(pool).data
            data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=gen))
        self.work = work
        self.seed = seed
        self.pages = list(range(1, self.n + 1))  # page 0 is SGLang's padding page

    def keys(self, what: str) -> list[str]:
        return page_keys([self.seed, hash(what) & 0xFFFF] + list(range(self.n * self.tokens)), self.tokens)[
            : self.n
        ]

    def adapter(
        self, sock: str, alloc: str, role: str, salt: str, extra_pool: bool = False
    ) -> HicachedStorage:
        b = HicachedStorage(storage_config({"socket": sock, "salt": salt, "timeout_s": 120}), {})
        b.register_mem_pool_host(self.pools[(role, alloc)])
        if extra_pool:
            from sglang.srt.mem_cache.hicache_storage import PoolName

            b.register_mem_host_pool_v2(self.extra[role], PoolName.SWA)
        return b

    def hicachefile(self, role: str, path: Path) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName

        f = HiCacheFile(storage_config({"file_storage_path": str(path)}))
        f.register_mem_pool_host(self.pools[(role, "default")])
        f.register_mem_host_pool_v2(self.pools[(role, "default")], PoolName.KV)
        f.register_mem_host_pool_v2(self.extra[role], PoolName.SWA)
        return f


def v2(name: Any, keys: list[str], pages: list[int], tokens: int) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    return PoolTransfer(name=name, keys=keys, host_indices=indices(pages, tokens))


def one_run(work: Path, page: int, total: int, seed: int) -> dict[str, float]:
    """GB/s (or seconds, for lookups) of every implementation for one run. Each step starts with nothing
    left to back up (flush), so that no step pays for another's backups; the implementations take turns in
    an order that rotates from run to run."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    r = Run(work, page, total, seed)
    nbytes = r.n * page
    out: dict[str, float] = {}

    def speed(name: str, each: Callable[[list[str], list[int]], Any], keys: list[str]) -> None:
        """GB/s of `each(keys, host pages)` over every batch of the run's pages."""
        parts = [([keys[i] for i in rg], [r.pages[i] for i in rg]) for rg in batches(r.n)]
        secs, _ = timed(lambda: [each(k, p) for k, p in parts])
        out[name] = nbytes / secs / 1e9

    def lookups(name: str, fn: Callable[[], Any]) -> None:
        out[name] = statistics.median(timed(fn)[0] for _ in range(50))

    def kv_and_swa(k: list[str], p: list[int]) -> list[Any]:
        return [v2(PoolName.KV, k, p, r.tokens), v2(PoolName.SWA, k, p, r.tokens)]

    def ok(result: Any) -> None:
        assert all(result), "a set failed"

    def set_v1(b: Any) -> Callable[[list[str], list[int]], Any]:
        return lambda k, p: ok(b.batch_set_v1(k, indices(p, r.tokens)))

    def get_v1(b: Any) -> Callable[[list[str], list[int]], Any]:
        return lambda k, p: b.batch_get_v1(k, indices(p, r.tokens))

    flat = sglang_pools.backing(r.pools[("src", "default")]).data[page : page + nbytes].reshape(r.n, page)
    dst = torch.ones((r.n + 1, page), dtype=torch.uint8)  # touched: a first touch is no copy's cost
    order = ["shm", "default", "plain"]
    order = order[seed % 3 :] + order[: seed % 3]
    pool_bytes = 2 * total + (256 << 20)
    root = work / f"d{seed}"
    root.mkdir()
    with (
        Daemon(root, config(root, pool_bytes)) as d,
        Client(d.sock, f"bench.plain{seed}", page, timeout=120) as c,
    ):
        adapters = {
            (alloc, role): r.adapter(d.sock, alloc, role, f"s{alloc}{seed}")
            for alloc in ("shm", "default")
            for role in ("src", "dst")
        }
        plain = r.keys("plain")
        # A first pass over the pool's slots is slower (bench_core's "first pass" row): every slot is
        # written once, and let go, before anything is measured.
        for lap in range(pool_bytes // nbytes):
            speed("warm-up", lambda k, p: c.store(k, [flat[i - 1] for i in p]), r.keys(f"warm{lap}"))
            d.flush()
        del out["warm-up"]
        for who in order:  # set: each implementation its own keys, the same pages
            if who == "plain":
                speed("set plain", lambda k, p: ok(c.store(k, [flat[i - 1] for i in p])), plain)
            else:
                speed(f"set adapter-{who}", set_v1(adapters[(who, "src")]), r.keys(who))
            d.flush()
        for who in order:  # get from L2
            if who == "plain":
                speed("get L2 plain", lambda k, p: c.load(k, [dst[i] for i in p]), plain)
                lookups("exists64 plain", lambda: c.exists(plain[:64]))
            else:
                b = adapters[(who, "dst")]
                speed(f"get L2 adapter-{who}", get_v1(b), r.keys(who))
                lookups(f"exists64 adapter-{who}", lambda b=b, keys=r.keys(who): b.batch_exists(keys[:64]))
        for b in adapters.values():
            b.close()
        b = r.adapter(d.sock, "shm", "src", f"v2{seed}", extra_pool=True)  # v2: KV and one extra pool
        b.on_host_pools_registered()
        speed("v2 set adapter", lambda k, p: b.batch_set_v2(kv_and_swa(k, p)), r.keys("v2"))
        b.close()
        d.flush()
    hf_dir = work / f"hf{seed}"
    f = r.hicachefile("src", hf_dir)
    speed("set hicachefile", lambda k, p: f.batch_set_v2([v2(PoolName.KV, k, p, r.tokens)]), r.keys("file"))
    f2 = r.hicachefile("src", work / f"hf2{seed}")
    speed("v2 set hicachefile", lambda k, p: f2.batch_set_v2(kv_and_swa(k, p)), r.keys("v2"))
    with Daemon(root, config(root, pool_bytes)) as d:  # get from L3: L2 empty, the page cache dropped
        b = r.adapter(d.sock, "shm", "dst", f"sshm{seed}")
        b.links[KV].client()
        drop_page_cache(root / "data", hf_dir)
        speed("get L3 adapter-shm", get_v1(b), r.keys("shm"))
        b.close()
    drop_page_cache(root / "data", hf_dir)
    files = [  # the pages the adapter just read: its namespace's files
        os.path.join(dp, n)
        for ns in os.listdir(root / "data")
        if f"sshm{seed}" in ns
        for dp, _, names in os.walk(root / "data" / ns)
        for n in names
    ]
    secs, nread = timed(lambda: raw_read(files))
    out["get L3 raw files"] = nread / secs / 1e9  # the disk's ceiling: no daemon, no checks, no copies
    drop_page_cache(root / "data", hf_dir)
    f = r.hicachefile("dst", hf_dir)
    speed(
        "get L3 hicachefile", lambda k, p: f.batch_get_v2([v2(PoolName.KV, k, p, r.tokens)]), r.keys("file")
    )
    return out


# (row, numerator, denominator, target, higher is better)
RATIOS = [
    ("set, shm adapter / plain client", "set adapter-shm", "set plain", 0.8, True),
    ("set, default allocator / plain client", "set adapter-default", "set plain", None, True),
    ("get L2, shm adapter / plain client", "get L2 adapter-shm", "get L2 plain", 0.8, True),
    ("get L2, default allocator / plain client", "get L2 adapter-default", "get L2 plain", None, True),
    ("set, shm adapter / HiCacheFile", "set adapter-shm", "set hicachefile", 2.0, True),
    ("cold get (L3), shm adapter / HiCacheFile", "get L3 adapter-shm", "get L3 hicachefile", 2.0, True),
    ("cold read, raw files / HiCacheFile (the disk)", "get L3 raw files", "get L3 hicachefile", None, True),
    ("v2 set (KV + 1 extra pool), adapter / HiCacheFile", "v2 set adapter", "v2 set hicachefile", None, True),
    ("exists x64 time, shm adapter / plain client", "exists64 adapter-shm", "exists64 plain", None, False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mib", type=int, default=512, help="bytes of pages per run and page size")
    parser.add_argument("--pages", default="2048,256", help="page sizes in KiB")
    a = parser.parse_args()
    try:
        sglang_pools.import_pool_modules()
    except ModuleNotFoundError as e:
        print(f"bench_sglang: SGLang's host pools do not import here ({e}); see .ci/run for the install")
        return 0
    py = sys.version.split()[0]
    print(f"hicached bench_sglang: python {py}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{a.mib} MiB of pages a run, {a.runs} runs, batches of {BATCH}; files in {tempfile.gettempdir()}")
    for kib in (int(x) for x in a.pages.split(",")):
        page = kib << 10
        runs = []
        with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
            for run in range(a.runs):
                runs.append(one_run(Path(tmp), page, a.mib << 20, run))
        print(f"\n{kib} KiB pages: GB/s (exists: ms), min / median / max over {a.runs} runs")
        for name in runs[0]:
            vals = [r[name] * (1e3 if name.startswith("exists") else 1) for r in runs]
            print(f"  {name:32s} {min(vals):8.3f} {statistics.median(vals):8.3f} {max(vals):8.3f}")
        print(f"\n  {'ratio':52s} {'min':>6s} {'median':>6s} {'max':>6s}  target")
        for label, num, den, target, higher in RATIOS:
            vals = [r[num] / r[den] for r in runs]
            med = statistics.median(vals)
            verdict = ""
            if target is not None:
                verdict = f">={target}x {'PASS' if (med >= target) == higher else 'MISS'}"
            print(f"  {label:52s} {min(vals):6.2f} {med:6.2f} {max(vals):6.2f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
