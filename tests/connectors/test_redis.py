"""What only the Redis connector does: zero-copy SET packing, TTL, AUTH, bounded connections, a full
server, and clear errors for a configuration that cannot work."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
from hicached.connectors import BackendMisconfigured, BackendUnavailable, header
from hicached.connectors.redis import RedisConnector, _Page, _PageConnection
from redis.asyncio.connection import Connection
from servers import RedisClusterServers, RedisServer, free_port, make_tls_files

from hicached import config

NS = "ns.test"
KiB = 1024
GUARD_S = 60


def key(i: int) -> str:
    return f"{i:064x}"


def make(tmp_path, url: str, **redis_cfg) -> RedisConnector:
    cfg = config.from_dict(
        {"storage": {"backend": "redis", "redis": {"url": url, **redis_cfg}}}, str(tmp_path)
    )
    return RedisConnector(cfg)


def test_a_page_is_packed_around_the_payload_without_copying_it() -> None:
    payload = memoryview(bytes(range(256)) * 64)
    head = header.encode(NS, key(1), payload)
    ours = _PageConnection().pack_commands([("SET", "k", _Page(head, payload), "PX", 500), ("GET", "k")])
    assert any(chunk is payload for chunk in ours)
    stock = Connection().pack_commands([("SET", "k", head + bytes(payload), "PX", 500), ("GET", "k")])
    assert b"".join(bytes(c) for c in ours) == b"".join(stock)


async def test_ttl_sets_an_expiry(tmp_path, redis_server) -> None:
    conn = make(tmp_path, redis_server.url, prefix="ttl", ttl="60s")
    await conn.start()
    try:
        assert await conn.put(NS, [key(1)], [memoryview(b"x" * 100)]) == [True]
    finally:
        await conn.close()
    with redis.Redis.from_url(redis_server.url) as c:
        assert 0 < c.pttl(f"ttl:{NS}:{key(1)}") <= 60_000


async def test_more_calls_than_connections_wait_for_one(tmp_path, redis_server) -> None:
    # redis-py 8's pool raises when it is exhausted; the connector's semaphore makes callers wait instead.
    conn = make(tmp_path, redis_server.url, prefix="pool", max_connections=2)
    await conn.start()
    try:
        pages = [memoryview(os.urandom(64 * KiB)) for _ in range(50)]
        done = await asyncio.gather(*(conn.put(NS, [key(i)], [p]) for i, p in enumerate(pages)))
        assert done == [[True]] * 50
        assert await conn.exists(NS, [key(i) for i in range(50)]) == 50
    finally:
        await conn.close()


async def test_a_full_server_fails_the_page_not_the_call(tmp_path) -> None:
    server = RedisServer(tmp_path, extra=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    server.start()
    try:
        conn = make(tmp_path, server.url)
        await conn.start()
        try:
            done = [await conn.put(NS, [key(i)], [memoryview(b"x" * (512 * KiB))]) for i in range(16)]
            assert done[0] == [True] and done[-1] == [False]
            assert conn.counters["errors.oom"] == done.count([False])
        finally:
            await conn.close()
    finally:
        server.stop()


async def test_password_from_the_environment(tmp_path, monkeypatch) -> None:
    server = RedisServer(tmp_path, extra=("--requirepass", "s3cret"))
    server.start()
    try:
        for bad in ({}, {"password": "wrong"}, {"password_env": "HICACHED_TEST_NO_SUCH_VARIABLE"}):
            conn = make(tmp_path, server.url, **bad)
            with pytest.raises(BackendMisconfigured):
                async with asyncio.timeout(GUARD_S):
                    await conn.start()
            await conn.close()
        monkeypatch.setenv("HICACHED_TEST_REDIS_PASSWORD", "s3cret")
        conn = make(tmp_path, server.url, password_env="HICACHED_TEST_REDIS_PASSWORD")
        await conn.start()
        try:
            await conn.probe()
        finally:
            await conn.close()
    finally:
        server.stop()


def test_a_url_that_is_not_redis_is_refused_by_the_config(tmp_path) -> None:
    with pytest.raises(config.ConfigError) as err:
        make(tmp_path, "http://127.0.0.1:6379")
    assert err.value.path == "storage.redis.url"
    with pytest.raises(config.ConfigError) as err:
        make(tmp_path, "unix:///run/redis.sock", cluster=True)
    assert err.value.path == "storage.redis.url"


async def test_a_malformed_url_is_a_configuration_error(tmp_path) -> None:
    conn = make(tmp_path, "redis://127.0.0.1:notaport/0")
    with pytest.raises(BackendMisconfigured) as err:
        await conn.start()
    assert "storage.redis.url" in str(err.value)
    await conn.close()


async def test_no_server_fails_start_as_unavailable(tmp_path) -> None:
    conn = make(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BackendUnavailable) as err:
        async with asyncio.timeout(GUARD_S):
            await conn.start()
    assert err.value.reason == "connection"
    # A closed (or never started) connector answers, it does not crash.
    with pytest.raises(BackendUnavailable):
        await conn.exists(NS, [key(1)])


async def test_tls(tmp_path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    server = RedisServer(tmp_path, tls=tls)
    server.start()
    try:
        conn = make(tmp_path, server.url, ssl_ca_certs=str(tls.ca))
        await conn.start()
        try:
            await conn.probe()
        finally:
            await conn.close()
        # Without our CA the server's certificate cannot be verified: a configuration error.
        conn = make(tmp_path, server.url)
        with pytest.raises(BackendMisconfigured) as err:
            async with asyncio.timeout(GUARD_S):
                await conn.start()
        assert "ssl_ca_certs" in str(err.value)
    finally:
        server.stop()


async def test_one_cluster_node_down_fails_the_calls_that_need_it(tmp_path) -> None:
    cluster = RedisClusterServers(tmp_path)
    cluster.start()
    try:
        conn = make(tmp_path, cluster.url, cluster=True, prefix="one")
        conn_keys = [key(i) for i in range(32)]  # spread over every node's slots
        pages = [memoryview(os.urandom(4 * KiB)) for _ in conn_keys]
        await conn.start()
        try:
            assert all(await conn.put(NS, conn_keys, pages))
            await asyncio.to_thread(cluster.nodes[1].stop)
            for call in (lambda: conn.put(NS, conn_keys, pages), lambda: conn.exists(NS, conn_keys)):
                with pytest.raises(BackendUnavailable):
                    async with asyncio.timeout(GUARD_S):
                        await call()
            await asyncio.to_thread(cluster.restart)
            assert all(await conn.put(NS, conn_keys, pages))
            assert await conn.exists(NS, conn_keys) == len(conn_keys)
        finally:
            await conn.close()
    finally:
        cluster.stop()
