"""One engine's connection to the daemon, once admitted: frames read from its transport, each request
dispatched to its handler (inline, or as a task when it has to wait), answers written back, and reading
paused while too many requests run or the peer does not read its answers. Closing it releases everything
its session held, whatever the engine did."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from hicached.common import protocol
from hicached.common.errors import BAD_REQUEST, DRAINING, INTERNAL, HicachedError
from hicached.daemon.sched.tiers import Session

log = logging.getLogger("hicached.server")

# Operator requests, and those that finish what an engine already started, are answered while draining.
CONTROL_OPS = frozenset(
    {
        "status",
        "stats",
        "reload",
        "backend",
        "drain",
        "flush",
        "commit",
        "abort",
        "release",
        "region_detach",
    }
)


class Connection(asyncio.Protocol):
    """`server` is the listener that admitted the peer (hicached.daemon.server.listener.Server)."""

    def __init__(
        self, server: Any, session: Session, token: str = "", uid: int = -1, initial: bytes = b""
    ) -> None:
        self.server = server
        self.session = session
        self.token = token
        self.uid = uid
        self._initial = initial  # bytes read before the socket became a transport
        self.decoder = protocol.FrameDecoder(server.cfg.server.max_frame)
        self.tasks: set[asyncio.Task[None]] = set()
        self.transport: asyncio.Transport | None = None
        self._paused = False  # reading paused: too many requests in flight, or answers not read
        self._write_paused = False  # the peer does not read its answers: the transport's buffer is full

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Answers a peer does not read stay in this buffer: past server.max_frame, no request is read
        # until it drains (pause_writing), so a peer that never reads cannot grow the daemon's memory.
        self.transport.set_write_buffer_limits(high=self.server.cfg.server.max_frame)
        self.server.connections.add(self)
        if self.token:
            self.server.by_token[self.token] = self
        if self._initial:
            data, self._initial = self._initial, b""
            self.data_received(data)
            if self._paused:
                # uvloop starts reading once connection_made returns, whatever it was told meanwhile.
                asyncio.get_running_loop().call_soon(self._repause)

    def _repause(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.server.by_token.get(self.token) is self:
            del self.server.by_token[self.token]
        for t in self.tasks:
            t.cancel()
        # Regions go first; leases and slots follow once no copy of this connection runs any more.
        self.server.regions.close_session(self.session, self.server.tiers.close_session)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except protocol.FrameError as e:
            for msg in e.messages:
                self._dispatch(msg)
            log.warning("closing connection from %s: %s", self.session.peer, e)
            self.transport.close()  # answers already written still go out
            return
        for msg in messages:
            self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, dict) or not isinstance(msg.get("id"), int) or isinstance(msg.get("id"), bool):
            log.warning("closing connection from %s: a request without an integer id", self.session.peer)
            self.transport.abort()
            return
        rid = msg["id"]
        op = msg.get("op")
        handler = self.server.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            self._send(protocol.error_answer(rid, BAD_REQUEST, f"unknown op {op!r}"))
            return
        if self.server.draining and op not in CONTROL_OPS:
            why = "shutting down" if self.server.stopping else "draining (hicached ctl drain)"
            self._send(protocol.error_answer(rid, DRAINING, f"the daemon is {why}"))
            return
        try:
            result = handler(self.session, msg)
        except Exception as e:
            self._send(self._error(rid, op, e))
            return
        if isinstance(result, Awaitable):
            task = asyncio.ensure_future(self._finish(rid, op, result))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
            self._flow()
        else:
            result["id"] = rid
            self._send(result)

    def _flow(self) -> None:
        """Reads requests only while fewer than server.max_inflight_per_connection run and the peer reads
        its answers."""
        stop = self._write_paused or len(self.tasks) >= self.server.cfg.server.max_inflight_per_connection
        if stop == self._paused or self.transport is None or self.transport.is_closing():
            return
        self._paused = stop
        if stop:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._flow()

    async def _finish(self, rid: int, op: str, coro: Awaitable[dict]) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._send(self._error(rid, op, e))
            return
        result["id"] = rid
        self._send(result)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._flow()

    def _error(self, rid: int, op: str, e: Exception) -> dict:
        if isinstance(e, HicachedError):
            return protocol.error_answer(rid, e.code, e.message)
        log.exception("internal error answering %s from %s", op, self.session.peer)
        return protocol.error_answer(rid, INTERNAL, f"internal error in {op}: {type(e).__name__}: {e}")

    def _send(self, message: dict) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(protocol.encode(message))
