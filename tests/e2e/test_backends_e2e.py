"""Every backend end to end through the daemon: store -> backup -> daemon restart -> prefetch -> the same
bytes, on real servers (redis-server, a 3-master Redis Cluster, moto in server mode)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from servers import MotoServer, RedisClusterServers, RedisServer, aws_env

from hicached.engine.client import Client

PAGE = 128 * 1024
NS = "e2e.backends"
BUCKET = "hicached-e2e"


@pytest.fixture(params=["file", "redis", "redis-cluster", "s3"])
def storage(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    kind = request.param
    if kind == "file":
        yield {"backend": "file", "file": {"root": "data"}}
        return
    if kind == "s3":
        for k, v in aws_env(tmp_path).items():
            monkeypatch.setenv(k, v)
        server = MotoServer(tmp_path / "moto")
    elif kind == "redis":
        server = RedisServer(tmp_path / "redis")
    else:
        server = RedisClusterServers(tmp_path / "cluster")
    try:
        server.start()
        if kind == "s3":
            server.create_bucket(BUCKET)
            s3 = {"bucket": BUCKET, "endpoint_url": server.endpoint_url, "addressing_style": "path"}
            yield {"backend": "s3", "s3": s3}
        else:
            yield {"backend": "redis", "redis": {"url": server.url, "cluster": kind == "redis-cluster"}}
    finally:
        server.stop()


def test_store_backup_restart_prefetch_identical(daemon_factory, storage):
    rng = random.Random(42)
    keys = [f"{i:04d}{rng.getrandbits(64):016x}" for i in range(60)]
    pages = [rng.randbytes(PAGE) for _ in keys]
    d = daemon_factory({"storage": storage})
    with Client(d.socket, NS, PAGE) as c:
        for i in range(0, len(keys), 15):
            assert c.store(keys[i : i + 15], pages[i : i + 15]) == [True] * 15
    assert d.ctl("flush")["flushed"]
    assert d.ctl("stats")["counters"]["backup.pages"] == len(keys)
    d.restart()
    with Client(d.socket, NS, PAGE) as c:
        assert c.stats()["pool"]["pages"] == 0
        assert c.exists(keys) == len(keys)
        h = c.prefetch(keys)
        assert c.wait(h, timeout=30) == len(keys)
        bufs = [bytearray(PAGE) for _ in keys]
        assert c.load(keys, bufs) == len(keys)
        assert [bytes(b) for b in bufs] == pages
        # A key that was never stored ends the prefix, wherever the pages live.
        assert c.exists(keys[:10] + ["f" * 64] + keys[10:]) == 10
