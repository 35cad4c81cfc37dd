"""Never another page's bytes in Redis or S3: the daemon backs up through a slow network (the proxy of
tests/support/proxy.py) with a time-out most backups run into, while two writers churn a small pool, so
that a slot whose backup was given up on is soon holding another page. Every object the store holds
afterwards, read straight from the server, is the page acknowledged under its key, header and all.

For Redis this guards the abort of a connection given up on in the middle of a SET (connectors/redis.py,
_PagePacking.disconnect): closed gracefully instead, its transport goes on sending the rest of the value
from the slot, by then another page's."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import churn
import pytest
import redis
from daemon_proc import DaemonProcess
from hicached.connectors import header
from hicached.connectors.base import PROBE_NAMESPACE
from proxy import LOOPBACK, TcpProxy
from servers import MotoServer, RedisServer, aws_env

PAGE = 256 << 10
NS = "netintegrity.p256k"
CHURN_S = 10.0
BUCKET = "hicached-netintegrity"
PREFIX = "netintegrity"
# A backup gets about 0.4 MiB through in its time-out: small ones finish, most are given up on.
RATE = 4 << 20
TIMEOUT = "100ms"

SUPPORT = os.path.join(os.path.dirname(__file__), "..", "support")


@dataclasses.dataclass
class Store:
    """A server behind a proxy: the daemon's section for it (through the proxy), and every object it
    holds, read past the proxy: (namespace, key) -> bytes."""

    kind: str
    section: dict
    proxy: TcpProxy
    objects: Callable[[], dict[tuple[str, str], bytes]]


@pytest.fixture(params=["redis", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    kind = request.param
    if kind == "redis":
        server = RedisServer(tmp_path / "redis")
    else:
        for k, v in aws_env(tmp_path).items():
            monkeypatch.setenv(k, v)  # the daemon inherits them: the standard AWS chain
        server = MotoServer(tmp_path / "moto")
    server.start()
    proxy = TcpProxy(server.port)
    proxy.start()
    try:
        if kind == "redis":
            section = {"url": f"redis://{LOOPBACK}:{proxy.port}/0", "prefix": PREFIX}
            yield Store(kind, section, proxy, lambda: _redis_objects(server.port))
        else:
            server.create_bucket(BUCKET)
            section = {"bucket": BUCKET, "prefix": PREFIX, "addressing_style": "path"}
            section["endpoint_url"] = f"http://{LOOPBACK}:{proxy.port}"
            yield Store(kind, section, proxy, lambda: _s3_objects(server))
    finally:
        proxy.close()
        server.stop()


def _redis_objects(port: int) -> dict[tuple[str, str], bytes]:
    with contextlib.closing(redis.Redis(host=LOOPBACK, port=port)) as c:
        out = {}
        for name in c.scan_iter(match=f"{PREFIX}:*", count=1000):
            value = c.get(name)
            if value is not None:
                _, ns, key = name.decode().split(":", 2)
                out[(ns, key)] = value
        return out


def _s3_objects(server: MotoServer) -> dict[tuple[str, str], bytes]:
    client = server.client()
    out = {}
    for listing in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/"):
        for obj in listing.get("Contents", []):
            _, ns, key = obj["Key"].split("/", 2)
            out[(ns, key)] = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
    return out


def _churn(d: DaemonProcess, tmp_path: Path) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.abspath(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for kind in ("store", "region"):
        out = tmp_path / f"{kind}.acked"
        argv = [sys.executable, "-m", "churn", kind, d.socket, NS, str(PAGE), str(CHURN_S), str(out)]
        procs.append((kind, subprocess.Popen(argv, env=env), out))
    acked = 0
    for kind, proc, out in procs:
        assert proc.wait(CHURN_S + 120) == 0, f"the {kind} writer failed:\n{d.log()[-4000:]}"
        acked += len([k for k in out.read_text().split("\n") if k])
    return acked


@pytest.mark.timeout(600)
def test_l3_over_a_slow_network_never_holds_another_pages_bytes(store: Store, tmp_path: Path) -> None:
    rate, attempts, timeouts = RATE, 3, 0
    for attempt in range(attempts):
        racy = {
            "pool": {"capacity": "64MiB", "slab_size": "4MiB"},
            "storage": {
                "backend": store.kind,
                store.kind: store.section,
                "operation_timeout": TIMEOUT,
                "retry": {"attempts": 1},
                "breaker": {"failures": 1_000_000},
            },
            "shutdown": {"flush_timeout": "2s"},
        }
        work = tmp_path / f"try{attempt}"
        d = DaemonProcess(str(work / "d"), racy).start()
        try:
            store.proxy.slow(bytes_per_s=rate)
            acked = _churn(d, work)
            stats = d.ctl("stats")
        finally:
            d.stop()
            store.proxy.resume()
        assert acked > 0
        counters = stats["counters"]
        prefix = f"backend.failures.{store.kind}.timeout"
        timeouts = sum(v for k, v in counters.items() if k.startswith(prefix))
        if timeouts:
            break
        # On a loaded machine the backups may all have fit in their time-out (or the backend not attached
        # in time to send any): slow the network further and try again.
        rate //= 4
    assert timeouts > 0, f"no backup timed out in {attempts} tries: the race was not exercised"
    # Whatever the daemon had sent reaches the server before it is read.
    deadline = time.monotonic() + 60
    while store.proxy.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.proxy.connections, "connections through the proxy still open a minute after the daemon"

    found = {k: v for k, v in store.objects().items() if k[0] != PROBE_NAMESPACE}
    assert found, "no page reached the store: nothing was checked"
    wrong = []
    for (ns, key), value in found.items():
        want = churn.page_of(key, PAGE)
        if value != header.encode(ns, key, want) + want:
            wrong.append(key)
    assert not wrong, f"{len(wrong)} of {len(found)} objects hold other bytes than their page: {wrong[:5]}"
