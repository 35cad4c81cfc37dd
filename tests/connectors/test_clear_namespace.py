"""clear_namespace on every L3 backend (file, redis, redis-cluster, s3) on real stores: it removes every page
of one namespace and nothing of any other, those whose name starts with the same letters included; and
what only the file backend has to get right (symlinks, trash left by a crash, the byte estimate)."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import threading
import time
from pathlib import Path

import pytest
from hicached.connectors import BackendUnavailable, Connector, file_janitor, header
from hicached.connectors import file as file_module
from hicached.connectors.base import BackendUnsupported
from hicached.connectors.file import FileConnector

from hicached import config

NS = "ns"
# Namespaces whose names start as NS's does (or NS's as theirs): a clear of NS leaves them whole.
OTHERS = ["ns2", "ns.x", "ns-", "n", "ns~0123456789abcdef"]  # the last: NS after a clear (its epoch's name)
SIZE = 4 * 1024
# Only a guard against a hang: the calls themselves are bounded by storage.operation_timeout.
GUARD_S = 60


def key(i: int) -> str:
    return f"{i:064x}"


def page(ns: str, i: int, size: int = SIZE) -> memoryview:
    seed = ns.encode() + i.to_bytes(4, "little")
    return memoryview(((seed + bytes(range(251))) * (size // 251 + 1))[:size])


async def fill(conn: Connector, ns: str, n: int, size: int = SIZE) -> list[str]:
    keys = [key(i) for i in range(n)]
    for start in range(0, n, 256):
        batch = keys[start : start + 256]
        pages = [page(ns, start + i, size) for i in range(len(batch))]
        assert await conn.put(ns, batch, pages) == [True] * len(batch)
    return keys


async def assert_gone(conn: Connector, ns: str, keys: list[str], size: int = SIZE) -> None:
    assert await conn.exists(ns, keys) == 0
    assert await conn.present(ns, keys) == [False] * len(keys)
    bufs = [memoryview(bytearray(size)) for _ in keys]
    assert await conn.get_into(ns, keys, bufs) == [False] * len(keys)


async def assert_intact(conn: Connector, ns: str, keys: list[str], size: int = SIZE) -> None:
    assert await conn.exists(ns, keys) == len(keys)
    bufs = [memoryview(bytearray(size)) for _ in keys]
    assert await conn.get_into(ns, keys, bufs) == [True] * len(keys)
    for i, buf in enumerate(bufs):
        assert buf == page(ns, i, size), f"{ns}/{keys[i]} does not read back as written"


async def test_clear_removes_every_page_of_its_namespace_and_nothing_else(backend) -> None:
    async with backend.connector() as conn:
        keys = await fill(conn, NS, 40)
        for ns in OTHERS:
            await fill(conn, ns, 10)
        assert await conn.clear_namespace(NS) == 40
        assert conn.counters["deletes"] == 40
        await assert_gone(conn, NS, keys)
        for ns in OTHERS:
            await assert_intact(conn, ns, keys[:10])
        assert not [k for k in conn.counters if k.startswith(("errors.", "corrupt."))], conn.counters


async def test_clear_of_a_namespace_under_its_epoch_leaves_its_other_names(backend) -> None:
    """After its first clear a namespace's objects live under `ns~{epoch}` (hicached.daemon.sched.epochs):
    a clear of one epoch's name removes its pages only, neither the namespace's first name nor another
    epoch's."""
    epoch, other = "ns~00000000000000aa", "ns~00000000000000bb"
    async with backend.connector() as conn:
        keys = await fill(conn, epoch, 12)
        for ns in (NS, other):
            await fill(conn, ns, 6)
        assert await conn.clear_namespace(epoch) == 12
        await assert_gone(conn, epoch, keys)
        for ns in (NS, other):
            await assert_intact(conn, ns, keys[:6])


async def test_clear_of_a_namespace_larger_than_one_round(backend) -> None:
    """More pages than one SCAN round or one listing page (1000) holds: every one goes, across rounds."""
    n = 1100
    async with backend.connector(operation_timeout=GUARD_S) as conn:
        keys = await fill(conn, NS, n, 64)
        await fill(conn, "ns2", 3, 64)
        assert await conn.clear_namespace(NS) == n
        assert await conn.present(NS, keys) == [False] * n
        await assert_intact(conn, "ns2", keys[:3], 64)


async def test_clearing_an_empty_unknown_or_invalid_namespace_removes_nothing(backend) -> None:
    async with backend.connector() as conn:
        keys = await fill(conn, NS, 5)
        assert await conn.clear_namespace("never-written") == 0
        for invalid in [
            "",
            ".",
            "..",
            "n*",
            "n?",
            "n[s]",
            "ns/",
            "ns:",
            "a/b",
            "../ns",
            ".trash~x",
            "x" * 129,
        ]:
            assert await conn.clear_namespace(invalid) == 0, invalid
        await assert_intact(conn, NS, keys)
        assert await conn.clear_namespace(NS) == 5
        assert await conn.clear_namespace(NS) == 0  # cleared already
        assert conn.counters["deletes"] == 5


async def test_a_cleared_namespace_takes_pages_again(backend) -> None:
    async with backend.connector() as conn:
        keys = await fill(conn, NS, 8)
        assert await conn.clear_namespace(NS) == 8
        await assert_gone(conn, NS, keys)
        assert await fill(conn, NS, 8) == keys
        await assert_intact(conn, NS, keys)
        assert await conn.clear_namespace(NS) == 8


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"], indirect=True)
@pytest.mark.parametrize("glob_char", ["*", "?", "[x]", "\\"])
async def test_redis_escapes_glob_characters_of_the_prefix(backend, glob_char: str) -> None:
    """A prefix with characters SCAN's MATCH treats specially. Unescaped, `{p}*:ns:*` and `{p}?:ns:*` would
    also match the pages of the neighbouring prefix (which must stay), and `{p}[x]:ns:*` and `{p}\\:ns:*`
    would match only the neighbour's (`{p}x`, `{p}`), none of the namespace's own."""
    base = backend.prefix
    neighbour = {"*": "xx", "?": "x", "[x]": "x", "\\": ""}[glob_char]
    async with (
        backend.connector(prefix=base + glob_char) as odd,
        backend.connector(prefix=base + neighbour) as other,
    ):
        keys = await fill(odd, NS, 6)
        await fill(other, NS, 6)
        assert await odd.clear_namespace(NS) == 6
        await assert_gone(odd, NS, keys)
        await assert_intact(other, NS, keys)


@pytest.mark.parametrize("backend", ["redis", "redis-cluster", "s3"], indirect=True)
async def test_objects_that_are_not_pages_of_the_namespace_are_left(backend) -> None:
    """Redis and S3 remove only names a page of the namespace could have: `{prefix}:ns:{key}` and
    `{prefix}/ns/{key}`, not deeper names beneath them. (The file backend owns its namespace's directory,
    and removes all of it.)"""
    sep = "/" if backend.kind == "s3" else ":"
    deeper = f"sub{sep}{key(1)}"
    async with backend.connector() as conn:
        keys = await fill(conn, NS, 3)
        await asyncio.to_thread(backend.replace, NS, deeper, b"not a page of ours")
        assert await conn.clear_namespace(NS) == 3
        assert await asyncio.to_thread(backend.raw, NS, deeper) == b"not a page of ours"
        await assert_gone(conn, NS, keys)


async def test_the_default_for_a_backend_that_cannot_clear_is_unsupported() -> None:
    class Bare(Connector):
        name = "bare"

        async def put(self, namespace, keys, payloads, checksums=None, hold=None):
            return []

        async def get_into(self, namespace, keys, buffers, hold=None):
            return []

        async def exists(self, namespace, keys):
            return 0

        async def delete(self, namespace, keys):
            return 0

    with pytest.raises(BackendUnsupported) as err:
        await Bare().clear_namespace(NS)
    assert (err.value.code, err.value.reason) == ("unsupported", "unsupported")


# Redis and S3 behind a proxy that stalls them.


async def test_a_stalled_store_fails_the_clear_within_the_timeout(stallable) -> None:
    harness, proxy = stallable
    fast = {"socket_timeout": 0.2} if harness.kind == "redis" else {"read_timeout": 0.2, "max_attempts": 1}
    async with harness.connector(operation_timeout=0.5, **fast) as conn:
        keys = await fill(conn, NS, 5)
        proxy.stall()
        try:
            start = time.monotonic()
            with pytest.raises(BackendUnavailable) as err:
                async with asyncio.timeout(GUARD_S):
                    await conn.clear_namespace(NS)
            assert time.monotonic() - start < 5
            assert err.value.code == "backend_unavailable"
            assert conn.counters["errors.timeout"] >= 1
        finally:
            proxy.resume()
        assert await conn.clear_namespace(NS) == 5
        await assert_gone(conn, NS, keys)


async def test_a_store_stalled_midway_fails_the_clear_and_a_second_clear_ends_it(stallable) -> None:
    """The store stops answering after the clear's first round trip (a SCAN, a listing): the next one
    ends at the time-out. What the first rounds removed is counted; the next clear removes the rest."""
    harness, proxy = stallable
    n = 1500  # more than one round: the clear must go back to the store after the stall
    fast = {"socket_timeout": 0.5} if harness.kind == "redis" else {"read_timeout": 0.5, "max_attempts": 1}
    async with harness.connector(operation_timeout=GUARD_S, **fast) as conn:
        keys = await fill(conn, NS, n, 64)
        await fill(conn, "ns2", 3, 64)
    async with harness.connector(operation_timeout=1.0, **fast) as conn:
        # Redis: a first call names the nodes to scan (no I/O), then come SCANs and UNLINK pipelines; S3:
        # listings and DeleteObjects. Stalled after the first round's removal.
        stall_after = 3 if harness.kind == "redis" else 2
        calls = 0
        real = conn._call

        async def call_then_stall(*args, **kw):
            nonlocal calls
            out = await real(*args, **kw)
            calls += 1
            if calls == stall_after:
                proxy.stall()
            return out

        conn._call = call_then_stall
        try:
            start = time.monotonic()
            with pytest.raises(BackendUnavailable) as err:
                async with asyncio.timeout(GUARD_S):
                    await conn.clear_namespace(NS)
            assert time.monotonic() - start < 10
            assert err.value.reason == "timeout"
        finally:
            proxy.resume()
        first = conn.counters["deletes"]
        assert 0 <= first < n
    async with harness.connector(operation_timeout=GUARD_S) as conn:
        assert await conn.clear_namespace(NS) == n - first
        assert await conn.present(NS, keys) == [False] * n
        await assert_intact(conn, "ns2", keys[:3], 64)


# The file backend.


def file_connector(tmp_path: Path, **file_cfg) -> FileConnector:
    storage = {"backend": "file", "file": {"root": "data", **file_cfg}}
    if "operation_timeout" in file_cfg:
        storage["operation_timeout"] = storage["file"].pop("operation_timeout")
    return FileConnector(config.from_dict({"storage": storage}, base_dir=str(tmp_path)))


@contextlib.asynccontextmanager
async def started(tmp_path: Path, **file_cfg):
    conn = file_connector(tmp_path, **file_cfg)
    await conn.start()
    try:
        yield conn
    finally:
        await conn.close()


def tree(path: Path) -> dict[str, bytes | str]:
    """Everything beneath `path`, symlinks not followed: file contents, link targets, and directories."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                out[rel] = Path(p).read_bytes()
    return out


def make_outside(tmp_path: Path) -> Path:
    """A directory outside the root, shaped like a namespace of pages (and a file beside them)."""
    outside = tmp_path / "outside"
    shard = outside / "00" / "00"
    shard.mkdir(parents=True)
    (shard / key(1)).write_bytes(b"precious")
    (outside / "note").write_bytes(b"also precious")
    return outside


def trash_names(conn: FileConnector) -> list[str]:
    return [n for n in os.listdir(conn.root) if n.startswith(file_janitor.TRASH_PREFIX)]


def tree_bytes(conn: FileConnector) -> int:
    """Bytes of the page files under root, seen from outside (hidden trees and temporary files left out)."""
    paths = glob.glob(os.path.join(conn.root, "*", "*", "*", "*"))
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


async def test_file_a_namespace_that_is_a_symlink_is_unlinked_never_followed(tmp_path) -> None:
    async with started(tmp_path) as conn:
        keys = await fill(conn, "ns2", 3)
        outside = make_outside(tmp_path)
        before = tree(outside)
        os.symlink(outside, os.path.join(conn.root, NS))
        assert await conn.exists(NS, [key(1)]) == 0  # never a page of ours
        assert await conn.clear_namespace(NS) == 0
        assert tree(outside) == before
        assert not os.path.lexists(os.path.join(conn.root, NS))
        assert trash_names(conn) == []
        await assert_intact(conn, "ns2", keys)
        assert await fill(conn, NS, 2) == keys[:2]  # a real namespace in its place


async def test_file_symlinks_inside_the_namespace_are_unlinked_never_followed(tmp_path) -> None:
    async with started(tmp_path) as conn:
        keys = await fill(conn, NS, 4)
        outside = make_outside(tmp_path)
        before = tree(outside)
        ns_dir = Path(conn.root) / NS
        os.symlink(outside, ns_dir / "zz")  # a shard level that leads out
        os.symlink(outside / "00", ns_dir / keys[0][0:2] / "zz")  # a shard that leads out
        os.symlink(outside / "note", ns_dir / keys[0][0:2] / keys[0][2:4] / key(99))  # a page that does
        (ns_dir / keys[0][0:2] / keys[0][2:4] / f".{key(98)}.dead0.tmp").write_bytes(b"a crashed write")
        assert await conn.clear_namespace(NS) == 4  # the page files; links and temporary files are not pages
        assert tree(outside) == before
        assert not os.path.lexists(ns_dir)
        assert trash_names(conn) == []


async def test_file_clear_keeps_the_byte_estimate(tmp_path) -> None:
    async with started(tmp_path, max_bytes="1GiB", janitor_interval="1h") as conn:
        await conn._scanned.wait()
        await fill(conn, NS, 20)
        keys = await fill(conn, "ns2", 5)
        assert conn.stored_bytes == 25 * (header.HEADER_SIZE + SIZE)
        assert await conn.clear_namespace(NS) == 20
        assert conn.stored_bytes == tree_bytes(conn) == 5 * (header.HEADER_SIZE + SIZE)
        await conn.enforce_bound()  # a scan: the exact count
        assert conn.stored_bytes == 5 * (header.HEADER_SIZE + SIZE)
        await assert_intact(conn, "ns2", keys)


def test_file_scan_counts_a_tree_being_cleared_and_skips_leftovers(tmp_path) -> None:
    """A tree this daemon is removing still takes its bytes (the clear takes them off as it goes) and offers
    no page to evict; a tree of another clear is not counted at all (the janitor removes it)."""
    for name, body in [(NS, b"p" * 10), (".trash~mine.1", b"q" * 100), (".trash~dead.1", b"r" * 1000)]:
        shard = tmp_path / name / "ab" / "cd"
        shard.mkdir(parents=True)
        (shard / key(1)).write_bytes(body)
        (shard / f".{key(2)}.x0.tmp").write_bytes(b"a temporary file")
    total, pages, _, _ = file_janitor.scan(str(tmp_path), threading.Event(), True, clearing={".trash~mine.1"})
    assert total == 110
    assert [p[3] for p in pages] == [str(tmp_path / NS / "ab" / "cd" / key(1))]
    assert list(file_janitor.shards(str(tmp_path))) == [str(tmp_path / NS / "ab" / "cd")]


async def test_file_trash_left_by_a_crash_is_removed_at_start(tmp_path) -> None:
    async with started(tmp_path) as conn:
        keys = await fill(conn, NS, 3)
        root = Path(conn.root)
    outside = make_outside(tmp_path)
    before = tree(outside)
    left = root / f"{file_janitor.TRASH_PREFIX}dead0.3"
    shard = left / "ab" / "cd"
    shard.mkdir(parents=True)
    (shard / key(7)).write_bytes(b"a page of a cleared namespace")
    os.symlink(outside, shard / "out")
    os.symlink(outside, left / "out")
    (root / f"{file_janitor.TRASH_PREFIX}dead0.4").symlink_to(outside)  # not even a directory

    async with started(tmp_path) as conn:
        await conn._scanned.wait()
        for _ in range(500):  # the scan's counters are set once it is back on the loop
            if conn.counters["stale_trash_removed"]:
                break
            await asyncio.sleep(0.01)
        assert conn.counters["stale_trash_removed"] == 2
        assert trash_names(conn) == []
        assert tree(outside) == before
        assert conn.stored_bytes == 3 * (header.HEADER_SIZE + SIZE)  # the trash never counted
        await assert_intact(conn, NS, keys)
        assert await conn.put(left.name, [key(1)], [page(NS, 1)]) == [False]  # no namespace takes its name
        assert await conn.clear_namespace(NS) == 3


async def test_file_a_stale_trash_dir_breaks_nothing_while_it_stays(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn._scanned.wait()
        left = Path(conn.root) / f"{file_janitor.TRASH_PREFIX}dead0.5" / "ab" / "cd"
        left.mkdir(parents=True)
        (left / key(1)).write_bytes(b"x" * 100)
        keys = await fill(conn, NS, 3)
        assert await conn.clear_namespace(NS) == 3
        await fill(conn, NS, 3)
        await assert_intact(conn, NS, keys)
        assert await conn.enforce_bound() == 0  # and the janitor takes it away
        assert trash_names(conn) == []


async def test_file_a_trash_tree_refilled_by_a_late_write_is_emptied_by_another_pass(
    tmp_path, monkeypatch
) -> None:
    """A put that opened its shard before the rename publishes its page into the trash after the pass that
    emptied that shard: the next pass takes it, and counts it."""
    real = file_janitor._empty
    refilled = []

    def empty_then_refill(fd, depth, freed):
        n = real(fd, depth, freed)
        if depth == 0 and not refilled:
            os.mkdir("ab", dir_fd=fd)
            shard = os.open("ab", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            try:
                os.mkdir("cd", dir_fd=shard)
                with open(os.open(f"cd/{key(9)}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=shard), "wb") as f:
                    f.write(b"late")
            finally:
                os.close(shard)
            refilled.append(True)
        return n

    monkeypatch.setattr(file_janitor, "_empty", empty_then_refill)
    async with started(tmp_path) as conn:
        await fill(conn, NS, 2)
        assert await conn.clear_namespace(NS) == 3
        assert refilled and trash_names(conn) == []


@pytest.mark.parametrize("page_io", ["native", "python"])
async def test_file_clear_with_puts_running_leaves_every_page_whole(tmp_path, monkeypatch, page_io) -> None:
    """Clears while puts write the namespace, on both page I/O paths: no call fails, every page reads back
    as written or misses, and no trash is left behind. A put whose page was in the middle of its write as
    its shard went into the trash may report it not written (ENOENT): true, it is not stored."""
    if page_io == "python":
        monkeypatch.setattr(file_module, "_pageio", None)
    elif file_module._pageio is None:
        pytest.skip("hicached.common._pageio is not built here")
    async with started(tmp_path, max_bytes="1GiB", janitor_interval="1h") as conn:
        await conn._scanned.wait()
        keys = [key(i) for i in range(64)]

        async def writer() -> None:
            for _ in range(20):
                for start in range(0, 64, 8):
                    pages = [page(NS, i) for i in range(start, start + 8)]
                    await conn.put(NS, keys[start : start + 8], pages)

        async def clearer() -> int:
            removed = 0
            for _ in range(20):
                removed += await conn.clear_namespace(NS)
                await asyncio.sleep(0)
            return removed

        await asyncio.gather(writer(), writer(), clearer())
        bufs = [memoryview(bytearray(SIZE)) for _ in keys]
        found = await conn.get_into(NS, keys, bufs)
        for i, hit in enumerate(found):
            assert not hit or bufs[i] == page(NS, i)
        odd = [k for k in conn.counters if k.startswith(("errors.", "corrupt.")) and k != "errors.ENOENT"]
        assert not odd, conn.counters
        assert trash_names(conn) == []
        await conn.enforce_bound()  # puts racing the clear leave the estimate off by their pages; a scan
        assert conn.stored_bytes == tree_bytes(conn)  # counts the tree as it is, and nothing of the trash


async def test_file_a_clear_past_the_timeout_fails_and_its_removal_goes_on(tmp_path, monkeypatch) -> None:
    release = threading.Event()
    real = file_janitor.remove_tree

    def slow_remove_tree(*args):
        release.wait(GUARD_S)
        return real(*args)

    monkeypatch.setattr(file_janitor, "remove_tree", slow_remove_tree)
    async with started(tmp_path, operation_timeout=0.3) as conn:
        keys = await fill(conn, NS, 3)
        try:
            with pytest.raises(BackendUnavailable) as err:
                async with asyncio.timeout(GUARD_S):
                    await conn.clear_namespace(NS)
            assert err.value.reason == "timeout"
            await assert_gone(conn, NS, keys)  # renamed away before the time-out
        finally:
            release.set()
        for _ in range(500):
            if not trash_names(conn):
                break
            await asyncio.sleep(0.01)
        assert trash_names(conn) == []


async def test_file_clear_of_a_missing_root_is_unavailable(tmp_path) -> None:
    async with started(tmp_path) as conn:
        await conn._scanned.wait()
        os.rmdir(conn.root)
        with pytest.raises(BackendUnavailable):
            await conn.clear_namespace(NS)
