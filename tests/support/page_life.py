"""Helpers for the tests of a page's life in the daemon (tests/e2e/test_page_life_e2e.py): a real L3 store
(the file backend's directory, a redis-server, moto's S3) that a test can read and delete behind the
daemon's back, and whose calls it can hold (a TCP proxy that keeps what the daemon sends until released, or
a FUSE mount whose operations wait); and the checks of what an engine can load back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from servers import MotoServer, RedisClusterServers, RedisServer, aws_env
from stallfs import StallFS, stallfs_available

from hicached import Client

LOOPBACK = "127.0.0.1"
BUCKET = "hicached-life"
PREFIX = "life"
_CHUNK = 1 << 16


class HoldProxy:
    """Forwards loopback TCP connections to a server, on a thread and event loop of its own. hold() keeps
    every byte the clients send from then on (nothing is dropped, no connection is cut) until release(),
    which forwards it all, in order, and goes on forwarding: a server that takes its time to answer, for as
    long as the test says. What the server sends always goes through (the answers to what it got before).
    `held_bytes`: the bytes (an end of stream counts as one) kept back now."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.held_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._stop: asyncio.Future[None] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def hold(self) -> None:
        self._in_loop(lambda: self._flowing.clear())

    def release(self) -> None:
        self._in_loop(lambda: self._flowing.set())

    def close(self) -> None:
        if self._thread.is_alive():
            self._in_loop(lambda: self._flowing.set() or self._stop.done() or self._stop.set_result(None))
            self._thread.join(10)
        self._loop.close()

    def _in_loop(self, change: Callable[[], Any]) -> None:
        async def run() -> None:
            change()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    async def _serve(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._stop = self._loop.create_future()
        server = await asyncio.start_server(self._handle, LOOPBACK, 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        for w in (writer, up_writer):
            w.transport.set_write_buffer_limits(0)  # drain() returns once the kernel has every byte
        pumps = {
            asyncio.ensure_future(self._pump(reader, up_writer, hold=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, hold=False)),
        }
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # close(): the proxy is going away, and so is every connection
        finally:
            for w in (writer, up_writer):
                w.close()
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold: bool) -> None:
        assert self._flowing is not None
        try:
            while True:
                data = await reader.read(_CHUNK)
                if hold and not self._flowing.is_set():
                    n = len(data) or 1
                    self.held_bytes += n
                    try:
                        await self._flowing.wait()
                    finally:
                        self.held_bytes -= n
                if not data:
                    return
                writer.write(data)
                await writer.drain()
        except OSError:
            return


@dataclasses.dataclass
class L3:
    """A real store for the daemon's L3, and what a test does to it behind the daemon's back."""

    kind: str
    section: dict[str, Any]  # the daemon's [storage.<kind>]: through the hold, where the store has one
    direct: dict[str, Any]  # the same store, never held: for a second daemon that reads it
    hold: Callable[[], None]  # from now on, the daemon's calls wait (until release)
    release: Callable[[], None]
    holding: Callable[[], bool]  # a call of the daemon's is being held now
    keys: Callable[[str], set[str]]  # the page keys of a namespace in the store
    delete: Callable[[str], int]  # every page of a namespace deleted; how many

    def storage(self, direct: bool = False) -> dict[str, Any]:
        """The [storage] table of a daemon on this store: a held call is not a stall, nor a failure (a
        test holds a call for a moment, and the breaker must not detach the backend meanwhile)."""
        return {
            "backend": self.kind,
            self.kind: self.direct if direct else self.section,
            "operation_timeout": "30s",
            "breaker": {"stall_timeout": 0, "slow_factor": 0},
        }


@contextlib.contextmanager
def open_l3(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holdable: bool) -> Iterator[L3]:
    """An L3 store of `kind` ("file", "redis", "cluster", "s3") in tmp_path. Redis and S3 are always behind a
    HoldProxy; the file backend is on a StallFS mount if `holdable` (skipped where FUSE cannot mount: it says
    why), else on a plain directory (hold() then fails). "cluster" is a three-master Redis Cluster, never
    held (its MOVED answers name the nodes' own ports, which a proxy in front of one node would not cover):
    hold() fails, whatever `holdable` says."""
    if kind == "file":
        yield from _file_l3(tmp_path, holdable)
        return
    if kind == "cluster":
        yield from _cluster_l3(tmp_path)
        return
    if kind == "redis":
        server: RedisServer | MotoServer = RedisServer(tmp_path / "redis", extra=("--maxmemory", "0"))
    else:
        for k, v in aws_env(tmp_path).items():
            monkeypatch.setenv(k, v)  # the daemons inherit them: the standard AWS chain
        server = MotoServer(tmp_path / "moto")
    server.start()
    proxy = HoldProxy(server.port)
    proxy.start()
    try:
        holding = lambda: proxy.held_bytes > 0  # noqa: E731
        if isinstance(server, RedisServer):
            section = {"url": f"redis://{LOOPBACK}:{proxy.port}/0", "prefix": PREFIX}
            direct = {"url": server.url, "prefix": PREFIX}
            port = server.port
            yield L3(
                "redis",
                section,
                direct,
                proxy.hold,
                proxy.release,
                holding,
                lambda ns: _redis_keys(port, ns),
                lambda ns: _redis_delete(port, ns),
            )
        else:
            server.create_bucket(BUCKET)
            section = {"bucket": BUCKET, "prefix": PREFIX, "addressing_style": "path"}
            direct = {**section, "endpoint_url": server.endpoint_url}
            section["endpoint_url"] = f"http://{LOOPBACK}:{proxy.port}"
            s3 = server
            yield L3(
                "s3",
                section,
                direct,
                proxy.hold,
                proxy.release,
                holding,
                lambda ns: _s3_keys(s3, ns),
                lambda ns: _s3_delete(s3, ns),
            )
    finally:
        proxy.release()
        proxy.close()
        server.stop()


def _file_l3(tmp_path: Path, holdable: bool) -> Iterator[L3]:
    if not holdable:
        root = tmp_path / "l3"
        section = {"root": str(root)}

        def cannot() -> None:
            raise AssertionError("this file store has no hold: open it with holdable=True")

        yield L3(
            "file",
            section,
            section,
            cannot,
            cannot,
            lambda: False,
            lambda ns: _file_keys(root, ns),
            lambda ns: _file_delete(root, ns),
        )
        return
    why = stallfs_available()
    if why is not None:
        pytest.skip(f"holding the file backend's reads needs a FUSE mount: {why}")
    backing = tmp_path / "disk"
    backing.mkdir()
    with StallFS(backing, tmp_path / "mnt") as fs:
        root = backing / "data"  # what the daemon sees as tmp_path/mnt/data
        try:
            yield L3(
                "file",
                {"root": str(tmp_path / "mnt" / "data")},
                {"root": str(root)},
                fs.stall,
                fs.resume,
                lambda: fs.waiting > 0,
                lambda ns: _file_keys(root, ns),
                lambda ns: _file_delete(root, ns),
            )
        finally:
            fs.resume()  # before the daemon stops: its threads may be waiting on the mount


def _cannot_hold() -> None:
    raise AssertionError("a Redis Cluster has no hold: only redis, s3 and a holdable file store have one")


def _cluster_l3(tmp_path: Path) -> Iterator[L3]:
    cluster = RedisClusterServers(tmp_path / "cluster")
    try:
        cluster.start()
        section = {"url": cluster.url, "cluster": True, "prefix": PREFIX}
        ports = [n.port for n in cluster.nodes]
        yield L3(
            "redis",
            section,
            section,
            _cannot_hold,
            _cannot_hold,
            lambda: False,
            lambda ns: set().union(*(_redis_keys(port, ns) for port in ports)),
            lambda ns: sum(_cluster_node_delete(port, ns) for port in ports),
        )
    finally:
        cluster.stop()


def _is_key(name: str) -> bool:
    """A page key as page_keys makes them (the backends' temporary files are named otherwise)."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _file_pages(root: Path, ns: str) -> list[Path]:
    return [Path(d, n) for d, _, names in os.walk(root / ns) for n in names if _is_key(n)]


def _file_keys(root: Path, ns: str) -> set[str]:
    return {p.name for p in _file_pages(root, ns)}


def _file_delete(root: Path, ns: str) -> int:
    """The page files of `ns` removed; their directories stay (as a janitor of another node leaves them)."""
    pages = _file_pages(root, ns)
    for p in pages:
        p.unlink()
    return len(pages)


def _redis_names(c: redis.Redis, ns: str) -> list[bytes]:
    return list(c.scan_iter(match=f"{PREFIX}:{ns}:*", count=1000))


def _redis_keys(port: int, ns: str) -> set[str]:
    with contextlib.closing(redis.Redis(host=LOOPBACK, port=port)) as c:
        return {name.decode().rsplit(":", 1)[1] for name in _redis_names(c, ns)}


def _redis_delete(port: int, ns: str) -> int:
    with contextlib.closing(redis.Redis(host=LOOPBACK, port=port)) as c:
        names = _redis_names(c, ns)
        return c.delete(*names) if names else 0


def _cluster_node_delete(port: int, ns: str) -> int:
    """The pages of `ns` that one master of a cluster holds, deleted one by one (a DEL of several keys in
    other hash slots is refused: CROSSSLOT)."""
    with contextlib.closing(redis.Redis(host=LOOPBACK, port=port)) as c:
        names = _redis_names(c, ns)
        pipe = c.pipeline(transaction=False)
        for name in names:
            pipe.delete(name)
        return sum(pipe.execute()) if names else 0


def _s3_objects(server: MotoServer, ns: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{ns}/")
    return [obj["Key"] for listing in pages for obj in listing.get("Contents", [])]


def _s3_keys(server: MotoServer, ns: str) -> set[str]:
    return {name.rsplit("/", 1)[1] for name in _s3_objects(server, ns)}


def _s3_delete(server: MotoServer, ns: str) -> int:
    names = _s3_objects(server, ns)
    client = server.client()
    for i in range(0, len(names), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in names[i : i + 1000]]})
    return len(names)


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Polls `check` until it returns something true (returned); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def loadable(socket: str, ns: str, page_bytes: int, pages: dict[str, bytes]) -> tuple[int, int]:
    """What a fresh engine loads of `pages` (key -> bytes): (how many come back with exactly their bytes,
    how many with other bytes). The keys present (in L2 or L3) are loaded all at once, and key by key if
    some of them do not come back."""
    with Client(socket, ns, page_bytes) as c:
        keys = [k for k, here in zip(pages, c.present(list(pages)), strict=True) if here]
        got = c.get(keys)
        if len(got) < len(keys):
            got = [b"".join(c.get([k])) for k in keys]
        exact = sum(g == pages[k] for k, g in zip(keys, got, strict=True))
        return exact, sum(len(g) > 0 for g in got) - exact
