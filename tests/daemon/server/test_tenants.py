"""Tenants in the server (hicached.daemon.server.tenants and the listener): membership, namespaces, the
tenant socket that serves engines alone, the views of `status` and `stats`, and reloads. The daemon runs in
this process as root: an operator on server.socket, in the default tenant; through a tenant's socket, an
engine of that tenant. Membership by uid and gid, with real processes of other uids: tests/e2e."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator

import pytest
from daemon_proc import to_toml

from hicached import config
from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.daemon.server.listener import Server
from hicached.daemon.server.tenants import TenantTable
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient, _connect, control

PAGE = 4096
CHANGING = [
    ("reload", {}),
    ("drain", {"cancel": False}),
    ("drain", {"cancel": True}),
    ("backend", {"action": "detach"}),
    ("backend", {"action": "attach", "name": "file"}),
    ("flush", {}),
]


def table(tenants: dict, **server) -> TenantTable:
    raw = {
        "server": {"socket": "/run/h/main.sock", **server},
        "pool": {"capacity": "64MiB", "slab_size": "1MiB"},
        "storage": {"backend": "none"},
        "tenants": tenants,
    }
    return TenantTable(config.from_dict(raw, "/etc/h"))


def test_membership_is_the_socket_then_the_uid_then_the_gid():
    t = table(
        {
            "a": {"uids": [1001], "gids": [77], "namespaces": ["a.*"], "capacity": "8MiB"},
            "b": {"gids": [500], "namespaces": ["b"], "capacity": "8MiB"},
            "c": {"uids": [1002], "socket": "run/c.sock", "namespaces": ["c.*"], "capacity": "8MiB"},
        }
    )
    assert t.member(1001, 500, "/etc/h/run/c.sock") == "c"  # the socket first, whoever connects
    assert t.member(1001, 500) == "a"  # then the uid: b's gid comes after a's uid
    assert t.member(1002, 77) == "c"  # c's uid over a's gid
    assert t.member(4242, 500) == "b"
    assert t.member(4242, 77) == "a"
    assert t.member(4242, 4242) is None  # the caller admits it into the default tenant, or refuses it


def test_namespaces_per_tenant_and_the_default_tenant_has_the_rest():
    t = table(
        {
            "a": {"uids": [1], "namespaces": ["team-a.*", "shared.x"], "capacity": "8MiB"},
            "b": {"uids": [2], "namespaces": ["team-b"], "capacity": "8MiB"},
        }
    )
    assert t.allows("a", "team-a.llama") and t.allows("a", "shared.x")
    assert not t.allows("a", "team-b") and not t.allows("a", "shared.y") and not t.allows("a", "team-ab")
    assert t.allows("b", "team-b") and not t.allows("b", "team-b.x")
    assert t.allows("default", "team-b.x") and t.allows("default", "shared.y")
    assert not t.allows("default", "team-a.llama") and not t.allows("default", "team-b")
    assert not t.allows("nobody", "shared.y")
    assert t.owner("team-a.q") == "a" and t.owner("zzz") == "default"
    assert t.tenants["default"].capacity == 48 << 20


def test_without_tenants_the_default_tenant_allows_every_namespace():
    t = table({})
    assert not t.configured and list(t.tenants) == ["default"]
    assert t.member(1001, 1001) is None
    assert all(t.allows("default", ns) for ns in ("a", "team-a.x", "x" * 128))


def write(tmp_path, tenants: dict, **server) -> str:
    raw = {
        "server": {"socket": "run/main.sock", **server},
        "pool": {"capacity": "16MiB", "slab_size": "1MiB", "prefault": False},
        "storage": {"backend": "file", "file": {"root": "data"}},
        "warmup": {"enabled": False},
        "tenants": tenants,
    }
    path = tmp_path / "hicached.toml"
    path.write_text(to_toml(raw))
    return str(path)


TENANT_T = {"socket": "run/t.sock", "namespaces": ["t.*"], "capacity": "4MiB"}


@contextlib.asynccontextmanager
async def daemon(tmp_path) -> AsyncIterator[Daemon]:
    """A daemon with one tenant, t, that has a socket of its own (`d.tenant_socket`)."""
    path = write(tmp_path, {"t": TENANT_T})
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    d.tenant_socket = str(tmp_path / "run" / "t.sock")
    try:
        yield d
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


def requests(path: str, reqs: list[dict]) -> list[dict]:
    """`reqs` one after the other on one raw connection; their answers."""
    sock, _, pool_fd = _connect(path, 10.0)
    os.close(pool_fd)
    decoder = protocol.FrameDecoder(1 << 20)
    out = []
    try:
        for i, req in enumerate(reqs, 1):
            sock.sendall(protocol.encode({**req, "id": i}))
            got: list = []
            while not got:
                got = decoder.feed(sock.recv(1 << 16))
            out.append(got[0])
    finally:
        sock.close()
    return out


def ask(path: str, requests: list[tuple[str, dict]]) -> list[dict]:
    out = []
    for op, fields in requests:
        try:
            out.append(control(path, op, timeout=10.0, **fields))
        except HicachedError as e:
            out.append({"code": e.code, "message": e.message})
    return out


async def test_the_tenant_socket_is_listened_on_with_the_socket_mode_and_removed_at_stop(tmp_path):
    path = write(tmp_path, {"t": TENANT_T}, socket_mode="0600")
    sock = tmp_path / "run" / "t.sock"
    sock.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))  # left by a daemon that died: nobody listens on it
    stale.close()
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    try:
        assert oct(os.stat(sock).st_mode & 0o777) == oct(0o600)
        assert (await asyncio.to_thread(control, str(sock), "status", 10.0))["tenant"] == "t"
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    assert not sock.exists() and not (tmp_path / "run" / "main.sock").exists()


async def test_root_through_a_tenant_socket_changes_nothing(tmp_path):
    """Root is an operator on server.socket, and through a tenant's socket an engine of that tenant: every
    control that changes the daemon is unauthorized there, and nothing changes."""
    async with daemon(tmp_path) as d:
        answers = await asyncio.to_thread(ask, d.tenant_socket, CHANGING)
        for (op, fields), ans in zip(CHANGING, answers, strict=True):
            assert ans.get("code") == "unauthorized", (op, fields, ans)
            assert "tenant 't''s socket, which serves engines alone" in ans["message"], ans
        status = await asyncio.to_thread(control, d.server.path, "status", 10.0)
        assert status["backend"] == "file" and status["draining"] is False and status["reloads"]["ok"] == 0
        # The same controls from root on server.socket work.
        assert "code" not in (await asyncio.to_thread(ask, d.server.path, [("flush", {})]))[0]


async def test_a_hello_outside_the_tenants_namespaces_is_unauthorized_and_changes_nothing(tmp_path):
    async with daemon(tmp_path) as d:
        async with AsyncClient(d.tenant_socket, "t.model", PAGE) as c:
            assert await c.store(["k1"], [b"\1" * PAGE]) == [True]
        hello = {"op": "hello", "page_bytes": PAGE}
        ok, refused, after = await asyncio.to_thread(
            requests,
            d.tenant_socket,
            [
                {**hello, "namespace": "t.model"},
                {**hello, "namespace": "d.model"},
                {"op": "exists", "keys": ["k1"]},
            ],
        )
        assert "error" not in ok and refused["error"]["code"] == "unauthorized", refused
        message = refused["error"]["message"]
        assert "namespace 'd.model' is not tenant 't''s: tenant 't' may open t.*" in message, message
        assert after == {"id": 3, "n": 1}, after  # still in t.model
        with pytest.raises(HicachedError) as e:
            await AsyncClient(d.server.path, "t.model", PAGE).connect()  # root, in the default tenant
        assert e.value.code == "unauthorized" and "it is tenant 't''s" in e.value.message


async def test_an_engine_sees_its_tenant_alone_and_an_operator_sees_all(tmp_path):
    async with daemon(tmp_path) as d:
        async with (
            AsyncClient(d.tenant_socket, "t.model", PAGE) as t,
            AsyncClient(d.server.path, "d.model", PAGE) as o,
        ):
            await t.store(["k"], [bytes(PAGE)])
            await o.store(["k"], [bytes(PAGE)])
            mine = await t.stats()
            assert mine["namespaces"] == {"t.model": PAGE}, mine["namespaces"]
            assert mine["tenant"]["name"] == "t" and "tenants" not in mine
            assert mine["server"]["connections"] == 1
            status = await asyncio.to_thread(control, d.tenant_socket, "status", 10.0)
            assert status["tenant"] == "t" and status["socket"] == d.tenant_socket and "tenants" not in status
            everything = await o.stats()
            assert everything["namespaces"] == {"t.model": PAGE, "d.model": PAGE}
            tenants = everything["tenants"]
            assert tenants["t"]["connections"] == 1 and tenants["t"]["patterns"] == ["t.*"]
            assert tenants["t"]["socket"] == d.tenant_socket and tenants["t"]["capacity_bytes"] == 4 << 20
            assert tenants["default"]["connections"] == 1 and tenants["default"]["capacity_bytes"] == 12 << 20


async def test_a_reload_closes_the_connections_its_tenants_no_longer_allow(tmp_path):
    """A tenant's namespaces change: the engine in a namespace no longer its tenant's is closed (and its
    client, reconnecting, is refused); one in a namespace still allowed stays connected."""
    async with daemon(tmp_path) as d:
        async with (
            AsyncClient(d.tenant_socket, "t.old", PAGE, reconnect=0) as gone,
            AsyncClient(d.tenant_socket, "t.new", PAGE, reconnect=0) as stays,
        ):
            assert await gone.exists(["k"]) == 0 and await stays.exists(["k"]) == 0
            write(tmp_path, {"t": {**TENANT_T, "namespaces": ["t.new"]}})
            answer = await d.reload()
            assert answer["ok"] and answer["applied"] == ["tenants.t.namespaces"], answer
            await asyncio.sleep(0.2)
            with pytest.raises(HicachedError):
                await gone.exists(["k"])
            assert await stays.exists(["k"]) == 0
            assert len(d.server.connections) == 1
        with pytest.raises(HicachedError) as e:
            await AsyncClient(d.tenant_socket, "t.old", PAGE).connect()
        assert e.value.code == "unauthorized"


async def test_a_reload_keeps_a_tenant_socket_and_the_set_of_tenants_until_a_restart(tmp_path):
    async with daemon(tmp_path) as d:
        write(
            tmp_path,
            {
                "t": {**TENANT_T, "socket": "run/other.sock", "capacity": "8MiB"},
                "u": {"uids": [4242], "namespaces": ["u.*"], "capacity": "1MiB"},
            },
        )
        answer = await d.reload()
        assert answer["ok"], answer
        assert answer["restart_required"] == ["tenants.t.capacity", "tenants.t.socket", "tenants.u"]
        assert list(d.cfg.tenants) == ["t"] and d.cfg.tenants["t"].socket == "run/t.sock"
        assert (await asyncio.to_thread(control, d.tenant_socket, "status", 10.0))["tenant"] == "t"


async def test_a_side_connection_through_a_tenant_socket_attaches_only_to_that_tenant(tmp_path):
    """Root's connection on server.socket is in the default tenant: a region offered for it through tenant
    t's socket, with its token and by its uid, is refused."""

    def attempt(d: Daemon) -> dict:
        main, welcome, pool_fd = _connect(d.server.path, 10.0)
        os.close(pool_fd)
        try:
            main.sendall(protocol.encode({"id": 1, "op": "hello", "namespace": "d.x", "page_bytes": PAGE}))
            assert protocol.FrameDecoder(1 << 20).feed(main.recv(1 << 16))[0].get("slot_bytes")
            side, _, fd = _connect(d.tenant_socket, 10.0)
            os.close(fd)
            region = os.memfd_create("region", os.MFD_CLOEXEC)
            os.ftruncate(region, 4 * PAGE)
            frame = {"id": 7, "op": "region_attach", "token": welcome["token"], "kind": "host"}
            socket.send_fds(
                side, [protocol.encode({**frame, "nbytes": 4 * PAGE, "page_bytes": PAGE})], [region]
            )
            os.close(region)
            answer = protocol.FrameDecoder(1 << 20).feed(side.recv(1 << 16))[0]
            side.close()
            return answer
        finally:
            main.close()

    async with daemon(tmp_path) as d:
        answer = await asyncio.to_thread(attempt, d)
    assert answer["error"]["code"] == "unauthorized", answer
    assert "tenant 't''s socket can only serve a connection of that tenant" in answer["error"]["message"]


async def test_a_hand_over_passes_the_tenant_sockets_and_the_next_server_matches_them_by_path(tmp_path):
    """Takeover: the old server hands over server.socket's listening socket and the tenants', still open;
    the next one listens on them (engines that connect meanwhile wait in their backlogs), binding nothing."""
    async with daemon(tmp_path) as d:
        socks = await d.server.hand_over(1.0)
        assert [s.getsockname() for s in socks] == [d.server.path, d.tenant_socket]
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        waiting.connect(d.tenant_socket)  # in the backlog, for the next server
        waiting.close()
        nxt = Server(d.cfg, d.tiers)
        await nxt.start(socks[0], owns_path=True, handed=list(reversed(socks[1:])))
        try:
            assert (await asyncio.to_thread(control, d.tenant_socket, "status", 10.0))["tenant"] == "t"
            assert (await asyncio.to_thread(control, d.server.path, "status", 10.0))["connections"] == 1
        finally:
            await nxt.stop(1.0)
        assert not os.path.exists(d.tenant_socket) and not os.path.exists(d.server.path)
