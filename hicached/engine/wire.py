"""The blocking connection to the daemon: the handshake (connect, read the welcome and the pool fd that comes
with it) and `_Wire`, one connection of a `Client` with its requests in flight."""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
from typing import Any, Protocol

from hicached.common import protocol
from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.engine.ops import Op, _Await, _held, _NoReply, _Ops, _Send, peer_closed_check
from hicached.engine.regions import SideAttach, side_attach

DEFAULT_TIMEOUT = 30.0
_WELCOME_MAX = 1 << 16
_CLIENT_MAX_FRAME = 256 << 20
# Answers are read into one buffer kept for the connection: `recv(n)` allocates n bytes each call, and a
# large n goes through mmap/munmap (measured: 13 us a call for 1 MiB against 2 us, more with threads).
_RECV_BYTES = 1 << 16


def _read_welcome(sock: socket.socket, deadline: float) -> tuple[dict[str, Any], int]:
    """The daemon's first frame and the pool fd that comes with it (blocking socket)."""
    decoder = protocol.FrameDecoder(_WELCOME_MAX)
    fds: list[int] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HicachedError(TIMEOUT, "the daemon did not send its welcome in time")
        sock.settimeout(remaining)
        try:
            data, got, _, _ = socket.recv_fds(sock, _WELCOME_MAX, 4)
        except TimeoutError:
            continue
        fds += got
        if not data:
            break
        msgs = decoder.feed(data)
        if msgs:
            return _check_welcome(msgs[0], fds)
    for fd in fds:
        os.close(fd)
    raise HicachedError(CONNECTION, "the daemon closed the connection during the handshake")


def _check_welcome(msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], int]:
    try:
        protocol.raise_for_error(msg)
        if msg.get("version") != protocol.VERSION or len(fds) != 1:
            raise HicachedError(CONNECTION, f"unexpected handshake from the daemon: {msg!r}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return msg, fds[0]


def _connect(path: str, timeout: float) -> tuple[socket.socket, dict[str, Any], int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise HicachedError(
                CONNECTION, f"no hicached daemon is listening on {path} ({e.strerror})"
            ) from None
        except PermissionError:
            raise HicachedError(
                CONNECTION, f"not allowed to connect to {path} (socket permissions)"
            ) from None
        try:
            welcome, fd = _read_welcome(sock, time.monotonic() + timeout)
        except OSError as e:  # reset or closed under us: a daemon stopping (a restart), not yet up again
            raise HicachedError(CONNECTION, f"the daemon on {path} dropped the handshake ({e})") from None
    except OSError as e:  # anything else the connect itself met (EAGAIN on a full backlog, a reset)
        sock.close()
        raise HicachedError(CONNECTION, f"could not connect to {path} ({e})") from None
    except BaseException:
        sock.close()
        raise
    return sock, welcome, fd


class _Owner(Protocol):
    """What a wire reads from its client on each call (engines may change the timeout between calls)."""

    timeout: float
    _path: str


class _Wire:
    """One connection of a `Client` and what belongs to it: the pool mapped from its welcome, the requests
    in flight, the slots held ahead. A call runs on one wire from start to end; a reconnect makes a new one,
    so nothing of a dead connection (a lease, an offset in the old pool) ever reaches the new one."""

    def __init__(self, client: _Owner, sock: socket.socket, ops: _Ops, gen: int) -> None:
        self.client = client  # for its timeout, which engines may change between calls
        self.sock = sock
        self.ops = ops
        self.gen = gen
        ops.peer_closed = peer_closed_check(sock.fileno())
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._decoder = protocol.FrameDecoder(_CLIENT_MAX_FRAME)
        self._rbuf = memoryview(bytearray(_RECV_BYTES))  # used by the one thread reading (_reading)
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._results: dict[int, dict[str, Any]] = {}
        self._waiting: set[int] = set()
        # Requests whose answer nobody waits for any more (timed out): their answer may hold a lease or
        # slots, which the reader gives back (_Ops._orphaned) when it comes. Emptied when the connection
        # breaks.
        self._sent: dict[int, dict[str, Any]] = {}
        self._orphans: dict[int, dict[str, Any]] = {}
        self._reading = False
        self.broken: str | None = None
        self._active = 0  # calls running on this wire, in any thread
        self._released = False

    def gone(self) -> bool:
        """Whether the connection is broken, or the daemon has closed it (then it is marked broken)."""
        if self.broken is None and self.ops.peer_closed():
            self.mark_broken("the daemon closed the connection")
        return self.broken is not None

    def mark_broken(self, why: str) -> None:
        self.ops._drop_reserved()
        with self._cv:
            self.broken = self.broken or why
            self._orphans.clear()  # the daemon gave back what the connection held
            self._cv.notify_all()
            idle = not self._active
        if idle:
            self._release()

    def close(self, why: str) -> None:
        with self._cv:
            self.broken = self.broken or why
            self._cv.notify_all()
        with contextlib.suppress(OSError):  # wakes a thread blocked reading; already gone is fine
            self.sock.shutdown(socket.SHUT_RDWR)
        self._release()

    def _release(self) -> None:
        """Lets go of the socket and the pool's mapping once no call uses them. After a daemon restart the
        mapping's memory is the old pool's, which the new daemon may need (pool.memory_wait)."""
        with self._cv:
            if self._released:
                return
            self._released = True
        self.sock.close()
        self.ops._detach()

    def run(self, op: Op) -> Any:
        # Frames held (ops._held) until the operation next blocks or sends something else, then
        # sent in one sendall: a store's allocations cost one system call and one wake-up of the daemon
        # instead of one each.
        held: list[bytes] = []
        with self._cv:
            self._active += 1
        try:
            req = next(op)
            while True:
                try:
                    answer = self._request(req, held)
                except HicachedError as e:
                    req = op.throw(e)
                    continue
                req = op.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            if held:  # sent, never awaited: the daemon still gets them (an abort, a commit)
                with contextlib.suppress(HicachedError):
                    self._write(held)
            with self._cv:
                self._active -= 1
                idle = self.broken is not None and not self._active
            if idle:
                self._release()

    def _request(self, req: Any, held: list[bytes]) -> Any:
        if isinstance(req, SideAttach):
            if self.broken:
                raise HicachedError(CONNECTION, self.broken)
            return side_attach(_connect, self.client._path, req, self.client.timeout)
        if isinstance(req, _Await):
            if held:
                self._write(held)
            return self._collect(req.ticket)
        rid = self._send(req, held)
        if isinstance(req, _NoReply):
            return None
        if isinstance(req, _Send):
            return rid  # the ticket: collected by a later _Await
        return self._collect(rid)

    def _send(self, req: dict[str, Any], held: list[bytes]) -> int:
        """Registers `req` and sends it with the frames held before it, or holds it too (_held)."""
        self.ops._fence_request(req)
        rid = next(self._ids)
        req["id"] = rid
        held.append(protocol.encode(req))
        with self._cv:
            if self.broken:
                held.clear()
                raise HicachedError(CONNECTION, self.broken)
            if not isinstance(req, _NoReply):
                self._waiting.add(rid)
                self._sent[rid] = req
        if not _held(req):
            self._write(held)
        return rid

    def _write(self, held: list[bytes]) -> None:
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as e:
            self._fail(f"the connection to the daemon broke: {e}")

    def _collect(self, rid: int) -> dict[str, Any]:
        answered = False
        try:
            answer = self._await(rid, time.monotonic() + self.client.timeout)
            answered = True
            return protocol.raise_for_error(answer)
        finally:
            follow = None
            fenced = False
            with self._cv:
                self._waiting.discard(rid)
                req = self._sent.pop(rid, None)
                late = self._results.pop(rid, None)
                if req is None:
                    pass
                elif answered or (late is not None and self.broken):
                    self.ops._fence_answered(req)
                elif late is not None:  # answered just as we gave up
                    follow = self.ops._orphaned(req, late)
                else:
                    fenced = self.ops._fence_hold(req)
                    if not self.broken:
                        self._orphans[rid] = req
            if follow is not None:
                self._send_follow([follow])
            if fenced:
                # No answer we read, and the daemon may still copy for the request: cancel it, and let the
                # caller give the memory back only once no copy of it touches that (no time bound).
                self.ops._fence_settle(req)

    def _send_follow(self, reqs: list[dict[str, Any]]) -> None:
        """Sends requests that give back what orphaned answers held; nobody waits for their answers."""
        frames = []
        for req in reqs:
            req["id"] = next(self._ids)
            frames.append(protocol.encode(req))
        with contextlib.suppress(HicachedError):
            self._write(frames)

    def _await(self, rid: int, deadline: float) -> dict[str, Any]:
        timeout = self.client.timeout
        with self._cv:
            while True:
                if rid in self._results:
                    return self._results.pop(rid)
                if self.broken:
                    raise HicachedError(CONNECTION, self.broken)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HicachedError(TIMEOUT, f"no answer from the daemon within {timeout}s")
                if not self._reading:
                    self._reading = True
                    break
                self._cv.wait(remaining)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._poll.poll(remaining * 1000):
                    raise HicachedError(TIMEOUT, f"no answer from the daemon within {timeout}s")
                try:
                    got = self.sock.recv_into(self._rbuf)
                except OSError as e:
                    self._fail(f"the connection to the daemon broke: {e}")
                if not got:
                    self._fail("the daemon closed the connection")
                try:
                    msgs = self._decoder.feed(self._rbuf[:got])
                except protocol.FrameError as e:
                    self._fail(f"unreadable answer from the daemon: {e}")
                follow = []
                with self._cv:
                    for m in msgs:
                        mid = m.get("id") if isinstance(m, dict) else None
                        if mid in self._waiting:
                            self._results[mid] = m
                        elif mid in self._orphans:
                            req = self.ops._orphaned(self._orphans.pop(mid), m)
                            if req is not None:
                                follow.append(req)
                    if msgs:
                        self._cv.notify_all()
                if follow:
                    self._send_follow(follow)
                with self._cv:
                    if rid in self._results:
                        return self._results.pop(rid)
        finally:
            with self._cv:
                self._reading = False
                self._cv.notify_all()

    def _fail(self, why: str) -> None:
        self.mark_broken(why)
        raise HicachedError(CONNECTION, why)
