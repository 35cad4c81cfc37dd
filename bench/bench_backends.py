"""Benchmark of hicached's L3 backup and prefetch on Redis and S3 (moto) against raw redis.asyncio pipelines
and raw aioboto3 put/get of the same pages at the same concurrency, measured in the same run. It starts its
own redis-server, moto_server and daemons. Usage: python bench/bench_backends.py [--quick] [--only redis|s3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The same real servers and daemon subprocess the end-to-end tests use.
sys.path.append(str(ROOT / "tests" / "support"))

import aioboto3  # noqa: E402
import numpy as np  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import uvloop  # noqa: E402
from aiobotocore.config import AioConfig  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402
from hicached.config.schema import RedisConfig, S3Config, StorageConfig  # noqa: E402
from hicached.connectors import header  # noqa: E402
from servers import MotoServer, RedisServer, aws_env  # noqa: E402

from hicached import Client  # noqa: E402

MiB = 1 << 20
KiB = 1 << 10
STORE_BATCH = 32  # pages per Client.store call (untimed: it only fills L2)
UNIQUE_PAGES = 32  # distinct page contents, cycled over the keys
BUCKET = "hicached-bench"
TARGETS = {"redis": 0.7, "s3": 0.8}
# The daemon's defaults, written into its config and used by the raw baselines alike.
STORAGE = StorageConfig()
REDIS_CONNECTIONS = RedisConfig().max_connections
S3_CONNECTIONS = S3Config().max_connections

now = time.perf_counter
# figure, hicached GB/s, raw GB/s, ratio, target ratio (0: for information)
Row = tuple[str, float, float, float, float]


def page_keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def size_label(p: int) -> str:
    return f"{p // MiB} MiB" if p >= MiB else f"{p // KiB} KiB"


async def batch_workers(
    keys: Sequence[str], workers: int, batch: int, job: Callable[[list[int]], Awaitable[None]]
) -> float:
    """`workers` tasks take batches of `batch` page indices off one queue, as the daemon's backup and
    prefetch workers do, and run `job` on each; returns the wall time."""
    batches = [list(range(i, min(i + batch, len(keys)))) for i in range(0, len(keys), batch)]
    batches.reverse()

    async def worker() -> None:
        while batches:
            await job(batches.pop())

    t0 = now()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return now() - t0


class RawRedis:
    """redis.asyncio with a connection pool as large as the connector's; values of header + payload size."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.r: aioredis.Redis | None = None

    async def start(self) -> None:
        pool = aioredis.ConnectionPool.from_url(self.url, max_connections=REDIS_CONNECTIONS)
        self.r = aioredis.Redis(connection_pool=pool)
        await self.r.ping()

    async def close(self) -> None:
        if self.r is not None:
            await self.r.aclose()

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> float:
        async def job(idx: list[int]) -> None:
            pipe = self.r.pipeline(transaction=False)
            for i in idx:
                pipe.set(keys[i], values[i])
            if not all(await pipe.execute()):
                raise RuntimeError("raw SET refused")

        return await batch_workers(
            keys, STORAGE.backup_concurrency, STORAGE.backup_batch(len(values[0])), job
        )

    async def get(self, keys: Sequence[str], size: int) -> float:
        async def job(idx: list[int]) -> None:
            pipe = self.r.pipeline(transaction=False)
            for i in idx:
                pipe.get(keys[i])
            if any(v is None or len(v) != size for v in await pipe.execute()):
                raise RuntimeError("raw GET missed a value")

        return await batch_workers(keys, STORAGE.prefetch_concurrency, STORAGE.prefetch_batch(size), job)

    async def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 256):
            await self.r.unlink(*keys[i : i + 256])


class RawS3:
    """One long-lived aioboto3 client with the connector's pool size and checksum setting; each batch is a
    gather of single-object requests, at most max_connections in flight, as in connectors/s3.py."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.stack = contextlib.AsyncExitStack()
        self.s3: Any = None
        self.sem: asyncio.Semaphore | None = None

    async def start(self) -> None:
        cfg = AioConfig(
            max_pool_connections=S3_CONNECTIONS,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.s3 = await self.stack.enter_async_context(
            aioboto3.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1", config=cfg)
        )
        self.sem = asyncio.Semaphore(S3_CONNECTIONS)
        await self.s3.head_bucket(Bucket=BUCKET)

    async def close(self) -> None:
        await self.stack.aclose()

    async def _each(self, idx: list[int], one: Callable[[int], Awaitable[None]]) -> None:
        async def bounded(i: int) -> None:
            async with self.sem:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in idx))

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> float:
        async def one(i: int) -> None:
            await self.s3.put_object(Bucket=BUCKET, Key=keys[i], Body=values[i])

        async def job(idx: list[int]) -> None:
            await self._each(idx, one)

        return await batch_workers(
            keys, STORAGE.backup_concurrency, STORAGE.backup_batch(len(values[0])), job
        )

    async def get(self, keys: Sequence[str], size: int) -> float:
        async def one(i: int) -> None:
            resp = await self.s3.get_object(Bucket=BUCKET, Key=keys[i])
            async with resp["Body"] as body:
                if len(await body.read()) != size:
                    raise RuntimeError("raw GET returned a short object")

        async def job(idx: list[int]) -> None:
            await self._each(idx, one)

        return await batch_workers(keys, STORAGE.prefetch_concurrency, STORAGE.prefetch_batch(size), job)

    async def delete(self, keys: Sequence[str]) -> None:
        async def one(i: int) -> None:
            await self.s3.delete_object(Bucket=BUCKET, Key=keys[i])

        await self._each(list(range(len(keys))), one)


class Daemon(DaemonProcess):
    """tests/daemon_proc.py's daemon subprocess, always stopped (killed if need be) on the way out."""

    def __enter__(self) -> Daemon:
        try:
            return self.start(timeout=60)
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close()
        if exc_type is not None and issubclass(exc_type, Exception):
            print(f"daemon log ({self.log_path}), last lines:\n{self.log()[-3000:]}", file=sys.stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.stop(timeout=30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def counters(self) -> dict[str, int]:
        return self.ctl("stats")["counters"]

    def tally_problems(self, into: dict[str, int]) -> None:
        """Adds the daemon's counters of errors, failures and retries to `into`: a figure measured while
        the daemon retried is not what it claims to be."""
        for k, v in self.counters().items():
            if v and ("error" in k or "fail" in k or "retr" in k):
                into[k] = into.get(k, 0) + v


def daemon_config(kind: str, backend: dict[str, Any], pool_bytes: int) -> dict[str, Any]:
    return {
        "pool": {"capacity": f"{pool_bytes // MiB}MiB", "slab_size": "32MiB", "prefault": True},
        "storage": {
            "backend": kind,
            # write-back: a store only fills L2, so the flush after it times pure L2 -> L3.
            "write_policy": "write_back",
            "backup_concurrency": STORAGE.backup_concurrency,
            "backup_batch_pages": STORAGE.backup_batch_pages,
            "prefetch_concurrency": STORAGE.prefetch_concurrency,
            "prefetch_batch_pages": STORAGE.prefetch_batch_pages,
            "operation_timeout": "60s",
            kind: backend,
        },
        "shutdown": {"flush_timeout": "120s"},
        # No refill of L2 from a warm list after the restart: the prefetch must find L2 empty.
        "warmup": {"enabled": False},
        "logging": {"level": "warning"},
    }


class Case:
    """One backend and one page size, in two phases, each repetition timing the daemon and then its raw
    baseline back to back. Backup: a write-back daemon stores a new set of pages and times its flush (pure
    L2 -> L3), then the raw writes. Prefetch: the daemon is restarted, so that every set is only in L3, and
    each set is prefetched (+ wait) and then read raw, object for object. Repetition 0 is a warm-up; its
    prefetch, the first after the restart, is shown on its own."""

    def __init__(
        self, kind: str, backend: dict[str, Any], raw: RawRedis | RawS3, key_of: Callable[[str, str], str]
    ) -> None:
        self.kind, self.backend, self.raw, self.key_of = kind, backend, raw, key_of

    def run(self, runner: asyncio.Runner, work: Path, p: int, n: int, reps: int) -> list[Row]:
        ns, label = f"bench.{self.kind}.p{p}", size_label(p)
        print(f"\n== {self.kind}, pages of {label}: {n} pages ({n * p / MiB:.0f} MiB) per repetition")
        rng = np.random.default_rng(p)
        unique = [rng.bytes(p) for _ in range(UNIQUE_PAGES)]
        pages = [unique[i % UNIQUE_PAGES] for i in range(n)]
        values = [header.encode(ns, "raw", page) + page for page in unique]  # header + payload, as stored
        values = [values[i % UNIQUE_PAGES] for i in range(n)]
        sets = [page_keys(f"{ns}/{r}", n) for r in range(reps + 1)]
        objects = [[self.key_of(ns, k) for k in keys] for keys in sets]
        t: dict[str, list[float]] = {"backup": [], "put": [], "prefetch": [], "get": []}
        # One set and some room: each set evicts the one before it, which is clean by then.
        cfg = daemon_config(self.kind, self.backend, -(-n * p // (32 * MiB)) * 32 * MiB + 128 * MiB)
        problems: dict[str, int] = {}
        warm = Warmup(f"{ns}.warm")
        try:
            with Daemon(str(work / f"daemon-{self.kind}-{p}"), cfg) as d:
                warm.backup(d)
                with Client(d.socket, ns, p) as c:
                    for keys in sets:
                        for i in range(0, n, STORE_BATCH):
                            if not all(c.store(keys[i : i + STORE_BATCH], pages[i : i + STORE_BATCH])):
                                raise RuntimeError("store failed (pool too small?)")
                        before = d.counters().get("backup.pages", 0)
                        t0 = now()
                        if not d.ctl("flush")["flushed"]:
                            raise RuntimeError("flush did not complete")
                        t["backup"].append(now() - t0)
                        if (wrote := d.counters().get("backup.pages", 0) - before) != n:
                            raise RuntimeError(f"flush wrote {wrote} of {n} pages")
                        raw_objects = [self.key_of(ns, f"raw-{k}") for k in keys]
                        t["put"].append(runner.run(self.raw.put(raw_objects, values)))
                        runner.run(self.raw.delete(raw_objects))
                d.tally_problems(problems)  # the restart resets the counters
                d.stop()
                d.start(timeout=60)  # L2 is empty now: the pages are only in L3
                warm.prefetch(d)
                with Client(d.socket, ns, p) as c:
                    for keys, objs in zip(sets, objects, strict=True):
                        t0 = now()
                        got = c.wait(c.prefetch(keys), timeout=120)
                        t["prefetch"].append(now() - t0)
                        if got != n:
                            counters = {k: v for k, v in d.counters().items() if k.startswith("prefetch")}
                            raise RuntimeError(f"prefetch brought {got} of {n} pages: {counters}")
                        t["get"].append(runner.run(self.raw.get(objs, header.HEADER_SIZE + p)))
                d.tally_problems(problems)
        finally:
            runner.run(self.raw.delete([o for objs in objects for o in objs] + warm.objects(self.key_of)))
        if problems:
            print(f"daemon counters of errors and retries: {problems}")
        for name, v in t.items():
            times = " ".join(f"{x * 1e3:7.1f}" for x in v[1:])
            print(f"{name:9} {times} ms  ({n / statistics.median(v[1:]):.0f} pages/s at the median)")
        target = TARGETS[self.kind]
        b, f = f"{self.kind} backup {label}", f"{self.kind} prefetch {label}"
        return [
            row(f"{b} (flush)", n * p, t["backup"][1:], t["put"][1:], target),
            row(f"{f} (+wait)", n * p, t["prefetch"][1:], t["get"][1:], target),
            row(f"{f}, 1st after restart", n * p, t["prefetch"][:1], t["get"][:1], 0.0),
        ]


class Warmup:
    """Tiny pages of a namespace of their own, backed up and prefetched before the timed work, so that a
    freshly started daemon has opened as many connections to the store as the raw client keeps open."""

    PAGE = 4 * KiB

    def __init__(self, ns: str) -> None:
        self.ns = ns
        # Enough pages for every worker to run a full batch at once.
        n = max(
            STORAGE.backup_concurrency * STORAGE.backup_batch(self.PAGE),
            STORAGE.prefetch_concurrency * STORAGE.prefetch_batch(self.PAGE),
        )
        self.keys = page_keys(ns, n)

    def backup(self, d: Daemon) -> None:
        with Client(d.socket, self.ns, self.PAGE) as c:
            if not all(c.store(self.keys, [bytes(self.PAGE)] * len(self.keys))):
                raise RuntimeError("warm-up store failed")
        if not d.ctl("flush")["flushed"]:
            raise RuntimeError("warm-up flush did not complete")

    def prefetch(self, d: Daemon) -> None:
        with Client(d.socket, self.ns, self.PAGE) as c:
            if c.wait(c.prefetch(self.keys), timeout=60) != len(self.keys):
                raise RuntimeError("warm-up prefetch missed pages")

    def objects(self, key_of: Callable[[str, str], str]) -> list[str]:
        return [key_of(self.ns, k) for k in self.keys]


def row(name: str, nbytes: int, ours: list[float], raw: list[float], target: float) -> Row:
    """Medians of each side; the ratio is the median of the per-repetition ratios, since each pair ran back
    to back and other load on the machine moves both alike."""
    ratios = [r / o for o, r in zip(ours, raw, strict=True)]
    if len(ratios) > 1:
        print(f"{name}: ratio per repetition {' '.join(f'{x:.2f}' for x in ratios)}")
    gbps = nbytes / statistics.median(ours) / 1e9, nbytes / statistics.median(raw) / 1e9
    return name, *gbps, statistics.median(ratios), target


def print_table(rows: list[Row]) -> None:
    print(f"\n{'figure':42} {'hicached':>12} {'raw':>12} {'ratio':>7} {'target':>7}  result")
    for name, ours, raw, ratio, target in rows:
        verdict = ("PASS" if ratio >= target else "MISS") if target else "info"
        shown = f">={target}x" if target else "-"
        print(f"{name:42} {ours:6.3f} GB/s {raw:6.3f} GB/s {ratio:6.2f}x {shown:>7}  {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and repetitions (under a minute)")
    parser.add_argument("--only", choices=("redis", "s3"), help="one backend only")
    a = parser.parse_args()
    reps = 2 if a.quick else 4
    sizes = {  # pages per repetition; moto is slow, so S3 gets fewer
        "redis": [(2 * MiB, 64 if a.quick else 256), (256 * KiB, 256 if a.quick else 512)],
        "s3": [(2 * MiB, 32 if a.quick else 64), (256 * KiB, 64 if a.quick else 128)],
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so every subprocess is stopped
    work = Path(tempfile.mkdtemp(prefix="hicached-bench-backends-"))
    os.environ.update(aws_env(work))  # for moto, the daemon and the raw client alike
    started = now()
    print(f"hicached bench_backends: python {platform.python_version()}, {len(os.sched_getaffinity(0))} CPUs")
    print(
        f"same concurrency both sides: backup {STORAGE.backup_concurrency} workers, prefetch "
        f"{STORAGE.prefetch_concurrency} workers, each call at most {STORAGE.backup_batch_pages} / "
        f"{STORAGE.prefetch_batch_pages} pages and {STORAGE.backup_batch_bytes >> 20} / "
        f"{STORAGE.prefetch_batch_bytes >> 20} MiB; connections: redis {REDIS_CONNECTIONS}, "
        f"s3 {S3_CONNECTIONS}"
    )
    rows: list[Row] = []
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            for kind in (a.only,) if a.only else ("redis", "s3"):
                rows += run_backend(kind, runner, work, sizes[kind], reps)
        print_table(rows)
        print(
            f"\nGB = 1e9 payload bytes; medians of {reps} repetitions after a warm-up; ratio: the median of"
        )
        print(f"the per-repetition ratios (each pair ran back to back); whole run {now() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_backend(
    kind: str, runner: asyncio.Runner, work: Path, sizes: list[tuple[int, int]], reps: int
) -> list[Row]:
    """Starts the store, runs every page size against it, and stops it whatever happened."""
    # Every set of a page size at once, and the raw copy of one; jemalloc rounds a 2 MiB + 32 B value up
    # to 2.5 MiB.
    biggest = max(p * n for p, n in sizes) * (reps + 2) * 5 // 4
    if kind == "redis":
        server: RedisServer | MotoServer = RedisServer(
            work / "redis", extra=("--maxmemory", f"{biggest // MiB + 512}mb")
        )
    else:
        server = MotoServer(work / "moto")
    rows: list[Row] = []
    try:
        server.start()
        if isinstance(server, RedisServer):
            raw: RawRedis | RawS3 = RawRedis(server.url)
            backend: dict[str, Any] = {"url": server.url}
            prefix = RedisConfig().prefix
            case = Case(kind, backend, raw, lambda ns, k: f"{prefix}:{ns}:{k}")
            print(f"\nredis-server {server.url}, maxmemory {biggest // MiB + 512} MiB")
        else:
            server.create_bucket(BUCKET)
            raw = RawS3(server.endpoint_url)
            backend = {"bucket": BUCKET, "endpoint_url": server.endpoint_url, "addressing_style": "path"}
            prefix = S3Config().prefix
            case = Case(kind, backend, raw, lambda ns, k: f"{prefix}/{ns}/{k}")
            print(f"\nmoto_server {server.endpoint_url}")
        runner.run(raw.start())
        try:
            for p, n in sizes:
                rows += case.run(runner, work, p, n, reps)
        finally:
            runner.run(raw.close())
    finally:
        server.stop()
    return rows


if __name__ == "__main__":
    sys.exit(main())
