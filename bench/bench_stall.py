"""Benchmark: engines storing through an L3 stall. Four engine processes each store 4 new pages of 256 KiB and
load back 4 every 20 ms into a 256 MiB pool while the backend (Redis or S3 behind the fault proxy, the file
backend on a FUSE mount) stalls for --stall-s seconds (15 by default), then recovers.

Two configurations, interleaved in each run: "before" is the daemon as it was before stall detection and
the backlog bound (no stall detection, no slow-call rule, stores refused once the pool is full of pages
waiting for L3: storage.breaker.stall_timeout = 0, slow_factor = 0, max_unbacked_fraction = 1,
when_backlog_full = "refuse"); "after" is the default configuration. Per backend and configuration, over
the runs (min/median/max): store throughput during the stall as a ratio to the same run's throughput in
the seconds before it, the share of pages stores did not take during the stall, the time from the stall to
the backend's detach, and from the fault clearing to its re-attach.

    python bench/bench_stall.py [--runs 3] [--stall-s 15] [--backends redis,s3,file]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests" / "support"))

import fault_run  # noqa: E402
from daemon_proc import DaemonProcess  # noqa: E402
from proxy import LOOPBACK, TcpProxy  # noqa: E402
from servers import MotoServer, RedisServer, aws_env  # noqa: E402
from stallfs import StallFS, stallfs_available  # noqa: E402

PAGE = 256 << 10
NS = "bench.stall"
BEFORE = {
    "breaker": {"stall_timeout": 0, "slow_factor": 0},
    "max_unbacked_fraction": 1.0,
    "when_backlog_full": "refuse",
}
CONFIGS = {"before": BEFORE, "after": {}}


@contextmanager
def backend(kind: str, work: Path) -> Iterator[tuple[dict, Callable[[], None], Callable[[], None]]]:
    """The storage section for `kind`, a stall and a resume of it."""
    if kind == "file":
        (work / "disk").mkdir()
        with StallFS(work / "disk", work / "mnt") as fs:
            yield {"backend": "file", "file": {"root": str(work / "mnt" / "data")}}, fs.stall, fs.resume
        return
    if kind == "redis":
        server = RedisServer(work / "redis", extra=("--maxmemory", "1gb"))
    else:
        os.environ.update(aws_env(work))  # the daemon inherits them: the standard AWS chain
        server = MotoServer(work / "moto")
    server.start()
    proxy = TcpProxy(server.port)
    proxy.start()
    try:
        if kind == "redis":
            section = {"url": f"redis://{LOOPBACK}:{proxy.port}/0", "prefix": "bench"}
        else:
            server.create_bucket("bench-stall")
            section = {"bucket": "bench-stall", "prefix": "bench", "addressing_style": "path"}
            section["endpoint_url"] = f"http://{LOOPBACK}:{proxy.port}"
        yield {"backend": kind, kind: section}, proxy.stall, proxy.resume
    finally:
        proxy.close()
        server.stop()


def one(kind: str, config: str, stall_s: float, work: Path) -> dict[str, float]:
    with backend(kind, work) as (storage, stall, resume):
        d = DaemonProcess(
            str(work / "d"),
            {
                "pool": {"capacity": "256MiB", "slab_size": "4MiB"},
                "storage": {**storage, **CONFIGS[config], "breaker": {**CONFIGS[config].get("breaker", {})}},
                "logging": {"level": "warning"},
            },
        ).start()
        try:
            r = fault_run.run(d, work, NS, PAGE, fault=stall, clear=resume, before_s=3.0, fault_s=stall_s)
        finally:
            resume()
            d.stop()
    steady = r.stored_mib_s(r.fault_at - 2.5, r.fault_at)
    during = r.stored_mib_s(r.fault_at, r.cleared_at)
    return {
        "steady MiB/s": steady,
        "stall MiB/s": during,
        "stall / steady": during / steady if steady else float("nan"),
        "False share in stall": r.false_share(r.fault_at, r.cleared_at),
        "detach s": r.detach_s if r.detach_s is not None else float("nan"),
        "re-attach s": (r.reattached_at - r.cleared_at) if r.reattached_at else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stall-s", type=float, default=15.0)
    ap.add_argument("--backends", default="redis,s3,file")
    args = ap.parse_args()
    kinds = args.backends.split(",")
    if "file" in kinds and (why := stallfs_available()) is not None:
        print(f"file backend left out: {why}")
        kinds.remove("file")
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for run in range(args.runs):
        for kind in kinds:
            order = list(CONFIGS) if run % 2 == 0 else list(reversed(CONFIGS))
            for config in order:
                with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
                    out = one(kind, config, args.stall_s, Path(tmp))
                rows.setdefault((kind, config), []).append(out)
                print(
                    f"run {run + 1} {kind:5} {config:6} " + ", ".join(f"{k} {v:.3g}" for k, v in out.items())
                )
    print(f"\n{args.stall_s:g} s stall; 4 engines x 4 pages of 256 KiB / 20 ms; 256 MiB pool; min/median/max")
    names = list(next(iter(rows.values()))[0])
    print(f"| backend | config | {' | '.join(names)} |")
    print("|---|---|" + "---|" * len(names))
    for (kind, config), outs in rows.items():
        cells = []
        for name in names:
            vals = sorted(o[name] for o in outs)
            cells.append(f"{vals[0]:.3g} / {statistics.median(vals):.3g} / {vals[-1]:.3g}")
        print(f"| {kind} | {config} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
