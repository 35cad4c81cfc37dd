"""The attacks of issue #23 from an engine's uid against the daemon as a subprocess: connections that hold
frames of max_frame open (the daemon's anonymous memory stays within server.max_pending_bytes plus a small
constant, and they are closed after request_timeout), and connections that never finish their handshake
(closed within handshake_timeout, freeing their slots), while a well-behaved engine is served all along."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import threading
import time
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from other_uid import other_user, run_as, shared_workdir

from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.engine.client import Client

MiB = 1 << 20
MAX_FRAME = 8 * MiB
BOUND = 64 * MiB
ATTACKERS = 128  # the figures: 128 x 8MiB = 1GiB held without the bound
SLACK = 32 * MiB  # the "small constant": read buffers, one chunk per connection past the bound, allocator
PAGE = 64 * 1024


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory (the pool is shared memory: RssShmem, not counted here)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/PID/status")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
    for fd in fds:
        os.close(fd)
    assert data, "closed before its welcome"
    return s


def hold_frames_open(path: str, n: int, push_s: float, hold_s: float) -> dict[str, Any]:
    """`n` engine connections each say hello, then announce a frame of MAX_FRAME and send all of it but its
    last byte (as much as the daemon reads) for `push_s` seconds; then hold on for `hold_s` seconds. Returns
    how many bytes went out and how many connections the daemon closed."""
    socks = []
    for i in range(n):
        s = _connect(path)
        s.sendall(protocol.encode({"id": 1, "op": "hello", "namespace": f"attack{i}", "page_bytes": PAGE}))
        s.setblocking(False)
        socks.append(s)
    body = memoryview(bytes(MAX_FRAME))
    left = [MAX_FRAME + 3 for _ in socks]  # the 4-byte header, then MAX_FRAME - 1 bytes of the body
    header = struct.pack(">I", MAX_FRAME)
    sent = 0
    closed: set[int] = set()
    end = time.monotonic() + push_s
    while time.monotonic() < end:
        for i, s in enumerate(socks):
            if i in closed or not left[i]:
                continue
            done = MAX_FRAME + 3 - left[i]
            chunk = header[done:] if done < 4 else body[done - 4 : done - 4 + min(left[i], 1 << 20)]
            try:
                k = s.send(chunk)
            except BlockingIOError:
                continue
            except OSError:
                closed.add(i)
                continue
            left[i] -= k
            sent += k
        time.sleep(0.01)
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                while s.recv(1 << 16):
                    pass
                closed.add(i)  # read b"": the daemon closed it
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {"sent": sent, "closed": len(closed)}


class GoodEngine:
    """Stores and loads a few pages again and again through the client, and keeps every error."""

    def __init__(self, path: str) -> None:
        self.client = Client(path, "good.ns", PAGE, timeout=30)
        self.rounds = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def round(self) -> None:
        keys = [f"{self.rounds:060x}{i:04x}" for i in range(4)]
        pages = [bytes([self.rounds % 251 + i]) * PAGE for i in range(4)]
        if self.client.store(keys, pages) != [True] * 4:
            raise RuntimeError("store refused")
        bufs = [bytearray(PAGE) for _ in keys]
        if self.client.load(keys, bufs) != 4 or [bytes(b) for b in bufs] != pages:
            raise RuntimeError("pages did not come back")
        self.rounds += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except (HicachedError, RuntimeError) as e:
                self.errors.append(str(e))
            time.sleep(0.02)

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> GoodEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)
        self.client.close()


@pytest.fixture
def engine_user():
    return other_user()


@pytest.fixture
def bounds_daemon(engine_user):
    made: list[DaemonProcess] = []
    workdir = shared_workdir("hicached-bounds-")

    def make(server: dict[str, Any]) -> DaemonProcess:
        d = DaemonProcess(
            workdir,
            {
                "server": {"socket_mode": "0666", "allowed_uids": [engine_user.pw_uid], **server},
                "pool": {"capacity": "64MiB", "slab_size": "4MiB", "prefault": True},
                "storage": {"backend": "none"},
            },
        )
        made.append(d)
        return d.start()

    yield make
    for d in made:
        if d.alive:
            d.proc.kill()
            d.proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def test_frames_held_open_stay_within_max_pending_bytes(bounds_daemon, engine_user):
    """Regression for #23: 128 engine connections each hold a frame of max_frame open, one byte short. The
    daemon's RssAnon grows by at most max_pending_bytes plus a small constant (1GiB without the bound), the
    connections past their share for request_timeout are closed, and the good engine is served meanwhile."""
    d = bounds_daemon(
        {
            "max_frame": "8MiB",
            "max_pending_bytes": "64MiB",
            "request_timeout": "3s",
            "handshake_timeout": "10s",
        }
    )
    pid = d.proc.pid
    u = engine_user
    with GoodEngine(d.socket) as good:
        for _ in range(20):  # the good engine's own memory is in the baseline
            good.round()
        time.sleep(0.5)
        base = rss_anon(pid)
        out: dict[str, Any] = {}
        attack = threading.Thread(
            target=lambda: out.update(
                run_as(u.pw_uid, u.pw_gid, hold_frames_open, d.socket, ATTACKERS, 10.0, 5.0)
            )
        )
        good.start()
        attack.start()
        peak = base
        while attack.is_alive():
            peak = max(peak, rss_anon(pid))
            time.sleep(0.05)
        attack.join()
        rounds_under_attack = good.rounds
    stats = d.ctl("stats")["server"]
    grew = peak - base
    print(f"RssAnon before {base / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB: grew {grew / MiB:.1f} MiB")
    print(f"attack: {out}, server stats: {stats}")
    assert grew <= BOUND + SLACK, f"RssAnon grew by {grew / MiB:.1f} MiB, past {BOUND + SLACK} bytes"
    assert out["sent"] > BOUND, f"the attack sent only {out['sent']} bytes: it did not test the bound"
    assert stats["pending_peak"] <= BOUND + ATTACKERS * MiB, stats
    assert stats["pending_closed"] > 0 and out["closed"] >= stats["pending_closed"], (out, stats)
    assert stats["pending_bytes"] == 0 and stats["pending_paused"] == 0, stats
    assert not good.errors, good.errors[:5]
    assert rounds_under_attack > 20, "the good engine was not served during the attack"


def open_handshakes(path: str, silent: int, half: int, wait_s: float) -> dict[str, Any]:
    """`silent` connections that send nothing and `half` that send half a hello; how long each stayed open
    (from its connect to the daemon closing it), None for one still open after `wait_s` seconds."""
    hello = protocol.encode({"id": 1, "op": "hello", "namespace": "half", "page_bytes": PAGE})
    socks, opened = [], []
    for i in range(silent + half):
        opened.append(time.monotonic())
        s = _connect(path)
        if i >= silent:
            s.sendall(hello[: len(hello) // 2])
        s.setblocking(False)
        socks.append(s)
    closed_after: list[float | None] = [None] * len(socks)
    codes: set[str] = set()
    end = time.monotonic() + wait_s
    while time.monotonic() < end and None in closed_after:
        for i, s in enumerate(socks):
            if closed_after[i] is not None:
                continue
            try:
                data = s.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                for m in protocol.FrameDecoder(1 << 20).feed(data):
                    codes.add(m.get("error", {}).get("code", "?"))
                continue
            closed_after[i] = time.monotonic() - opened[i]
        time.sleep(0.02)
    for s in socks:
        s.close()
    return {"closed_after": closed_after, "codes": sorted(codes)}


def test_handshakes_that_never_finish_are_closed_in_time(bounds_daemon, engine_user):
    """Regression for #23: 100 connections that never send hello and 20 that send half of one are each
    closed within handshake_timeout plus a margin (answered `timeout`), freeing their max_connections slots;
    a good engine that said hello and idles past handshake_timeout is served meanwhile and after."""
    timeout_s, margin_s = 2.0, 5.0
    d = bounds_daemon({"handshake_timeout": "2s", "max_connections": 64})
    u = engine_user
    idle = Client(d.socket, "idle.ns", PAGE, timeout=30)
    try:
        with GoodEngine(d.socket) as good:
            good.start()
            out = run_as(u.pw_uid, u.pw_gid, open_handshakes, d.socket, 100, 20, timeout_s + margin_s + 5)
        stays = out["closed_after"]
        late = [
            round(t, 1) if t is not None else None for t in stays if t is None or t > timeout_s + margin_s
        ]
        assert not late, f"{len(late)} of 120 closed late or never: {late[:10]}"
        assert out["codes"] == ["timeout"], out["codes"]
        assert not good.errors and good.rounds > 0, good.errors[:5]
        assert idle.exists([f"{1:064x}"]) == 0  # idle since its hello, longer than handshake_timeout
        st = d.ctl("stats")["server"]
        assert st["handshake_timeouts"] >= 120 and st["connections"] == 2, st  # `idle` and this ctl
        # Their slots are free: 60 engines more than max_connections (64) would leave room for otherwise.
        engines = [Client(d.socket, "after.ns", PAGE, timeout=30) for _ in range(60)]
        try:
            assert all(c.exists([f"{2:064x}"]) == 0 for c in engines)
        finally:
            for c in engines:
                c.close()
    finally:
        idle.close()
