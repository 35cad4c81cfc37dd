"""L3 trouble costs L3, not L2: the daemon (a subprocess) serves four engine processes while its Redis or S3
backend, behind the fault proxy, stalls (accepts and never answers), slows to a crawl, or resets every
connection, or while the disk of its file backend (a FUSE mount whose operations can be held) hangs or
crawls. For each fault: the backend is detached within storage.breaker.stall_timeout of the stall, no
store is answered False after that, no call takes longer than server.request_timeout, no load returns
other bytes, the backend is attached again once the fault clears, and every page acknowledged during the
fault is in L3 afterwards or counted (backup.dropped_gone, backup.lost)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import fault_run
import pytest
import redis
from daemon_proc import DaemonProcess
from proxy import LOOPBACK, TcpProxy
from servers import MotoServer, RedisServer, aws_env
from stallfs import StallFS, stallfs_available

# Four engines each store 4 new pages of 128 KiB and load back 4 every 40 ms: 50 MiB/s into a 64 MiB pool,
# which pages waiting for L3 would fill in under two seconds.
PAGE = 128 << 10
PERIOD_S = 0.04
NS = "stall.p128k"
BUCKET = "hicached-stall"
PREFIX = "stall"
STALL_TIMEOUT = 2.0
REQUEST_TIMEOUT = 30.0


@dataclasses.dataclass
class Store:
    """A real store, and the faults the test can make between the daemon and it."""

    kind: str
    section: dict
    faults: dict[str, Callable[[], None]]  # "stall", "slow", "reset" where it has one
    resume: Callable[[], None]
    keys: Callable[[], set[str]]  # the page keys the store holds, read behind the daemon's back


@pytest.fixture(params=["redis", "s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    kind = request.param
    if kind == "file":
        yield from _file_store(tmp_path)
        return
    if kind == "redis":
        server = RedisServer(tmp_path / "redis", extra=("--maxmemory", "0"))  # keeps every page it took
    else:
        for k, v in aws_env(tmp_path).items():
            monkeypatch.setenv(k, v)
        server = MotoServer(tmp_path / "moto")
    server.start()
    proxy = TcpProxy(server.port)
    proxy.start()
    faults = {
        "stall": proxy.stall,  # accepts, and never answers: a hung server, a partition
        "slow": lambda: proxy.slow(bytes_per_s=16 << 10),  # a crawl: 16 KiB/s a connection
        "reset": proxy.reset,
        "cut": lambda: proxy.cut_after(32 << 10),  # every connection cut 32 KiB in: values dropped halfway
    }
    try:
        if kind == "redis":
            section = {"url": f"redis://{LOOPBACK}:{proxy.port}/0", "prefix": PREFIX}
            yield Store(kind, section, faults, proxy.resume, lambda: _redis_keys(server.port))
        else:
            server.create_bucket(BUCKET)
            section = {"bucket": BUCKET, "prefix": PREFIX, "addressing_style": "path"}
            section["endpoint_url"] = f"http://{LOOPBACK}:{proxy.port}"
            yield Store(kind, section, faults, proxy.resume, lambda: _s3_keys(server))
    finally:
        proxy.close()
        server.stop()


def _file_store(tmp_path: Path) -> Iterator[Store]:
    """The file backend on a FUSE mount (tests/support/stallfs.py) whose every operation can be held (a hung
    disk or NFS server) or delayed."""
    why = stallfs_available()
    if why is not None:
        pytest.skip(f"the file backend's stall needs a FUSE mount: {why}")
    backing = tmp_path / "disk"
    backing.mkdir()
    with StallFS(backing, tmp_path / "mnt") as fs:
        faults = {"stall": fs.stall, "slow": lambda: fs.slow(0.5)}  # 0.5 s an operation: a dying disk
        yield Store(
            "file", {"root": str(tmp_path / "mnt" / "data")}, faults, fs.resume, lambda: _file_keys(backing)
        )
        fs.resume()


def _file_keys(backing: Path) -> set[str]:
    return {name for _, _, names in os.walk(backing / "data" / NS) for name in names if _KEY.fullmatch(name)}


_KEY = re.compile(r"p[0-9]+-[0-9]+")  # steady_load's keys; the backend's temporary files are named otherwise


def _redis_keys(port: int) -> set[str]:
    with contextlib.closing(redis.Redis(host=LOOPBACK, port=port)) as c:
        return {name.decode().split(":", 2)[2] for name in c.scan_iter(match=f"{PREFIX}:{NS}:*", count=1000)}


def _s3_keys(server: MotoServer) -> set[str]:
    out = set()
    for listing in (
        server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{NS}/")
    ):
        out.update(obj["Key"].split("/", 2)[2] for obj in listing.get("Contents", []))
    return out


def daemon_for(store: Store, tmp_path: Path) -> DaemonProcess:
    return DaemonProcess(
        str(tmp_path / "d"),
        {
            "pool": {"capacity": "64MiB", "slab_size": "2MiB"},
            "server": {"request_timeout": f"{REQUEST_TIMEOUT}s"},
            "storage": {
                "backend": store.kind,
                store.kind: store.section,
                "breaker": {
                    "stall_timeout": f"{STALL_TIMEOUT}s",
                    "probe_interval": "200ms",
                    "probe_max_interval": "1s",
                },
            },
            "shutdown": {"flush_timeout": "30s"},
        },
    ).start()


def check_served(r: fault_run.FaultRun, store: Store, counters: dict, since: float) -> None:
    """What engines must see whatever L3 does: every page taken from `since` on, no error, no call past
    server.request_timeout, no other bytes; the backend attached again once the fault cleared; every page
    acknowledged during the fault in L3 afterwards, or counted as not."""
    assert r.false_share(since, r.cleared_at) == 0, r.false_share(since, r.cleared_at)
    assert all(c.get("error") is None for c in r.calls), [c for c in r.calls if c.get("error")][:3]
    assert max(c["s"] for c in r.calls) < REQUEST_TIMEOUT
    assert sum(c.get("wrong", 0) for c in r.calls) == 0
    assert r.reattached_at is not None, "not attached again after the fault cleared"
    during = set(r.acked(r.fault_at, r.cleared_at))
    assert during, "no store was acknowledged during the fault"
    missing = during - store.keys()
    counted = counters.get("backup.dropped_gone", 0) + counters.get("backup.lost", 0)
    assert len(missing) <= counted, (len(missing), counted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["stall", "slow"])
def test_a_stalled_or_crawling_backend_is_detached_and_costs_l3_not_l2(
    store: Store, fault: str, tmp_path: Path
) -> None:
    d = daemon_for(store, tmp_path)
    try:
        r = fault_run.run(
            d,
            tmp_path,
            NS,
            PAGE,
            fault=store.faults[fault],
            clear=store.resume,
            fault_s=6.0,
            period_s=PERIOD_S,
        )
        d.ctl("flush")
        counters = d.ctl("stats")["counters"]
    finally:
        store.resume()  # before the daemon stops: its threads may be waiting on a held file system
        d.stop()
    print(f"{store.kind}/{fault}: detached {r.detach_s}s after the fault, attached again {r.reattached_at}")
    assert r.detached_at is not None, f"never detached; states {r.states[-5:]}\n{d.log()[-3000:]}"
    # Noticed within the stall time-out, give or take the watch's tick, the poll and a busy machine.
    assert r.detach_s < STALL_TIMEOUT + 5, r.detach_s
    assert counters["backend.stalls"] >= 1
    check_served(r, store, counters, since=r.detached_at + 0.5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["reset", "cut"])
def test_connections_reset_or_cut_halfway_cost_l3_not_l2(store: Store, fault: str, tmp_path: Path) -> None:
    # reset: every connection reset, four times a second; cut: every connection cut 32 KiB into what it
    # sends, values dropped halfway. Calls fail rather than hang: the breaker may trip on failures, and L2
    # goes on all the same.
    if fault not in store.faults:
        pytest.skip(f"the {store.kind} backend has no connections to {fault}")
    stop = threading.Event()

    def resets() -> None:
        while not stop.wait(0.25):
            store.faults["reset"]()

    resetter = threading.Thread(target=resets)
    start, clear = (resetter.start, stop.set) if fault == "reset" else (store.faults["cut"], store.resume)
    d = daemon_for(store, tmp_path)
    try:
        r = fault_run.run(d, tmp_path, NS, PAGE, fault=start, clear=clear, fault_s=4.0, period_s=PERIOD_S)
        if resetter.is_alive():
            resetter.join()
        d.ctl("flush")
        counters = d.ctl("stats")["counters"]
    finally:
        stop.set()
        store.resume()
        d.stop()
    check_served(r, store, counters, since=r.fault_at)
