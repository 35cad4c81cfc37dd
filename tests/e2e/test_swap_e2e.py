"""Backend hot-swap under load and the circuit breaker, with the daemon as a subprocess and real Redis
and S3 (moto) servers: engines keep working, and nothing acknowledged is lost."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from daemon_proc import to_toml
from hicached.connectors import header
from servers import MotoServer, RedisServer, aws_env

from hicached.common.errors import HicachedError
from hicached.engine.client import Client, control

PAGE = 32 * 1024
NS = "swap.ns"
BUCKET = "hicached-swap"


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for k, v in aws_env(tmp_path).items():
        monkeypatch.setenv(k, v)  # the daemon subprocess inherits them: the standard AWS chain
    r = RedisServer(tmp_path / "redis")
    m = MotoServer(tmp_path / "moto")
    try:
        r.start()
        m.start()
        m.create_bucket(BUCKET)
        yield r, m
    finally:
        r.stop()
        m.stop()


def storage_cfg(backend: str, r: RedisServer, m: MotoServer, **extra) -> dict:
    return {
        "backend": backend,
        "file": {"root": "data"},
        "redis": {"url": r.url, "prefix": "hc"},
        "s3": {"bucket": BUCKET, "prefix": "kv", "endpoint_url": m.endpoint_url, "addressing_style": "path"},
        "operation_timeout": "3s",
        **extra,
    }


def wait_for(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Engines:
    """Threads that store new pages and read back old ones until stopped; they record every page the
    daemon acknowledged and every error."""

    def __init__(self, socket: str, n: int) -> None:
        self.socket = socket
        self.acked: dict[str, bytes] = {}
        self.errors: list[BaseException] = []
        self.mismatches: list[str] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def __enter__(self) -> Engines:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        try:
            with Client(self.socket, NS, PAGE) as c:
                n = 0
                while not self._stop.is_set():
                    keys = [f"e{i}-{n + j}" for j in range(4)]
                    pages = [rng.randbytes(PAGE) for _ in keys]
                    n += 4
                    ok = c.store(keys, pages)
                    with self._lock:
                        self.acked.update((k, p) for k, p, good in zip(keys, pages, ok, strict=True) if good)
                        old = rng.sample(sorted(self.acked), min(4, len(self.acked)))
                        expect = [self.acked[k] for k in old]
                    got = c.get(old)
                    for k, want, have in zip(old, expect, got, strict=False):
                        if want != have:
                            self.mismatches.append(k)
                    self.requests += 2
        except BaseException as e:
            self.errors.append(e)


def in_backends(d, rc: redis.Redis, s3, key: str) -> set[bytes]:
    """What each backend holds for `key` (payloads that verify), looked up behind the daemon's back."""
    found = set()
    path = os.path.join(d.workdir, "data", NS, key[:2], key[2:4], key)
    blobs = []
    if os.path.exists(path):
        blobs.append(open(path, "rb").read())
    v = rc.get(f"hc:{NS}:{key}")
    if v is not None:
        blobs.append(v)
    with contextlib.suppress(s3.exceptions.NoSuchKey):
        blobs.append(s3.get_object(Bucket=BUCKET, Key=f"kv/{NS}/{key}")["Body"].read())
    for blob in blobs:
        hdr, payload = blob[: header.HEADER_SIZE], blob[header.HEADER_SIZE :]
        with contextlib.suppress(header.CorruptPage):
            header.verify(hdr, NS, key, payload)
            found.add(payload)
    return found


def test_swap_file_redis_s3_file_under_load(daemon_factory, stores, tmp_path):
    r, m = stores
    # refuse: a store is answered False while L3 is behind, so that every page acknowledged reaches a store
    # (drop_oldest, the default, lets the oldest go to keep taking new ones: moto takes ~130 PUT/s).
    refuse = {"when_backlog_full": "refuse"}
    d = daemon_factory(
        {"pool": {"capacity": "16MiB", "slab_size": "1MiB"}, "storage": storage_cfg("file", r, m, **refuse)}
    )
    with Engines(d.socket, 8) as engines:
        for backend in ("redis", "s3", "file"):
            wait_for(lambda: engines.requests > 200, "engines to get going")
            engines.requests = 0
            d.config["storage"] = storage_cfg(backend, r, m, **refuse)
            d.write_config(to_toml(d.config))
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda b=backend: d.ctl("status")["backend"] == b, f"swap to {backend}")
        wait_for(lambda: engines.requests > 200, "engines to go on after the last swap")
    assert not engines.errors, engines.errors[:3]
    assert not engines.mismatches
    assert d.ctl("flush")["flushed"]
    stats = d.ctl("stats")
    assert stats["counters"]["backend.swaps"] == 3
    assert stats["pool"]["evictions"] > 0, "the test should push pages out of L2"
    lost = []
    s3 = m.client()
    with Client(d.socket, NS, PAGE) as c, contextlib.closing(redis.Redis.from_url(r.url)) as rc:
        for key, page in sorted(engines.acked.items()):
            got = c.get([key])
            if got == [page]:
                continue  # in L2, or in the file backend attached now
            if page not in in_backends(d, rc, s3, key):
                lost.append(key)
    assert not lost, f"{len(lost)} of {len(engines.acked)} acknowledged pages are nowhere: {lost[:5]}"


def test_broken_backend_config_keeps_the_old_backend(daemon_factory, stores):
    r, m = stores
    d = daemon_factory({"storage": storage_cfg("file", r, m)})
    cfg = storage_cfg("redis", r, m)
    cfg["redis"]["url"] = "redis://127.0.0.1:1/0"  # nothing listens there: the probe fails
    d.config["storage"] = cfg
    d.write_config(to_toml(d.config))
    answer = d.ctl("reload")
    assert answer["ok"] is False and "redis" in answer["reason"]
    status = d.ctl("status")
    assert status["backend"] == "file" and status["last_reload"].startswith("rejected")
    with Client(d.socket, NS, PAGE) as c:
        assert c.store(["k"], [os.urandom(PAGE)]) == [True]


def test_breaker_opens_when_redis_dies_and_reattaches(daemon_factory, stores):
    r, m = stores
    extra = {"breaker": {"failures": 3, "probe_interval": "200ms", "probe_max_interval": "1s"}}
    d = daemon_factory({"storage": storage_cfg("redis", r, m, **extra)})
    with Engines(d.socket, 4) as engines:
        wait_for(lambda: engines.requests > 100, "engines to get going")
        r.stop()
        wait_for(lambda: d.ctl("status")["backend_state"] == "breaker_open", "the breaker to open")
        engines.requests = 0
        wait_for(lambda: engines.requests > 100, "engines served from L2 while Redis is down")
        r.start()
        wait_for(lambda: d.ctl("status")["backend_state"] == "attached", "re-attach", timeout=60)
        engines.requests = 0
        wait_for(lambda: engines.requests > 100, "engines after re-attach")
    assert not engines.errors, engines.errors[:3]
    assert not engines.mismatches
    assert d.ctl("flush")["flushed"]
    stats = d.ctl("stats")
    assert stats["counters"]["backend.breaker_trips"] >= 1 and stats["counters"]["backend.reattached"] >= 1
    # Pages stored while Redis was away were written to it once it came back.
    with contextlib.closing(redis.Redis.from_url(r.url)) as rc:
        in_redis = {k.decode().split(":")[-1] for k in rc.scan_iter(f"hc:{NS}:*", count=1000)}
    missing = [k for k in engines.acked if k not in in_redis]
    with Client(d.socket, NS, PAGE) as c:
        gone = [k for k in missing if c.get([k]) != [engines.acked[k]]]
    assert not gone, f"{len(gone)} acknowledged pages are neither in Redis nor in L2"


def test_redis_down_at_start_is_attached_when_it_comes(daemon_factory, stores):
    r, m = stores
    r.stop()
    extra = {"breaker": {"probe_interval": "200ms", "probe_max_interval": "1s"}}
    d = daemon_factory({"storage": storage_cfg("redis", r, m, **extra)})
    assert d.ctl("status")["backend"] == "none"
    with Client(d.socket, NS, PAGE) as c:
        assert c.store(["early"], [b"\1" * PAGE]) == [True]
        r.start()
        wait_for(lambda: d.ctl("status")["backend_state"] == "attached", "attach", timeout=60)
        assert d.ctl("flush")["flushed"]
    with contextlib.closing(redis.Redis.from_url(r.url)) as rc:
        assert rc.exists(f"hc:{NS}:early")


def test_ctl_errors_for_bad_backend(daemon):
    with pytest.raises(HicachedError) as e:
        control(daemon.socket, "backend", action="explode")
    assert e.value.code == "bad_request"
