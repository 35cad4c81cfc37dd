"""Latency of one page read from the file backend while the event loop is busy, on the C engine's threads
(hicached.common._pageio.Engine) and on Python threads (the path used where the C module is not built).

The daemon's event loop runs Python for every request of every engine; an I/O thread that needs the GIL
must win it from the loop. This bench keeps the loop busy in slices of --busy-ms of Python, with a turn
of the loop between slices (as many clients' requests would), and times get_into of one page meanwhile.
It prints p50 / p99 / max against a raw os.preadv of the same file in this thread.

Usage: python bench/busy_loop_read.py [--page-kib 256] [--reads 50] [--busy-ms 1] [--timeout-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import tempfile
import time

import uvloop  # noqa: E402
from hicached.connectors import BackendUnavailable  # noqa: E402
from hicached.connectors import file as file_module  # noqa: E402
from hicached.connectors.header import HEADER_SIZE  # noqa: E402

from hicached import config  # noqa: E402

NS = "bench.busy"


def percentile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def reads(
    conn, keys: list[str], page: int, a: argparse.Namespace, busy: bool
) -> tuple[list[float], int]:
    """Latencies of a.reads one-page reads (seconds), and how many timed out."""
    stop = False

    async def spin() -> None:
        while not stop:
            until = time.perf_counter() + a.busy_ms / 1e3
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin()) if busy else None
    buf = memoryview(bytearray(page))
    out, timeouts = [], 0
    try:
        for _ in range(a.reads):
            t0 = time.perf_counter()
            try:
                ok = await conn.get_into(NS, [random.choice(keys)], [buf])
                if ok != [True]:
                    raise RuntimeError("a page was not read")
            except BackendUnavailable:
                timeouts += 1
            out.append(time.perf_counter() - t0)
    finally:
        stop = True
        if spinner is not None:
            await spinner
    return out, timeouts


def raw_reads(root: str, keys: list[str], page: int, n: int) -> list[float]:
    head, buf = bytearray(HEADER_SIZE), bytearray(page)
    out = []
    for _ in range(n):
        k = random.choice(keys)
        t0 = time.perf_counter()
        fd = os.open(f"{root}/{NS}/{k[0:2]}/{k[2:4]}/{k}", os.O_RDONLY)
        try:
            os.preadv(fd, [head, buf], 0)
        finally:
            os.close(fd)
        out.append(time.perf_counter() - t0)
    return out


async def run(a: argparse.Namespace, root: str) -> None:
    page = a.page_kib << 10
    keys = [f"{i:064x}" for i in range(64)]
    cfg = config.from_dict(
        {"storage": {"backend": "file", "operation_timeout": a.timeout_s, "file": {"root": root}}}
    )
    native = file_module._pageio
    paths = [("C engine", native)] if native is not None else []
    paths.append(("Python threads", None))
    raw: list[float] = []  # raw preadv times, taken once the first connector has put the pages
    print(f"one {a.page_kib} KiB page a read, {a.reads} reads; busy: {a.busy_ms} ms slices of Python")
    print(f"{'path':16s} {'loop':5s} {'p50':>9s} {'p99':>9s} {'max':>9s} {'p50/raw':>8s} timeouts")
    for name, module in paths:
        file_module._pageio = module
        try:
            conn = file_module.FileConnector(cfg)
        finally:
            file_module._pageio = native
        await conn.start()
        try:
            if not raw:
                payload = memoryview(os.urandom(page))
                if await conn.put(NS, keys, [payload] * len(keys)) != [True] * len(keys):
                    raise RuntimeError("put failed")
                raw = raw_reads(root, keys, page, a.reads)
                print(f"{'raw preadv':16s} {'-':5s} {statistics.median(raw) * 1e6:7.0f}us")
            for busy in (False, True):
                lat, timeouts = await reads(conn, keys, page, a, busy)
                p50, p99 = statistics.median(lat), percentile(lat, 0.99)
                print(
                    f"{name:16s} {'busy' if busy else 'idle':5s} {p50 * 1e6:7.0f}us {p99 * 1e6:7.0f}us"
                    f" {max(lat) * 1e6:7.0f}us {p50 / statistics.median(raw):7.1f}x {timeouts:8d}"
                )
        finally:
            await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--reads", type=int, default=50)
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=2.0, help="storage.operation_timeout of the reads")
    a = parser.parse_args()
    logging.getLogger("hicached").setLevel(logging.ERROR)  # the Python path's warning that C is not used
    with tempfile.TemporaryDirectory() as root:
        uvloop.run(run(a, os.path.join(root, "data")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
