"""The file connector against a real directory: round trips, leading-prefix exists, corruption, faults."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import os
import pathlib
import shutil
import stat
import threading
import time

import pytest
import stall
from hicached.connectors import BackendUnavailable, build, file_janitor, header
from hicached.connectors import file as file_module
from hicached.connectors.base import Hold
from hicached.connectors.file import FileConnector

from hicached import config

NS = "llama-3.1-8b.bf16.p64.tp0of1"
KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(autouse=True, params=["native", "python"])
def page_io(request, monkeypatch) -> str:
    """Every test runs on both page I/O paths, which must read and write the same files alike: the C module
    hicached.common._pageio and the Python loops it stands in for."""
    if request.param == "python":
        monkeypatch.setattr(file_module, "_pageio", None)
    elif file_module._pageio is None:
        pytest.skip(
            "hicached.common._pageio is not built here (no C compiler at install); .ci/run requires it"
        )
    return request.param


def make(tmp_path, **file_cfg) -> FileConnector:
    storage = {"backend": "file", "file": {"root": "data", **file_cfg}}
    if "operation_timeout" in file_cfg:
        storage["operation_timeout"] = storage["file"].pop("operation_timeout")
    cfg = config.from_dict({"storage": storage}, base_dir=str(tmp_path))
    return FileConnector(cfg)


@contextlib.asynccontextmanager
async def started(tmp_path, **file_cfg):
    conn = make(tmp_path, **file_cfg)
    await conn.start()
    try:
        yield conn
    finally:
        await conn.close()


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int, size: int) -> memoryview:
    return memoryview(((i.to_bytes(4, "little") + bytes(range(251))) * (size // 255 + 1))[:size])


def path_of(conn: FileConnector, k: str, ns: str = NS) -> str:
    return os.path.join(conn.root, ns, k[0:2], k[2:4], k)


# Blocking checks of the tree, kept out of the async tests themselves.
def exists(path: str) -> bool:
    return os.path.exists(path)


def is_file(path: str) -> bool:
    return os.path.isfile(path)


def size_of(path: str) -> int:
    return os.path.getsize(path)


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def no_temp_files(conn: FileConnector) -> bool:
    return not glob.glob(os.path.join(conn.root, "**", ".*.tmp"), recursive=True)


@pytest.mark.parametrize("size", [4 * KiB, 8 * MiB])
async def test_put_publishes_a_page_only_if_it_hashes_to_its_checksum(tmp_path, size: int) -> None:
    """A checksum given with a page (taken as it entered L2) goes into its header, and the file is renamed
    into place only if the payload, as written, hashes to it: a page whose bytes are not those it was
    acknowledged with is never stored under its key (False, counted, no file, no temporary left); None is
    hashed here."""
    async with started(tmp_path) as conn:
        keys = [key(i) for i in range(3)]
        pages = [page(i, size) for i in range(3)]
        sums = [header.checksum(pages[0]), header.checksum(pages[1]) ^ 1, None]
        assert await conn.put(NS, keys, pages, sums) == [True, False, True]
        assert conn.counters["errors.changed"] == 1
        assert not exists(path_of(conn, keys[1])) and no_temp_files(conn)
        for k, want in zip([keys[0], keys[2]], [sums[0], header.checksum(pages[2])], strict=True):
            with open(path_of(conn, k), "rb") as f:
                assert header.parse(f.read(header.HEADER_SIZE), NS, k, size) == want
        bufs = [memoryview(bytearray(size)) for _ in keys]
        assert await conn.get_into(NS, keys, bufs) == [True, False, True]
        assert bufs[0] == pages[0] and bufs[2] == pages[2]
        with pytest.raises(ValueError, match="checksums"):
            await conn.put(NS, keys, pages, sums[:2])


@pytest.mark.parametrize("size", [4 * KiB, 256 * KiB, 8 * MiB])
async def test_round_trip(tmp_path, size: int) -> None:
    async with started(tmp_path) as conn:
        keys = [key(i) for i in range(3)]
        pages = [page(i, size) for i in range(3)]
        assert await conn.put(NS, keys, pages) == [True] * 3
        bufs = [memoryview(bytearray(size)) for _ in keys]
        assert await conn.get_into(NS, keys, bufs) == [True] * 3
        assert bufs == pages
        assert size_of(path_of(conn, keys[0])) == header.HEADER_SIZE + size
        assert conn.counters["bytes_written"] == conn.counters["bytes_read"] == 3 * size
        assert (conn.counters["puts"], conn.counters["gets"], conn.counters["hits"]) == (3, 3, 3)
        assert no_temp_files(conn)


async def test_registry_builds_it_and_probe_works(tmp_path) -> None:
    cfg = config.from_dict({"storage": {"file": {"root": "data"}}}, base_dir=str(tmp_path))
    conn = build(cfg)
    assert isinstance(conn, FileConnector) and conn.name == "file"
    assert conn.capabilities.persistent and not conn.capabilities.shared
    await conn.start()
    try:
        await conn.probe()
        assert not glob.glob(os.path.join(conn.root, "_hicached_probe", "**", "probe"), recursive=True)
    finally:
        await conn.close()
    await conn.close()  # idempotent


async def test_root_is_private_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0o277)
    try:
        conn = make(tmp_path, root="a/b/cache")
        await conn.start()
    finally:
        os.umask(old)
    try:
        assert conn.root == str(tmp_path / "a" / "b" / "cache")
        assert stat.S_IMODE(os.stat(conn.root).st_mode) == 0o700
        assert await conn.put(NS, [key(1)], [page(1, 4 * KiB)]) == [True]
    finally:
        await conn.close()


async def test_short_keys_and_layout(tmp_path) -> None:
    async with started(tmp_path) as conn:
        assert await conn.put(NS, ["a", "abcde"], [page(1, 100), page(2, 100)]) == [True, True]
        assert is_file(os.path.join(conn.root, NS, "a_", "__", "a"))
        assert is_file(os.path.join(conn.root, NS, "ab", "cd", "abcde"))
        assert await conn.exists(NS, ["a", "abcde"]) == 2


async def test_exists_counts_the_leading_prefix(tmp_path) -> None:
    async with started(tmp_path) as conn:
        keys = [key(i) for i in range(6)]
        present = [0, 1, 2, 4, 5]  # hole at 3
        await conn.put(NS, [keys[i] for i in present], [page(i, 4 * KiB) for i in present])
        assert await conn.exists(NS, keys) == 3
        assert await conn.exists(NS, keys[4:]) == 2
        assert await conn.exists(NS, keys[3:]) == 0
        assert await conn.exists(NS, []) == 0
        assert await conn.exists("other-namespace", keys) == 0
        # A file too short to hold a header is not a page.
        write_file(path_of(conn, keys[3]), b"")
        assert await conn.exists(NS, keys) == 3


async def test_delete_counts_what_it_removed(tmp_path) -> None:
    async with started(tmp_path) as conn:
        keys = [key(i) for i in range(3)]
        await conn.put(NS, keys[:2], [page(0, 100), page(1, 100)])
        assert await conn.delete(NS, keys) == 2
        assert await conn.delete(NS, keys) == 0
        assert await conn.exists(NS, keys) == 0
        assert conn.counters["deletes"] == 2


async def test_missing_page_is_a_miss(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(0)], [page(0, 4 * KiB)])
        bufs = [memoryview(bytearray(4 * KiB)) for _ in range(2)]
        assert await conn.get_into(NS, [key(0), key(1)], bufs) == [True, False]
        assert (conn.counters["hits"], conn.counters["misses"]) == (1, 1)
        assert not any(k.startswith("corrupt.") for k in conn.counters)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 1)


def _empty(path: str) -> None:
    os.truncate(path, 0)


def _append(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: _flip(p, header.HEADER_SIZE + 1234), "checksum"),
        (lambda p: _flip(p, 0), "magic"),
        (lambda p: _flip(p, 9), "length"),
        (lambda p: _flip(p, 17), "checksum"),
        (lambda p: _flip(p, 25), "key"),
        (_truncate, "length"),
        (_empty, "short"),
        (_append, "length"),
    ],
    ids=[
        "payload-byte",
        "magic",
        "length-field",
        "checksum-field",
        "key-tag",
        "truncated",
        "zero-length",
        "longer",
    ],
)
@pytest.mark.parametrize("size", [64 * KiB, 512 * KiB + 17], ids=["one-chunk", "three-chunks"])
async def test_corrupt_page_is_a_counted_miss_and_removed(tmp_path, damage, reason: str, size: int) -> None:
    async with started(tmp_path) as conn:
        k = key(7)
        await conn.put(NS, [k], [page(7, size)])
        damage(path_of(conn, k))
        buf = memoryview(bytearray(size))
        assert await conn.get_into(NS, [k], [buf]) == [False]
        assert conn.counters[f"corrupt.{reason}"] == 1
        assert conn.counters["misses"] == 1 and conn.counters["hits"] == 0
        assert not is_file(path_of(conn, k))
        assert await conn.exists(NS, [k]) == 0


@pytest.mark.parametrize("offset", [256 * KiB + 3, MiB + 4])
async def test_corrupt_byte_in_a_later_chunk_is_caught(tmp_path, offset: int) -> None:
    async with started(tmp_path) as conn:
        k, size = key(8), MiB + 5  # read and hashed in several chunks
        await conn.put(NS, [k], [page(8, size)])
        _flip(path_of(conn, k), header.HEADER_SIZE + offset)
        assert await conn.get_into(NS, [k], [memoryview(bytearray(size))]) == [False]
        assert conn.counters["corrupt.checksum"] == 1
        assert not is_file(path_of(conn, k))


async def test_page_renamed_to_another_key_is_a_miss(tmp_path) -> None:
    async with started(tmp_path) as conn:
        a, b = key(1), key(2)
        await conn.put(NS, [a, b], [page(1, 4 * KiB), page(2, 4 * KiB)])
        os.rename(path_of(conn, a), path_of(conn, b))
        buf = memoryview(bytearray(4 * KiB))
        assert await conn.get_into(NS, [b], [buf]) == [False]
        assert conn.counters["corrupt.key"] == 1
        assert not is_file(path_of(conn, b))


async def test_wrong_buffer_size_never_hits(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(1)], [page(1, 4 * KiB)])
        assert await conn.get_into(NS, [key(1)], [memoryview(bytearray(4 * KiB + 1))]) == [False]
        assert conn.counters["misfit.length"] == 1  # another page size: left for the nodes it fits
        assert is_file(path_of(conn, key(1)))


async def test_overwrite_replaces_the_page(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(1)], [page(1, 4 * KiB)])
        await conn.put(NS, [key(1)], [page(2, 4 * KiB)])
        buf = memoryview(bytearray(4 * KiB))
        assert await conn.get_into(NS, [key(1)], [buf]) == [True]
        assert buf == page(2, 4 * KiB)


async def test_concurrent_puts_and_gets(tmp_path) -> None:
    size = 128 * KiB
    async with started(tmp_path, io_threads=4) as conn:
        same = key(999)
        await conn.put(NS, [same], [page(0, size)])
        versions = {bytes(page(v, size)) for v in range(20)}

        async def put_many(i: int) -> list[bool]:
            keys = [key(i * 100 + j) for j in range(8)] + [same]
            return await conn.put(NS, keys, [page(i * 100 + j, size) for j in range(8)] + [page(i, size)])

        async def get_same() -> bytes:
            buf = memoryview(bytearray(size))
            assert await conn.get_into(NS, [same], [buf]) == [True]  # rename is atomic: never torn
            return bytes(buf)

        results = await asyncio.gather(*[put_many(i) for i in range(20)], *[get_same() for _ in range(20)])
        assert all(r == [True] * 9 for r in results[:20])
        assert all(r in versions for r in results[20:])

        keys = [key(i * 100 + j) for i in range(20) for j in range(8)]
        bufs = [memoryview(bytearray(size)) for _ in keys]
        assert await conn.get_into(NS, keys, bufs) == [True] * len(keys)
        assert all(buf == page(i * 100 + j, size) for buf, (i, j) in zip(bufs, _ij(20, 8), strict=True))
        assert await conn.exists(NS, keys) == len(keys)
        assert no_temp_files(conn)
        assert not any(k.startswith(("corrupt.", "errors.")) for k in conn.counters)


def _ij(n: int, m: int):
    return [(i, j) for i in range(n) for j in range(m)]


async def test_large_batch_is_split_across_threads_in_order(tmp_path) -> None:
    async with started(tmp_path, io_threads=3) as conn:
        keys = [key(i) for i in range(50)]
        sizes = [512 * KiB + i for i in range(50)]  # 25 MiB: three jobs
        assert await conn.put(NS, keys, [page(i, n) for i, n in enumerate(sizes)]) == [True] * 50
        bufs = [memoryview(bytearray(n)) for n in sizes]
        assert await conn.get_into(NS, keys, bufs) == [True] * 50
        assert all(buf == page(i, n) for i, (buf, n) in enumerate(zip(bufs, sizes, strict=True)))


class EngineSpy:
    """A hicached.common._pageio.Engine that notes the jobs it is given: (_write_chunk or _read_chunk,
    pages)."""

    def __init__(self, engine, seen: list[tuple[str, int]]) -> None:
        self.engine, self.seen = engine, seen

    def read(self, token, namespace, keys, *rest):
        self.seen.append(("_read_chunk", len(keys)))
        return self.engine.read(token, namespace, keys, *rest)

    def write(self, token, namespace, keys, *rest):
        self.seen.append(("_write_chunk", len(keys)))
        return self.engine.write(token, namespace, keys, *rest)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@pytest.mark.parametrize(
    "pages, size, jobs",
    [(16, 256 * KiB, [16]), (16, 2 * MiB, [4, 4, 4, 4]), (3, 8 * MiB, [1, 1, 1]), (40, 2 * MiB, [5] * 8)],
)
async def test_batch_goes_to_few_big_jobs(tmp_path, pages: int, size: int, jobs: list[int]) -> None:
    # Every job costs thread hand-offs: small pages share one, big ones spread over at most io_threads.
    async with started(tmp_path, io_threads=8) as conn:
        seen: list[tuple[str, int]] = []

        def spy(fn):
            def chunk(namespace, keys, views, stop):
                seen.append((fn.__name__, len(keys)))
                return fn(namespace, keys, views, stop)

            return chunk

        if conn._engines is not None:  # the C engines: the jobs they are given
            conn._engines = tuple(EngineSpy(e, seen) for e in conn._engines)
        else:
            conn._write_chunk, conn._read_chunk = spy(conn._write_chunk), spy(conn._read_chunk)
        keys = [key(i) for i in range(pages)]
        assert await conn.put(NS, keys, [page(i, size) for i in range(pages)]) == [True] * pages
        assert await conn.get_into(NS, keys, [memoryview(bytearray(size)) for _ in keys]) == [True] * pages
        assert sorted(seen) == sorted(
            [("_write_chunk", n) for n in jobs] + [("_read_chunk", n) for n in jobs]
        )


@pytest.mark.parametrize("idle", [True, False])
async def test_writes_run_at_a_lower_cpu_priority_than_reads(tmp_path, idle) -> None:
    # Backups are background work: their threads are niced by storage.file.write_nice and, with
    # write_sched_idle, run under SCHED_IDLE; reads are not.
    async with started(tmp_path, io_threads=2, write_nice=7, write_sched_idle=idle) as conn:
        seen: dict[str, tuple[int, int]] = {}

        def spy(fn, what):
            def chunk(namespace, keys, views, stop):
                tid = threading.get_native_id()
                seen[what] = (os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid))
                return fn(namespace, keys, views, stop)

            return chunk

        conn._write_chunk = spy(conn._write_chunk, "write")
        conn._read_chunk = spy(conn._read_chunk, "read")
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert await conn.put(NS, [key(1)], [page(1, 4 * KiB)]) == [True]
        assert await conn.get_into(NS, [key(1)], [memoryview(bytearray(4 * KiB))]) == [True]
        policy = os.sched_getscheduler(0)
        if conn._engines is not None:  # the C engines' threads, each of them
            for what, engine in zip(("read", "write"), conn._engines, strict=True):
                tids = engine.info["thread_ids"]
                assert len(tids) == 2
                priorities = {(os.getpriority(os.PRIO_PROCESS, t), os.sched_getscheduler(t)) for t in tids}
                names = {pathlib.Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tids}
                assert names == {"hicached-file" if what == "read" else "hicached-file-w"}
                assert len(priorities) == 1
                seen[what] = priorities.pop()
        assert seen == {
            "write": (min(19, base + 7), os.SCHED_IDLE if idle else policy),
            "read": (base, policy),
        }


# The C path's short-transfer loop cannot be reached from here (it calls preadv/pwritev itself): only
# the Python path is run, with os.preadv/os.pwritev cut short.
@pytest.mark.parametrize("page_io", ["python"], indirect=True)
@pytest.mark.parametrize("size", [64 * KiB, 256 * KiB + 17, 2 * MiB + 5])  # one chunk, two, several
async def test_short_writes_and_reads_are_completed(tmp_path, monkeypatch, size: int) -> None:
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = {"w": 0, "r": 0}

    def _cut(bufs, limit):
        out, left = [], limit
        for b in bufs:
            b = memoryview(b)
            if left <= 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return out

    def pwritev(fd, bufs, offset):
        calls["w"] += 1
        return real_pwritev(fd, _cut(bufs, 10_000), offset)

    def preadv(fd, bufs, offset):
        calls["r"] += 1
        return real_preadv(fd, _cut(bufs, 10_000), offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    async with started(tmp_path) as conn:
        assert await conn.put(NS, [key(1)], [page(1, size)]) == [True]
        buf = memoryview(bytearray(size))
        assert await conn.get_into(NS, [key(1)], [buf]) == [True]
        assert buf == page(1, size)
        assert calls["w"] >= size // 10_000 and calls["r"] >= size // 10_000  # every call was cut short


@pytest.mark.parametrize("page_io", ["python"], indirect=True)  # a full disk, from os.pwritev
async def test_write_error_is_a_counted_false_and_leaves_no_temp_file(tmp_path, monkeypatch) -> None:
    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    async with started(tmp_path) as conn:
        monkeypatch.setattr(os, "pwritev", full)
        assert await conn.put(NS, [key(1), key(2)], [page(1, 4 * KiB), page(2, 4 * KiB)]) == [False, False]
        assert conn.counters["errors.ENOSPC"] == 2
        assert no_temp_files(conn)
        monkeypatch.undo()
        assert await conn.exists(NS, [key(1)]) == 0


async def test_failed_rename_is_a_counted_false_and_leaves_no_temp_file(tmp_path) -> None:
    # A directory where the page file should go: the page is written, then its rename fails.
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(2)], [page(2, 4 * KiB)])  # makes the namespace's tree
        os.makedirs(os.path.join(os.path.dirname(path_of(conn, key(1))), key(1), "x"))
        for size in (4 * KiB, 600 * KiB):  # one chunk; several, the header last
            assert await conn.put(NS, [key(1), key(3)], [page(1, size), page(3, size)]) == [False, True]
        assert sum(v for k, v in conn.counters.items() if k.startswith("errors.")) == 2
        assert no_temp_files(conn)
        assert await conn.get_into(NS, [key(3)], [memoryview(bytearray(600 * KiB))]) == [True]


async def test_file_in_place_of_a_shard_directory(tmp_path) -> None:
    async with started(tmp_path) as conn:
        bad, good = "ab" + "0" * 62, "cd" + "0" * 62
        os.makedirs(os.path.join(conn.root, NS))
        write_file(os.path.join(conn.root, NS, "ab"), b"in the way")
        assert await conn.put(NS, [bad, good], [page(1, 4 * KiB), page(2, 4 * KiB)]) == [False, True]
        assert sum(v for k, v in conn.counters.items() if k.startswith("errors.")) == 1
        buf = memoryview(bytearray(4 * KiB))
        assert await conn.get_into(NS, [bad], [buf]) == [False]
        assert await conn.exists(NS, [bad]) == 0
        assert await conn.exists(NS, [good]) == 1


async def test_removed_shard_directories_are_made_again(tmp_path) -> None:
    async with started(tmp_path) as conn:
        a, b = "ab" + "0" * 62, "ab" + "1" * 62  # same shard
        assert await conn.put(NS, [a], [page(1, 4 * KiB)]) == [True]
        shutil.rmtree(os.path.join(conn.root, NS))
        assert await conn.put(NS, [b, a], [page(2, 4 * KiB), page(1, 4 * KiB)]) == [True, True]
        assert await conn.exists(NS, [a, b]) == 2
        assert stat.S_IMODE(os.stat(os.path.dirname(path_of(conn, a))).st_mode) == 0o700


async def test_new_shards_are_made_within_the_job(tmp_path, monkeypatch, page_io: str) -> None:
    # The C page I/O makes the shard directories of a fresh tree itself (a return to Python and a second
    # call for most pages cost ~14 % of a put of 256 KiB pages); the Python path makes them in _make_shard.
    async with started(tmp_path) as conn:
        made = []
        real = conn._make_shard
        monkeypatch.setattr(conn, "_make_shard", lambda *a: made.append(a) or real(*a))
        keys = [f"{i:02x}{i:02x}" + "0" * 60 for i in range(16)]  # sixteen shards, none there yet
        assert await conn.put(NS, keys, [page(i, 4 * KiB) for i in range(16)]) == [True] * 16
        assert (made == []) is (page_io == "native")
        for k in keys:
            for d in (os.path.dirname(path_of(conn, k)), os.path.dirname(os.path.dirname(path_of(conn, k)))):
                assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(conn.root, NS)).st_mode) == 0o700


async def test_root_is_checked_only_after_a_failure(tmp_path, monkeypatch) -> None:
    async with started(tmp_path) as conn:
        checks = []
        real = conn._check_root
        monkeypatch.setattr(conn, "_check_root", lambda: checks.append(1) or real())
        keys = [key(i) for i in range(16)]
        assert await conn.put(NS, keys, [page(i, 4 * KiB) for i in range(16)]) == [True] * 16
        assert await conn.get_into(NS, keys, [memoryview(bytearray(4 * KiB)) for _ in keys]) == [True] * 16
        assert checks == []
        missing = [key(i) for i in range(100, 116)]
        assert (
            await conn.get_into(NS, missing, [memoryview(bytearray(4 * KiB)) for _ in missing])
            == [False] * 16
        )
        # Once for the job, not once per missing page; the C engine checks it in the job itself.
        assert checks == ([] if conn._engines is not None else [1])


async def test_invalid_namespace_or_key_never_escapes_the_root(tmp_path) -> None:
    async with started(tmp_path) as conn:
        for ns in ["..", ".", "../x", "a/b", ""]:
            assert await conn.put(ns, [key(1)], [page(1, 100)]) == [False]
            assert await conn.get_into(ns, [key(1)], [memoryview(bytearray(100))]) == [False]
            assert await conn.exists(ns, [key(1)]) == 0
            assert await conn.delete(ns, [key(1)]) == 0
        for k in ["../../x", "a/b", "", "x" * 129]:
            assert await conn.put(NS, [k], [page(1, 100)]) == [False]
            assert await conn.get_into(NS, [k], [memoryview(bytearray(100))]) == [False]
            assert await conn.exists(NS, [k]) == 0
        assert os.listdir(tmp_path) == ["data"]
        assert os.listdir(conn.root) == []


async def test_vanished_root_fails_the_whole_call(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(1)], [page(1, 100)])
        os.rename(conn.root, str(tmp_path / "moved"))
        buf = memoryview(bytearray(100))
        for call in (
            conn.put(NS, [key(2)], [page(2, 100)]),
            conn.get_into(NS, [key(1)], [buf]),
            conn.exists(NS, [key(1)]),
            conn.delete(NS, [key(1)]),
        ):
            with pytest.raises(BackendUnavailable) as e:
                await call
            assert e.value.reason == "ENOENT" and e.value.code == "backend_unavailable"
        assert not exists(conn.root)  # a put must not quietly re-create it


@stall.needs_stall
async def test_timeout_raises_backend_unavailable(tmp_path) -> None:
    async with started(tmp_path, io_threads=1, operation_timeout="50ms") as conn:
        # A write whose thread hangs in the middle of its page (a disk that stopped answering); a write
        # queued behind it on the one write thread times out as well.
        stuck = stall.StalledMemory(64 * KiB)
        # (With its checksum: the Python path hashes a page that comes without one before writing it,
        # holding the GIL, and the stalled memory would stop every thread.)
        for call in (conn.put(NS, [key(2)], [stuck.view], [1]), conn.put(NS, [key(3)], [page(3, 100)])):
            with pytest.raises(BackendUnavailable) as e:
                await call
            assert e.value.reason == "timeout"
        assert conn.counters["errors.timeout"] >= 2
        stuck.release()  # the thread is free again; the write it had begun was given up: not published
        conn._timeout = 30.0  # 50 ms is short on a busy CI
        assert await conn.put(NS, [key(1)], [page(1, 100)]) == [True]
        assert await conn.exists(NS, [key(1)]) == 1
        buf = memoryview(bytearray(100))
        assert await conn.get_into(NS, [key(1)], [buf]) == [True] and buf == page(1, 100)
        assert not exists(path_of(conn, key(2))) and not exists(path_of(conn, key(3)))
        assert no_temp_files(conn)
        stuck.close()


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


@stall.needs_stall
async def test_a_put_given_up_holds_its_buffers_until_its_thread_lets_go(tmp_path) -> None:
    # The regression behind wrong KV in L3: a put answered at its time-out while an io thread was still in
    # the middle of a page; the caller reused the slot and the thread published the new bytes. Now the
    # call's Hold keeps the buffers until the thread ends, and what it finishes is not renamed into place.
    async with started(tmp_path, io_threads=1, operation_timeout="100ms") as conn:
        stuck = stall.StalledMemory(64 * KiB)
        hold = Hold()
        keys = [key(1), key(2)]
        with pytest.raises(BackendUnavailable):
            await conn.put(NS, keys, [stuck.view, page(2, 100)], [123, None], hold=hold)
        assert not hold.released and hold.pending == 1
        let_go = []
        hold.when_released(lambda: let_go.append(1))
        # A second call queued behind the stuck one and given up never began: it holds nothing.
        second = Hold()
        with pytest.raises(BackendUnavailable):
            await conn.put(NS, [key(3)], [page(3, 100)], hold=second)
        await _until(lambda: second.released)
        stuck.release()
        await _until(lambda: hold.released)
        assert let_go == [1]
        assert not any(exists(path_of(conn, k)) for k in (*keys, key(3)))
        assert no_temp_files(conn)
        stuck.close()


@stall.needs_stall
async def test_a_get_given_up_holds_its_buffers_until_its_thread_lets_go(tmp_path) -> None:
    # A read that lands in a slot after its call was answered must not land in a slot handed to another
    # page meanwhile: the Hold keeps it until the read ended.
    async with started(tmp_path, io_threads=1, operation_timeout="100ms") as conn:
        assert await conn.put(NS, [key(1)], [page(1, 64 * KiB)]) == [True]
        stuck = stall.StalledMemory(64 * KiB)
        hold = Hold()
        with pytest.raises(BackendUnavailable):
            await conn.get_into(NS, [key(1)], [stuck.view], hold=hold)
        assert not hold.released
        stuck.release()
        await _until(lambda: hold.released)
        stuck.close()


async def test_objects_that_are_not_pages_are_misses_at_once(tmp_path) -> None:
    # One odd object must never be an outage: a FIFO (whose open would wait for a writer), a directory
    # and a symlink at page paths, and a shard or namespace directory that is a symlink leading out of the
    # root, are misses without waiting for the time-out, and never lead outside the root.
    async with started(tmp_path, operation_timeout="10s") as conn:
        good = [key(10)]
        assert await conn.put(NS, good, [page(10, 100)]) == [True]
        fifo, directory, link = key(1), key(2), key(3)
        for k in (fifo, directory, link):
            os.makedirs(os.path.dirname(path_of(conn, k)), exist_ok=True)
        os.mkfifo(path_of(conn, fifo), 0o600)
        os.mkdir(path_of(conn, directory))
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "page").write_bytes(b"x" * 132)
        os.symlink(outside / "page", path_of(conn, link))
        shard_link = "ff" + "0" * 62  # its shard directory ff/00 is a symlink out of the root
        os.makedirs(os.path.join(conn.root, NS, "ff"))
        os.symlink(outside, os.path.join(conn.root, NS, "ff", "00"))
        (outside / shard_link).write_bytes(b"x" * 132)
        os.symlink(outside, os.path.join(conn.root, "ns-link"))  # a namespace directory that is a symlink
        keys = [fifo, directory, link, shard_link, *good]
        bufs = [memoryview(bytearray(100)) for _ in keys]
        start = time.monotonic()
        assert await conn.get_into(NS, keys, bufs) == [False, False, False, False, True]
        assert await conn.get_into("ns-link", [shard_link], bufs[:1]) == [False]
        assert await conn.exists(NS, [fifo]) == 0 and await conn.exists(NS, [shard_link]) == 0
        assert time.monotonic() - start < 5  # not one of them waited for operation_timeout
        # Writes never follow them out either, and nothing out there is removed.
        assert await conn.put(NS, [shard_link], [page(1, 100)]) == [False]
        assert await conn.put("ns-link", [key(5)], [page(5, 100)]) == [False]
        assert await conn.delete(NS, [shard_link]) == 0
        assert sorted(os.listdir(outside)) == sorted(["page", shard_link])
        assert (outside / shard_link).read_bytes() == b"x" * 132
        assert conn.counters["not_a_page"] >= 2
        await conn.probe(timeout=5)  # the store as a whole still works


async def test_closed_connector_raises(tmp_path) -> None:
    conn = make(tmp_path)
    await conn.start()
    await conn.close()
    with pytest.raises(BackendUnavailable) as e:
        await conn.exists(NS, [key(1)])
    assert e.value.reason == "closed"


async def test_mismatched_lengths_and_readonly_buffers_are_refused(tmp_path) -> None:
    async with started(tmp_path) as conn:
        with pytest.raises(ValueError):
            await conn.put(NS, [key(1)], [])
        with pytest.raises(ValueError):
            await conn.get_into(NS, [key(1)], [memoryview(b"x")])


# Capacity bound: the janitor removes the least recently used pages once the tree passes max_bytes.

PAGE = 4 * KiB
FILE = header.HEADER_SIZE + PAGE  # bytes of one page file


def tree_bytes(conn: FileConnector) -> int:
    """Bytes of the page files under root, seen from outside (temporary files left out)."""
    paths = glob.glob(os.path.join(conn.root, "*", "*", "*", "*"))
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def set_last_use(path: str, when: float) -> None:
    os.utime(path, (when, when))


async def janitor_done(conn: FileConnector) -> None:
    """Waits for the janitor's work to end (without a bound and with no crash leftovers: the scan at start).
    close() does not wait for a scan's thread, which stops only at its next shard: a scan still walking the
    tree after close() removes the temporary files a test plants next, for a connector that is gone."""
    await conn._janitor


async def stop_janitor(conn: FileConnector) -> None:
    """Leaves the janitor's work to the test's own enforce_bound() calls, so that runs are deterministic."""
    await conn._scanned.wait()
    conn._janitor.cancel()
    await asyncio.gather(conn._janitor, return_exceptions=True)


async def test_bound_removes_the_least_recently_used_pages(tmp_path) -> None:
    async with started(tmp_path, max_bytes=10 * FILE, low_watermark=0.5) as conn:
        await stop_janitor(conn)
        keys = [key(i) for i in range(14)]
        assert await conn.put(NS, keys, [page(i, PAGE) for i in range(14)]) == [True] * 14
        assert conn.stored_bytes == 14 * FILE
        old = time.time() - 3600
        for i, k in enumerate(keys):  # written in this order, an hour ago
            set_last_use(path_of(conn, k), old + i)
        assert await conn.get_into(NS, [keys[0]], [memoryview(bytearray(PAGE))]) == [True]  # read: now newest
        assert os.stat(path_of(conn, keys[0])).st_mtime > old + 1800  # marked used whatever atime does

        assert await conn.enforce_bound() == 9  # from 14 pages down to 0.5 * 10
        assert conn.stored_bytes == tree_bytes(conn) == 5 * FILE
        assert (conn.counters["evictions"], conn.counters["evicted_bytes"]) == (9, 9 * FILE)
        survivors = [keys[0], *keys[10:]]
        bufs = [memoryview(bytearray(PAGE)) for _ in survivors]
        assert await conn.get_into(NS, survivors, bufs) == [True] * 5
        assert bufs == [page(i, PAGE) for i in (0, 10, 11, 12, 13)]
        # An evicted page is an ordinary miss.
        assert await conn.get_into(NS, [keys[1]], [memoryview(bytearray(PAGE))]) == [False]
        assert await conn.exists(NS, keys[1:]) == 0
        assert conn.counters["misses"] == 1 and not any(k.startswith("corrupt.") for k in conn.counters)
        # Under the bound, a run removes nothing.
        assert await conn.enforce_bound() == 0
        assert conn.stored_bytes == 5 * FILE


async def test_page_used_after_the_scan_is_not_evicted(tmp_path, monkeypatch) -> None:
    async with started(tmp_path, max_bytes=2 * FILE, low_watermark=0.5) as conn:
        await stop_janitor(conn)
        keys = [key(i) for i in range(3)]
        await conn.put(NS, keys, [page(i, PAGE) for i in range(3)])
        old = time.time() - 3600
        for i, k in enumerate(keys):
            set_last_use(path_of(conn, k), old + i)
        real_scan = file_janitor.scan

        def scan_then_read(root, stop, collect, **kw):
            out = real_scan(root, stop, collect, **kw)
            set_last_use(path_of(conn, keys[0]), time.time())  # read by someone between scan and unlink
            return out

        monkeypatch.setattr(file_janitor, "scan", scan_then_read)
        assert await conn.enforce_bound() == 2
        assert await conn.exists(NS, keys[:1]) == 1 and await conn.exists(NS, keys[1:2]) == 0


async def test_estimate_follows_overwrites_deletes_and_corrupt_pages(tmp_path) -> None:
    async with started(tmp_path, max_bytes=100 * FILE) as conn:
        await stop_janitor(conn)
        keys = [key(i) for i in range(3)]
        await conn.put(NS, keys, [page(i, PAGE) for i in range(3)])
        await conn.put(NS, keys[:1], [page(9, PAGE)])  # replaces a page: the tree does not grow
        assert conn.stored_bytes == 3 * FILE
        assert await conn.delete(NS, keys[1:2]) == 1
        assert conn.stored_bytes == 2 * FILE
        _flip(path_of(conn, keys[2]), header.HEADER_SIZE + 5)
        assert await conn.get_into(NS, keys[2:], [memoryview(bytearray(PAGE))]) == [False]
        assert conn.stored_bytes == tree_bytes(conn) == FILE


async def test_startup_scan_counts_existing_pages_and_removes_stale_temp_files(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(i) for i in range(3)], [page(i, PAGE) for i in range(3)])
        shard = os.path.dirname(path_of(conn, key(0)))
        await janitor_done(conn)  # else its scan may remove `stale` below, and the next daemon count none
    stale, fresh = os.path.join(shard, f".{key(0)}.dead0.tmp"), os.path.join(shard, f".{key(1)}.live0.tmp")
    write_file(stale, b"left by a crash")
    set_last_use(stale, time.time() - 3600)
    write_file(fresh, b"a write in flight")

    async with started(tmp_path) as conn:  # no bound: one scan at start, and one when `fresh` is stale
        await conn._scanned.wait()
        assert conn.stored_bytes == 3 * FILE
        assert conn.counters["stale_temp_removed"] == 1
        assert not exists(stale) and exists(fresh)
        assert conn.counters["evictions"] == 0
        assert not conn._janitor.done()  # waits for `fresh` to turn stale


@pytest.mark.parametrize("max_bytes", [0, 100 * FILE])
async def test_temp_files_of_a_crash_just_before_the_start_are_removed_once_stale(
    tmp_path, monkeypatch, max_bytes: int
) -> None:
    # A crash, and a restart (systemd: 2 s later): its temporary files are too young for the scan at start;
    # a later scan removes them, with or without a bound, and without another restart.
    async with started(tmp_path) as conn:
        await conn.put(NS, [key(0)], [page(0, PAGE)])
        shard = os.path.dirname(path_of(conn, key(0)))
        await janitor_done(conn)  # else its scan may remove `left` below once stale, uncounted
    left = os.path.join(shard, f".{key(1)}.dead0c7.tmp")
    write_file(left, b"left by a crash")
    monkeypatch.setattr(file_janitor, "STALE_TMP_S", 1.0)
    async with started(tmp_path, max_bytes=max_bytes, janitor_interval="1h") as conn:
        await conn._scanned.wait()
        for _ in range(500):  # bounds are generous: CI machines are shared and slow at times
            if conn.counters["stale_temp_removed"]:  # counted once the scan is back: after the unlink
                break
            await asyncio.sleep(0.01)
        assert not exists(left)
        assert conn.counters["stale_temp_removed"] == 1
        if not max_bytes:  # nothing left to wait for: done, as with no crash at all
            await asyncio.wait_for(asyncio.shield(conn._janitor), 10)


def test_the_daemons_own_writes_in_flight_are_not_crash_leftovers(tmp_path) -> None:
    shard = tmp_path / NS / "ab" / "cd"
    shard.mkdir(parents=True)
    for name in (".k1.mine0.tmp", ".k2.minec12.tmp"):  # the Python path's name, the C path's
        write_file(str(shard / name), b"in flight")
    assert file_janitor.scan(str(tmp_path), threading.Event(), False, own_tag="mine")[3] is None
    write_file(str(shard / ".k3.other0.tmp"), b"left by a crash")
    due = file_janitor.scan(str(tmp_path), threading.Event(), False, own_tag="mine")[3]
    assert due is not None and due > time.time() + file_janitor.STALE_TMP_S - 60


async def test_janitor_runs_when_a_put_crosses_the_bound(tmp_path) -> None:
    conn = make(tmp_path, max_bytes=10 * FILE, janitor_interval="1h")
    evicted = asyncio.Event()
    real = conn.enforce_bound

    async def enforce_bound() -> int:
        n = await real()
        if n:
            evicted.set()
        return n

    conn.enforce_bound = enforce_bound
    await conn.start()
    try:
        await conn._scanned.wait()
        keys = [key(i) for i in range(12)]
        assert await conn.put(NS, keys, [page(i, PAGE) for i in range(12)]) == [True] * 12
        await asyncio.wait_for(evicted.wait(), 10)  # a guard, not a measure: the run starts at once
        assert conn.stored_bytes == tree_bytes(conn) == 9 * FILE  # down to 0.9 * 10 pages
        hits = await conn.get_into(NS, keys, [memoryview(bytearray(PAGE)) for _ in keys])
        assert hits.count(True) == 9
    finally:
        await conn.close()


async def test_close_leaves_no_task_even_during_a_scan(tmp_path) -> None:
    conn = make(tmp_path, max_bytes=10 * FILE)
    release = threading.Event()
    blocker = conn._scan_executor.submit(release.wait, 5)  # the startup scan queues behind it
    await conn.start()
    try:
        await asyncio.sleep(0)
        assert not conn._janitor.done()
    finally:
        await conn.close()
        release.set()
    assert conn._janitor.done()
    blocker.result(5)
    assert not conn._scanned.is_set()  # the run was cancelled; its thread stopped at once


@pytest.mark.parametrize(
    "section, path",
    [
        ({"low_watermark": 1.0}, "storage.file.low_watermark"),
        ({"low_watermark": 0}, "storage.file.low_watermark"),
        ({"janitor_interval": "0s"}, "storage.file.janitor_interval"),
        ({"max_bytes": -1}, "storage.file.max_bytes"),
    ],
)
def test_bound_settings_are_checked(tmp_path, section, path: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        make(tmp_path, **section)
    assert e.value.path == path


def test_bound_defaults_to_none(tmp_path) -> None:
    default = config.from_dict({}).storage.file
    assert (default.max_bytes, default.low_watermark, default.janitor_interval) == (0, 0.9, 30.0)
    cfg = config.from_dict({"storage": {"file": {"max_bytes": "2GiB", "janitor_interval": "5s"}}})
    assert (cfg.storage.file.max_bytes, cfg.storage.file.janitor_interval) == (2 << 30, 5.0)


@pytest.mark.parametrize("page_io", ["native"], indirect=True)
@pytest.mark.parametrize("size", [4 * KiB, 256 * KiB, 600 * KiB + 3])
async def test_both_page_io_paths_write_the_same_bytes_and_read_each_other(tmp_path, monkeypatch, size):
    keys = [key(i) for i in range(3)]
    pages = [page(i, size) for i in range(3)]
    async with started(tmp_path / "c") as native:
        monkeypatch.setattr(file_module, "_pageio", None)
        async with started(tmp_path / "py") as python:
            assert native._native is not None and python._native is None
            assert await native.put(NS, keys, pages) == [True] * 3
            assert await python.put(NS, keys, pages) == [True] * 3
            for k, p in zip(keys, pages, strict=True):
                with open(path_of(native, k), "rb") as a, open(path_of(python, k), "rb") as b:
                    data = a.read()
                    assert data == b.read()
                header.verify(data[: header.HEADER_SIZE], NS, k, p)
            # Each reads what the other wrote.
            for reader, writer in ((native, python), (python, native)):
                await reader.delete(NS, keys)
                for k in keys:
                    os.makedirs(os.path.dirname(path_of(reader, k)), exist_ok=True)
                    shutil.copyfile(path_of(writer, k), path_of(reader, k))
                bufs = [memoryview(bytearray(size)) for _ in keys]
                assert await reader.get_into(NS, keys, bufs) == [True] * 3
                assert bufs == pages


@pytest.mark.parametrize("page_io", ["native"], indirect=True)
def test_native_page_io_refuses_bad_arguments(tmp_path) -> None:
    io = file_module._pageio
    stop = bytearray(1)
    root = os.fsencode(tmp_path)
    with pytest.raises(ValueError):
        io.read_pages(NS, [key(1)], root, [bytearray(8), bytearray(8)], 1024, stop, -1.0)
    with pytest.raises(TypeError):
        io.read_pages(NS, (key(1),), root, [bytearray(8)], 1024, stop, -1.0)
    with pytest.raises(TypeError):
        io.read_pages(NS, [1], root, [bytearray(8)], 1024, stop, -1.0)
    with pytest.raises(TypeError):  # the root as str
        io.read_pages(NS, [key(1)], str(tmp_path), [bytearray(8)], 1024, stop, -1.0)
    with pytest.raises(BufferError):  # read into bytes
        io.read_pages(NS, [key(1)], root, [b"12345678"], 1024, stop, -1.0)
    with pytest.raises(ValueError):
        io.write_pages(NS, [key(1)], root, b"t", [b"x"], 0, stop, False, False)
    for ns in ("", ".", "..", "a/b", "n" * 129, "ns\x00"):
        with pytest.raises(ValueError, match="namespace"):
            io.write_pages(ns, [key(1)], root, b"t", [b"x"], 1024, stop, False, False)
    # A key that is not one (hicached.keys.valid_key) gets no name: nothing is touched, under the root or
    # outside it.
    bad = ["", "../../x", "a/b", ".hidden", "k" * 129, "caf\u00e9", "a b"]
    assert io.write_pages(NS, bad, root, b"t", [b"x"] * len(bad), 1024, stop, False, False) == (
        [io.BAD_KEY] * len(bad),
        0,
        0,
    )
    assert io.read_pages(NS, bad, root, [bytearray(1) for _ in bad], 1024, stop, -1.0) == (
        [io.BAD_KEY] * len(bad),
        0,
        0,
    )
    # A cancelled job touches nothing.
    stop[0] = 1
    assert io.write_pages(NS, [key(1)], root, b"t", [b"x"], 1024, stop, False, False) == (
        [io.CANCELLED],
        0,
        0,
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("page_io", ["native"], indirect=True)
async def test_both_page_io_paths_name_files_alike(tmp_path, monkeypatch) -> None:
    # Short keys are padded for their shard; the C names and FileConnector._path must agree on every key.
    keys = ["a", "ab", "abc", "abcd", "Z-_9x", key(7), "k" * 128]
    pages = [page(i, 5000) for i in range(len(keys))]
    trees = []
    for native in (True, False):
        root = tmp_path / ("c" if native else "py")
        if not native:
            monkeypatch.setattr(file_module, "_pageio", None)
        async with started(root) as conn:
            assert (conn._native is not None) is native
            assert await conn.put(NS, keys, pages) == [True] * len(keys)
            for k in keys:
                assert os.path.isfile(conn._path(NS, k))
            trees.append(sorted(os.path.relpath(p, root) for p in glob.glob(f"{root}/**/*", recursive=True)))
    assert trees[0] == trees[1]
    shutil.rmtree(tmp_path / "py")
    shutil.copytree(tmp_path / "c", tmp_path / "py")  # the Python path reads what C wrote
    async with started(tmp_path / "py") as conn:
        bufs = [memoryview(bytearray(5000)) for _ in keys]
        assert await conn.get_into(NS, keys, bufs) == [True] * len(keys) and bufs == pages


async def test_info_says_which_page_io_runs(tmp_path, page_io: str) -> None:
    async with started(tmp_path, io_threads=3) as conn:
        expected = {"root": conn.root, "io_threads": 3, "page_io": "c" if page_io == "native" else "python"}
        if page_io == "native":  # the C engines' jobs: none now
            expected |= {"reads_queued": 0, "reads_running": 0, "writes_queued": 0, "writes_running": 0}
        assert conn.info() == expected


@pytest.mark.parametrize("page_io", ["native"], indirect=True)
@pytest.mark.parametrize("seed", range(1, 9))
async def test_both_page_io_paths_judge_damaged_files_alike(tmp_path, monkeypatch, seed: int) -> None:
    # The same tree, damaged at random (flipped bytes anywhere, truncation, extension, emptied, removed),
    # read by both paths: the same hits, the same bytes, the same counters, the same files left.
    import random

    rnd = random.Random(seed)
    size = rnd.choice([4 * KiB, 256 * KiB + 5, 600 * KiB])
    keys = [key(i) for i in range(24)]
    pages = [page(i, size) for i in range(24)]
    async with started(tmp_path / "w") as writer:
        assert await writer.put(NS, keys, pages) == [True] * 24
        for k in keys:
            path = path_of(writer, k)
            damage = rnd.choice(["none", "none", "flip", "truncate", "extend", "empty", "remove"])
            if damage == "flip":
                _flip(path, rnd.randrange(header.HEADER_SIZE + size))
            elif damage == "truncate":
                os.truncate(path, rnd.randrange(1, header.HEADER_SIZE + size))
            elif damage == "extend":
                with open(path, "ab") as f:
                    f.write(b"x" * rnd.randrange(1, 5000))
            elif damage == "empty":
                _empty(path)
            elif damage == "remove":
                os.unlink(path)
    seen = []
    for native in (True, False):
        root = tmp_path / ("c" if native else "py")
        shutil.copytree(tmp_path / "w", root)
        if not native:
            monkeypatch.setattr(file_module, "_pageio", None)
        async with started(root) as conn:
            assert (conn._native is not None) is native
            bufs = [memoryview(bytearray(size)) for _ in keys]
            hits = await conn.get_into(NS, keys, bufs)
            got = [bytes(b) if h else None for b, h in zip(bufs, hits, strict=True)]
            left = sorted(os.path.relpath(p, root) for p in glob.glob(f"{root}/**/*", recursive=True))
            counters = {k: v for k, v in conn.counters.items() if v}  # the janitor's zeros come when they do
            seen.append((hits, got, counters, left))
    assert seen[0] == seen[1]
    hits = seen[0][0]
    assert [g for g, h in zip(seen[0][1], hits, strict=True) if h] == [
        bytes(p) for p, h in zip(pages, hits, strict=True) if h
    ]


async def test_longest_namespace_and_key(tmp_path) -> None:
    ns, k = "n" * 128, "k" * 128
    async with started(tmp_path) as conn:
        assert await conn.put(ns, [k], [page(1, 300 * KiB)]) == [True]
        buf = memoryview(bytearray(300 * KiB))
        assert await conn.get_into(ns, [k], [buf]) == [True] and buf == page(1, 300 * KiB)


@pytest.mark.parametrize("page_io", ["native"], indirect=True)
def test_native_page_io_takes_the_longest_names(tmp_path) -> None:
    # The longest namespace and key the daemon accepts: their key tag and names fit.
    io, stop = file_module._pageio, bytearray(1)
    ns, k = "n" * 128, "k" * 128
    data = page(3, 5000)
    os.makedirs(tmp_path / ns / "kk" / "kk")
    assert io.write_pages(ns, [k], os.fsencode(tmp_path), b"t", [data], 1024, stop, False, False)[0] == [0]
    with open(tmp_path / ns / "kk" / "kk" / k, "rb") as f:
        header.verify(f.read(header.HEADER_SIZE), ns, k, data)
    buf = bytearray(5000)
    assert io.read_pages(ns, [k], os.fsencode(tmp_path), [buf], 1024, stop, -1.0) == ([0], 0, 0)
    assert buf == data
