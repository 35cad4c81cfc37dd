"""Takeover without systemd (issue #19, point 3): a second `hicached serve` on the same socket takes the
socket, L2 and its index from the running daemon, with engines running; refusals leave the old one serving."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from churn import page_of
from daemon_proc import DaemonProcess, refused_line, wait_pid
from other_uid import other_user, run_as, shared_workdir

from hicached.common.errors import HicachedError
from hicached.daemon.persist import takeover
from hicached.engine.client import Client, control

PAGE = 32 * 1024
SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")
# Named in every test's configuration, not taken from daemon_proc.BASE_CONFIG: a test that changes its own
# daemon's config in place can change the shared default for the tests after it.
POOL = {"capacity": "128MiB", "slab_size": "4MiB"}
CAP, SLAB = 128 << 20, 4 << 20


def _successor(old: DaemonProcess, name: str = "new.log") -> DaemonProcess:
    """A second instance on the old one's configuration (same socket), logging apart."""
    new = DaemonProcess(old.workdir, old.config)
    new.log_path = os.path.join(old.workdir, name)
    return new


class Probe(threading.Thread):
    """Connects to the socket again and again while it runs: a `status` answered, a connection dropped (an
    instance handing over), or the socket unreachable (nothing listening: what must never happen)."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.answered: set[int] = set()  # pids that answered
        self.dropped = 0
        self.unreachable: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.answered.add(control(self.path, "status", timeout=60.0)["pid"])
            except HicachedError as e:
                if "no hicached daemon is listening" in str(e) or "permissions" in str(e):
                    self.unreachable.append(str(e))
                else:
                    self.dropped += 1
            time.sleep(0.005)


@pytest.fixture
def daemons(tmp_path):
    started: list[DaemonProcess] = []

    def make(overrides: dict | None = None, workdir: str | None = None) -> DaemonProcess:
        d = DaemonProcess(workdir or str(tmp_path / "d"), overrides)
        started.append(d)
        return d.start()

    make.started = started
    yield make
    for d in started:
        if d.alive:
            d.proc.kill()
            d.proc.wait()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_takeover_under_load(daemons, tmp_path, policy):
    """Four engine processes store and load while a new instance takes over: 0 wrong bytes, no call failed
    but by a connection drop (and was answered after it), every page acknowledged is a hit after from L2, the
    old process exits 0, and the socket answers throughout."""
    # A pool that holds every page the engines store: a hit after the takeover is one from before it.
    old = daemons({"storage": {"write_policy": policy}, "pool": {**POOL, "capacity": "256MiB"}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}
    procs = []
    for i in range(4):
        ns, out = f"take.e{i}", str(tmp_path / f"load{i}.jsonl")
        argv = [sys.executable, "-m", "steady_load", old.socket, ns, str(PAGE), "12", out, "0.05", "4"]
        procs.append((subprocess.Popen(argv, env=env), ns, out))
    deadline = time.monotonic() + 60
    while True:  # take over once every engine has stored a while (they start slowly on a busy machine)
        stats = old.ctl("stats")
        if len(stats["namespaces"]) == 4 and stats["counters"].get("store.pages", 0) >= 160:
            break
        assert time.monotonic() < deadline, stats["counters"]
        time.sleep(0.1)
    old_pid = old.proc.pid
    probe = Probe(old.socket)
    probe.start()
    time.sleep(0.3)
    new = _successor(old)
    daemons.started.append(new)
    handed_at = time.time()
    new.launch()
    assert old.proc.wait(60) == 0, old.log()
    wait_pid(old.socket, new.proc.pid)
    time.sleep(0.5)
    probe.stop.set()
    probe.join(70)
    for p, _, _ in procs:
        assert p.wait(120) == 0
    assert probe.unreachable == [], probe.unreachable
    assert {old_pid, new.proc.pid} <= probe.answered, "both instances answered the probe"
    acked: dict[str, list[str]] = {}
    all_calls: list[dict] = []
    for _, ns, out in procs:
        with open(out) as f:
            *calls, end = [json.loads(line) for line in f]
        # The engine's Client reconnected by itself when the old instance closed its connection, and every
        # call was answered: none failed, none was refused.
        assert end["op"] == "end" and end["reconnects"] >= 1, end
        assert [c for c in calls if "error" in c] == []
        assert [c for c in calls if c["ok"] != c["n"]] == [], (
            "every store acknowledged, every load a full hit"
        )
        assert sum(c.get("wrong", 0) for c in calls) == 0
        acked[ns] = [k for c in calls if c["op"] == "store" for k in c["keys"]]
        all_calls += calls
    # Engines stored on both sides of the takeover (a Client that reconnects by itself shows no drop here).
    assert new.ctl("stats")["counters"].get("store.pages", 0) > 0, "engines stored after the takeover"
    first, last = min(c["t"] for c in all_calls), max(c["t"] for c in all_calls)
    assert first < handed_at < last, "the engines' traffic spanned the takeover"
    assert "handed over to pid" in old.log(), old.log()
    log = new.log()
    assert "taking over from pid" in log and "0 did not verify" in log, log
    for ns, keys in acked.items():
        with Client(new.socket, ns, PAGE) as c:
            got = c.get(keys)
            assert len(got) == len(keys), f"{ns}: {len(got)} of {len(keys)} acknowledged pages are hits"
            assert all(g == page_of(k, PAGE) for g, k in zip(got, keys, strict=True))
    stats = new.ctl("stats")
    assert stats["pool"].get("evictions", 0) == 0
    assert stats["counters"].get("prefetch.pages", 0) == 0, "every hit came from L2, none from L3"
    assert stats["counters"]["keep.pages"] > 0
    flushed = new.ctl("flush")
    assert flushed["flushed"] and flushed["lost"] == 0, flushed
    assert new.stop() == 0, new.log()
    assert not os.path.exists(new.socket), "the new instance removes the socket it took over at its stop"


def test_takeover_refused_for_another_capacity(daemons, tmp_path):
    """A new instance with another pool.capacity says why in one line and exits 1; the old one serves on,
    with its pages."""
    old = daemons({"pool": POOL})
    keys = [f"k{i}" for i in range(16)]
    with Client(old.socket, "take.cap", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)
    new = DaemonProcess(
        str(tmp_path / "n"), {"server": {"socket": old.socket}, "pool": {"capacity": "64MiB"}}
    )
    line, stderr = refused_line(new)
    assert (
        "refused the takeover: pool.capacity is 128.0MiB in the running daemon and 64.0MiB in the new "
        "instance" in line
    )
    assert "serves on" in line
    assert "L2 pool of" not in stderr, "no pool was allocated"
    assert old.alive and control(old.socket, "status")["pid"] == old.proc.pid
    assert "refused a takeover from pid" in old.log()
    with Client(old.socket, "take.cap", PAGE) as c:
        assert c.get(keys) == [page_of(k, PAGE) for k in keys]
    # The endpoint still offers a takeover: one that fits succeeds.
    new = _successor(old)
    daemons.started.append(new)
    new.launch()
    assert old.proc.wait(60) == 0, old.log()
    wait_pid(old.socket, new.proc.pid)
    with Client(new.socket, "take.cap", PAGE) as c:
        assert c.get(keys) == [page_of(k, PAGE) for k in keys]


def _ask_for_a_takeover(socket_path: str) -> tuple[int, str]:
    """In the child of another uid: its pid, and what the daemon answered its takeover request."""
    try:
        asyncio.run(takeover.request(socket_path, CAP, SLAB))
    except takeover.TakeoverError as e:
        return os.getpid(), str(e)
    return os.getpid(), "taken over"


def test_another_uid_cannot_take_over(daemons):
    """A process of another uid reaches the endpoint (the socket's mode lets it in) and is refused by its
    SO_PEERCRED; the daemon serves on."""
    user = other_user()
    workdir = shared_workdir("hicached-takeover-")
    try:
        old = daemons({"server": {"socket_mode": "0666"}, "pool": POOL}, workdir=workdir)
        pid, msg = run_as(user.pw_uid, user.pw_gid, _ask_for_a_takeover, old.socket)
        assert f"uid {user.pw_uid} may not take over this daemon" in msg, msg
        assert old.alive and control(old.socket, "status")["pid"] == old.proc.pid
        assert f"refused a takeover from pid {pid}: uid {user.pw_uid} may not take over" in old.log()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_new_instance_gone_after_the_hand_over(daemons):
    """A new instance that takes the fds and goes away without serving: the old one serves again in its own
    process (same pid), from the same socket and L2; nothing acknowledged is lost under write-back."""
    old = daemons({"storage": {"write_policy": "write_back"}, "pool": POOL})
    keys = [f"k{i}" for i in range(24)]
    with Client(old.socket, "take.gone", PAGE) as c:
        assert c.store(keys, [page_of(k, PAGE) for k in keys]) == [True] * len(keys)

    async def take_and_vanish() -> int:
        handed = await takeover.request(old.socket, CAP, SLAB)
        for _, pool_fd, index_fd in handed.arenas:
            os.close(pool_fd)
            os.close(index_fd)
        handed.listen.close()
        handed.sock.close()
        return handed.pages

    assert asyncio.run(take_and_vanish()) == 24
    deadline = time.monotonic() + 60
    while "24 pages served again" not in old.log():
        assert old.alive and time.monotonic() < deadline, old.log()
        time.sleep(0.05)
    wait_pid(old.socket, old.proc.pid)
    assert "did not take over after the hand-over" in old.log()
    with Client(old.socket, "take.gone", PAGE) as c:
        assert c.get(keys) == [page_of(k, PAGE) for k in keys]
    flushed = old.ctl("flush")
    assert flushed["flushed"] and flushed["lost"] == 0 and flushed["not_in_l3"] == 0, flushed
    assert old.stop() == 0, old.log()
