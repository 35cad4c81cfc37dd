"""One peer's connection to the daemon, once admitted: frames read from its transport, each request
dispatched to its handler (inline, or as a task when it has to wait; controls that change the daemon only for
operators), answers written back, reading paused while too many requests run, the peer does not read its
answers or the server holds too many bytes for its peers, and closed when no hello nor control request came
within server.handshake_timeout. Closing it releases everything its session held, whatever the engine did."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from hicached.common import protocol
from hicached.common.errors import BAD_REQUEST, DRAINING, INTERNAL, TIMEOUT, UNAUTHORIZED, HicachedError
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


# Answers shown to an engine as its tenant sees them (Server.view).
VIEWS = frozenset({"status", "stats"})


class Connection(asyncio.Protocol):
    """`server` is the listener that admitted the peer (hicached.daemon.server.listener.Server)."""

    def __init__(
        self,
        server: Any,
        session: Session,
        token: str = "",
        uid: int = -1,
        initial: bytes = b"",
        operator: bool = False,
        deadline: float | None = None,
        gid: int = -1,
        via: str = "",
    ) -> None:
        self.server = server
        self.session = session
        self.token = token
        self.uid = uid
        self.gid = gid
        self.via = via  # the tenant socket the peer came through; "" for server.socket
        self.operator = operator  # may use the controls that change the daemon, and sees every tenant
        self._initial = initial  # bytes read before the socket became a transport
        self.decoder = protocol.FrameDecoder(server.cfg.server.max_frame)
        self.tasks: set[asyncio.Task[None]] = set()
        self.transport: asyncio.Transport | None = None
        self._paused = False  # reading paused: too many requests in flight, or answers not read
        self._write_paused = False  # the peer does not read its answers: the transport's buffer is full
        self._budget_paused = False  # the server holds server.max_pending_bytes for its peers
        self._held = 0  # bytes of an unfinished request and of unread answers, as last told to the budget
        # Closes the connection at `deadline` (loop time) unless a hello or a control request came first.
        self._deadline = deadline
        self._handshake: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Answers a peer does not read stay in this buffer: past server.max_frame, no request is read
        # until it drains (pause_writing), so a peer that never reads cannot grow the daemon's memory.
        self.transport.set_write_buffer_limits(high=self.server.cfg.server.max_frame)
        self.server.connections.add(self)
        if self.token:
            self.server.by_token[self.token] = self
        if self._deadline is not None:
            self._handshake = asyncio.get_running_loop().call_at(self._deadline, self._handshake_expired)
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
        self._handshake_done()
        self.server.budget.forget(self)
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
        self._account()

    # The handshake time-out.

    def _handshake_done(self) -> None:
        if self._handshake is not None:
            self._handshake.cancel()
            self._handshake = None

    def _handshake_expired(self) -> None:
        self._handshake = None
        if self.transport is None or self.transport.is_closing():
            return
        self.server.handshake_timeouts += 1
        log.info(
            "closing connection from %s: no hello nor control request within server.handshake_timeout",
            self.session.peer,
        )
        self._send(
            protocol.error_answer(0, TIMEOUT, "no hello nor control request within server.handshake_timeout")
        )
        self.transport.close()

    # The bound on pending bytes (hicached.daemon.server.budget).

    def _account(self) -> None:
        if self.transport is None:
            return
        held = self.decoder.pending + self.transport.get_write_buffer_size()
        if held != self._held:
            self._held = held
            self.server.budget.set(self, held)

    def budget_pause(self) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        self._budget_paused = True
        self._flow()
        return True

    def budget_resume(self) -> None:
        self._budget_paused = False
        self._flow()

    def budget_refresh(self) -> None:
        self._account()

    def budget_close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

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
        if not self.operator and self.server.needs_operator(op, msg):
            self.server.unauthorized += 1
            action = msg.get("action")
            what = f"backend {action}" if op == "backend" and isinstance(action, str) else op
            who = (
                f"this is tenant {self.session.tenant!r}'s socket, which serves engines alone: operators use "
                "server.socket"
                if self.via
                else f"uid {self.uid} connects as an engine"
            )
            self._send(
                protocol.error_answer(
                    rid,
                    UNAUTHORIZED,
                    f"{what} changes the daemon and needs the operator role (root, the daemon's uid, "
                    f"server.operator_uids/operator_gids); {who}",
                )
            )
            return
        if op in self.server.control_ops:
            self._handshake_done()
        if self.server.draining and op not in CONTROL_OPS:
            why = "shutting down" if self.server.stopping else "draining (hicached ctl drain)"
            self._send(protocol.error_answer(rid, DRAINING, f"the daemon is {why}"))
            return
        try:
            result = handler(self.session, msg)
        except Exception as e:
            self._send(self._error(rid, op, e))
            return
        if op == "hello":
            self._handshake_done()
        elif op in VIEWS:
            result = self.server.view(op, result, None if self.operator else self.session.tenant)
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
        stop = (
            self._write_paused
            or self._budget_paused
            or len(self.tasks) >= self.server.cfg.server.max_inflight_per_connection
        )
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
            if self._held or self.transport.get_write_buffer_size():  # answers the peer has not read yet
                self._account()
