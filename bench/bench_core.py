"""Benchmark of hicached's core paths against the raw speed of the same work, measured in the same run:
store and load (memcpy), L2 -> file backup (pwrite), file -> L2 prefetch (preadv), exists (a bare uvloop
round trip). It runs real daemons on a temporary config. Usage: python bench/bench_core.py [--quick] [--dir D]
[--runs N] (N whole runs, then each ratio's min / median / max and how many runs met its target)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib
import msgpack
import numpy as np
import uvloop
import xxhash
from hicached.connectors.file import FileConnector, default_io_threads
from hicached.connectors.header import HEADER_SIZE

from hicached import Client, config
from hicached.common.memfd import map_memfd
from hicached.engine.ops import _copy_pages as copy_pages  # None where hicached.common._pageio is not built

MiB = 1 << 20
BATCH = 32  # pages per store/load call
# The daemon runs with its default storage.file.io_threads; the raw baselines take the fastest of these.
RAW_THREADS = sorted({1, default_io_threads(), 8})
EXISTS_KEYS = 64
CONFIG = """\
[server]
socket = "run/hicached.sock"
[pool]
capacity = "{pool_mib}MiB"
slab_size = "32MiB"
[storage]
backend = "file"
write_policy = "{policy}"
[storage.file]
root = "data"
[shutdown]
flush_timeout = "30s"
[warmup]
enabled = false  # prefetch is measured from an empty L2 after a restart
[logging]
level = "warning"
"""

now = time.perf_counter
Row = tuple[str, float, float, str, str]  # figure, hicached, raw, unit, target ("" for information)


def page_keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def page_path(root: Path, ns: str, key: str) -> str:
    """Where the file connector keeps a page (connectors/file.py)."""
    return f"{root}/{ns}/{key[0:2]}/{key[2:4]}/{key}"


def uncache(paths: Sequence[str]) -> None:
    """Drops the files' pages from the page cache (clean pages only), so the next read goes to the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_files(root: Path, ns: str, keys: Sequence[str]) -> None:
    """Removes pages the run no longer needs, so dirty page cache stays far below the writeback limits."""
    for k in keys:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(page_path(root, ns, k))


def shared_mapping(nbytes: int) -> np.ndarray:
    """A memfd mapped MAP_SHARED and prefaulted for writing, as the L2 pool is (hicached.pool.map_memfd: in
    2 MiB pages too, where the node's shmem_enabled allows them)."""
    fd = os.memfd_create("hicached-bench", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = map_memfd(fd, nbytes, True, "the raw mapping")
    finally:
        os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr.fill(1)
    return arr


def raw_io(
    ex: ThreadPoolExecutor, paths: list[str], slots: list[np.ndarray], threads: int, write: bool
) -> float:
    """os.pwrite of each page to a new file of its own, or os.preadv of each page file (header + payload)
    into the shared mapping; in this thread, or cut into `threads` jobs as the file connector does."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL if write else os.O_RDONLY

    def job(r: range) -> None:
        head = bytearray(HEADER_SIZE)
        for i in r:
            fd = os.open(paths[i], flags | os.O_CLOEXEC, 0o600)
            try:
                n = os.pwrite(fd, slots[i], 0) if write else os.preadv(fd, [head, slots[i]], 0) - HEADER_SIZE
                if n != slots[i].nbytes:
                    raise OSError(f"short transfer on {paths[i]}")
            finally:
                os.close(fd)

    return run_jobs(ex, job, len(paths), threads)


def run_jobs(ex: ThreadPoolExecutor, job: Callable[[range], None], n: int, threads: int) -> float:
    """Time of `job` over range(n): in this thread, or cut into `threads` jobs on `ex`."""
    t0 = now()
    if threads == 1:
        job(range(n))
    else:
        list(ex.map(job, [range(i * n // threads, (i + 1) * n // threads) for i in range(threads)]))
    return now() - t0


CHUNK = 256 << 10  # as the file connector hashes: each chunk right after reading it, or before writing it


def bare_checked_io(
    ex: ThreadPoolExecutor, paths: list[str], slots: list[np.ndarray], threads: int, write: bool
) -> float:
    """The least a Python loop does with the page format: raw_io plus the xxh3 of every payload (checked on
    reads) and, on writes, a temporary name renamed into place. No daemon, no connector."""

    def write_job(r: range) -> None:
        for i in r:
            tmp, view = paths[i] + ".tmp", memoryview(slots[i])
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                hasher = xxhash.xxh3_64()
                for start in range(0, view.nbytes, CHUNK):
                    hasher.update(view[start : start + CHUNK])
                    os.pwrite(fd, view[start : start + CHUNK], HEADER_SIZE + start)
                digest = hasher.intdigest().to_bytes(8, "little")  # where the page header keeps it
                os.pwrite(fd, bytes(16) + digest + bytes(HEADER_SIZE - 24), 0)
            finally:
                os.close(fd)
            os.rename(tmp, paths[i])

    def read_job(r: range) -> None:
        head = bytearray(HEADER_SIZE)
        for i in r:
            view = memoryview(slots[i])
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                got = os.preadv(fd, [head, view[:CHUNK]], 0) - HEADER_SIZE
                hasher = xxhash.xxh3_64(view[:CHUNK])
                for start in range(CHUNK, view.nbytes, CHUNK):
                    got += os.preadv(fd, [view[start : start + CHUNK]], HEADER_SIZE + start)
                    hasher.update(view[start : start + CHUNK])
            finally:
                os.close(fd)
            if got != view.nbytes or hasher.intdigest() != int.from_bytes(head[16:24], "little"):
                raise RuntimeError(f"{paths[i]} does not verify")

    return run_jobs(ex, write_job if write else read_job, len(paths), threads)


class ConnectorAlone:
    """The file connector by itself: put / get_into of a whole set on its own threads, no daemon, index or
    protocol. Between raw and the daemon, it tells what the page format costs (checksum, temporary name and
    rename) from what the daemon adds."""

    def __init__(self, root: Path) -> None:
        cfg = config.from_dict({"storage": {"backend": "file", "file": {"root": str(root)}}})
        self.loop = uvloop.new_event_loop()
        self.conn = FileConnector(cfg)
        self.loop.run_until_complete(self.conn.start())

    def time(self, write: bool, ns: str, keys: list[str], slots: list[np.ndarray]) -> float:
        call = self.conn.put if write else self.conn.get_into
        t0 = now()
        ok = self.loop.run_until_complete(call(ns, keys, [memoryview(s) for s in slots]))
        t = now() - t0
        if not all(ok):
            raise RuntimeError(f"the file connector failed {ok.count(False)} pages")
        return t

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


class Daemon(benchlib.Daemon):
    def __init__(self, work: Path, pool_bytes: int, policy: str) -> None:
        text = CONFIG.format(pool_mib=pool_bytes // MiB, policy=policy)
        super().__init__(work, text, f"hicached-{policy}.toml")


def batched(call: Callable[[list[str], list], list[bool] | int], keys: list[str], objs: list) -> float:
    """Time of `Client.store` or `Client.load` over `keys` in batches of BATCH; every page must succeed."""
    t0 = now()
    for i in range(0, len(keys), BATCH):
        ok = call(keys[i : i + BATCH], objs[i : i + BATCH])
        if (sum(ok) if isinstance(ok, list) else ok) != len(keys[i : i + BATCH]):
            raise RuntimeError(f"{call.__name__} failed for some pages: {ok} (pool too small?)")
    return now() - t0


class SizeBench:
    """Every figure for one page size. Each repetition times hicached and its raw baseline back to back;
    repetition 0 is a warm-up and is not kept."""

    def __init__(self, p: int, a: argparse.Namespace, work: Path, ex: ThreadPoolExecutor) -> None:
        self.p, self.a, self.work, self.ex = p, a, work, ex
        self.n = a.rep_bytes // p
        self.nbytes = self.n * p
        self.ns, self.root = f"bench.p{p}", work / "data"
        self.label = f"{p >> 10} KiB" if p < MiB else f"{p >> 20} MiB"
        rng = np.random.default_rng(p)
        srcs = [rng.bytes(p) for _ in range(BATCH)]
        self.pages = [srcs[i % BATCH] for i in range(self.n)]
        self.src_arrays = [np.frombuffer(s, dtype=np.uint8) for s in self.pages]
        self.raw = shared_mapping(self.nbytes)
        self.slots = [self.raw[i * p : (i + 1) * p] for i in range(self.n)]
        self.t: dict[str, list[float]] = collections.defaultdict(list)
        self.sets: list[list[str]] = []  # pages that the write-back phase left in files, for prefetch
        self.alone = ConnectorAlone(self.root)
        # Reads from the device as well, where the work dir is on one (tmpfs has no page cache to drop).
        self.cold_reads = fs_type(work) not in ("tmpfs", "ramfs")
        self.cold = 0.0

    def keep(self, r: int, **times: float) -> None:
        for name, t in times.items() if r else ():
            self.t[name].append(t)

    def gbps(self, *names: str) -> float:
        return self.nbytes / sum(statistics.median(self.t[n]) for n in names) / 1e9

    def memcpy(self) -> float:
        t0 = now()
        for dst, src in zip(self.slots, self.src_arrays, strict=True):
            np.copyto(dst, src)
        return now() - t0

    def stream_copy(self) -> float:
        """The client's own copy into the pool (hicached.common._pageio.copy_pages: streaming stores on
        x86-64), raw, BATCH pages a call into the shared mapping: what a store costs without the daemon."""
        p, t0 = self.p, now()
        for i in range(0, self.n, BATCH):
            batch = self.pages[i : i + BATCH]
            copy_pages(self.raw, [(i + j) * p for j in range(len(batch))], p, batch, True)
        return now() - t0

    def mv_assign(self) -> float:
        mv, p, t0 = memoryview(self.raw), self.p, now()
        for i, src in enumerate(self.pages):
            mv[i * p : (i + 1) * p] = src
        return now() - t0

    def raw_write(self, threads: int, io: Callable[..., float] = raw_io) -> float:
        """Into a directory of its own, removed afterwards (untimed)."""
        d = self.work / "raw"
        d.mkdir()
        t = io(self.ex, [f"{d}/{i}" for i in range(self.n)], self.slots, threads, write=True)
        shutil.rmtree(d)
        return t

    def fill_pool(self, c: Client, d: Daemon, tag: str) -> float:
        """Stores a pool's worth of pages, so that this client's mapping of every slot is faulted in (as in
        an engine that has run for a while); returns the time of the first, cold, repetition."""
        times = []
        for w in range(self.a.pool_bytes // self.nbytes):
            keys = page_keys(f"{self.ns}/{tag}{w}", self.n)
            times.append(batched(c.store, keys, self.pages))
            d.flush()
            drop_files(self.root, self.ns, keys)
        return times[0]

    def run(self, rows: list[Row], tail: list[Row]) -> None:
        print(f"\n== pages of {self.label}: {self.n} pages ({self.nbytes >> 20} MiB) per repetition")
        try:
            self.write_back_phase(tail)
            self.write_through_phase()
        finally:
            self.alone.close()
        for keys in self.sets:
            drop_files(self.root, self.ns, keys)
        w = max((f"pwrite{t}" for t in RAW_THREADS), key=self.gbps)
        r = max((f"preadv{t}" for t in RAW_THREADS), key=self.gbps)
        print(f"raw memoryview slice assignment: {self.gbps('mv'):.2f} GB/s (holds the GIL; for reference)")
        for what in ("pwrite", "preadv"):
            each = ", ".join(f"{t} thread(s) {self.gbps(f'{what}{t}'):.2f} GB/s" for t in RAW_THREADS)
            print(f"raw {what}, file per page: {each}")
        print(f"baselines below use the fastest: {w[6:]} threads for pwrite, {r[6:]} for preadv")
        lb, g = self.label, self.gbps
        rows += [
            (f"store {lb} (write-back: L2 alone)", g("store"), g("memcpy"), "GB/s", ">=0.8"),
            (f"store {lb} (write-through)", g("store_wt"), g("memcpy_wt"), "GB/s", ">=0.8"),
            *(  # what the client's copy method is worth by itself, and the store against it
                [
                    ("  the client's copy alone, raw (streaming)", g("stream"), g("memcpy"), "GB/s", ""),
                    ("  store (write-back) against that copy", g("store"), g("stream"), "GB/s", ""),
                ]
                if copy_pages is not None
                else []
            ),
            (f"store {lb}, first pass over the pool", self.cold, g("memcpy"), "GB/s", ""),
            (f"backup {lb} L2 -> file (flush only)", g("backup"), g(w), "GB/s", ">=0.8"),
            ("  a bare Python loop with the page format", g("bare_put"), g(w), "GB/s", ""),
            ("  the file connector's put alone", g("alone_put"), g(w), "GB/s", ""),
            (f"store + backup {lb} (write-through)", g("total_wt"), g("memcpy", w), "GB/s", ""),
            (f"prefetch {lb} file -> L2 (warm)", g("prefetch"), g(r), "GB/s", ">=0.8"),
            ("  a bare Python loop with the page format", g("bare_get"), g(r), "GB/s", ""),
            ("  the file connector's get_into alone", g("alone_get"), g(r), "GB/s", ""),
            (f"load {lb} L2 -> client buffer", g("load"), g("load_raw"), "GB/s", ""),
        ]
        if self.cold_reads:
            rc = max((f"cold_preadv{t}" for t in RAW_THREADS), key=self.gbps)
            rows.append(
                (f"prefetch {lb} file -> L2 (cold: from the disk)", g("cold_prefetch"), g(rc), "GB/s", "")
            )

    def write_back_phase(self, tail: list[Row]) -> None:
        """Write-back: a store fills L2 alone, and the flush after it is pure L2 -> file."""
        a, slots = self.a, self.slots
        with Daemon(self.work, a.pool_bytes, "write_back") as d, Client(d.sock, self.ns, self.p) as c:
            self.cold = self.nbytes / self.fill_pool(c, d, "warm-wb") / 1e9
            for r in range(a.reps + 1):
                keys = page_keys(f"{self.ns}/a{r}", self.n)
                ts = batched(c.store, keys, self.pages)
                t0 = now()
                d.flush()
                tb = now() - t0
                raw = {f"pwrite{t}": self.raw_write(t) for t in RAW_THREADS}
                raw["bare_put"] = self.raw_write(default_io_threads(), bare_checked_io)
                alone = page_keys(f"{self.ns}/alone{r}", self.n)
                raw["alone_put"] = self.alone.time(True, self.ns, alone, slots)
                drop_files(self.root, self.ns, alone)
                if copy_pages is not None:
                    raw["stream"] = self.stream_copy()
                self.keep(r, store=ts, backup=tb, memcpy=self.memcpy(), mv=self.mv_assign(), **raw)
                self.sets.append(keys)
                if len(self.sets) > a.pool_bytes // self.nbytes + 1:  # enough to cycle prefetch through
                    drop_files(self.root, self.ns, self.sets.pop(0))
            buf = np.empty(self.nbytes, dtype=np.uint8)
            buf.fill(0)
            bufs = [buf[i * self.p : (i + 1) * self.p] for i in range(self.n)]
            for r in range(a.reps + 1):
                tl = batched(c.load, self.sets[-1], bufs)
                t0 = now()
                for dst, src in zip(bufs, slots, strict=True):
                    np.copyto(dst, src)
                self.keep(r, load=tl, load_raw=now() - t0)
            if self.p == max(a.sizes):
                tail += exists_latency(c, [k for s in self.sets[-2:] for k in s][-EXISTS_KEYS:], a, self.work)

    def prefetch(self, c: Client, keys: list[str]) -> float:
        t0 = now()
        got = c.wait(c.prefetch(keys), timeout=60)
        t = now() - t0
        if got != len(keys):
            raise RuntimeError(f"prefetch brought {got} of {len(keys)} pages")
        return t

    def write_through_phase(self) -> None:
        """A restarted daemon (L2 empty, the pages only in files): prefetch, then write-through stores."""
        a, ex, slots, n = self.a, self.ex, self.slots, self.n
        with Daemon(self.work, a.pool_bytes, "write_through") as d, Client(d.sock, self.ns, self.p) as c:
            for r in range(a.reps + 1):  # a set comes round again only after the pool has evicted it
                keys = self.sets[r % len(self.sets)]
                paths = [page_path(self.root, self.ns, k) for k in keys]
                raw_io(ex, paths, slots, max(RAW_THREADS), False)  # warm, as the daemon's files are
                raw = {f"preadv{t}": raw_io(ex, paths, slots, t, False) for t in RAW_THREADS}
                raw["bare_get"] = bare_checked_io(ex, paths, slots, default_io_threads(), False)
                raw["alone_get"] = self.alone.time(False, self.ns, keys, slots)
                self.keep(r, prefetch=self.prefetch(c, keys), **raw)
            if self.cold_reads:  # on a disk: the same, with the files dropped from the page cache first
                os.sync()  # DONTNEED leaves dirty pages cached
                for r in range(a.reps + 1):
                    keys = self.sets[(a.reps + 1 + r) % len(self.sets)]  # the set the pool evicted last
                    paths = [page_path(self.root, self.ns, k) for k in keys]
                    raw = {}
                    for t in RAW_THREADS:
                        uncache(paths)
                        raw[f"cold_preadv{t}"] = raw_io(ex, paths, slots, t, False)
                    uncache(paths)
                    self.keep(r, cold_prefetch=self.prefetch(c, keys), **raw)
            self.fill_pool(c, d, "warm-wt")
            for r in range(a.reps + 1):
                keys = page_keys(f"{self.ns}/b{r}", n)
                t0 = now()
                ts = batched(c.store, keys, self.pages)
                d.flush()
                self.keep(r, store_wt=ts, total_wt=now() - t0, memcpy_wt=self.memcpy())
                drop_files(self.root, self.ns, keys)


def echo_server(path: str) -> None:
    """The raw baseline for a request: length-prefixed msgpack in, a small msgpack map out, on uvloop."""
    import asyncio

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport, self.buf = transport, bytearray()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while len(self.buf) >= 4 and len(self.buf) >= 4 + (size := int.from_bytes(self.buf[:4], "big")):
                req = msgpack.unpackb(self.buf[4 : 4 + size])
                del self.buf[: 4 + size]
                body = msgpack.packb({"id": req["id"], "n": len(req["keys"])})
                self.transport.write(len(body).to_bytes(4, "big") + body)

    async def main() -> None:
        # Held for as long as it serves: a server object nothing refers to may be collected, and its
        # listening socket closed with it.
        server = await asyncio.get_running_loop().create_unix_server(Echo, path)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def raw_exists(sock: socket.socket, keys: list[str], rid: int) -> None:
    body = msgpack.packb({"id": rid, "op": "exists", "keys": keys})
    sock.sendall(len(body).to_bytes(4, "big") + body)
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        buf += sock.recv(1 << 16)
    msgpack.unpackb(buf[4:])


def exists_latency(c: Client, keys: list[str], a: argparse.Namespace, work: Path) -> list[Row]:
    """`exists` of keys all in L2 against the echo server, call by call in turn; the first tenth warms up."""
    path = str(work / "echo.sock")
    proc = subprocess.Popen([sys.executable, __file__, "--echo-server", path], start_new_session=True)
    ours, raw = [], []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            while s.connect_ex(path) != 0:
                if proc.poll() is not None:
                    raise RuntimeError("echo server exited")
                time.sleep(0.02)
            for i in range(a.calls + a.calls // 10):
                t0 = now()
                raw_exists(s, keys, i)
                t1 = now()
                if c.exists(keys) != len(keys):
                    raise RuntimeError("exists missed keys that are in L2")
                ours.append(now() - t1), raw.append(t1 - t0)
    finally:
        proc.terminate()
        proc.wait()
    ours, raw = (np.array(x[a.calls // 10 :]) * 1e6 for x in (ours, raw))
    name = f"exists x{len(keys)} round trip"
    p50, p99 = (tuple(np.percentile(x, q) for x in (ours, raw)) for q in (50, 99))
    return [(f"{name} p50", *p50, "µs", "<=2"), (f"{name} p99", *p99, "µs", "")]


def fs_type(path: Path) -> str:
    mounts = [line.split()[1:3] for line in open("/proc/self/mounts")]
    inside = [(m, t) for m, t in mounts if str(path).startswith(m.rstrip("/") + "/")]
    return max(inside, key=lambda mt: len(mt[0]))[1] if inside else "unknown filesystem"


def meets(ratio: float, target: str) -> bool:
    limit = float(target[2:])
    return ratio >= limit if target.startswith(">=") else ratio <= limit


def print_table(rows: list[Row]) -> None:
    print(f"\n{'figure':42} {'hicached':>12} {'raw':>12} {'ratio':>7} {'target':>7}  result")
    for name, val, raw, unit, target in rows:
        ratio = val / raw
        verdict = ("PASS" if meets(ratio, target) else "MISS") if target else "info"
        shown = f"{target}x" if target else "-"
        print(f"{name:42} {val:7.2f} {unit:4} {raw:7.2f} {unit:4} {ratio:6.2f}x {shown:>7}  {verdict}")


def print_ranges(runs: list[list[Row]]) -> None:
    """The ratio of each figure over several runs: on a shared machine one run says little."""
    print(f"\nratios over {len(runs)} runs")
    print(f"{'figure':42} {'min':>6} {'median':>7} {'max':>6} {'target':>7}  runs that pass")
    for i, (name, _, _, _, target) in enumerate(runs[0]):
        ratios = sorted(run[i][1] / run[i][2] for run in runs)
        passed = f"{sum(meets(r, target) for r in ratios)} of {len(ratios)}" if target else "-"
        shown = f"{target}x" if target else "-"
        med = statistics.median(ratios)
        print(f"{name:42} {ratios[0]:5.2f}x {med:6.2f}x {ratios[-1]:5.2f}x {shown:>7}  {passed}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer repetitions (~15 s)")
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
        help="parent of the temporary work dir, where both the daemon's files and the raw files go (default: "
        "/dev/shm, in memory: warm against warm, free of disk writeback and of the filesystem's history)",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="whole runs, each with fresh daemons; then each ratio's range"
    )
    parser.add_argument("--echo-server", metavar="PATH", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.echo_server:
        echo_server(a.echo_server)
        return 0
    a.sizes = (2 * MiB, 256 * 1024)
    a.rep_bytes, a.reps, a.pool_bytes, a.calls = (
        (64 * MiB, 4, 256 * MiB, 500) if a.quick else (256 * MiB, 9, 1024 * MiB, 2000)
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemons are stopped
    work = Path(tempfile.mkdtemp(prefix="hicached-bench-", dir=a.dir))
    started = now()
    cpus = len(os.sched_getaffinity(0))
    print(f"hicached bench_core: python {platform.python_version()}, {cpus} CPUs")
    print(f"work dir {work} ({fs_type(work)}), for the daemon's files and the raw files alike")
    print(
        f"daemon: pool {a.pool_bytes >> 20} MiB, slabs of 32 MiB, file backend with its default io_threads "
        f"({default_io_threads()} here)"
    )
    runs: list[list[Row]] = []
    try:
        with ThreadPoolExecutor(max(RAW_THREADS)) as ex:
            for r in range(max(1, a.runs)):
                t0, rows, tail = now(), [], []
                (work / "data").mkdir()
                for p in a.sizes:
                    SizeBench(p, a, work, ex).run(rows, tail)
                shutil.rmtree(work / "data")
                if a.runs > 1:
                    print(f"\n=== run {r + 1} of {a.runs}, {time.strftime('%H:%M:%S')}")
                print_table(rows + tail)
                print(f"\nGB = 1e9 bytes; medians of {a.reps} repetitions; this run {now() - t0:.0f} s")
                runs.append(rows + tail)
        if len(runs) > 1:
            print_ranges(runs)
            print(f"\nwhole run {now() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
