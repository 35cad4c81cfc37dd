"""Side connections: one that registers a host memory region for an engine's connection sends a region_attach
frame with the region's memfd, gets one answer (a fence board's with the daemon's pidfd), and is closed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from hicached.common import protocol
from hicached.common.errors import (
    BAD_REQUEST,
    BUSY,
    DRAINING,
    INTERNAL,
    NOT_FOUND,
    UNAUTHORIZED,
    HicachedError,
)
from hicached.common.protocol import arg

log = logging.getLogger("hicached.server")

# `server` below is a hicached.daemon.server.listener.Server (not imported: the listener imports this module).


async def attach_connection(
    server: Any, sock: socket.socket, data: bytes, fds: list[int], uid: int, deadline: float, via: str = ""
) -> None:
    """A connection that registers a host region: one region_attach frame that came with the region's
    memfd, one answer, then it closes. The region belongs to the connection named by `token`, of the same
    uid and, when it came through a tenant socket, of that tenant. Its unfinished frame counts against
    server.max_pending_bytes: past it the connection is answered busy."""
    loop = asyncio.get_running_loop()
    rid = 0
    answer: dict[str, Any] | None = None
    held = server.budget.side()
    try:
        decoder = protocol.FrameDecoder(server.cfg.server.max_frame)
        msgs = decoder.feed(data)
        while not msgs:
            if not held.hold(decoder.pending):
                raise HicachedError(BUSY, "the daemon holds too many unfinished requests (max_pending_bytes)")
            more = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), max(0.0, deadline - loop.time()))
            if not more:
                break  # the peer went away before its frame was whole
            msgs = decoder.feed(more)
        held.hold(0)
        if msgs:
            msg = msgs[0]
            if isinstance(msg, dict) and isinstance(msg.get("id"), int):
                rid = msg["id"]
            answer = await _region_attach(server, msg, fds, uid, via)
            answer["id"] = rid
    except HicachedError as e:
        answer = protocol.error_answer(rid, e.code, e.message)
    except protocol.FrameError as e:
        answer = protocol.error_answer(rid, BAD_REQUEST, f"unreadable region_attach frame: {e}")
    except TimeoutError:
        answer = protocol.error_answer(rid, BAD_REQUEST, "region_attach frame incomplete in time")
    except OSError:
        raise  # the socket failed: nobody to answer (the listener's _admit logs it)
    except Exception as e:  # a bug: answered as on an engine connection, not by closing in silence
        log.exception("internal error answering region_attach on a side connection")
        answer = protocol.error_answer(
            rid, INTERNAL, f"internal error in region_attach: {type(e).__name__}: {e}"
        )
    finally:
        held.hold(0)
        for fd in fds:
            os.close(fd)
        if answer is None:
            sock.close()
    if answer is None:
        return
    # A peer that went away gets no answer; its region, if any, goes with its connection.
    try:
        with contextlib.suppress(OSError, TimeoutError):
            data = protocol.encode(answer)
            if answer.get("kind") == "fence" and server.pidfd >= 0:
                # The daemon's own pidfd with a fence board's answer: the client's wait for copies of a
                # request it gave up on ends when this process exits, seen even from another pid
                # namespace (a container), where the daemon's pid means nothing.
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    data = data[socket.send_fds(sock, [data], [server.pidfd]) :]
            if data:
                await asyncio.wait_for(loop.sock_sendall(sock, data), 5.0)
    finally:
        sock.close()


async def _region_attach(server: Any, msg: Any, fds: list[int], uid: int, via: str = "") -> dict[str, Any]:
    if not isinstance(msg, dict) or msg.get("op") != "region_attach":
        raise HicachedError(BAD_REQUEST, "a connection that passes an fd must open with region_attach")
    if len(fds) != 1:
        raise HicachedError(BAD_REQUEST, f"region_attach takes exactly one fd, got {len(fds)}")
    conn = server.by_token.get(arg(msg, "token", str))
    if conn is None:
        raise HicachedError(
            NOT_FOUND, "no open connection has this token: register regions while the connection is open"
        )
    if conn.uid != uid:
        raise HicachedError(UNAUTHORIZED, "a region can only be registered by the connection's own user")
    if via and conn.session.tenant != server.tenant_of.get(via):
        raise HicachedError(
            UNAUTHORIZED,
            f"a region registered through tenant {server.tenant_of.get(via)!r}'s socket can only serve a "
            "connection of that tenant",
        )
    if server.draining:
        raise HicachedError(DRAINING, "the daemon is draining")
    return await server.regions.attach(conn.session, msg, fds[0])
