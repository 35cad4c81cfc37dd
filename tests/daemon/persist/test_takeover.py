"""The takeover's hand-over (hicached.daemon.persist.takeover): each arena's fds named by arena and role, and
the positional form of a release before named fds, read from an old instance and sent to one."""

from __future__ import annotations

import asyncio
import os
import socket

import msgpack
import pytest

from hicached.daemon.persist import takeover
from hicached.daemon.persist.takeover import INDEX, LISTEN, POOL, TENANT_LISTEN

SLAB = 1 << 20
ARENAS = [("default", 4 << 20), ("a", 2 << 20), ("b", 2 << 20)]


def _memfd(tag: str) -> int:
    fd = os.memfd_create(f"test-{tag}", os.MFD_CLOEXEC)
    os.write(fd, tag.encode())
    return fd


def _tag(fd: int) -> str:
    return os.pread(fd, 64, 0).decode()


def _listener(tmp_path, name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp_path / name))
    s.listen()
    return s


def _entries(tmp_path, names: list[str], tenant_sockets: int = 0) -> takeover.Entries:
    """What an old instance hands over: its listening socket, each arena's pool and index snapshot (memfds
    holding their own names, to tell them apart), the tenants' sockets."""
    out: takeover.Entries = [(LISTEN, "", _listener(tmp_path, "main").detach())]
    for name in names:
        out += [(POOL, name, _memfd(f"pool {name}")), (INDEX, name, _memfd(f"index {name}"))]
    out += [(TENANT_LISTEN, "", _listener(tmp_path, f"t{i}").detach()) for i in range(tenant_sockets)]
    return out


async def _exchange(messages, receive, names):
    """`messages` sent on one end of a SOCK_SEQPACKET pair and read with `receive` on the other."""
    old, new = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    new.setblocking(False)
    try:
        for msg, fds in messages:
            socket.send_fds(old, [msgpack.packb(msg)], fds)
        got = await receive(new, names)
        return takeover._handed(new, 4242, *got, names)
    finally:
        old.close()


def _arenas(handed: takeover.Handed) -> list[tuple[str, str, str]]:
    return [(name, _tag(p), _tag(i)) for name, p, i in handed.arenas]


def _close(entries: takeover.Entries, handed: takeover.Handed) -> None:
    for _, _, fd in entries:
        os.close(fd)
    for _, p, i in handed.arenas:
        os.close(p)
        os.close(i)
    for s in (handed.listen, *handed.tenant_listen, handed.sock):
        s.close()


@pytest.mark.parametrize("names", [["default"], [n for n, _ in ARENAS]])
async def test_named_hand_over_names_each_arenas_fds(tmp_path, names):
    entries = _entries(tmp_path, names, tenant_sockets=2)
    messages = takeover._named_messages(entries)
    assert len(messages) == 1 and messages[0][0]["op"] == "handover" and not messages[0][0]["more"]
    assert [POOL, names[-1]] in messages[0][0]["fds"] and [INDEX, names[0]] in messages[0][0]["fds"]
    handed = await _exchange(messages, takeover._recv_named, names)
    assert _arenas(handed) == [(n, f"pool {n}", f"index {n}") for n in names]
    assert len(handed.tenant_listen) == 2 and handed.listen.getsockname() == str(tmp_path / "main")
    _close(entries, handed)


async def test_named_hand_over_past_what_one_message_carries(tmp_path):
    names = [f"t{i}" for i in range(130)]
    entries = _entries(tmp_path, names)
    messages = takeover._named_messages(entries)
    assert [m["op"] for m, _ in messages] == ["handover", "fds"] and messages[0][0]["more"]
    handed = await _exchange(messages, takeover._recv_named, names)
    assert _arenas(handed) == [(n, f"pool {n}", f"index {n}") for n in names]
    _close(entries, handed)


async def test_named_hand_over_missing_an_arena_is_refused(tmp_path):
    entries = _entries(tmp_path, ["default", "a"])
    messages = takeover._named_messages(entries[:-2])
    old, new = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    new.setblocking(False)
    for msg, fds in messages:
        socket.send_fds(old, [msgpack.packb(msg)], fds)
    msg, got = await takeover._recv_named(new, ["default", "a"])
    with pytest.raises(takeover._PeerError, match="not"):
        takeover._handed(new, 1, msg, got, ["default", "a"])
    for _, _, fd in entries + got:
        os.close(fd)
    old.close()
    new.close()


@pytest.mark.parametrize("names", [["default"], [n for n, _ in ARENAS]])
async def test_positional_hand_over_of_a_release_before_named_fds_is_read(tmp_path, names):
    """An old instance (a release before named fds) hands its fds over by position: the listening socket,
    the first arena's pool and index, the tenants' sockets, then one message for each other arena."""
    entries = _entries(tmp_path, names, tenant_sockets=1)
    fd = {(role, name): fd for role, name, fd in entries}
    tenant = [fd for role, _, fd in entries if role == TENANT_LISTEN]
    first = {"op": "handover", "pages": 7, "owed": 2, "tenant_sockets": 1}
    if len(names) > 1:
        first["arenas"] = names
    messages = [(first, [fd[(LISTEN, "")], fd[(POOL, names[0])], fd[(INDEX, names[0])], *tenant])]
    messages += [({"op": "arena", "name": n}, [fd[(POOL, n)], fd[(INDEX, n)]]) for n in names[1:]]
    handed = await _exchange(messages, takeover._recv_positional, names)
    assert _arenas(handed) == [(n, f"pool {n}", f"index {n}") for n in names]
    assert (handed.pages, handed.owed, len(handed.tenant_listen)) == (7, 2, 1)
    # And what this release sends to an old instance (its hello lacks `named`) is that same form.
    said = None if len(names) == 1 else [[n, 1] for n in names]
    sent = takeover._positional(entries, said)
    sent[0][0].update(pages=7, owed=2)
    assert sent == messages
    _close(entries, handed)


async def test_takeover_from_a_release_before_named_fds(tmp_path):
    """request() against an old instance's endpoint: its offer lacks `named`, and its hand-over comes by
    position; what it handed over is read as named arenas all the same."""
    path = str(tmp_path / "hicached.sock")
    endpoint = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    endpoint.bind(takeover.endpoint_path(path))
    endpoint.listen()
    entries = _entries(tmp_path, ["default"])
    fds = [fd for _, _, fd in entries]
    seen = {}

    def old_release() -> None:
        conn, _ = endpoint.accept()
        with conn:
            seen["hello"] = msgpack.unpackb(conn.recv(1 << 16))
            offer = {k: v for k, v in takeover.describe(8 << 20, SLAB).items() if k != "named"}
            conn.send(msgpack.packb({"op": "offer", **offer}))
            assert msgpack.unpackb(conn.recv(1 << 16))["op"] == "go"
            socket.send_fds(conn, [msgpack.packb({"op": "handover", "pages": 3, "owed": 0})], fds)
            seen["answer"] = msgpack.unpackb(conn.recv(1 << 16))

    loop = asyncio.get_running_loop()
    served = loop.run_in_executor(None, old_release)
    handed = await takeover.request(path, 8 << 20, SLAB)
    assert seen["hello"]["version"] == 1 and "arenas" not in seen["hello"], seen["hello"]
    assert _arenas(handed) == [("default", "pool default", "index default")] and handed.pages == 3
    await handed.confirm()
    await served
    assert seen["answer"]["op"] == "serving"
    _close(entries, handed)
    endpoint.close()
