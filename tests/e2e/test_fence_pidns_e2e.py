"""The wait of a fenced region request ends when the daemon exits, seen even from another pid namespace (an
engine in a container, where the daemon's pid names nothing): the daemon sends its own pidfd with the fence
board's answer. Root only (a new pid namespace needs CAP_SYS_ADMIN; CI runs as root)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import time

import pytest

from hicached.common.memfd import SEALS
from hicached.engine.client import Client

PAGE = 64 * 1024
CLONE_NEWPID = 0x20000000


def _in_new_pid_namespace(path: str, ready_w: int, out_w: int, go_r: int) -> None:
    """In the grandchild, pid 1 of a new pid namespace: registers a region (and with it the fence board),
    says so, waits for the daemon to be killed, and reports what it saw of the daemon process."""
    fd = os.memfd_create("region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8 * PAGE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    c = Client(path, "pidns", PAGE, timeout=10, reconnect=0)
    c.register_region(fd, PAGE, num_pages=8)
    daemon = c._wire.ops.daemon
    seen = {"pid": daemon.pid, "gone_before": daemon.gone()}
    os.write(ready_w, b"1")
    os.read(go_r, 1)  # the daemon has been killed
    deadline = time.monotonic() + 10
    while not daemon.gone(0.05) and time.monotonic() < deadline:
        pass
    seen["gone_after"] = daemon.gone()
    os.write(out_w, json.dumps(seen).encode())


def test_daemon_exit_is_seen_from_another_pid_namespace(daemon):
    if os.getuid() != 0:
        pytest.skip("a new pid namespace needs root (CI runs as root)")
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: unshare, then fork the grandchild into the new namespace
        code = 1
        try:
            if libc.unshare(CLONE_NEWPID) != 0:
                os.write(out_w, json.dumps({"error": os.strerror(ctypes.get_errno())}).encode())
                os._exit(0)
            inner = os.fork()
            if inner == 0:
                try:
                    _in_new_pid_namespace(daemon.socket, ready_w, out_w, go_r)
                    os._exit(0)
                except BaseException as e:
                    os.write(out_w, json.dumps({"error": repr(e)}).encode())
                    os._exit(1)
            os.waitpid(inner, 0)
            code = 0
        finally:
            os._exit(code)
    for fd in (ready_w, out_w, go_r):
        os.close(fd)
    try:
        os.read(ready_r, 1)  # registered (or failed: then it wrote its error)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        os.write(go_w, b"1")
        seen = json.loads(os.read(out_r, 1 << 16) or b"{}")
    finally:
        os.waitpid(pid, 0)
    if "error" in seen and "Operation not permitted" in seen["error"]:
        pytest.skip(f"this machine refuses a new pid namespace: {seen['error']}")
    # The daemon's pid names nothing in the engine's namespace, yet its exit is seen: the pidfd it sent.
    assert seen == {"pid": 0, "gone_before": False, "gone_after": True}, seen
