"""The server against misbehaving peers and live reconfiguration: bounds that must hold whatever a peer
does, and reloads that apply what they report as applied."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

from hicached import config
from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient, control


def write_config(tmp_path, **server) -> str:
    path = tmp_path / "hicached.toml"
    lines = ["[server]", 'socket = "run/d.sock"', *(f"{k} = {v!r}" for k, v in server.items())]
    lines += ["[pool]", 'capacity = "16MiB"', 'slab_size = "1MiB"', "prefault = false"]
    lines += ["[storage]", 'backend = "none"', "[warmup]", "enabled = false"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def raw_connect(path: str) -> socket.socket:
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    await loop.sock_connect(s, path)
    await asyncio.sleep(0.05)
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
    for fd in fds:
        os.close(fd)
    assert data
    return s


async def test_reload_applies_max_keys_per_request_to_engine_requests(tmp_path):
    path = write_config(tmp_path, max_keys_per_request=100)
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    try:
        keys = [f"{i:064x}" for i in range(150)]
        async with AsyncClient(d.server.path, "mk.ns", 4096) as c:
            with pytest.raises(HicachedError, match="limit is 100"):
                await c.exists(keys)
            write_config(tmp_path, max_keys_per_request=1000)
            assert (await d.reload())["applied"] == ["server.max_keys_per_request"]
            assert await c.exists(keys) == 0
            assert await c.store(keys, [bytes(4096)] * 150) == [True] * 150
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_connections_in_their_handshake_count_against_max_connections(tmp_path):
    path = write_config(tmp_path, max_connections=4, handshake_timeout="200ms")
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    socks = []
    try:
        loop = asyncio.get_running_loop()
        for _ in range(12):  # all at once, none sends anything
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            await loop.sock_connect(s, d.server.path)
            socks.append(s)
        await asyncio.sleep(0.5)
        assert len(d.server.connections) <= 4
    finally:
        for s in socks:
            s.close()
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_a_peer_that_never_reads_its_answers_cannot_grow_the_daemon(tmp_path):
    path = write_config(tmp_path, max_frame="64KiB")
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    s = await raw_connect(d.server.path)
    try:
        loop = asyncio.get_running_loop()
        hello = protocol.encode({"id": 1, "op": "hello", "namespace": "wb.ns", "page_bytes": 4096})
        batch = b"".join(protocol.encode({"id": i, "op": "status"}) for i in range(2, 1002))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await loop.sock_sendall(s, hello)
        for _ in range(200):  # 200k requests; the daemon must stop reading well before
            try:
                await asyncio.wait_for(loop.sock_sendall(s, batch), 0.5)
            except TimeoutError:
                break
        (conn,) = d.server.connections
        assert conn.transport.get_write_buffer_size() < 1 << 20
    finally:
        s.close()
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_sighup_during_startup_reloads_once_started(tmp_path):
    path = write_config(tmp_path)
    sent: list[str] = []

    class Notes:
        def ready(self, status=""):
            sent.append("READY")

        def reloading(self):
            sent.append("RELOADING")

        def __getattr__(self, name):
            return lambda *a: None

    d = Daemon(config.load(path), config_path=path, notifier=Notes())
    d.should_exit = asyncio.Event()
    d.handle_signal(signal.SIGHUP)  # before anything is built
    await asyncio.sleep(0)
    await d.startup()
    try:
        for _ in range(100):
            if d.reloads["ok"]:
                break
            await asyncio.sleep(0.01)
        assert d.reloads["ok"] == 1
        assert sent == ["READY", "RELOADING", "READY"]  # never READY before the daemon serves
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_at_max_connections_engines_are_refused_busy_but_a_region_can_still_be_registered(tmp_path):
    # The side connection that registers a host region belongs to a connection already counted: an engine
    # at the limit can still register its memory, while another engine is told `busy`.
    from hicached.engine.client import shared_buffer

    path = write_config(tmp_path, max_connections=2)
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    try:
        async with (
            AsyncClient(d.server.path, "a.ns", 4096) as a,
            AsyncClient(d.server.path, "b.ns", 4096) as b,
        ):
            with pytest.raises(HicachedError) as e:
                await AsyncClient(d.server.path, "c.ns", 4096).connect()
            assert e.value.code == "busy" and "max_connections" in e.value.message
            region = shared_buffer(8 * 4096)
            region[:4096] = 7
            handle = await a.register_region(region, 4096)
            assert await a.store_pages(handle, [0], ["r0"]) == [True]
            assert await a.get(["r0"]) == [bytes([7]) * 4096]
            assert await b.exists(["r0"]) == 0  # another namespace
            assert len(d.server.connections) == 2
        # Once one has gone, another engine gets in.
        async with AsyncClient(d.server.path, "c.ns", 4096) as c:
            assert await c.exists(["x"]) == 0
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_a_peer_that_sends_nothing_is_answered_timeout_and_closed(tmp_path):
    path = write_config(tmp_path, handshake_timeout="300ms")
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    loop = asyncio.get_running_loop()
    silent = await raw_connect(d.server.path)
    half = await raw_connect(d.server.path)
    try:
        hello = protocol.encode({"id": 4, "op": "hello", "namespace": "h.ns", "page_bytes": 4096})
        await loop.sock_sendall(half, hello[:5])
        for s in (silent, half):
            got = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(s, 1 << 16), 5.0):
                got += chunk
            (answer,) = protocol.FrameDecoder(1 << 16).feed(got)
            assert answer["error"]["code"] == "timeout", answer
        assert d.server.handshake_timeouts == 2 and not d.server.connections
    finally:
        silent.close()
        half.close()
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_an_idle_engine_and_a_long_control_request_are_never_cut_off(tmp_path):
    path = write_config(tmp_path, handshake_timeout="200ms")
    d = Daemon(config.load(path), config_path=path)
    await d.startup()

    async def slow_flush(session, req) -> dict:
        await asyncio.sleep(1.0)  # a flush that waits on L3 for five handshake time-outs
        return {"flushed": True}

    d.server.handlers["flush"] = slow_flush
    try:
        async with AsyncClient(d.server.path, "idle.ns", 4096) as c:
            t0 = time.monotonic()
            answer = await asyncio.to_thread(control, d.server.path, "flush", 10.0)
            assert answer["flushed"] is True and time.monotonic() - t0 >= 1.0
            assert await c.exists([f"{1:064x}"]) == 0  # said hello, then idled past the time-out
        assert d.server.handshake_timeouts == 0
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
