"""hicached.common._pageio.Engine: the C threads that run the file connector's page I/O without the GIL.

Its jobs against a real directory, its queue, its close, and the connector's use of it: answers that
reach the caller through the event loop's reader, whatever the loop is doing."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import select
import sys
import time
import types

import pytest
import stall
from hicached.connectors import file as file_module
from hicached.connectors.file import FileConnector

from hicached import config

pytestmark = pytest.mark.skipif(
    file_module._pageio is None, reason="hicached.common._pageio is not built here (no C compiler at install)"
)

NS = "engine.p64"
KiB = 1024
CHUNK = 256 * KiB


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int, size: int) -> bytes:
    return ((i.to_bytes(4, "little") + bytes(range(251))) * (size // 255 + 1))[:size]


def path_of(root: str, k: str) -> str:
    return os.path.join(root, NS, k[0:2], k[2:4], k)


def reap_all(engine, want: int, timeout: float = 10.0) -> dict:
    """Waits on the engine's eventfd, as the event loop does, until `want` jobs came back: {token: answer}."""
    out: dict = {}
    deadline = time.monotonic() + timeout
    while len(out) < want:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(out)} of {want} jobs came back"
        select.select([engine.fileno()], [], [], left)
        for token, *answer in engine.reap():
            out[token] = tuple(answer)
    return out


NO_STALL = stall.available()
needs_stall = pytest.mark.skipif(
    NO_STALL is not None, reason=f"no thread can be stalled mid-page: {NO_STALL}"
)


def wait_running(engine, n: int = 1) -> None:
    deadline = time.monotonic() + 10
    while engine.info["running"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_jobs_of_every_kind_come_back_with_their_tokens(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(2)
    stop = bytearray(1)
    keys = [key(i) for i in range(6)]
    pages = [page(i, 5000 + i) for i in range(6)]
    engine.write("w1", NS, keys[:3], root, b"t", pages[:3], CHUNK, stop, False, False)
    engine.write("w2", NS, keys[3:], root, b"t", pages[3:], CHUNK, stop, False, False)
    done = reap_all(engine, 2)
    assert done == {
        "w1": ([0, 0, 0], sum(32 + len(p) for p in pages[:3]), 0),
        "w2": ([0, 0, 0], sum(32 + len(p) for p in pages[3:]), 0),
    }
    bufs = [bytearray(len(p)) for p in pages]
    engine.read("r", NS, keys, root, bufs, CHUNK, stop, -1.0)
    engine.exists("e", NS, [*keys[:4], key(99), keys[4]], root, stop)
    assert reap_all(engine, 2) == {
        "r": ([0] * 6, 0, 0),
        "e": ([0, 0, 0, 0, errno.ENOENT, io.CANCELLED], 0, 0),
    }
    assert bufs == [bytearray(p) for p in pages]
    # A corrupt page is a miss, removed: the tree shrank by its size.
    with open(path_of(str(tmp_path), keys[0]), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    engine.read("r", NS, keys[:1], root, bufs[:1], CHUNK, stop, -1.0)
    assert reap_all(engine, 1) == {"r": ([io.CHECKSUM_BAD], -(32 + 5000), 0)}
    engine.delete("d", NS, keys, root, stop)
    assert reap_all(engine, 1) == {"d": ([errno.ENOENT] + [0] * 5, -sum(32 + len(p) for p in pages[1:]), 0)}
    assert os.listdir(tmp_path / NS / "00" / "00") == []
    engine.close()


def test_bad_arguments_are_refused_at_once_and_the_engine_keeps_working(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    with pytest.raises(ValueError, match="namespace"):
        engine.read("x", "../up", [key(1)], root, [bytearray(8)], CHUNK, stop, -1.0)
    with pytest.raises(ValueError):
        engine.write("x", NS, [key(1)], root, b"t", [b"a", b"b"], CHUNK, stop, False, False)
    with pytest.raises(TypeError):
        engine.exists("x", NS, (key(1),), root, stop)
    with pytest.raises(BufferError):
        engine.read("x", NS, [key(1)], root, [b"read-only"], CHUNK, stop, -1.0)
    with pytest.raises(TypeError):
        engine.read()
    assert engine.info["queued"] == 0 and engine.reap() == []
    engine.write("ok", NS, [key(1)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    assert reap_all(engine, 1) == {"ok": ([0], 35, 0)}
    engine.close()


@needs_stall
def test_close_runs_what_was_queued_and_refuses_more(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    stuck = stall.StalledMemory(8 * KiB)  # the one thread waits in the middle of this page's pwritev
    engine.write("blocked", NS, [key(0)], root, b"t", [stuck.view], CHUNK, stop, False, False)
    engine.write("queued", NS, [key(1)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    wait_running(engine)
    assert (engine.info["running"], engine.info["queued"]) == (1, 1)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.write("late", NS, [key(2)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    assert engine.info["closed"]
    stuck.release()
    done = reap_all(engine, 2)
    assert done["blocked"][0] == [0]
    assert done["queued"] == ([0], 35, 0)
    assert not os.path.exists(path_of(str(tmp_path), key(2)))
    stuck.close()


@needs_stall
def test_an_engine_dropped_with_jobs_queued_and_running_is_harmless(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    stuck = stall.StalledMemory(8 * KiB)
    engine.write("running", NS, [key(0)], root, b"t", [stuck.view], CHUNK, stop, False, False)
    for i in range(1, 4):
        engine.write(f"queued{i}", NS, [key(i)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    wait_running(engine)  # the thread has the first write; the others wait behind it
    del engine
    gc.collect()
    stuck.release()  # the thread ends its job, finds no engine, and exits
    time.sleep(0.05)
    assert not any(os.path.exists(path_of(str(tmp_path), key(i))) for i in range(1, 4))  # dropped, not run


@needs_stall
def test_a_queued_job_can_be_taken_back_and_a_running_one_cannot(tmp_path) -> None:
    # What the connector does for a call given up on: a job no thread has begun never touches its buffers
    # (answered CANCELLED at once); one that runs is answered when its page in progress ends.
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    stuck = stall.StalledMemory(8 * KiB)
    engine.write("running", NS, [key(0)], root, b"t", [stuck.view], CHUNK, stop, False, False)
    wait_running(engine)
    engine.write("queued", NS, [key(1)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    engine.write("last", NS, [key(2)], root, b"t", [b"abc"], CHUNK, stop, False, False)
    assert engine.cancel("queued") is True
    assert engine.cancel("running") is False and engine.cancel("nobody") is False
    assert reap_all(engine, 1) == {"queued": ([io.CANCELLED], 0, 0)}
    assert engine.info["queued"] == 1
    stuck.release()
    assert reap_all(engine, 2) == {"running": ([0], 32 + 8 * KiB, 0), "last": ([0], 35, 0)}
    assert engine.cancel("last") is False
    assert not os.path.exists(path_of(str(tmp_path), key(1)))
    engine.close()
    stuck.close()


@needs_stall
def test_a_write_finished_after_stop_is_not_published(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    stuck = stall.StalledMemory(8 * KiB)
    engine.write("w", NS, [key(0), key(1)], root, b"t", [stuck.view, b"abc"], CHUNK, stop, False, False)
    wait_running(engine)
    stop[0] = 1  # the caller gave up while the thread was in the middle of the first page
    stuck.release()
    assert reap_all(engine, 1) == {"w": ([io.CANCELLED, io.CANCELLED], 0, 0)}
    assert os.listdir(tmp_path / NS / "00" / "00") == []  # neither renamed into place nor left behind
    engine.close()
    stuck.close()


def test_a_payload_that_does_not_hash_to_its_checksum_is_not_published(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(1)
    pages = [page(1, 300 * KiB), page(2, 4 * KiB)]
    sums = [file_module.header.checksum(pages[0]) ^ 1, file_module.header.checksum(pages[1])]
    engine.write("w", NS, [key(1), key(2)], root, b"t", pages, CHUNK, stop, False, False, sums)
    assert reap_all(engine, 1) == {"w": ([io.CHANGED, 0], 32 + 4 * KiB, 0)}
    assert not os.path.exists(path_of(str(tmp_path), key(1)))
    assert os.listdir(tmp_path / NS / "00" / "00") == [key(2)]
    engine.close()


def test_pages_are_opened_beneath_the_root_and_never_through_a_symlink(tmp_path) -> None:
    io = file_module._pageio
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / NS / "00").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / NS / "00" / "00")  # a shard directory that leads out of the root
    engine = io.Engine(1)
    stop = bytearray(1)
    broot = os.fsencode(root)
    engine.write("w", NS, [key(1)], broot, b"t", [b"abc"], CHUNK, stop, False, False)
    (outside / key(2)).write_bytes(b"x" * 40)
    engine.read("r", NS, [key(2)], broot, [bytearray(8)], CHUNK, stop, -1.0)
    engine.exists("e", NS, [key(2)], broot, stop)
    engine.delete("d", NS, [key(2)], broot, stop)
    done = reap_all(engine, 4)
    assert done["w"][0][0] in (errno.ELOOP, errno.ENOTDIR)
    assert done["r"][0][0] in (io.NOT_PAGE, errno.ENOTDIR)  # a symlink on the way: not a page of ours
    assert done["e"][0][0] in (errno.ENOENT, errno.ENOTDIR)
    assert done["d"][0][0] in (errno.ENOENT, errno.ENOTDIR)
    assert sorted(os.listdir(outside)) == [key(2)]  # nothing written, read or removed out there
    engine.close()


def test_a_fifo_or_a_directory_at_a_page_path_is_a_miss_at_once(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    shard = tmp_path / NS / "00" / "00"
    shard.mkdir(parents=True)
    os.mkfifo(shard / key(1), 0o600)  # its open would wait for a writer
    (shard / key(2)).mkdir()
    engine = io.Engine(1)
    stop = bytearray(1)
    engine.read("r", NS, [key(1), key(2)], root, [bytearray(8), bytearray(8)], CHUNK, stop, -1.0)
    engine.exists("e", NS, [key(1)], root, stop)
    assert reap_all(engine, 2, timeout=5) == {
        "r": ([io.NOT_PAGE, io.NOT_PAGE], 0, 0),
        "e": ([errno.ENOENT], 0, 0),
    }
    assert sorted(os.listdir(shard)) == [key(1), key(2)]  # left alone: not ours to remove
    engine.close()


def test_cancelled_jobs_touch_nothing(tmp_path) -> None:
    io, root = file_module._pageio, os.fsencode(tmp_path)
    engine = io.Engine(1)
    stop = bytearray(b"\x01")
    engine.write("w", NS, [key(1), key(2)], root, b"t", [b"a", b"b"], CHUNK, stop, False, False)
    assert reap_all(engine, 1) == {"w": ([io.CANCELLED] * 2, 0, 0)}
    assert os.listdir(tmp_path) == []
    engine.close()


def test_missing_root_is_reported_once_a_page_is_not_found(tmp_path) -> None:
    io = file_module._pageio
    engine = io.Engine(1)
    stop = bytearray(1)
    gone = os.fsencode(tmp_path / "gone")
    engine.read("r", NS, [key(1)], gone, [bytearray(8)], CHUNK, stop, -1.0)
    engine.write("w", NS, [key(1)], gone, b"t", [b"abc"], CHUNK, stop, False, False)
    engine.exists("e", NS, [key(1)], os.fsencode(tmp_path), stop)  # the root is there: just a miss
    done = reap_all(engine, 3)
    assert done == {
        "r": ([errno.ENOENT], 0, errno.ENOENT),
        "w": ([errno.ENOENT], 0, errno.ENOENT),
        "e": ([errno.ENOENT], 0, 0),
    }
    assert not os.path.exists(tmp_path / "gone")  # never re-created
    engine.close()


def _connector(tmp_path, **file_cfg) -> FileConnector:
    storage = {"backend": "file", "file": {"root": "data", **file_cfg}}
    return FileConnector(config.from_dict({"storage": storage}, base_dir=str(tmp_path)))


async def test_reads_complete_while_the_event_loop_is_busy(tmp_path) -> None:
    # The engine's threads never need the GIL: queued jobs run one after the other while the loop runs
    # Python, and their answers come on the loop's next turn. (A Python thread needs the GIL between two
    # jobs, which the loop does not give up here: at most the first job would run.)
    conn = _connector(tmp_path, io_threads=1)
    await conn.start()
    try:
        keys = [key(i) for i in range(3)]
        assert await conn.put(NS, keys, [memoryview(page(i, 64 * KiB)) for i in range(3)]) == [True] * 3
        bufs = [memoryview(bytearray(64 * KiB)) for _ in keys]
        reads = [asyncio.ensure_future(conn.get_into(NS, [k], [b])) for k, b in zip(keys, bufs, strict=True)]
        await asyncio.sleep(0)  # the jobs are queued
        interval = sys.getswitchinterval()
        sys.setswitchinterval(100.0)  # no other Python thread gets the GIL from this one meanwhile
        try:
            until = time.monotonic() + 0.3
            while time.monotonic() < until:  # the loop holds the GIL all along
                pass
            filled = [buf == page(i, 64 * KiB) for i, buf in enumerate(bufs)]
        finally:
            sys.setswitchinterval(interval)
        assert filled == [True] * 3  # read meanwhile, by a thread that never took the GIL
        assert await asyncio.gather(*reads) == [[True]] * 3
    finally:
        await conn.close()


@needs_stall
async def test_a_call_in_flight_at_close_gets_its_answer(tmp_path) -> None:
    conn = _connector(tmp_path, io_threads=1)
    await conn.start()
    stuck = stall.StalledMemory(8 * KiB)
    write = asyncio.ensure_future(conn.put(NS, [key(0)], [stuck.view]))
    await asyncio.sleep(0.05)
    await conn.close()
    stuck.release()
    assert await asyncio.wait_for(write, 10) == [True]
    assert conn._engine_loop is None  # the loop no longer watches the engines
    stuck.close()


def test_a_connector_started_on_one_loop_works_on_another(tmp_path) -> None:
    # Its engines' answers follow it to the loop that calls it (a bench drives it from loops of its own).
    conn = _connector(tmp_path)
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first.run_until_complete(conn.start())
        assert second.run_until_complete(conn.put(NS, [key(1)], [memoryview(b"abc")])) == [True]
        assert second.run_until_complete(conn.exists(NS, [key(1)])) == 1
        assert conn._engine_loop is second
        assert first.run_until_complete(conn.exists(NS, [key(1)])) == 1
        first.run_until_complete(conn.close())
    finally:
        first.close()
        second.close()


async def test_engines_that_cannot_start_leave_the_python_path_running(tmp_path, caplog) -> None:
    # A thread or file limit can stop the engine's threads or eventfd: the connector then runs its Python
    # path (the same files), after closing an engine that did start.
    real, made = file_module._pageio, []

    def engine(*args, **kwargs):
        if made:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        made.append(real.Engine(*args, **kwargs))
        return made[-1]

    conn = _connector(tmp_path)
    conn._native = types.SimpleNamespace(
        **{k: getattr(real, k) for k in dir(real) if k.isupper()}, Engine=engine
    )
    await conn.start()
    try:
        assert "did not start" in caplog.text and made and made[0].info["closed"]
        assert conn.info()["page_io"] == "python" and conn._engines is None
        assert await conn.put(NS, [key(1)], [memoryview(page(1, 5000))]) == [True]
        buf = memoryview(bytearray(5000))
        assert await conn.get_into(NS, [key(1)], [buf]) == [True] and buf == page(1, 5000)
        assert await conn.exists(NS, [key(1)]) == 1
    finally:
        await conn.close()
