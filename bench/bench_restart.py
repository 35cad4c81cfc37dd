"""Benchmark: a daemon restart, from the signal to the first L2 hit and to full service (every page stored
before is an L2 hit), for a pool of 256 KiB pages filled to 70% (the warm list refills at most 80%), with
the file backend as L3. Three ways, interleaved in each run (their order rotates), on one fill:

- snapshot: SIGTERM; the pool memfd and its index snapshot go to systemd's fd store at stop and come back
  at start (issue #19; through the stand-in for systemd's store in tests/support/systemd_notify.py);
- scan: SIGKILL (a crash); the pool memfd and its slot headers, in the fd store since the start, come back
  and the index is rebuilt by a full scan of the headers;
- warm list: SIGTERM, no fd store (the path without it): the new daemon starts on a fresh pool, prefaulted
  before it listens (pool.prefault, the default), and the warm list refills L2 from L3 (files just
  written, so mostly the page cache: a best case for it).

Times are seconds from the signal: the old instance gone ("stop"), the new one answering ("up"), then, seen
by an engine's Client connected before the restart (it reconnects by itself; it stays idle while the
daemon restarts), the first of 8 sampled pages an L2 hit, and every page an L2 hit (acquire without
reading L3). The ratios (warm list / snapshot, warm list / scan) are taken within each run. If memory is
short the pool is halved until it fits, and the table says so. Daemon logs: --keep DIR.

    python bench/bench_restart.py [--runs 3] [--pool-gib 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests" / "support"))

from daemon_proc import to_toml  # noqa: E402
from systemd_notify import NotifySocket  # noqa: E402

from hicached import Client, HicachedError  # noqa: E402
from hicached.engine.client import control  # noqa: E402
from hicached.engine.ops import Op, _NoReply  # noqa: E402

PAGE = 256 << 10
FILL = 0.7
NS = "bench.restart"
CHUNK = 4096
SAMPLES = 8
WAYS = ["snapshot", "scan", "warm list"]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def pick_pool_gib(want: float) -> tuple[float, str]:
    """The pool size that fits: room for the pool, a copy of its pages in the page cache (L3 files) and
    1 GiB besides; halved until it does."""
    avail = mem_available()
    gib = want
    while gib > 0.25 and (2 * gib + 1) * (1 << 30) > avail:
        gib /= 2
    note = "" if gib == want else f" (asked {want:g} GiB; {avail / (1 << 30):.1f} GiB available)"
    return gib, note


def l2_hits(keys: list[str]) -> Op:
    """Leading keys that are in L2 now, without reading L3 (acquire with fetch=false), lease released."""
    ans = yield {"op": "acquire", "keys": keys, "fetch": False}
    if ans["offsets"]:
        yield _NoReply(op="release", lease=ans["lease"])
    return len(ans["offsets"])


def page(i: int) -> bytes:
    return i.to_bytes(8, "little") * (PAGE // 8)


class Restarts:
    def __init__(self, work: Path, pool_gib: float) -> None:
        self.work = work
        self.store = NotifySocket(str(work / "notify.sock"))
        cfg = {
            "server": {"socket": "run/hicached.sock", "request_timeout": "60s"},
            "pool": {"capacity": f"{int(pool_gib * 1024)}MiB"},
            "storage": {"backend": "file", "file": {"root": "data"}},
            "logging": {"level": "info"},
            "shutdown": {"flush_timeout": "120s"},
            "warmup": {"enabled": True},
        }
        (work / "hicached.toml").write_text(to_toml(cfg))
        self.sock = str(work / "run" / "hicached.sock")
        self.proc: subprocess.Popen | None = None
        self.n = int(pool_gib * (1 << 30) * FILL) // PAGE
        self.keys = [f"p{i}" for i in range(self.n)]

    def launch(self, fds: list[tuple[str, int]]) -> None:
        with open(self.work / "daemon.log", "ab") as log:
            self.proc = self.store.launch(
                [sys.executable, "-m", "hicached", "serve", "--config", str(self.work / "hicached.toml")],
                fds,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work,
                env={**os.environ, "NOTIFY_SOCKET": self.store.path},
            )

    def wait_up(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited; see {self.work / 'daemon.log'}")
            try:
                control(self.sock, "status", timeout=2.0)
                return
            except HicachedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def fill(self, c: Client) -> None:
        for lo in range(0, self.n, 64):
            keys = self.keys[lo : lo + 64]
            ok = c.store(keys, [page(lo + i) for i in range(len(keys))])
            if not all(ok):
                raise RuntimeError(f"the fill was refused at page {lo}: {ok.count(False)} not stored")
        ans = control(self.sock, "flush", timeout=600.0)
        if not ans.get("flushed"):
            raise RuntimeError(f"flush did not complete: {ans}")

    def restart(self, c: Client, way: str) -> dict[str, float]:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGKILL if way == "scan" else signal.SIGTERM)
        self.proc.wait(300)
        stopped = time.monotonic()
        self.store.drain(0.05)
        if way == "warm list":  # the path without the fd store: whatever the old instance stored is dropped
            for name in set(self.store.names()):
                self.store.remove(name)
        self.launch(self.store.stored)
        self.wait_up()
        up = time.monotonic()
        samples = [self.keys[i * (self.n - 1) // (SAMPLES - 1)] for i in range(SAMPLES)]
        first = None
        while True:
            now = time.monotonic()
            if first is None and any(c._run(l2_hits([k])) for k in samples):
                first = time.monotonic()
            if first is not None:
                chunks = [self.keys[i : i + CHUNK] for i in range(0, self.n, CHUNK)]
                if all(c._run(l2_hits(ch)) == len(ch) for ch in chunks):
                    full = time.monotonic()
                    break
            if now - t0 > 600:
                raise RuntimeError("no full service within 600 s")
            time.sleep(0.02)
        return {"stop s": stopped - t0, "up s": up - t0, "first hit s": first - t0, "full s": full - t0}


def one(run: int, pool_gib: float, keep: Path | None) -> dict[str, dict[str, float]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=keep))
    r = Restarts(tmp, pool_gib)
    out: dict[str, dict[str, float]] = {}
    try:
        r.launch([])
        r.wait_up()
        with Client(r.sock, NS, PAGE, timeout=120, reconnect=120) as c:
            r.fill(c)
            order = WAYS[run % 3 :] + WAYS[: run % 3]
            for way in order:
                out[way] = r.restart(c, way)
                print(f"run {run + 1} {way:9} " + ", ".join(f"{k} {v:.3f}" for k, v in out[way].items()))
    finally:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()
        r.store.close()
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--keep", type=Path, help="work under this folder and keep it (daemon logs)")
    args = ap.parse_args()
    pool_gib, note = pick_pool_gib(args.pool_gib)
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    ratios: dict[str, list[float]] = {}
    for run in range(args.runs):
        out = one(run, pool_gib, args.keep)
        for way, figures in out.items():
            rows[way].append(figures)
        for name in ("first hit", "full"):
            for kept in ("snapshot", "scan"):
                ratio = out["warm list"][f"{name} s"] / out[kept][f"{name} s"]
                ratios.setdefault(f"{name}, warm list / {kept}", []).append(ratio)
    n = int(pool_gib * (1 << 30) * FILL) // PAGE
    print(
        f"\n{pool_gib:g} GiB pool{note}, {n} pages of 256 KiB stored (70%), file backend; "
        f"seconds from the signal; min / median / max of {args.runs} runs"
    )
    names = list(rows["snapshot"][0])
    print(f"| way | {' | '.join(names)} |")
    print("|---|" + "---|" * len(names))
    for way, outs in rows.items():
        cells = []
        for name in names:
            vals = sorted(o[name] for o in outs)
            cells.append(f"{vals[0]:.3g} / {statistics.median(vals):.3g} / {vals[-1]:.3g}")
        print(f"| {way} | {' | '.join(cells)} |")
    for name, vals in ratios.items():
        vals.sort()
        mid = statistics.median(vals)
        print(f"{name} (same run): {vals[0]:.3g} / {mid:.3g} / {vals[-1]:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
