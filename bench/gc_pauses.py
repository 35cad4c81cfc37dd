"""The garbage collector's pauses while the page index grows: every page in L2 is an object the collector
tracks, and a full collection scans them all, with the event loop stopped meanwhile.

The tiers run in this process as the daemon runs them (file backend, no I/O during the fill) and fill a
pool of --pages slots with alloc + commit of 32 pages a call. Each collection is timed with gc.callbacks.
It runs twice, in fresh processes: with the index freezing what is alive as it grows
(hicached/daemon/l2/index.py, gc.freeze), and without (the freezes pushed out of reach), and prints both.

Usage: python bench/gc_pauses.py [--pages 524288] [--page-kib 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

import uvloop  # noqa: E402
from hicached.connectors.file import FileConnector  # noqa: E402

from hicached import config  # noqa: E402
from hicached.daemon.l2 import index as index_module  # noqa: E402
from hicached.daemon.l2.pool import Pool  # noqa: E402
from hicached.daemon.sched.tiers import Session, Tiers  # noqa: E402

BATCH = 32


async def fill(pages: int, page: int, root: str) -> float:
    cfg = config.from_dict(
        {
            "pool": {"capacity": pages * page, "slab_size": "32MiB", "prefault": False},
            "storage": {"write_policy": "write_back", "file": {"root": root}},
        }
    )
    conn = FileConnector(cfg)
    await conn.start()
    pool = Pool(cfg.pool.capacity, prefault=False)
    tiers = Tiers(cfg, pool, conn)
    tiers.start()
    s = Session(peer="bench")
    tiers.hello(s, "bench", page)
    keys = [f"{i:064x}" for i in range(pages)]
    try:
        t0 = time.perf_counter()
        for i in range(0, pages, BATCH):
            part = keys[i : i + BATCH]
            tiers.alloc(s, part)
            tiers.commit(s, part)
        return time.perf_counter() - t0
    finally:
        await tiers.stop()
        await conn.close()
        pool.close()


def one(a: argparse.Namespace) -> None:
    if not a.freeze:
        index_module._FREEZE_FROM = 1 << 62
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    with tempfile.TemporaryDirectory() as root:
        took = uvloop.run(fill(a.pages, a.page_kib << 10, os.path.join(root, "data")))
    gc.callbacks.remove(timed)
    full = [p for g, p in pauses if g == 2]
    label = "with" if a.freeze else "without"
    print(
        f"{label:7s} freezes: fill {took:5.2f} s; full collections {len(full):2d}, "
        f"{sum(full) * 1e3:5.0f} ms in all, longest {max(full, default=0) * 1e3:4.0f} ms; "
        f"every collection {sum(p for _, p in pauses) * 1e3:5.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=512 * 1024)
    parser.add_argument("--page-kib", type=int, default=4)
    parser.add_argument("--freeze", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.freeze is not None:
        one(a)
        return 0
    print(f"filling a pool of {a.pages} pages of {a.page_kib} KiB, {BATCH} pages a call")
    for freeze in (0, 1):
        cmd = [sys.executable, __file__, "--pages", str(a.pages), "--page-kib", str(a.page_kib)]
        subprocess.run([*cmd, "--freeze", str(freeze)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
