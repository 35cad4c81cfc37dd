"""Regression for issue #21, point 5 (losses stay visible): after a full disk, acknowledged pages that the
backup gave up on left L2 and `ctl flush` still answered `flushed: true` and exited 0. The real daemon and
the real file backend, whose pages cannot be written, a small pool, and `hicached ctl` as an operator runs
it."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request

from ports import free_port

from hicached.engine.client import Client

PAGE = 64 * 1024
POOL = {"capacity": "8MiB", "slab_size": "1MiB"}  # 128 pages of 64 KiB


def wait_for(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ctl(d, *words: str) -> tuple[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", d.socket, "--json", *words],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, json.loads(out.stdout)


def counters(d) -> dict:
    return d.ctl("stats")["counters"]


def pages(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(PAGE) for _ in range(n)]


def store(d, ns: str, keys: list[str], data: list[bytes]) -> None:
    with Client(d.socket, ns, PAGE) as c:
        for i in range(0, len(keys), 16):
            assert all(c.store(keys[i : i + 16], data[i : i + 16]))


def push_out(d, n: int) -> None:
    """Stores `n` pages of another namespace, which the backend takes: the full pool evicts the least
    recently used pages for them (those no longer held for L3 among them)."""
    keys = [f"o{i}" for i in range(n)]
    data = pages(2, n)
    with Client(d.socket, "ok.ns", PAGE) as c:
        for i in range(0, n, 16):
            wait_for(lambda i=i: all(c.store(keys[i : i + 16], data[i : i + 16])), "room in the pool")


def test_pages_given_up_on_a_full_disk_then_evicted_make_flush_exit_1(daemon_factory):
    port = free_port()
    d = daemon_factory(
        {
            "pool": POOL,
            "storage": {"retry": {"base": "10ms", "attempts": 2}},
            "metrics": {"listen": f"127.0.0.1:{port}"},
        }
    )
    # Every page of namespace lost.ns fails to be written, each on its own and the call still answering (as
    # on a full disk, so the breaker stays closed): its directory under the root is a regular file.
    with open(os.path.join(d.workdir, "data", "lost.ns"), "w") as f:
        f.write("not a directory")
    keys = [f"k{i}" for i in range(20)]
    store(d, "lost.ns", keys, pages(1, 20))  # acknowledged
    wait_for(lambda: counters(d).get("backup.failed", 0) >= 20, "the backup to give up")
    # In L2 still: at risk, not lost; flushed must not be claimed.
    code, answer = ctl(d, "flush")
    assert (code, answer["flushed"], answer["not_in_l3"], answer["lost"]) == (1, False, 20, 0)
    push_out(d, 200)
    wait_for(lambda: counters(d)["backup.lost"] == 20, "the pages given up to be evicted")
    with Client(d.socket, "lost.ns", PAGE) as c:
        assert c.exists(keys) == 0  # in neither L2 nor L3
    code, answer = ctl(d, "flush")
    assert (code, answer["flushed"], answer["not_in_l3"], answer["lost"]) == (1, False, 0, 20)
    code, answer = ctl(d, "flush")  # lost since the previous flush: none
    assert (code, answer["flushed"], answer["lost"]) == (0, True, 0)
    stats = counters(d)
    assert stats["backup.lost"] == 20 and stats["backup.failed"] >= 20
    assert d.ctl("status")["backend_state"] == "attached"  # refusals page by page: the breaker stayed closed
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert re.search(r"^hicached_backup_lost_pages_total 20\.0$", body, re.M)
    assert re.search(r"^hicached_backup_failed_pages_total [1-9]", body, re.M)
    assert "acknowledged pages since start: they left L2 before reaching L3" in d.log()


def test_pages_stranded_by_an_open_breaker_then_evicted_make_flush_exit_1(daemon_factory):
    d = daemon_factory(
        {
            "pool": POOL,
            "storage": {
                "write_policy": "write_back",  # pages held in L2 until written: dirty when the backend goes
                "retry": {"base": "10ms", "attempts": 2},
                "breaker": {"failures": 2, "probe_interval": "100ms", "probe_max_interval": "200ms"},
            },
        }
    )
    keys = [f"k{i}" for i in range(20)]
    store(d, "lost.ns", keys, pages(1, 20))
    # The store goes away: its root is now a regular file, so every call fails and the breaker opens.
    root = os.path.join(d.workdir, "data")
    shutil.rmtree(root)
    with open(root, "w") as f:
        f.write("not a directory")
    code, answer = ctl(d, "flush")  # its writes fail: the breaker opens, and the 20 pages wait for a backend
    assert code == 1 and not answer["flushed"]
    wait_for(lambda: d.ctl("status")["backend_state"] == "breaker_open", "the breaker to open")
    code, answer = ctl(d, "flush")  # no backend attached: answered at once, and not with flushed: true
    assert (code, answer["flushed"], answer["not_in_l3"], answer["lost"]) == (1, False, 20, 0)
    push_out(d, 200)  # stored while detached: owed to the backend too, and evicted in turn
    lost = wait_for(lambda: counters(d)["backup.lost"] >= 20 and counters(d)["backup.lost"], "evictions")
    code, answer = ctl(d, "flush")
    assert code == 1 and not answer["flushed"] and answer["lost"] == lost
