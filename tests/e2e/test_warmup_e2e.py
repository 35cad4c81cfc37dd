"""Warmup: a restarted daemon refills L2 from L3 with what it held, pinned pages first and pinned again."""

from __future__ import annotations

import os
import time

from hicached.engine.client import Client

PAGE = 64 * 1024


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_restart_warms_l2_and_restores_pins(daemon_factory):
    d = daemon_factory({"warmup": {"enabled": True, "snapshot_interval": "0s"}})
    keys = [f"w{i:03d}" for i in range(40)]
    pages = [os.urandom(PAGE) for _ in keys]
    with Client(d.socket, "warm.ns", PAGE) as c:
        assert all(c.store(keys, pages))
        assert c.pin(keys[:5]) == 5
    assert d.ctl("flush")["flushed"]
    d.restart()
    wait_for(lambda: d.ctl("stats")["counters"].get("warmup.pages") == 40)
    stats = d.ctl("stats")
    assert stats["pool"]["pages"] == 40 and stats["pool"]["pinned"] == 5
    assert stats["counters"].get("load.pages", 0) == 0  # nobody asked: the daemon warmed itself
    with Client(d.socket, "warm.ns", PAGE) as c:
        assert c.get(keys) == pages
        assert c.stats()["counters"].get("prefetch.misses", 0) == 0


def test_warmup_is_bounded_and_survives_a_broken_list(daemon_factory):
    # A quarter of the 128 MiB pool may be warmed: 32 MiB.
    d = daemon_factory({"warmup": {"enabled": True, "snapshot_interval": "0s", "max_fraction": 0.25}})
    keys = [f"b{i:03d}" for i in range(1000)]
    with Client(d.socket, "bound.ns", PAGE) as c:
        for i in range(0, len(keys), 100):
            assert all(c.store(keys[i : i + 100], [os.urandom(PAGE)] * 100))
    d.ctl("flush")
    d.restart()
    warmed = wait_for(lambda: d.ctl("stats")["counters"].get("warmup.pages"))
    assert 0 < warmed <= (32 << 20) // PAGE
    d.stop()
    with open(os.path.join(d.workdir, "state", "warm.msgpack"), "wb") as f:
        f.write(b"\x00garbage")
    d.start()
    # The list is read by a background task once the daemon serves: wait for its verdict.
    wait_for(lambda: "ignoring the warm list" in d.log())
    with Client(d.socket, "bound.ns", PAGE) as c:
        assert c.exists(keys[:10]) == 10  # still serving, from L3
