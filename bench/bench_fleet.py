"""Benchmark of a fleet: two daemons (nodes A and B, each with its own L2) on one L3. Node A stores N pages
and flushes them to L3; then, in each run, interleaved (their order alternates):

- peer: node B, restarted with an empty L2, asks for A's pages: the hit rate of its first request (`present`
  of every key), then the load of every page (Client.load in batches) from L3, timed;
- own: node A itself, restarted with an empty L2 (the same daemon, its directory and config: a clean stop,
  then a fresh pool; warmup off), reads its own pages from L3 the same way.

Prints the hit rates, the load throughput of each in GB/s of page bytes, and the peer's throughput as a
ratio of A's own in the same run (1.0: a node reads another's pages from L3 as fast as its own). Every page
loaded is checked for its exact bytes, untimed. L3: a file root in a temporary directory (the page cache
serves both readers alike), or `--backend redis`, a redis-server it starts. Daemon logs: --keep DIR.

    python bench/bench_fleet.py [--runs 5] [--pages 1024] [--page-kib 256] [--batch 64] [--backend file|redis]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The same real servers and daemon subprocess the end-to-end tests use.
sys.path.append(str(ROOT / "tests" / "support"))

from daemon_proc import DaemonProcess  # noqa: E402
from servers import RedisServer  # noqa: E402

from hicached import Client  # noqa: E402

NS = "bench.fleet"
MiB = 1 << 20
STORE_BATCH = 32
READERS = ("peer", "own")


def page_of(i: int, size: int) -> bytes:
    """Page i's bytes: its index's digest, repeated (distinct for every page)."""
    digest = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (digest * (size // len(digest) + 1))[:size]


class Fleet:
    def __init__(self, work: Path, storage: dict[str, Any], pages: int, page_bytes: int, batch: int) -> None:
        self.page_bytes, self.batch = page_bytes, batch
        self.keys = [hashlib.sha256(f"fleet/{i}".encode()).hexdigest() for i in range(pages)]
        pool_mib = max(128, pages * page_bytes * 5 // 4 // MiB + 64)
        pool_mib = -(-pool_mib // 32) * 32  # whole slabs (the loader refuses a part of one)
        overrides = {
            "pool": {"capacity": f"{pool_mib}MiB"},
            "storage": storage,
            "server": {"request_timeout": "120s"},
            "shutdown": {"flush_timeout": "300s"},
        }
        self.nodes = {
            "own": DaemonProcess(str(work / "a"), overrides),
            "peer": DaemonProcess(str(work / "b"), overrides),
        }

    def fill(self) -> None:
        """Node A stores every page and flushes them to L3."""
        a = self.nodes["own"].start(timeout=120)
        with Client(a.socket, NS, self.page_bytes, timeout=120) as c:
            for lo in range(0, len(self.keys), STORE_BATCH):
                keys = self.keys[lo : lo + STORE_BATCH]
                ok = c.store(keys, [page_of(lo + i, self.page_bytes) for i in range(len(keys))])
                if not all(ok):
                    raise RuntimeError(f"node A refused {ok.count(False)} pages at page {lo}")
        ans = a.ctl("flush")
        if not ans.get("flushed"):
            raise RuntimeError(f"node A's flush did not complete: {ans}")

    def read(self, reader: str) -> dict[str, float]:
        """The reader's node restarted with an empty L2 (untimed), then its first request's hit rate and
        the timed load of every page from L3."""
        d = self.nodes[reader]
        if d.alive:
            code = d.stop()
            if code != 0:
                raise RuntimeError(f"node {reader} exited with {code}; see {d.log_path}")
        d.start(timeout=120)
        n, size = len(self.keys), self.page_bytes
        buffers = [bytearray(size) for _ in range(self.batch)]
        loaded = wrong = 0
        with Client(d.socket, NS, size, timeout=120) as c:
            pool = c.stats()["pool"]["pages"]
            if pool:
                raise RuntimeError(f"node {reader} restarted with {pool} pages in L2: not an empty L2")
            hits = sum(c.present(self.keys))
            seconds = 0.0
            for lo in range(0, n, self.batch):
                keys = self.keys[lo : lo + self.batch]
                t0 = time.perf_counter()
                got = c.load(keys, buffers[: len(keys)])
                seconds += time.perf_counter() - t0
                loaded += got
                wrong += sum(bytes(buffers[i]) != page_of(lo + i, size) for i in range(got))
        if wrong:
            raise RuntimeError(f"node {reader} loaded {wrong} pages with wrong bytes")
        return {"hit": hits / n, "loaded": loaded / n, "GB/s": loaded * size / seconds / 1e9}

    def stop(self) -> None:
        for d in self.nodes.values():
            if d.alive:
                d.stop()


def spread(vals: list[float], fmt: str) -> str:
    vals = sorted(vals)
    return f"{vals[0]:{fmt}} / {statistics.median(vals):{fmt}} / {vals[-1]:{fmt}}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="pages per Client.load call")
    ap.add_argument("--backend", choices=("file", "redis"), default="file")
    ap.add_argument("--keep", type=Path, help="work under this folder and keep it (daemon logs)")
    args = ap.parse_args()
    page_bytes = args.page_kib << 10
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir=args.keep))
    server = None
    fleet = None
    try:
        if args.backend == "redis":
            mib = args.pages * page_bytes // MiB + 256
            server = RedisServer(work / "redis", extra=("--maxmemory", f"{mib}mb"))
            server.start()
            storage: dict[str, Any] = {"backend": "redis", "redis": {"url": server.url}}
        else:
            storage = {"backend": "file", "file": {"root": str(work / "l3")}}
        fleet = Fleet(work, storage, args.pages, page_bytes, args.batch)
        fleet.fill()
        rows: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
        ratios: list[float] = []
        for run in range(args.runs):
            order = READERS if run % 2 == 0 else READERS[::-1]
            out = {reader: fleet.read(reader) for reader in order}
            for reader, figures in out.items():
                rows[reader].append(figures)
            ratios.append(out["peer"]["GB/s"] / out["own"]["GB/s"])
            print(
                f"run {run + 1} ({' then '.join(order)}): "
                + "; ".join(
                    f"{r} hit {out[r]['hit']:.1%}, loaded {out[r]['loaded']:.1%}, {out[r]['GB/s']:.3f} GB/s"
                    for r in READERS
                )
                + f"; peer / own {ratios[-1]:.3f}"
            )
    finally:
        if fleet is not None:
            fleet.stop()
        if server is not None:
            server.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{args.backend} L3, {args.pages} pages of {args.page_kib} KiB stored by node A, loaded in batches "
        f"of {args.batch}; min / median / max of {args.runs} runs"
    )
    print("| reader (an empty L2) | first request hit rate | loaded | load GB/s |")
    print("|---|---|---|---|")
    names = {"peer": "node B (a peer)", "own": "node A (its own pages, restarted)"}
    for reader in READERS:
        outs = rows[reader]
        print(
            f"| {names[reader]} | {spread([o['hit'] for o in outs], '.1%')} | "
            f"{spread([o['loaded'] for o in outs], '.1%')} | {spread([o['GB/s'] for o in outs], '.3g')} |"
        )
    print(f"peer / own load throughput (same run): {spread(ratios, '.3g')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
