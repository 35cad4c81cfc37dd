"""What only the S3 connector does: object names, and a store that refuses us reported as a configuration
error, never as misses."""

from __future__ import annotations

import asyncio

import pytest
from hicached.connectors import BackendMisconfigured, BackendUnavailable
from hicached.connectors.s3 import S3Connector
from servers import MotoServer, env_with, free_port

from hicached import config

NS = "ns.test"
BUCKET = "hicached-test"  # made by the moto_server fixture
GUARD_S = 60


def key(i: int) -> str:
    return f"{i:064x}"


def make(tmp_path, endpoint_url: str, **s3_cfg) -> S3Connector:
    s3 = {"bucket": BUCKET, "endpoint_url": endpoint_url, "addressing_style": "path", **s3_cfg}
    return S3Connector(config.from_dict({"storage": {"backend": "s3", "s3": s3}}, str(tmp_path)))


async def start_fails(conn: S3Connector, error: type[Exception]) -> Exception:
    with pytest.raises(error) as err:
        async with asyncio.timeout(GUARD_S):
            await conn.start()
    await conn.close()
    return err.value


async def test_objects_are_named_prefix_namespace_key(tmp_path, moto_server, aws_credentials) -> None:
    for prefix, name in (("kv/a", f"kv/a/{NS}/{key(1)}"), ("", f"{NS}/{key(1)}")):
        conn = make(tmp_path, moto_server.endpoint_url, prefix=prefix)
        await conn.start()
        try:
            assert await conn.put(NS, [key(1)], [memoryview(b"x" * 100)]) == [True]
        finally:
            await conn.close()
        head = await asyncio.to_thread(moto_server.client().head_object, Bucket=BUCKET, Key=name)
        assert head["ContentLength"] == 32 + 100


async def test_missing_bucket_is_a_configuration_error_at_start(
    tmp_path, moto_server, aws_credentials
) -> None:
    err = await start_fails(
        make(tmp_path, moto_server.endpoint_url, bucket="no-such-bucket"), BackendMisconfigured
    )
    assert "no-such-bucket" in str(err) and "storage.s3.bucket" in str(err)


async def test_no_credentials_is_a_configuration_error(
    tmp_path, moto_server, aws_credentials, monkeypatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    err = await start_fails(make(tmp_path, moto_server.endpoint_url), BackendMisconfigured)
    assert err.reason == "credentials"


async def test_refused_credentials_are_a_configuration_error(tmp_path, aws_credentials) -> None:
    # moto checks credentials only when asked to; our dummy key is then unknown to it: a 403.
    server = MotoServer(tmp_path / "moto", env=env_with(INITIAL_NO_AUTH_ACTION_COUNT="0"))
    server.start()
    try:
        err = await start_fails(make(tmp_path, server.endpoint_url), BackendMisconfigured)
        assert err.reason == "refused"
    finally:
        server.stop()


async def test_no_server_fails_start_as_unavailable(tmp_path, aws_credentials) -> None:
    conn = make(tmp_path, f"http://127.0.0.1:{free_port()}", max_attempts=1)
    err = await start_fails(conn, BackendUnavailable)
    assert err.reason == "connection"
    with pytest.raises(BackendUnavailable):
        await conn.exists(NS, [key(1)])
