"""Daemons of several nodes share one bounded file root (one storage.file.root on NFS, Lustre, 3FS): the
bound, storage.file.max_bytes, holds for the tree whatever the number of daemons writing to it (#29). Real
daemons (subprocesses) on one directory; the tree is counted from outside, file by file.

Regressions: each daemon counted only its own writes between its scans, so n daemons let the tree reach
about n x max_bytes; and two daemons lowering max_bytes by a reload at the same moment each removed the
whole excess: an 800-page root fell to 0 where the low watermark was 230 pages."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess, to_toml
from hicached.connectors import header
from page_life import wait_for

from hicached import Client

PAGE = 16 << 10
FILE = header.HEADER_SIZE + PAGE  # bytes of one page file
NS = "fleet.bound"
REFRESH_S = 0.1  # storage.file.fleet_refresh
# The stated tolerance: the tree stays within max_bytes, plus what the fleet writes in two refresh periods
# (a daemon publishes its count once a period, the others read it once a period) and one janitor run (its
# wake-up, scan and removals: RUN_S, generous for a loaded 2-CPU machine), plus 10 % of max_bytes for the
# rest (a backup call's pages are counted when the call ends; the sampler looks every 10 ms).
RUN_S = 0.7
BATCH = 8


def bounded(root: Path, max_pages: int, low: float) -> dict[str, Any]:
    return {
        "storage": {
            "backend": "file",
            "file": {
                "root": str(root),
                "max_bytes": max_pages * FILE,
                "low_watermark": low,
                "fleet_refresh": f"{int(REFRESH_S * 1000)}ms",
                "janitor_interval": "5s",
            },
            "backup_defer": "0s",  # pages reach the tree as they are stored: the load is what the test says
            "breaker": {"stall_timeout": 0, "slow_factor": 0},
        }
    }


def tree_pages(root: Path) -> int:
    """The page files under root/namespace/ab/cd, counted from outside (temporary files, trash trees and the
    fleet's .fleet~ left out); one removed while listed is not counted."""
    n = 0
    for ns in _dirs(str(root)):
        for a in _dirs(ns):
            for shard in _dirs(a):
                try:
                    with os.scandir(shard) as entries:
                        n += sum(1 for e in entries if not e.name.startswith("."))
                except FileNotFoundError:
                    continue
    return n


def _dirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


class Sampler:
    """Counts the tree every few milliseconds on a thread of its own; `peak`: the most pages seen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, tree_pages(self.root))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class Writer:
    """An engine of one node storing new pages, BATCH at a time, `rate` pages a second at most."""

    def __init__(self, d: DaemonProcess, tag: str, rate: float) -> None:
        self.d, self.tag, self.rate = d, tag, rate
        self.stored = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = os.urandom(PAGE)
        with Client(self.d.socket, NS, PAGE, timeout=30) as c:
            start = time.monotonic()
            i = 0
            while not self._stop.is_set():
                keys = [hashlib.sha256(f"{self.tag}-{i + j}".encode()).hexdigest() for j in range(BATCH)]
                ok = c.store(keys, [body] * BATCH)
                self.stored += ok.count(True)
                self.refused += ok.count(False)
                i += BATCH
                self._stop.wait(max(0.0, start + i / self.rate - time.monotonic()))  # paced, not a burst

    def start(self) -> Writer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def backend(d: DaemonProcess) -> tuple[dict, dict]:
    stats = d.ctl("stats")
    return stats["backend_counters"], stats["backend_info"]


MAX_PAGES = 900
LOW = 0.5
RATE = 400.0  # pages a second, each node, at most (about 330 on a loaded 2-CPU machine)
LOAD_S = 3.5  # each daemon writes past max_bytes on its own: n daemons counting alone reach n x max_bytes


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_the_bound_holds_for_the_tree_whatever_the_number_of_daemons(
    daemon_factory, tmp_path: Path, nodes: int
) -> None:
    root = tmp_path / "shared"
    daemons = [
        daemon_factory(bounded(root, MAX_PAGES, LOW), start=False, name=f"node{i}") for i in range(nodes)
    ]
    for d in daemons:  # started side by side: a daemon takes about a second to come up
        d.launch()
    for d in daemons:
        d.wait_up(30)
    with Sampler(root) as sampler:
        began = time.monotonic()
        writers = [Writer(d, f"node{i}", RATE).start() for i, d in enumerate(daemons)]
        time.sleep(LOAD_S)  # the length of the load, not an ordering: the sampler watches throughout
        for w in writers:
            w.stop()
        elapsed = time.monotonic() - began
        for d in daemons:
            assert d.ctl("flush")["flushed"]
        # The janitors catch up with the last writes within a refresh and a run.
        wait_for(lambda: tree_pages(root) <= MAX_PAGES, "the tree back within the bound")
    stored = sum(w.stored for w in writers)
    rate = stored / elapsed
    tolerance = 0.1 * MAX_PAGES + rate * (2 * REFRESH_S + RUN_S)
    final = tree_pages(root)
    counters = [backend(d)[0] for d in daemons]
    runs = [c.get("janitor.runs", 0) for c in counters]
    skipped = [c.get("janitor.skipped_locked", 0) for c in counters]
    allowed = MAX_PAGES + tolerance
    print(
        f"{nodes} daemon(s): {stored} pages stored in {elapsed:.1f}s ({rate:.0f}/s); tree peak {sampler.peak}"
        f" pages = {sampler.peak / MAX_PAGES:.2f} x max_bytes ({MAX_PAGES}), allowed {allowed:.0f}; after the"
        f" load {final} (low watermark {int(MAX_PAGES * LOW)}); janitor runs {runs}, skipped {skipped}"
    )
    assert not any(w.refused for w in writers)
    assert stored > MAX_PAGES  # the bound was passed
    assert sampler.peak <= allowed, (sampler.peak, allowed)
    assert int(MAX_PAGES * LOW) - 1 <= final <= MAX_PAGES
    assert sum(c.get("evictions", 0) for c in counters) + final == stored  # every page stored, once


def test_two_daemons_lowering_the_bound_at_once_leave_the_low_watermark(
    daemon_factory, tmp_path: Path
) -> None:
    """Regression (#29): both daemons reload a lower max_bytes at the same moment (SIGHUP), over a root of
    800 pages; the tree ends at the new low watermark, 230 pages, not 0."""
    root = tmp_path / "shared"
    a, b = (daemon_factory(bounded(root, 4000, 0.9), name=name) for name in ("a", "b"))
    body = os.urandom(PAGE)
    keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(800)]
    with Client(a.socket, NS, PAGE, timeout=30) as c:
        for i in range(0, len(keys), 100):
            assert c.store(keys[i : i + 100], [body] * 100) == [True] * 100
    assert a.ctl("flush")["flushed"]
    assert tree_pages(root) == 800
    for d in (a, b):
        d.config["storage"]["file"]["max_bytes"] = 256 * FILE  # the low watermark: 0.9 x 256 = 230.4 pages
        d.write_config(to_toml(d.config))
    for d in (a, b):
        d.proc.send_signal(signal.SIGHUP)
    for d in (a, b):
        wait_for(lambda d=d: d.ctl("status")["reloads"]["ok"] == 1, "the reload")

    def evictions() -> int:
        return sum(backend(d)[0].get("evictions", 0) for d in (a, b))

    # Done when the runs that removed pages have all reported them.
    wait_for(lambda: evictions() >= 800 - 256 and evictions() + tree_pages(root) == 800, "the janitors' runs")
    left = tree_pages(root)
    print(f"800 pages, max_bytes lowered to 256 by both daemons at once: {left} left (low watermark 230)")
    assert 229 <= left <= 231, left
    # And both estimates follow the tree: exactly once the runs' scans reach them, nearly always. Not where
    # a run's snapshot of the ledgers and its scan straddle a put or delete (a file gone before the scan
    # whose removal its daemon counts after the snapshot): caught once with these figures, the new
    # connector's probe, 303 bytes low, until the next scan. It must then be within 10% of the bound.
    for d in (a, b):
        try:
            wait_for(lambda d=d: backend(d)[1]["bound"]["estimate"] == left * FILE, "the estimate")
        except AssertionError:
            for x in (a, b):
                print(x.workdir, backend(x)[1]["bound"], backend(x)[0], tree_pages(root) * FILE)
            print((root / ".fleet~" / "scan").read_text())
            for name in os.listdir(root / ".fleet~" / "nodes"):
                print(name, (root / ".fleet~" / "nodes" / name).read_text())
            off = abs(backend(d)[1]["bound"]["estimate"] - left * FILE)
            assert off <= 0.1 * 256 * FILE, (off, FILE)
