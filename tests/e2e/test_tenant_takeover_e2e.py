"""A takeover with [tenants]: a second `hicached serve` on the same configuration takes every tenant's pool
(its memfd and a snapshot of its pages, offsets within it) and every tenant's listening socket from the
running daemon, and serves each tenant's pages again from L2 (no L3 here); an instance whose tenants' pools
differ is refused before anything is handed over, the old one serving on; one that takes the fds and
vanishes leaves the old one serving again, every tenant's pages with it."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from daemon_proc import DaemonProcess, refused_line, wait_pid

from hicached.daemon.persist import takeover
from hicached.engine.client import Client, control

PAGE = 32 * 1024
KEYS = [f"{i:064x}" for i in range(24)]
TENANTS = ("default", "a", "b")
ARENAS = [("default", 32 << 20), ("a", 16 << 20), ("b", 16 << 20)]
SLAB = 1 << 20
CONFIG = {
    "pool": {"capacity": "64MiB", "slab_size": "1MiB"},
    "storage": {"backend": "none"},
    "warmup": {"enabled": False},
    "tenants": {
        "a": {"socket": "run/a.sock", "namespaces": ["a.*"], "capacity": "16MiB"},
        "b": {"socket": "run/b.sock", "namespaces": ["b.*"], "capacity": "16MiB"},
    },
}


def page(tenant: str, key: str) -> bytes:
    seed = (tenant + key).encode()
    return (seed * (PAGE // len(seed) + 1))[:PAGE]


def socket_of(d: DaemonProcess, tenant: str) -> str:
    """Root on the main socket is the default tenant's; a and b have sockets of their own."""
    return d.socket if tenant == "default" else os.path.join(d.workdir, "run", f"{tenant}.sock")


def ns(tenant: str) -> str:
    return "d.m" if tenant == "default" else f"{tenant}.m"


def store_all(d: DaemonProcess) -> None:
    for t in TENANTS:
        with Client(socket_of(d, t), ns(t), PAGE, timeout=30) as c:
            assert c.store(KEYS, [page(t, k) for k in KEYS]) == [True] * len(KEYS)


def hits(d: DaemonProcess, tenant: str) -> int:
    """How many of the tenant's pages come back through its socket, checking their bytes."""
    with Client(socket_of(d, tenant), ns(tenant), PAGE, timeout=30) as c:
        bufs = [bytearray(PAGE) for _ in KEYS]
        n = c.load(KEYS, bufs)
    for i in range(n):
        assert bufs[i] == page(tenant, KEYS[i]), (tenant, i)
    return n


@pytest.fixture
def daemons(tmp_path):
    started: list[DaemonProcess] = []

    def make(workdir: str, overrides: dict, log: str = "daemon.log") -> DaemonProcess:
        d = DaemonProcess(workdir, overrides)
        d.log_path = os.path.join(workdir, log)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.alive:
            d.proc.kill()
            d.proc.wait()


def test_takeover_keeps_every_tenants_pool_and_socket(daemons, tmp_path):
    old = daemons(str(tmp_path / "d"), CONFIG).start()
    store_all(old)
    new = daemons(old.workdir, CONFIG, "new.log")
    new.launch()
    assert old.proc.wait(60) == 0, old.log()
    wait_pid(old.socket, new.proc.pid)
    assert "handed over to pid" in old.log() and "3 tenants' pools" in old.log(), old.log()
    for t in TENANTS:
        assert hits(new, t) == len(KEYS), (t, new.log())  # no L3: these can only be L2's
    stats = new.ctl("stats")
    assert stats["counters"]["keep.pages"] == 3 * len(KEYS) and stats["counters"].get("keep.dropped", 0) == 0
    log = new.log()
    for t in TENANTS:
        assert f"tenant {t}'s L2 kept over the restart: {len(KEYS)} pages served again" in log, log
    # The tenants' sockets are the new instance's: a stop removes them.
    assert new.stop() == 0, new.log()
    assert not os.path.exists(socket_of(new, "a")) and not os.path.exists(socket_of(new, "b"))


def test_takeover_refused_when_a_tenants_pool_differs(daemons, tmp_path):
    """A new instance where tenant b has another capacity says why in one line and exits 1, before anything
    is handed over; the old one serves on, every tenant's pages with it."""
    old = daemons(str(tmp_path / "d"), CONFIG).start()
    store_all(old)
    new = daemons(old.workdir, CONFIG, "new.log")
    new.config["tenants"]["b"]["capacity"] = "8MiB"
    new.config_path = os.path.join(old.workdir, "new.toml")
    new.write_config()
    line, stderr = refused_line(new)
    assert "refused the takeover: the tenants' pools are default 32.0MiB, a 16.0MiB, b 16.0MiB in the " in (
        line
    ), line
    assert "default 40.0MiB, a 16.0MiB, b 8.0MiB in the new instance" in line, line
    assert "L2 pool of" not in stderr, "no pool was allocated"
    assert old.alive and control(old.socket, "status")["pid"] == old.proc.pid
    for t in TENANTS:
        assert hits(old, t) == len(KEYS), t


def test_new_instance_gone_after_the_hand_over_of_tenants_pools(daemons, tmp_path):
    """A new instance that takes every tenant's fds and goes away without serving: the old one serves again
    in its own process (same pid), from the same sockets and every tenant's pool."""
    old = daemons(str(tmp_path / "d"), CONFIG).start()
    store_all(old)

    async def take_and_vanish() -> list[str]:
        handed = await takeover.request(old.socket, 64 << 20, SLAB, ARENAS)
        for _, pool_fd, index_fd in handed.arenas:
            os.close(pool_fd)
            os.close(index_fd)
        for s in [handed.listen, *handed.tenant_listen]:
            s.close()
        handed.sock.close()
        return [name for name, _, _ in handed.arenas]

    assert asyncio.run(take_and_vanish()) == ["default", "a", "b"]
    deadline = time.monotonic() + 60
    while "tenant b's L2 kept over the restart" not in old.log():
        assert old.alive and time.monotonic() < deadline, old.log()
        time.sleep(0.05)
    wait_pid(old.socket, old.proc.pid)
    assert "did not take over after the hand-over" in old.log()
    for t in TENANTS:
        assert hits(old, t) == len(KEYS), (t, old.log())
    assert old.stop() == 0, old.log()
