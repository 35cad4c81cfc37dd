"""The daemon's own CPU per page, without the I/O: the tiers (page index, prefetch, backup) and the file
connector run in this process as the daemon runs them, with the connector's page I/O replaced by an
answer at once (every read a hit, every write done; the C engine's jobs are still made, see
AtOnceEngine). What is left is the bookkeeping on the event loop that a page costs: on a node short of
CPUs, it comes out of the I/O threads and the engines.

Usage: python bench/cpu_per_page.py [--page-kib 256] [--reps 10] [--steps prefetch,store,put]

It prints the best of --reps (CPU seconds of this process per page, all threads) for:
  prefetch   a prefetch + wait of pages missing from L2, into a full pool (each page evicts one);
  store      alloc + commit of 32 pages a call, into a full pool;
  put        reserve + put of 32 pages a call (the client's usual path), into a full pool;
  flush      the write-back flush of the pages the store step left dirty.

Timings on a shared VM move by tens of percent. For a comparison of two versions of the code, count
instructions instead, which barely move: run it under valgrind twice, with two --reps counts, and divide
the difference by the pages of the extra repetitions (printed at the end), e.g.
  valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/cpu_per_page.py --reps 1
  valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/cpu_per_page.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import tempfile
import time

import uvloop  # noqa: E402
from hicached.connectors.file import FileConnector, _pageio  # noqa: E402

from hicached import config  # noqa: E402
from hicached.daemon.l2.pool import Pool  # noqa: E402
from hicached.daemon.sched.tiers import Session, Tiers  # noqa: E402

MiB = 1 << 20
POOL = 64 * MiB
SET = 64 * MiB  # pages per step: a set as large as the pool, so that every page evicts one
BATCH = 32


def keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class AtOnceEngine:
    """hicached.common._pageio.Engine with every job answered at once: its arguments are taken as the engine
    takes them (the names made, the buffers held, by the C call with its stop flag already set, so that no
    page is touched), and the answer comes through an eventfd to the connector's reader as the engine's."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.done: list[tuple] = []
        self.stop = bytearray(b"\x01")

    def fileno(self) -> int:
        return self.fd

    def read(self, token, ns, ks, root, views, chunk, stop, touch) -> None:
        _pageio.read_pages(ns, ks, root, views, chunk, self.stop, touch)
        self._answer(token, len(ks))

    def write(self, token, ns, ks, root, tag, views, chunk, stop, fsync, measure, sums=None) -> None:
        _pageio.write_pages(ns, ks, root, tag, views, chunk, self.stop, fsync, measure, sums)
        self._answer(token, len(ks))

    def _answer(self, token, n: int) -> None:
        if not self.done:
            os.eventfd_write(self.fd, 1)
        self.done.append((token, [0] * n, 0, 0))

    def reap(self) -> list[tuple]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        pass


async def run(page: int, reps: int, root: str, steps: set[str]) -> dict[str, float]:
    cfg = config.from_dict(
        {
            "pool": {"capacity": POOL, "slab_size": "32MiB", "prefault": False},
            "storage": {"write_policy": "write_back", "file": {"root": root}},
        }
    )
    conn = FileConnector(cfg)
    await conn.start()
    # The page I/O answers at once: only the daemon's own work is left.
    conn._read_chunk = lambda ns, ks, views, stop: ["hit"] * len(ks)
    conn._write_chunk = lambda ns, ks, views, stop: [None] * len(ks)
    if conn._engines is not None:  # the C engines: jobs taken as they are, answered by the loop's reader
        conn._unwatch()
        conn._engines = (AtOnceEngine(), AtOnceEngine())
        conn._watch(asyncio.get_running_loop())
    pool = Pool(cfg.pool.capacity, prefault=False)
    t = Tiers(cfg, pool, conn)
    t.start()
    s = Session(peer="bench")
    t.hello(s, "bench", page)
    n = SET // page
    best: dict[str, float] = {}

    def keep(name: str, cpu: float) -> None:
        best[name] = min(best.get(name, float("inf")), cpu / n)

    async def store(rep: int) -> None:
        ks = keys(f"s{rep}", n)
        c0 = time.process_time()
        for i in range(0, n, BATCH):
            part = ks[i : i + BATCH]
            t.alloc(s, part)
            t.commit(s, part)
        keep("store", time.process_time() - c0)
        c0 = time.process_time()
        if not await t.flush_dirty(60):
            raise RuntimeError("flush did not finish")
        keep("flush", time.process_time() - c0)

    async def put(rep: int) -> None:
        ks = keys(f"r{rep}", n)
        c0 = time.process_time()
        i = 0
        while i < n:  # a connection holds pool.reserve_per_connection at most: fewer slots may come
            offsets, _ = t.reserve(s, min(BATCH, n - i))
            if not offsets:
                raise RuntimeError("no slots reserved")
            t.put(s, ks[i : i + len(offsets)], offsets)
            i += len(offsets)
        keep("put", time.process_time() - c0)
        if not await t.flush_dirty(60):
            raise RuntimeError("flush did not finish")

    try:
        for rep in range(reps):
            if "prefetch" in steps:
                ks = keys(f"p{rep}", n)
                c0 = time.process_time()
                handle = t.prefetch(s, ks, 0)
                got = await t.wait(s, handle, None)
                keep("prefetch", time.process_time() - c0)
                if got != n:
                    raise RuntimeError(f"prefetch placed {got} of {n} pages")
            if "store" in steps:
                await store(rep)
            if "put" in steps:
                await put(rep)
    finally:
        await t.stop()
        await conn.close()
        pool.close()
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--steps", default="prefetch,store,put", help="which steps run (flush follows both stores)"
    )
    a = parser.parse_args()
    steps = set(a.steps.split(","))
    page = a.page_kib << 10
    with tempfile.TemporaryDirectory() as root:
        best = uvloop.run(run(page, a.reps, os.path.join(root, "data"), steps))
    for name, cpu in best.items():
        print(f"{name:9s} {cpu * 1e6:6.2f} us of CPU a page (best of {a.reps})")
    pages = (SET // page) * sum(1 for step in ("prefetch", "store", "put") if step in steps)
    print(f"pages a repetition: {pages} (instruction counts: divide by this times the extra repetitions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
