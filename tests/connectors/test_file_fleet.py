"""The file backend's bound shared by the daemons on one root (connectors/file_fleet.py): several
FileConnectors on one real directory, each with its own ledger, estimate and janitor, as daemons on several
nodes would be over one NFS or Lustre root."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import glob
import json
import logging
import os
import threading
import time

import pytest
from hicached.connectors import file_fleet, file_janitor, header
from hicached.connectors.base import FLEET_NAMESPACE
from hicached.connectors.file import FileConnector
from waits import wait_until

from hicached import config

NS = "fleet.bound.ns"
PAGE = 4 * 1024
FILE = header.HEADER_SIZE + PAGE  # bytes of one page file
FAST = {"fleet_refresh": "20ms", "janitor_interval": "1h"}  # refreshes often; runs when over, not on a timer


def make(tmp_path, **file_cfg) -> FileConnector:
    cfg = config.from_dict(
        {"storage": {"backend": "file", "file": {"root": "data", **file_cfg}}}, str(tmp_path)
    )
    return FileConnector(cfg)


@contextlib.asynccontextmanager
async def started(tmp_path, **file_cfg):
    conn = make(tmp_path, **file_cfg)
    await conn.start()
    try:
        yield conn
    finally:
        await conn.close()


async def stop_janitor(conn: FileConnector) -> None:
    """Leaves the janitor's runs to the test's own enforce_bound() calls; the ledger's refreshes go on."""
    await conn._scanned.wait()
    conn._janitor.cancel()
    await asyncio.gather(conn._janitor, return_exceptions=True)


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int) -> memoryview:
    return memoryview(i.to_bytes(4, "little") * (PAGE // 4))


def tree_pages(root: str) -> list[str]:
    """The page files under root, seen from outside (temporary files and the fleet's files left out)."""
    return [p for p in glob.glob(os.path.join(root, "*", "*", "*", "*")) if os.path.isfile(p)]


def tree_bytes(root: str) -> int:
    total = 0
    for path in tree_pages(root):
        with contextlib.suppress(FileNotFoundError):  # removed since listed: a janitor at work
            total += os.path.getsize(path)
    return total


def fill(root: str, n: int, ns: str = NS, first: int = 0) -> list[str]:
    """`n` page files written as a daemon writes them, each used a second after the one before, an hour ago:
    the least recently used first. Their paths, in that order."""
    paths = []
    old = time.time() - 3600
    for i in range(first, first + n):
        k = key(i)
        shard = os.path.join(root, ns, k[0:2], k[2:4])
        os.makedirs(shard, exist_ok=True)
        path = os.path.join(shard, k)
        with open(path, "wb") as f:
            f.write(header.encode(ns, k, page(i)) + page(i))
        os.utime(path, (old + i, old + i))
        paths.append(path)
    return paths


def ledger_path(root: str, tag: str) -> str:
    return os.path.join(root, file_fleet.FLEET_DIR, file_fleet.NODES, tag)


def write_ledger(root: str, tag: str, nbytes: int, age_s: float = 0.0) -> None:
    path = ledger_path(root, tag)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"bytes": nbytes, "host": "elsewhere", "pid": 1}, f)
    when = time.time() - age_s
    os.utime(path, (when, when))


async def test_each_daemon_estimates_the_whole_tree(tmp_path) -> None:
    """A daemon's estimate takes its own writes at once, another daemon's after a refresh: puts and
    deletes, whichever daemon's pages they touch."""
    keys = [key(i) for i in range(8)]
    async with (
        started(tmp_path, max_bytes=100 * FILE, **FAST) as a,
        started(tmp_path, max_bytes=100 * FILE, **FAST) as b,
    ):
        await a._scanned.wait()
        await b._scanned.wait()
        assert await a.put(NS, keys[:5], [page(i) for i in range(5)]) == [True] * 5
        assert a.stored_bytes == 5 * FILE
        await wait_until(lambda: b.stored_bytes == 5 * FILE, what="b seeing a's puts")
        assert await b.put(NS, keys[5:], [page(i) for i in range(5, 8)]) == [True] * 3
        assert b.stored_bytes == 8 * FILE
        # At least: a janitor's scan that overlapped b's put counts it twice until the next scan (an
        # estimate errs high, never low).
        await wait_until(lambda: a.stored_bytes >= 8 * FILE, what="a seeing b's puts")
        assert await b.delete(NS, keys[:2]) == 2  # a's pages, removed by b
        # A scan is exact for every daemon once each one's ledger counts what it did before the scan: a
        # change made but not yet published when a run snapshots the ledgers is in the tree and then counted
        # again when published (high for a put, low for a delete) until the next run. On a loaded machine a's
        # run came between b's delete and b's next publish, and the estimates never reached 6 pages.
        await wait_until(lambda: b._ledger._published == b._ledger._net, what="b publishing its deletes")
        while True:  # a scan makes the estimate exact again (another daemon's run may hold the lease)
            await a.enforce_bound()
            if not a._skipped:
                break
        await wait_until(lambda: a.stored_bytes == b.stored_bytes == 6 * FILE, what="both seeing b's deletes")
        assert tree_bytes(a.root) == 6 * FILE
        bound = a.info()["bound"]
        assert bound["estimate"] == 6 * FILE and bound["nodes"] == 2 and bound["coordinated"], bound
        assert bound["last_scan_by"].endswith(f"({a._tmp_tag})") or bound["last_scan_by"].endswith(
            f"({b._tmp_tag})"
        )


async def test_a_put_past_the_bound_on_one_daemon_wakes_the_janitor_of_another(tmp_path) -> None:
    """Only b writes; a's janitor may be the one that runs. Either way the tree comes back within the bound
    once a put crosses it, and the other daemon's estimate follows the run's scan."""
    async with (
        started(tmp_path, max_bytes=10 * FILE, **FAST) as a,
        started(tmp_path, max_bytes=10 * FILE, **FAST) as b,
    ):
        await a._scanned.wait()
        await b._scanned.wait()
        keys = [key(i) for i in range(12)]
        assert await b.put(NS, keys, [page(i) for i in range(12)]) == [True] * 12
        evictions = lambda: a.counters["evictions"] + b.counters["evictions"]  # noqa: E731
        await wait_until(evictions, what="a janitor's run")
        await wait_until(lambda: a.stored_bytes == b.stored_bytes == 9 * FILE, what="both estimates")
        assert tree_bytes(a.root) == 9 * FILE and evictions() == 3  # down to 0.9 * 10 pages


async def test_janitors_starting_at_once_remove_only_the_excess(tmp_path, monkeypatch) -> None:
    """Regression (#29): two daemons started (or reloaded with a lower max_bytes) at the same moment over an
    over-full root each removed the whole excess; 800 pages fell to 0 where the low watermark was 230.
    Under the lease one janitor runs, the other leaves it the run and reads its scan."""
    root = str(tmp_path / "data")
    fill(root, 40)
    cfg = {"max_bytes": 20 * FILE, "low_watermark": 0.5, **FAST}
    a, b = make(tmp_path, **cfg), make(tmp_path, **cfg)
    scanned = []
    real_scan = file_janitor.scan

    def scan_then_wait(*args, **kw):  # at once: until the other janitor scanned too, or left its run to us
        out = real_scan(*args, **kw)
        scanned.append(out)
        deadline = time.monotonic() + 10
        while len(scanned) < 2 and not (
            a.counters["janitor.skipped_locked"] or b.counters["janitor.skipped_locked"]
        ):
            assert time.monotonic() < deadline, "the other janitor neither scanned nor was skipped"
            time.sleep(0.001)
        return out

    monkeypatch.setattr(file_janitor, "scan", scan_then_wait)
    try:
        await a.start()
        await b.start()
        evictions = lambda: a.counters["evictions"] + b.counters["evictions"]  # noqa: E731
        await wait_until(evictions, what="a janitor's run")
        await wait_until(lambda: a.stored_bytes == b.stored_bytes == 10 * FILE, what="both estimates")
        assert tree_bytes(root) == 10 * FILE and evictions() == 30
        assert a.counters["evicted_gone"] + b.counters["evicted_gone"] == 0  # never at once
    finally:
        await a.close()
        await b.close()


async def test_janitors_without_flock_together_remove_no_more_than_the_excess(
    tmp_path, monkeypatch, caplog
) -> None:
    """Regression (#29): where the file system cannot lock (NFS mounted nolock, Lustre without -o flock), two
    janitors run at once from the same scan. A page the other removed first counts as freed (out of the
    tree) but not as an eviction: together they stop at the low watermark, give or take a page each."""
    root = str(tmp_path / "data")
    fill(root, 400)
    low = 100 * FILE

    def cannot(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(file_fleet, "lease", functools.partial(file_fleet.lease, flock=cannot))
    both_scanned = threading.Barrier(2)
    scans = iter(range(2))
    real_scan = file_janitor.scan

    def scan_then_meet(*args, **kw):  # the first two scans, one each: both evict from one tree at once
        out = real_scan(*args, **kw)
        if next(scans, None) is not None:
            with contextlib.suppress(threading.BrokenBarrierError):
                both_scanned.wait(10)
        return out

    monkeypatch.setattr(file_janitor, "scan", scan_then_meet)
    caplog.set_level(logging.WARNING, "hicached.connectors.file")
    cfg = {"max_bytes": 200 * FILE, "low_watermark": 0.5, **FAST}
    async with started(tmp_path, **cfg) as a, started(tmp_path, **cfg) as b:
        await stop_janitor(a)
        await stop_janitor(b)
        left = tree_bytes(root)
        removed = a.counters["evictions"] + b.counters["evictions"]
        assert low - FILE <= left <= low, (left // FILE, a.counters, b.counters)
        assert removed * FILE == 400 * FILE - left
        assert a.counters["evicted_gone"] + b.counters["evicted_gone"] > 0  # they did run at once
        for conn in (a, b):
            assert conn.counters["janitor.lock_unsupported"] == 1 and not conn.info()["bound"]["coordinated"]
    warnings = [r for r in caplog.records if "cannot be locked" in r.getMessage()]
    assert len(warnings) == 2  # once a daemon


async def test_a_run_waits_while_another_daemon_holds_the_lease(tmp_path) -> None:
    """While another daemon's janitor holds the lease, this one's runs are skipped (and counted), and it tries
    again each refresh; once the lease is free it runs."""
    root = str(tmp_path / "data")
    fill(root, 40)
    os.makedirs(os.path.join(root, file_fleet.FLEET_DIR))
    lock = os.open(os.path.join(root, file_fleet.FLEET_DIR, file_fleet.LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another daemon's janitor, in the middle of a long scan
        async with started(tmp_path, max_bytes=20 * FILE, low_watermark=0.5, **FAST) as conn:
            await wait_until(lambda: conn.counters["janitor.skipped_locked"] >= 3, what="runs skipped")
            assert len(tree_pages(root)) == 40 and not conn.counters["evictions"]
            assert await conn.enforce_bound() == 0  # the public call too
            fcntl.flock(lock, fcntl.LOCK_UN)
            await wait_until(lambda: conn.counters["evictions"], what="the run once the lease is free")
            assert conn.counters["evictions"] == 30 and conn.stored_bytes == tree_bytes(root) == 10 * FILE
    finally:
        os.close(lock)


async def test_dead_daemons_ledgers_are_removed_and_live_ones_counted(tmp_path) -> None:
    """A ledger not written for 10 minutes is a dead daemon's: the next run removes it (its pages are in the
    scan). A live daemon's count moving after the run's snapshot moves the estimate by as much."""
    root = str(tmp_path / "data")
    fill(root, 6)
    write_ledger(root, "dead0000", 999 * FILE, age_s=file_fleet.STALE_S + 60)
    write_ledger(root, "live0000", 3 * FILE)
    tmp_left = os.path.join(root, file_fleet.FLEET_DIR, file_fleet.NODES, ".live0000.77.1.tmp")
    write_ledger(root, ".live0000.77.1.tmp", 0, age_s=file_fleet.STALE_S + 60)  # a crash while publishing
    async with started(tmp_path, max_bytes=100 * FILE, **FAST) as conn:
        await stop_janitor(conn)
        assert not os.path.exists(ledger_path(root, "dead0000")) and not os.path.exists(tmp_left)
        assert os.path.exists(ledger_path(root, "live0000")) and os.path.exists(
            ledger_path(root, conn._tmp_tag)
        )
        await wait_until(lambda: conn.stored_bytes == 6 * FILE, what="the estimate from the scan")
        write_ledger(root, "live0000", 5 * FILE)  # the live daemon wrote two pages since the snapshot
        await wait_until(lambda: conn.stored_bytes == 8 * FILE, what="the live daemon's writes counted")
        scan = file_fleet.read_scan(root)
        assert scan is not None and scan.total == 6 * FILE and scan.by == conn._tmp_tag
        assert scan.snapshot == {"live0000": 3 * FILE, conn._tmp_tag: 0}


async def test_a_closed_daemon_leaves_its_last_count(tmp_path) -> None:
    """Closing (a stop, or a reload that swaps in a new connector) publishes the last count, refreshed or
    not: the other daemons' estimates keep what it wrote until the next scan."""
    async with started(tmp_path, max_bytes=100 * FILE, fleet_refresh="1h", janitor_interval="1h") as a:
        await a._scanned.wait()
        assert await a.put(NS, [key(1), key(2)], [page(1), page(2)]) == [True, True]
        tag = a._tmp_tag
    with open(ledger_path(a.root, tag)) as f:
        assert json.load(f)["bytes"] == 2 * FILE
    async with started(tmp_path, max_bytes=100 * FILE, **FAST) as b:
        await wait_until(lambda: b.stored_bytes == 2 * FILE, what="the estimate of the new daemon")


async def test_what_the_fleet_keeps_is_never_counted_or_evicted(tmp_path) -> None:
    """Under FLEET_NAMESPACE (.fleet~: the ledgers, the lease, the nodes' marks such as clear epochs) nothing
    is a page: never counted, never evicted, even files shaped like pages and older than every page."""
    root = str(tmp_path / "data")
    kept = fill(root, 4, ns=FLEET_NAMESPACE)  # the oldest of all, at .fleet~/00/00/{key}
    mark = os.path.join(root, FLEET_NAMESPACE, "marks", key(99))
    os.makedirs(os.path.dirname(mark))
    with open(mark, "wb") as f:
        f.write(b"epoch")
    fill(root, 12, first=10)
    async with started(tmp_path, max_bytes=10 * FILE, low_watermark=0.5, **FAST) as conn:
        await stop_janitor(conn)
        assert all(map(os.path.exists, kept)) and os.path.exists(mark)
        assert conn.counters["evictions"] == 7  # 12 pages down to 5
        # tree_pages' glob leaves .fleet~ out too (a leading dot)
        assert conn.stored_bytes == tree_bytes(root) == 5 * FILE


async def test_the_janitor_runs_where_the_fleets_files_cannot_be_written(tmp_path, caplog) -> None:
    """A full or damaged .fleet~ (here a file where the ledgers' directory goes, a directory where the scan
    goes) costs the sharing, never the bound: the janitor still removes pages, and says so once."""
    root = str(tmp_path / "data")
    fill(root, 40)
    fleet = os.path.join(root, file_fleet.FLEET_DIR)
    os.makedirs(os.path.join(fleet, file_fleet.SCAN))
    with open(os.path.join(fleet, file_fleet.NODES), "w") as f:
        f.write("not a directory")
    caplog.set_level(logging.WARNING, "hicached.connectors.file")
    async with started(tmp_path, max_bytes=20 * FILE, low_watermark=0.5, **FAST) as conn:
        await wait_until(lambda: conn.counters["evictions"], what="the janitor's run")
        assert conn.counters["evictions"] == 30 and conn.stored_bytes == tree_bytes(root) == 10 * FILE
        await wait_until(lambda: conn.counters["fleet.errors"] >= 3, what="refreshes failing")
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "could not be shared" in m]) == 1, said
    assert len([m for m in said if "cannot share the bound's count" in m]) == 1, said


def test_flock_errors_decide_the_lease(tmp_path) -> None:
    """EWOULDBLOCK: another janitor runs. ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL: the file system cannot lock,
    every janitor runs on its own. Anything else is an error of the run."""
    for err in (errno.EWOULDBLOCK, errno.EAGAIN):
        assert file_fleet.lease_outcome(OSError(err, "")) == file_fleet.TAKEN
    for err in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        assert file_fleet.lease_outcome(OSError(err, "")) == file_fleet.UNSUPPORTED
    with pytest.raises(OSError) as e:
        file_fleet.lease_outcome(OSError(errno.EIO, "io"))
    assert e.value.errno == errno.EIO

    root = str(tmp_path)
    with file_fleet.lease(root) as first, file_fleet.lease(root) as second:  # two opens: two daemons
        assert (first, second) == (file_fleet.HELD, file_fleet.TAKEN)
    with file_fleet.lease(root) as again:  # released at the end of the block
        assert again == file_fleet.HELD

    def cannot(fd: int, op: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    with file_fleet.lease(root, flock=cannot) as held:
        assert held == file_fleet.UNSUPPORTED


def test_ledger_estimate_follows_scans_and_counts(tmp_path) -> None:
    """The estimate: the last scan's total, plus how far each daemon's count moved since that scan's
    snapshot (a daemon new since counts whole; one whose ledger is gone counts no more)."""
    root = str(tmp_path)
    me = file_fleet.Ledger(root, "me000000", shared=True)
    write_ledger(root, "other000", 10)
    write_ledger(root, "gone0000", 50)
    me.add(7)
    me.refresh()
    assert me.estimate == 10 + 50 + 7  # no scan yet: every count whole
    snapshot = me.begin_run()
    assert snapshot == {"me000000": 7, "other000": 10, "gone0000": 50}
    me.add(3)  # during the scan
    me.end_run(100, snapshot, max_bytes=1000)
    assert me.estimate == 103
    write_ledger(root, "other000", 14)
    write_ledger(root, "new00000", 5)
    os.unlink(ledger_path(root, "gone0000"))
    me.refresh()
    assert me.estimate == 100 + 3 + 4 + 5
    info = me.info()
    assert (info["last_scan_total"], info["last_scan_max_bytes"], info["nodes"]) == (100, 1000, 3)
    # Another daemon reads the same files to the same figure; what `me` adds reaches it at me's next refresh.
    other = file_fleet.Ledger(root, "other000", shared=True)
    other.add(14)
    other.refresh()
    assert other.estimate == me.estimate == 112
    me.add(-2)
    other.refresh()
    assert (me.estimate, other.estimate) == (110, 112)
    me.refresh()
    other.refresh()
    assert other.estimate == me.estimate == 110
