"""The file connector over a filesystem that hangs or crawls (tests/support/stallfs.py, FUSE over a real
directory): calls and probes end at their time-outs, slow calls still succeed, the connector works again once
the filesystem does, and nothing stays blocked after it is gone (issue #18, point 3)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hicached.connectors import BackendUnavailable
from hicached.connectors import file as file_module
from hicached.connectors.base import Hold
from hicached.connectors.file import FileConnector
from stallfs import StallFS, stallfs_available

from hicached import config

NS = "stall.p64"
PAGE = 64 * 1024
TIMEOUT = 1.0  # storage.operation_timeout while the filesystem is stalled
# What a call that should end at its time-out may take beyond it on a loaded 2-core machine: wide, since
# only a call that never ends is the failure looked for.
MARGIN = 8.0


@pytest.fixture(params=["native", "python"])
def page_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both page I/O paths block in the filesystem alike: the C module's threads and the Python ones."""
    if request.param == "python":
        monkeypatch.setattr(file_module, "_pageio", None)
    elif file_module._pageio is None:
        pytest.skip(
            "hicached.common._pageio is not built here (no C compiler at install); .ci/run requires it"
        )
    return request.param


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[StallFS]:
    why = stallfs_available()
    if why is not None:
        pytest.skip(f"a stalling filesystem cannot be made here: {why}")
    backing = tmp_path / "backing"
    backing.mkdir()
    with StallFS(backing, tmp_path / "mnt", teardown_grace=2.0) as stallfs:
        yield stallfs


def make(tmp_path: Path, operation_timeout: float) -> FileConnector:
    """The real connector with its root inside the mount."""
    storage = {
        "backend": "file",
        "file": {"root": str(tmp_path / "mnt" / "l3"), "io_threads": 2},
        "operation_timeout": operation_timeout,
    }
    return FileConnector(config.from_dict({"storage": storage}, base_dir=str(tmp_path)))


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int) -> memoryview:
    return memoryview(bytearray(random.Random(i).randbytes(PAGE)))


def blank(n: int) -> list[memoryview]:
    return [memoryview(bytearray(PAGE)) for _ in range(n)]


def stuck_threads(pid: int | str = "self") -> list[str]:
    """The threads of a process blocked on a FUSE filesystem, as `tid:state:wchan`: in uninterruptible sleep
    (state D: a killed process waiting for its request's answer), or waiting for an answer at all (wchan
    request_wait_answer, where the kernel names it; an interruptible wait there shows as state S). []
    once the process is gone."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state == "D" or "fuse" in wchan or wchan == "request_wait_answer":
            out.append(f"{tid}:{state}:{wchan}")
    return out


def mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def released(hold: Hold, timeout: float = 10.0) -> None:
    done = asyncio.get_running_loop().create_future()
    hold.when_released(lambda: done.done() or done.set_result(None))
    await asyncio.wait_for(done, timeout)


async def timed_out(call: Callable[[], object]) -> BackendUnavailable:
    """Runs a call that must fail with BackendUnavailable by time-out, within TIMEOUT plus the margin."""
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        await asyncio.wait_for(call(), TIMEOUT + MARGIN)  # wait_for: a call that never ends fails here
    assert time.monotonic() - start < TIMEOUT + MARGIN
    assert info.value.reason == "timeout"
    return info.value


async def test_put_and_get_on_a_stalled_filesystem_time_out_and_work_after_resume(
    tmp_path: Path, fs: StallFS, page_io: str
) -> None:
    """A hung disk: a put and a get end at storage.operation_timeout with BackendUnavailable, the threads
    caught in the filesystem keep the call's buffers (Hold) until it answers again, and then the same
    connector stores and reads pages byte for byte, those from before the stall too."""
    conn = make(tmp_path, TIMEOUT)
    await conn.start()
    try:
        before = [key(i) for i in range(4)]
        assert await conn.put(NS, before, [page(i) for i in range(4)]) == [True] * 4

        fs.stall()
        put_hold, get_hold = Hold(), Hold()
        during = [key(i) for i in range(4, 8)]
        await timed_out(lambda: conn.put(NS, during, [page(i) for i in range(4, 8)], hold=put_hold))
        await timed_out(lambda: conn.get_into(NS, before, blank(4), hold=get_hold))
        assert conn.counters["errors.timeout"] == 2
        assert fs.holds(os.getpid())  # the calls' threads are held in the filesystem, not failed otherwise
        assert not put_hold.released  # a thread is in the middle of the put's pages

        fs.resume()
        await released(put_hold)
        await released(get_hold)
        after = [key(i) for i in range(8, 12)]
        assert await conn.put(NS, after, [page(i) for i in range(8, 12)]) == [True] * 4
        keys = before + after
        bufs = blank(len(keys))
        assert await conn.get_into(NS, keys, bufs) == [True] * len(keys)
        for i, buf in zip([*range(4), *range(8, 12)], bufs, strict=True):
            assert buf == page(i)
    finally:
        await conn.close()


async def test_probe_on_a_stalled_filesystem_fails_within_its_timeout(tmp_path: Path, fs: StallFS) -> None:
    """The breaker's probe runs on a thread of its own: a stalled filesystem makes it fail at its own
    time-out, and once the filesystem answers again a probe passes."""
    conn = make(tmp_path, 30.0)
    await conn.start()
    try:
        await conn.probe(timeout=10.0)
        fs.stall()
        await timed_out(lambda: conn.probe(timeout=TIMEOUT))
        assert fs.holds(os.getpid())
        fs.resume()
        await asyncio.wait_for(conn.probe(timeout=10.0), 20.0)
    finally:
        await conn.close()


async def test_slow_filesystem_calls_succeed_later(tmp_path: Path, fs: StallFS, page_io: str) -> None:
    """A slow disk: every operation waits, and puts, gets and the probe still succeed within a generous
    time-out, reading back what was written."""
    delay = 0.005
    conn = make(tmp_path, 60.0)
    await conn.start()
    try:
        fs.slow(delay_per_op=delay)
        ops = fs.ops
        keys = [key(i) for i in range(2)]
        start = time.monotonic()
        assert await conn.put(NS, keys, [page(i) for i in range(2)]) == [True] * 2
        bufs = blank(2)
        assert await conn.get_into(NS, keys, bufs) == [True] * 2
        await conn.probe(timeout=30.0)
        elapsed, served = time.monotonic() - start, fs.ops - ops
        assert elapsed >= delay  # the calls went through the filesystem, which waited
        assert served > 0
        assert [bytes(b) for b in bufs] == [bytes(page(i)) for i in range(2)]
    finally:
        fs.resume()
        await conn.close()


async def test_nothing_stays_blocked_after_the_filesystem_exits_stalled(tmp_path: Path) -> None:
    """Threads of this process caught in a stalled filesystem (a put given up on) are freed when the
    StallFS exits, stall and all: none is left waiting in the kernel, the mount is gone, the call's
    buffers are let go, and the connector closes."""
    if (why := stallfs_available()) is not None:
        pytest.skip(f"a stalling filesystem cannot be made here: {why}")
    backing = tmp_path / "backing"
    backing.mkdir()
    conn = make(tmp_path, TIMEOUT)
    hold = Hold()
    try:
        with StallFS(backing, tmp_path / "mnt", teardown_grace=2.0) as fs:
            await conn.start()
            fs.stall()
            await timed_out(lambda: conn.put(NS, [key(0), key(1)], [page(0), page(1)], hold=hold))
            assert fs.holds(os.getpid())
        mountpoint = tmp_path / "mnt"
        assert not mounted(mountpoint)
        await until(lambda: not stuck_threads())
        await released(hold)
    finally:
        await conn.close()


@pytest.mark.parametrize("server", ["answering", "wedged"])
def test_a_process_killed_while_blocked_is_freed(tmp_path: Path, fs: StallFS, server: str) -> None:
    """A daemon killed while one of its threads waited on a stalled filesystem stays in state D (the
    kernel waits for the answer to a request already handed to the server). Leaving the StallFS frees it,
    also when its server no longer answers at all ("wedged", stopped): then by aborting the connection."""
    target = tmp_path / "mnt" / "page"
    target.write_bytes(b"x" * PAGE)
    script = (
        "import threading, time\n"
        f"threading.Thread(target=lambda: open({str(target)!r}, 'rb').read(), daemon=True).start()\n"
        "time.sleep(120)\n"
    )
    fs.stall()
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        fs.wait_holds(proc.pid)
        proc.kill()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # killed, but held by its thread in the filesystem
        assert stuck_threads(proc.pid)
        if server == "wedged":
            assert fs.server_pid is not None
            os.kill(fs.server_pid, signal.SIGSTOP)
            fs.teardown_grace = 0.5  # what close() waits for an answer, then for the server to end
        fs.close()
        assert proc.wait(10) == -signal.SIGKILL
        if server == "wedged":
            assert fs.aborted  # resume could not reach the server: the connection was aborted
        assert not mounted(tmp_path / "mnt")
    finally:
        if proc.poll() is None:
            proc.kill()
