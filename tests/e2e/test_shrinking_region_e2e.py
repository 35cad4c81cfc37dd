"""An engine's memory that shrinks under the real daemon (a subprocess) mid-traffic, an unsealed memfd (as
SGLang makes it) or a tmpfs file (as vLLM makes its /dev/shm region): the daemon stays up, that engine's
requests fail with a clear error and its region is dropped, and another engine (another process, copying its
own unsealed memfd all along) is served with the right bytes throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hicached.common import ranges as ranges_mod
from hicached.common.errors import HicachedError
from hicached.engine.client import Client

pytestmark = pytest.mark.skipif(
    not ranges_mod.can_guard(),
    reason="hicached.common._pageio is not built: the daemon refuses unsealed memfds",
)

PAGE = 64 * 1024

# The other engine: its own memfd, unsealed too (so its copies are guarded as well), mapped to write pages
# and to check what load_pages brought back. Key (k, j) always holds content (8 k + j) % 64. It prints
# "it N" every 10 rounds, and a JSON summary once told to stop on stdin.
STEADY = textwrap.dedent(
    """
    import json, mmap, os, sys, threading
    import numpy as np
    from hicached.engine.client import Client

    sock, page = sys.argv[1], int(sys.argv[2])
    fd = os.memfd_create("e2e-steady", os.MFD_CLOEXEC)
    os.ftruncate(fd, 16 * page)
    mm = mmap.mmap(fd, 16 * page, flags=mmap.MAP_SHARED)
    region = np.frombuffer(mm, dtype=np.uint8).reshape(16, page)
    contents = np.random.default_rng(7).integers(0, 256, (64, page), dtype=np.uint8)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    rounds, errors, wrong = 0, [], 0
    with Client(sock, "steady.ns", page) as c:
        h = c.register_region(fd, page)
        print("ready", flush=True)
        while not stop.is_set():
            k = rounds % 400
            which = [(8 * k + j) % 64 for j in range(8)]
            keys = [f"steady-{k:04d}-{j}" for j in range(8)]
            src, dst = (list(range(8)), list(range(8, 16)))[:: 1 if rounds % 2 else -1]
            region[src] = contents[which]
            try:
                ok = c.store_pages(h, src, keys)
                region[dst] = 0xAA
                n = c.load_pages(h, dst, keys)
            except Exception as e:
                errors.append(repr(e))
                break
            if ok != [True] * 8 or n != 8 or not (region[dst] == contents[which]).all():
                wrong += 1
            rounds += 1
            if rounds % 10 == 0:
                print(f"it {rounds}", flush=True)
        c.unregister_region(h)
    print(json.dumps({"rounds": rounds, "errors": errors, "wrong": wrong}), flush=True)
    """
)


class Steady:
    """The other engine's process, and the latest round it reported."""

    def __init__(self, socket_path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STEADY, socket_path, str(PAGE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.rounds = 0
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            self.lines.append(line)
            if line == "ready":
                self.ready.set()
            elif line.startswith("it "):
                self.rounds = int(line[3:])

    def wait_rounds(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.rounds < n:
            assert self.proc.poll() is None, f"the other engine exited: {self.lines[-3:]}"
            assert time.monotonic() < deadline, f"the other engine is stuck at round {self.rounds}"
            time.sleep(0.01)

    def stop(self) -> dict:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        assert self.proc.wait(60) == 0
        self._reader.join(10)
        return json.loads(self.lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def ctl_stats(daemon) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", daemon.socket, "--json", "stats"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def _engine_memory(kind: str) -> int:
    if kind == "memfd":
        return os.memfd_create("e2e-shrinks", os.MFD_CLOEXEC)  # as SGLang makes it: it cannot be sealed
    # As vLLM's SharedOffloadRegion makes it: O_CREAT|O_EXCL, mode 0600, born with F_SEAL_SEAL.
    path = f"/dev/shm/hicached-e2e-shrinks-{os.getpid()}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)  # the open fd keeps it; nothing is left in /dev/shm whatever the test does
    return fd


@pytest.mark.parametrize("kind", ["memfd", "tmpfs file"])
def test_memory_truncated_under_load_drops_its_region_and_nothing_else(daemon_factory, kind):
    if kind == "tmpfs file" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    daemon = daemon_factory({"pool": {"capacity": "512MiB"}})
    fd = _engine_memory(kind)
    pages = [os.urandom(PAGE) for _ in range(16)]
    os.ftruncate(fd, 64 * PAGE)
    os.pwrite(fd, b"".join(pages), 0)
    steady = Steady(daemon.socket)
    try:
        assert steady.ready.wait(60), steady.lines
        with Client(daemon.socket, "shrinks.ns", PAGE) as a:
            h = a.register_region(fd, PAGE)
            keys = [f"a-0000-{j}" for j in range(16)]
            assert a.store_pages(h, list(range(16)), keys) == [True] * 16
            assert a.load_pages(h, list(range(32, 48)), keys) == 16
            assert os.pread(fd, 16 * PAGE, 32 * PAGE) == b"".join(pages)

            rounds = [0]
            failure: list[HicachedError] = []

            def traffic() -> None:  # this engine's own loop, until its region fails it
                while True:
                    keys = [f"a-{rounds[0] % 200:04d}-{j}" for j in range(16)]
                    try:
                        a.store_pages(h, list(range(16)), keys)
                        a.load_pages(h, list(range(32, 48)), keys)
                    except HicachedError as e:
                        failure.append(e)
                        return
                    rounds[0] += 1

            t = threading.Thread(target=traffic)
            t.start()
            steady.wait_rounds(30)
            while rounds[0] < 20 and t.is_alive():
                time.sleep(0.01)
            at_truncation = steady.rounds
            os.ftruncate(fd, 4096)  # mid-traffic, under both engines' copies
            t.join(60)
            assert not t.is_alive() and daemon.alive

            why = (
                f"region {h} was dropped: its memory shrank under the daemon (the {kind} is now 4096 bytes; "
                f"the region reaches byte {64 * PAGE}); register the memory again"
            )
            [e] = failure
            assert e.code == "copy_failed" and e.message == why, e
            for call in (lambda: a.store_pages(h, [0], ["a-after"]), lambda: a.load_pages(h, [0], keys[:1])):
                with pytest.raises(HicachedError) as gone:
                    call()
                assert gone.value.code == "not_found" and gone.value.message == why
            assert a.store(["a-plain"], [pages[0]]) == [True]  # the engine's connection goes on
            assert a.get(["a-plain"]) == [pages[0]]

            steady.wait_rounds(at_truncation + 50)  # served all along, and after
            stats = ctl_stats(daemon)["regions"]
            assert stats["count"] == 1  # the other engine's
            assert stats["counters"]["dropped.shrunk"] == 1 and stats["copier"]["jobs_failed"] >= 1
            summary = steady.stop()
        assert summary == {"rounds": summary["rounds"], "errors": [], "wrong": 0}
        assert summary["rounds"] >= at_truncation + 50
        assert daemon.alive and ctl_stats(daemon)["regions"]["count"] == 0
        assert daemon.log().count("shrank under the daemon") == 1  # logged once
    finally:
        steady.kill()
        os.close(fd)
