"""One bad object in the file backend is a miss, never an outage (issue: a FIFO at a page's path held each
load until storage.operation_timeout, eight such loads tripped the breaker, and every engine on the node
lost L3 because of one file).

A FIFO, a directory, a symlinked page, a shard directory that is a symlink leading out of the root, and a
file the daemon may not read (the daemon then runs without the capabilities that let root read any file),
each at a page's path: every load of them is a miss that does not wait for the time-out, is loaded again
and again past the breaker's threshold, other pages keep loading from L3, the backend stays attached, and
nothing outside the root is read, written or removed."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from daemon_proc import DaemonProcess, without_file_capabilities

from hicached import Client

PAGE = 64 << 10
NS = "odd.p64k"
TIMEOUT_S = 10.0  # storage.operation_timeout: a load that waited for it would take this long


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (PAGE // 4))[:PAGE]


def path_of(d: DaemonProcess, k: str) -> str:
    return os.path.join(d.workdir, "data", NS, k[0:2], k[2:4], k)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "shard_symlink", "unreadable"])
def test_an_object_that_is_not_a_page_is_a_quick_miss_and_l3_stays_attached(tmp_path, kind: str) -> None:
    overrides = {"storage": {"operation_timeout": f"{TIMEOUT_S}s", "breaker": {"failures": 3}}}
    preexec = without_file_capabilities if kind == "unreadable" else None
    d = DaemonProcess(str(tmp_path / "d"), overrides, preexec=preexec).start()
    good = [key(i) for i in range(1, 9)]
    odd = "ff" + "0" * 62 if kind == "shard_symlink" else key(100)
    outside = tmp_path / "outside"
    outside.mkdir()
    try:
        with Client(d.socket, NS, PAGE) as c:
            assert c.store(good, [page(i) for i in range(1, 9)]) == [True] * 8
            assert d.ctl("flush")["flushed"]
        d.stop()
        # The odd object, planted while the daemon is down.
        target = path_of(d, odd)
        os.makedirs(os.path.dirname(os.path.dirname(target)), exist_ok=True)
        if kind == "shard_symlink":
            # A shard directory that leads out of the root, to a copy of a real page file renamed to the
            # odd key (its key tag is another's: read through the link it would be "corrupt", and removed).
            shutil.copy(path_of(d, good[0]), outside / odd)
            os.symlink(outside, os.path.dirname(target))
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if kind == "fifo":
                os.mkfifo(target, 0o600)
            elif kind == "directory":
                os.mkdir(target)
            elif kind == "symlink":
                shutil.copy(path_of(d, good[0]), outside / "page")
                os.symlink(outside / "page", target)
            else:
                shutil.copy(path_of(d, good[0]), target)
                os.chmod(target, 0)  # the daemon (without root's file capabilities) may not open it
        before = sorted(os.listdir(outside))
        d.start()  # L2 empty: every load reads L3
        with Client(d.socket, NS, PAGE, timeout=60) as c:
            buf = bytearray(PAGE)
            for _ in range(8):  # past storage.breaker.failures, many times over
                start = time.monotonic()
                assert c.load([odd], [buf]) == 0
                assert time.monotonic() - start < TIMEOUT_S / 2, "a load of it waited for the time-out"
            for i, k in enumerate(good, start=1):  # the others still load, from L3
                assert c.load([k], [buf]) == 1 and bytes(buf) == page(i)
        status = d.ctl("status")
        assert status["backend_state"] == "attached", status
        assert d.ctl("stats")["counters"].get("backend.breaker_trips", 0) == 0
        assert sorted(os.listdir(outside)) == before  # nothing out there written or removed
        if kind == "shard_symlink":
            assert (outside / odd).read_bytes() == open(path_of(d, good[0]), "rb").read()
    finally:
        d.stop()
        if kind == "unreadable":
            os.chmod(path_of(d, odd), 0o600)  # so that pytest can clean up
