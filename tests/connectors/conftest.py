"""Fixtures that give a test one L3 backend of each kind, on real servers, with hooks to damage objects
behind the connector's back and to stop, stall and restart the store."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hicached.connectors import Connector, build
from proxy import TcpProxy
from servers import MotoServer, RedisClusterServers, RedisServer, aws_env

from hicached import config

BACKENDS = ["file", "redis", "redis-cluster", "s3"]
BUCKET = "hicached-test"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    try:
        server.start()
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


class Harness:
    """One backend for one test: its configuration, its connector, and the store seen from outside."""

    kind: str

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.prefix = f"t{uuid.uuid4().hex[:10]}"  # every test sees only its own objects

    def storage(self) -> dict[str, Any]:
        raise NotImplementedError

    def config(self, operation_timeout: float | None = None, **section: Any) -> config.Config:
        """The configuration; `section` overrides keys of the backend's own section."""
        raw = self.storage()
        raw[raw["backend"]].update(section)
        if operation_timeout is not None:
            raw["operation_timeout"] = operation_timeout
        return config.from_dict({"storage": raw}, base_dir=str(self.tmp_path))

    @contextlib.asynccontextmanager
    async def connector(
        self, operation_timeout: float | None = None, **section: Any
    ) -> AsyncIterator[Connector]:
        conn = build(self.config(operation_timeout, **section))
        assert conn is not None
        await conn.start()
        try:
            yield conn
        finally:
            await conn.close()

    # The stored object, read and written with the store's own client (blocking; tests call these
    # between connector calls).
    def raw(self, ns: str, key: str) -> bytes | None:
        raise NotImplementedError

    def replace(self, ns: str, key: str, data: bytes) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError


class FileHarness(Harness):
    kind = "file"

    def storage(self) -> dict[str, Any]:
        return {"backend": "file", "file": {"root": "l3"}}

    @property
    def root(self) -> Path:
        return self.tmp_path / "l3"

    def _path(self, ns: str, key: str) -> str | None:
        found = glob.glob(str(self.root / ns / "**" / key), recursive=True)
        return found[0] if found else None

    def raw(self, ns: str, key: str) -> bytes | None:
        path = self._path(ns, key)
        return Path(path).read_bytes() if path else None

    def replace(self, ns: str, key: str, data: bytes) -> None:
        path = self._path(ns, key) or str(self.root / ns / key[0:2] / key[2:4] / key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_bytes(data)

    def stop(self) -> None:  # no server to stop: the store vanishes with its directory
        shutil.rmtree(self.root)

    def restart(self) -> None:
        self.root.mkdir(mode=0o700)


class RedisHarness(Harness):
    kind = "redis"

    def __init__(
        self, tmp_path: Path, server: RedisServer | RedisClusterServers, url: str | None = None
    ) -> None:
        super().__init__(tmp_path)
        self.server = server
        self.url = url or server.url
        self.cluster = isinstance(server, RedisClusterServers)

    def storage(self) -> dict[str, Any]:
        redis = {"url": self.url, "prefix": self.prefix, "cluster": self.cluster}
        return {"backend": "redis", "redis": redis}

    def _client(self) -> Any:
        import redis
        import redis.cluster

        if self.cluster:
            return redis.cluster.RedisCluster.from_url(self.server.url)
        return redis.Redis.from_url(self.server.url)

    def raw(self, ns: str, key: str) -> bytes | None:
        with contextlib.closing(self._client()) as c:
            return c.get(f"{self.prefix}:{ns}:{key}")

    def replace(self, ns: str, key: str, data: bytes) -> None:
        with contextlib.closing(self._client()) as c:
            c.set(f"{self.prefix}:{ns}:{key}", data)

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server.restart()


class S3Harness(Harness):
    kind = "s3"

    def __init__(self, tmp_path: Path, server: MotoServer, endpoint_url: str | None = None) -> None:
        super().__init__(tmp_path)
        self.server = server
        self.endpoint_url = endpoint_url or server.endpoint_url

    def storage(self) -> dict[str, Any]:
        s3 = {"bucket": BUCKET, "prefix": self.prefix, "endpoint_url": self.endpoint_url}
        return {"backend": "s3", "s3": {**s3, "addressing_style": "path"}}

    def _name(self, ns: str, key: str) -> str:
        return f"{self.prefix}/{ns}/{key}"

    def raw(self, ns: str, key: str) -> bytes | None:
        client = self.server.client()
        try:
            return client.get_object(Bucket=BUCKET, Key=self._name(ns, key))["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    def replace(self, ns: str, key: str, data: bytes) -> None:
        self.server.client().put_object(Bucket=BUCKET, Key=self._name(ns, key), Body=data)

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server.restart()  # moto keeps nothing across a restart: the bucket is made again
        self.server.create_bucket(BUCKET)


@pytest.fixture
def aws_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in aws_env(tmp_path).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    """A backend on a server shared by the session; each test gets its own key prefix."""
    kind = request.param
    if kind == "file":
        return FileHarness(tmp_path)
    if kind == "redis":
        return RedisHarness(tmp_path, request.getfixturevalue("redis_server"))
    if kind == "redis-cluster":
        return RedisHarness(tmp_path, request.getfixturevalue("redis_cluster"))
    request.getfixturevalue("aws_credentials")
    return S3Harness(tmp_path, request.getfixturevalue("moto_server"))


@pytest.fixture(params=BACKENDS)
def restartable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """A backend on servers of its own, which the test may stop and restart on the same ports."""
    kind = request.param
    if kind == "file":
        yield FileHarness(tmp_path)
        return
    if kind == "s3":
        request.getfixturevalue("aws_credentials")
        server: Any = MotoServer(tmp_path / "moto")
    elif kind == "redis":
        server = RedisServer(tmp_path)
    else:
        server = RedisClusterServers(tmp_path)
    try:
        server.start()
        if kind == "s3":
            server.create_bucket(BUCKET)
            yield S3Harness(tmp_path, server)
        else:
            yield RedisHarness(tmp_path, server)
    finally:
        server.stop()


@pytest.fixture(params=["redis", "s3"])
def stallable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Harness, TcpProxy]]:
    """A backend reached through a proxy that can stall the traffic. (A Redis Cluster hands its clients
    the nodes' own addresses, past any proxy, so it is not among these.)"""
    if request.param == "redis":
        server: Any = request.getfixturevalue("redis_server")
        proxy = TcpProxy(server.port)
    else:
        request.getfixturevalue("aws_credentials")
        server = request.getfixturevalue("moto_server")
        proxy = TcpProxy(server.port)
    proxy.start()
    try:
        if request.param == "redis":
            yield RedisHarness(tmp_path, server, url=f"redis://127.0.0.1:{proxy.port}/0"), proxy
        else:
            yield S3Harness(tmp_path, server, endpoint_url=f"http://127.0.0.1:{proxy.port}"), proxy
    finally:
        proxy.close()
