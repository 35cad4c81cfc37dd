"""Tenants kept apart by the kernel (issue #23, points 2 and 5): each tenant is handed a pool memfd of its
own, so a process of tenant B that writes over everything it can map never changes tenant A's pages. Real
processes of another uid against the daemon as a subprocess; the same attack without tenants (both uids in
allowed_uids, one pool) is run first, and does reach A's pages: what the tenants' pools prevent."""

from __future__ import annotations

import mmap
import os
import re
import shutil
import socket
import urllib.request

import pytest
from daemon_proc import DaemonProcess
from other_uid import other_user, run_as, shared_workdir
from ports import free_port

from hicached.common import protocol
from hicached.common.errors import UNAUTHORIZED, HicachedError
from hicached.engine.client import Client

PAGE = 64 * 1024
KEYS = [f"{i:064x}" for i in range(32)]


def payload(i: int) -> bytes:
    return bytes([i + 1]) * PAGE


def overwrite_everything(path: str) -> dict:
    """As a hostile engine: connects, takes the pool fd from the welcome, and writes 0xEE over every byte
    of it, through its own mapping and through a fresh open of /proc/self/fd (which might have given more
    rights); then tries to open tenant A's namespace with the public client."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    welcome = protocol.FrameDecoder(1 << 20).feed(data)[0]
    out: dict = {"pool_bytes": welcome["pool_bytes"], "fds": len(fds), "written": 0}
    for fd in fds:
        size = os.fstat(fd).st_size
        out["fd_size"] = size
        with mmap.mmap(fd, size) as m:
            m[:] = b"\xee" * size
            out["written"] += size
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with mmap.mmap(again, os.fstat(again).st_size) as m:
                m[:] = b"\xee" * len(m)
        finally:
            os.close(again)
        os.close(fd)
    sock.close()
    try:
        with Client(path, "a.model", PAGE, timeout=30, reconnect=0) as c:
            n = c.exists(KEYS)
        out["open_a"] = f"opened, {n} found"
    except HicachedError as e:
        out["open_a"] = e.code
    with Client(path, "b.model", PAGE, timeout=30, reconnect=0) as c:
        st, status = c.stats(), c.status()
    out["stats"] = {
        "pool": st.get("pool", {}).get("capacity_bytes"),
        "slab": st.get("pool", {}).get("slabs", {}).get("slab_bytes"),
        "counters": "counters" in st,
        "namespaces": sorted(st.get("namespaces", {})),
        "status_capacity": status.get("capacity_bytes"),
    }
    return out


def run_attack(tenants: bool) -> tuple[dict, int]:
    """Root stores KEYS in namespace a.model; the other uid attacks; returns its report and how many of
    root's pages then read back wrong (a miss is not wrong)."""
    u = other_user()
    workdir = shared_workdir("hicached-tenant-pools-")
    server = {"socket_mode": "0666", "allowed_uids": [] if tenants else [u.pw_uid]}
    cfg: dict = {
        "server": server,
        "pool": {"capacity": "64MiB", "slab_size": "1MiB"},
        "storage": {"backend": "none"},
    }
    if tenants:
        cfg["tenants"] = {
            "a": {"uids": [0], "namespaces": ["a.*"], "capacity": "16MiB"},
            "b": {"uids": [u.pw_uid], "namespaces": ["b.*"], "capacity": "16MiB"},
        }
    d = DaemonProcess(workdir, cfg)
    d.start()
    try:
        with Client(d.socket, "a.model", PAGE, timeout=30) as c:
            assert c.store(KEYS, [payload(i) for i in range(len(KEYS))]) == [True] * len(KEYS)
        report = run_as(u.pw_uid, u.pw_gid, overwrite_everything, d.socket)
        wrong = 0
        with Client(d.socket, "a.model", PAGE, timeout=30) as c:
            bufs = [bytearray(PAGE) for _ in KEYS]
            n = c.load(KEYS, bufs)
            wrong = sum(1 for i in range(n) if bufs[i] != payload(i))
        assert d.alive
        return report, wrong
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_without_tenants_one_engine_rewrites_anothers_pages():
    """The baseline: one pool for every engine; what the issue found (32 of 32 wrong)."""
    report, wrong = run_attack(tenants=False)
    assert report["pool_bytes"] == 64 << 20 and report["written"] >= 64 << 20
    assert wrong == len(KEYS), (report, wrong)


def test_a_tenant_that_writes_over_all_it_can_map_never_reaches_another_tenants_pages():
    report, wrong = run_attack(tenants=True)
    # B was handed its own 16 MiB, not the pool, and wrote over all of it.
    assert report["pool_bytes"] == 16 << 20 and report["fd_size"] == 16 << 20, report
    assert report["written"] == 16 << 20
    assert report["open_a"] == UNAUTHORIZED, report
    assert wrong == 0, report
    # What B sees of the daemon is its own pool: not the whole pool's figures nor the daemon's counters.
    assert report["stats"] == {
        "pool": 16 << 20,
        "slab": 1 << 20,
        "counters": False,
        "namespaces": ["b.model"],
        "status_capacity": 16 << 20,
    }, report


@pytest.mark.parametrize("tenant", ["a", "default"])
def test_the_welcome_hands_each_tenant_its_own_pool(tenant):
    """The fd each peer gets is its tenant's arena: root is in a (by uid) or, without that table entry, in
    the default tenant, whose pool is what the tenants leave of pool.capacity."""
    workdir = shared_workdir("hicached-tenant-pools-")
    tenants = {"b": {"uids": [4242], "namespaces": ["b.*"], "capacity": "8MiB"}}
    if tenant == "a":
        tenants["a"] = {"uids": [0], "namespaces": ["a.*"], "capacity": "4MiB"}
    port = free_port()
    d = DaemonProcess(
        workdir,
        {
            "pool": {"capacity": "32MiB", "slab_size": "1MiB"},
            "storage": {"backend": "none"},
            "metrics": {"listen": f"127.0.0.1:{port}"},
            "tenants": tenants,
        },
    )
    d.start()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(d.socket)
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        welcome = protocol.FrameDecoder(1 << 20).feed(data)[0]
        sizes = [os.fstat(fd).st_size for fd in fds]
        for fd in fds:
            os.close(fd)
        sock.close()
        want = 4 << 20 if tenant == "a" else (32 - 8) << 20
        assert welcome["pool_bytes"] == want and sizes == [want]
        # And the pages root stores land in, and come back from, that pool.
        ns = "a.m" if tenant == "a" else "elsewhere"
        with Client(d.socket, ns, PAGE, timeout=30) as c:
            assert c.store(KEYS[:4], [payload(i) for i in range(4)]) == [True] * 4
            bufs = [bytearray(PAGE) for _ in range(4)]
            assert c.load(KEYS[:4], bufs) == 4 and all(b == payload(i) for i, b in enumerate(bufs))
        # The operator's metrics give each tenant's pool.
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        name = "a" if tenant == "a" else "default"
        assert re.search(rf'^hicached_tenant_pool_pages\{{tenant="{name}"\}} 4\.0$', body, re.M), body
        cap = re.search(r'^hicached_tenant_pool_capacity_bytes\{tenant="b"\} (\S+)$', body, re.M)
        assert cap and float(cap.group(1)) == 8 << 20, body
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
