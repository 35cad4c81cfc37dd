"""Where a store call's time goes, on one clock for the client and the daemon: the client's copy, the time
from the client writing a request to the daemon reading it (the daemon's wake-up), the daemon's handling,
and the time from its answer to the client having it (the client's wake-up).

Usage: python bench/store_timeline.py [--page-kib 256] [--reps 3] [--calls 12]

It starts a write-back daemon (its request handling timed by patching hicached.server.Connection in the
daemon process only), stores 256 MiB a repetition in calls of 32 pages as bench_core.py does, and prints
the first --calls calls of the last repetition, then the medians and 90th percentiles over every call.
CLOCK_MONOTONIC (time.perf_counter) is one clock for both processes. Not a benchmark of speed: the
patching costs a few microseconds a request.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def serve(log_path: str, argv: list[str]) -> int:
    """The daemon, with (received, op, keys, answered) recorded for every request and written at exit."""
    import atexit

    import hicached.daemon.server.listener as srv
    from hicached.cli import main

    log: list[tuple[float, str, int, float]] = []
    dispatch, send = srv.Connection._dispatch, srv.Connection._send

    def timed_dispatch(self, msg):  # type: ignore[no-untyped-def]
        if isinstance(msg, dict):
            n = len(msg.get("keys") or ()) or msg.get("n", 0)
            self.__dict__.setdefault("_seen", {})[msg.get("id")] = (time.perf_counter(), msg.get("op"), n)
        dispatch(self, msg)

    def timed_send(self, message):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        send(self, message)
        seen = self.__dict__.get("_seen", {}).pop(message.get("id"), None)
        if seen is not None:  # (read, op, keys, answer ready, answer written)
            log.append((*seen, t, time.perf_counter()))

    srv.Connection._dispatch, srv.Connection._send = timed_dispatch, timed_send
    atexit.register(lambda: Path(log_path).write_text(json.dumps(log)))
    sys.argv = ["hicached", *argv]
    return main()


def run(a: argparse.Namespace) -> None:
    import bench_core as bc
    import benchlib
    import numpy as np

    import hicached.engine.ops as ops_mod
    import hicached.engine.wire as wire_mod
    from hicached import Client

    work = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="hicached-bench-"))
    (work / "data").mkdir()
    daemon_log = work / "requests.json"
    popen = subprocess.Popen

    def wrapped(cmd, *args, **kw):  # type: ignore[no-untyped-def]
        if cmd[1:3] == ["-m", "hicached"]:
            cmd = [cmd[0], __file__, "--serve", str(daemon_log), *cmd[3:]]
        return popen(cmd, *args, **kw)

    benchlib.subprocess.Popen = wrapped
    events: list[tuple[str, float, float]] = []  # (what, start, end) on the client's side

    def timing(name: str, fn):  # type: ignore[no-untyped-def]
        def timed(*args, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                events.append((name, t0, time.perf_counter()))

        return timed

    wire_mod._Wire._write = timing("write", wire_mod._Wire._write)
    wire_mod._Wire._await = timing("wait", wire_mod._Wire._await)
    ops_mod._Ops._copy = timing("copy", ops_mod._Ops._copy)

    p = a.page_kib << 10
    n = (256 << 20) // p
    rng = np.random.default_rng(1)
    srcs = [rng.bytes(p) for _ in range(bc.BATCH)]
    pages = [srcs[i % bc.BATCH] for i in range(n)]
    calls: list[tuple[float, float]] = []
    try:
        with bc.Daemon(work, 1024 << 20, "write_back") as d, Client(d.sock, "timeline", p) as c:
            for w in range(5):  # every slot of the pool faulted in by this client, then clean
                keys = bc.page_keys(f"warm{w}", n)
                bc.batched(c.store, keys, pages)
                d.flush()
                bc.drop_files(work / "data", "timeline", keys)
            events.clear()
            for r in range(a.reps):
                keys = bc.page_keys(f"rep{r}", n)
                for i in range(0, n, bc.BATCH):
                    t0 = time.perf_counter()
                    c.store(keys[i : i + bc.BATCH], pages[i : i + bc.BATCH])
                    calls.append((t0, time.perf_counter()))
                d.flush()
                bc.drop_files(work / "data", "timeline", keys)
        requests = [tuple(x) for x in json.loads(daemon_log.read_text())]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(a, bc.BATCH, calls, events, requests)


def report(a: argparse.Namespace, batch: int, calls: list, events: list, requests: list) -> None:
    rows = []
    for t0, t1 in calls:
        mine = [e for e in events if t0 <= e[1] <= t1]
        writes = [e[2] for e in mine if e[0] == "write"]
        reqs = [r for r in requests if t0 <= r[0] <= t1 and r[1] in ("put", "alloc", "commit", "reserve")]
        if not writes or not reqs:
            continue
        # Each request batch the daemon read: the gap from the client's last write before it.
        wake = [r[0] - max((w for w in writes if w <= r[0]), default=r[0]) for r in reqs]
        rows.append(
            {
                "call": t1 - t0,
                "copy": sum(e[2] - e[1] for e in mine if e[0] == "copy"),
                "wait": sum(e[2] - e[1] for e in mine if e[0] == "wait"),
                "daemon_wake": max(wake),
                "daemon_work": sum(r[3] - r[0] for r in reqs),
                "daemon_write": max(r[4] - r[3] for r in reqs),
                "client_write": max(e[2] - e[1] for e in mine if e[0] == "write"),
                "client_wake": t1 - max(r[3] for r in reqs),
                "reqs": reqs,
                "t0": t0,
            }
        )
    us = 1e6
    print(f"pages of {a.page_kib} KiB, {batch} a call; times in us from the call's start")
    print("  call   copy   wait | requests as the daemon read them: op(keys or slots) read-answered")
    for row in rows[-(len(rows) // a.reps) :][: a.calls]:
        reqs = "  ".join(
            f"{op}({k}) {(rd - row['t0']) * us:.0f}-{(an - row['t0']) * us:.0f}"
            for rd, op, k, an, _ in row["reqs"]
        )
        print(f"{row['call'] * us:6.0f} {row['copy'] * us:6.0f} {row['wait'] * us:6.0f} | {reqs}")
    print(f"\nover {len(rows)} calls        median      p90")
    for name, what in (
        ("call", "the whole call"),
        ("copy", "the client's copy into the pool"),
        ("wait", "the client waiting for answers"),
        ("daemon_wake", "longest write -> the daemon reading it"),
        ("daemon_work", "the daemon handling the call's requests"),
        ("daemon_write", "the daemon's longest write(2) of an answer"),
        ("client_write", "the client's longest write(2) of requests"),
        ("client_wake", "the daemon's last answer -> the call returning"),
    ):
        v = sorted(r[name] for r in rows)
        print(f"  {what:48s} {statistics.median(v) * us:7.0f}  {v[int(0.9 * (len(v) - 1))] * us:7.0f}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=12, help="calls of the last repetition printed one by one")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
