"""A daemon under steady engine traffic (steady_load, in processes of their own) through an L3 fault: the
fault starts, lasts, clears; what each call did and when the daemon detached and re-attached the backend.
Shared by tests/e2e/test_stall_e2e.py and bench/bench_stall.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess

SUPPORT = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class FaultRun:
    calls: list[dict]  # every call of every client (steady_load's records)
    fault_at: float  # wall clock
    cleared_at: float
    detached_at: float | None  # first status seen with the backend not attached, after the fault began
    reattached_at: float | None  # first status seen attached again, after the fault cleared
    states: list[tuple[float, str]]  # (wall clock, backend state) as polled

    @property
    def detach_s(self) -> float | None:
        return None if self.detached_at is None else self.detached_at - self.fault_at

    def stores(self, since: float = 0.0, until: float = float("inf")) -> list[dict]:
        return [c for c in self.calls if c["op"] == "store" and since <= c["t"] < until]

    def false_share(self, since: float = 0.0, until: float = float("inf")) -> float:
        """Of the pages the stores asked for in [since, until), the share not taken."""
        calls = self.stores(since, until)
        asked = sum(c["n"] for c in calls)
        return 0.0 if not asked else 1 - sum(c["ok"] for c in calls) / asked

    def acked(self, since: float = 0.0, until: float = float("inf")) -> list[str]:
        return [k for c in self.stores(since, until) for k in c.get("keys", [])]

    def stored_mib_s(self, since: float, until: float) -> float:
        """Page bytes taken per second by stores that began in [since, until)."""
        return sum(c["ok"] for c in self.stores(since, until)) * self.page_bytes / (until - since) / 2**20

    page_bytes: int = 0


def run(
    d: DaemonProcess,
    tmp_path: Path,
    namespace: str,
    page_bytes: int,
    fault: Callable[[], None],
    clear: Callable[[], None],
    clients: int = 4,
    before_s: float = 2.0,
    fault_s: float = 5.0,
    after_s: float = 4.0,
    period_s: float = 0.02,
    batch: int = 4,
) -> FaultRun:
    """Runs `clients` steady_load processes (each storing `batch` pages and loading back as many every
    period_s) for before_s + fault_s + after_s, with `fault()` called after before_s and `clear()` fault_s
    later; polls the backend's state meanwhile."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}
    total = before_s + fault_s + after_s
    procs = []
    for i in range(clients):
        out = tmp_path / f"load{i}.jsonl"
        argv = [
            sys.executable,
            "-m",
            "steady_load",
            d.socket,
            namespace,
            str(page_bytes),
            str(total),
            str(out),
        ]
        argv += [str(period_s), str(batch)]
        procs.append((subprocess.Popen(argv, env=env), out))
    states: list[tuple[float, str]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                states.append((time.time(), d.ctl("status")["backend_state"]))
            except Exception:  # noqa: BLE001 - a status that did not answer is just not a sample
                pass
            stop.wait(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(before_s)
        fault_at = time.time()
        fault()
        time.sleep(fault_s)
        cleared_at = time.time()
        clear()
        for proc, _ in procs:
            assert proc.wait(total + 120) == 0, f"a client failed:\n{d.log()[-4000:]}"
        deadline = time.monotonic() + 60  # the probe backs off: up to storage.breaker.probe_max_interval
        while time.monotonic() < deadline and not [
            s for t, s in states if t > cleared_at and s == "attached"
        ]:
            time.sleep(0.1)
    finally:
        stop.set()
        poller.join()
    calls = []
    for _, out in procs:
        records = [json.loads(line) for line in out.read_text().splitlines() if line]
        calls += [c for c in records if c["op"] != "end"]  # the last says how often the client reconnected
    detached = [t for t, s in states if t >= fault_at and s != "attached"]
    back = [t for t, s in states if t >= cleared_at and s == "attached"]
    return FaultRun(
        calls,
        fault_at,
        cleared_at,
        detached[0] if detached else None,
        back[0] if back else None,
        states,
        page_bytes,
    )
