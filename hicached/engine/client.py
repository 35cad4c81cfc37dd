"""The engine-side client: `Client` (blocking, thread-safe) and `AsyncClient` (the same methods as
coroutines). Control messages go over the daemon's Unix socket; page bytes are copied straight into and out
of the shared L2 pool, whose fd the daemon hands over when the connection opens.

Each operation is written once, as a generator that yields requests and receives answers (`_Ops`); the two
clients only differ in how they carry a request to the daemon and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicached.common import protocol
from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.engine.ops import Op, _Await, _held, _NoReply, _Ops, _Send, peer_closed_check
from hicached.engine.regions import SideAttach, shared_buffer, side_attach

__all__ = ["AsyncClient", "Client", "control", "shared_buffer"]

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
        welcome, fd = _read_welcome(sock, time.monotonic() + timeout)
    except BaseException:
        sock.close()
        raise
    return sock, welcome, fd


class Client:
    """Blocking client; one instance may be shared by many threads (requests from several threads are in
    flight together; whichever thread waits reads the socket and hands answers to their owners)."""

    def __init__(
        self, socket_path: str, namespace: str, page_bytes: int, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self._ops = _Ops(namespace, page_bytes)
        self.timeout = timeout
        self._path = os.fspath(socket_path)
        self._sock, welcome, fd = _connect(self._path, timeout)
        self._sock.settimeout(None)
        self._ops._attach(welcome, fd)
        self._ops.peer_closed = peer_closed_check(self._sock.fileno())
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
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
        self._broken: str | None = None
        self._active = 0  # calls running, in any thread
        try:
            self._run(self._ops.op_hello())
        except BaseException:
            self.close()
            raise

    @property
    def namespace(self) -> str:
        return self._ops.namespace

    @property
    def page_bytes(self) -> int:
        return self._ops.page_bytes

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cv:
            if self._broken is None:
                self._broken = "the client is closed"
            self._cv.notify_all()
        with contextlib.suppress(OSError):  # wakes a thread blocked reading; already gone is fine
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._ops._detach()

    def exists(self, keys: Sequence[str]) -> int:
        return self._run(self._ops.op_exists(keys))

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in L2 or L3, holes and all (exists counts the leading ones only)."""
        return self._run(self._ops.op_present(keys))

    def store(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        return self._run(self._ops.op_store(keys, pages))

    def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> int:
        return self._run(self._ops.op_load(keys, buffers))

    def get(self, keys: Sequence[str]) -> list[bytes]:
        return self._run(self._ops.op_get(keys))

    def prefetch(self, keys: Sequence[str], priority: int = 0) -> int:
        return self._run(self._ops.op_prefetch(keys, priority))

    def wait(self, handle: int, timeout: float | None = None) -> int:
        return self._run(self._ops.op_wait(handle, timeout))

    def pin(self, keys: Sequence[str]) -> int:
        return self._run(self._ops.op_pin(keys))

    def unpin(self, keys: Sequence[str]) -> int:
        return self._run(self._ops.op_unpin(keys))

    def clear(self) -> dict[str, Any]:
        """Forgets every page of this client's namespace in L2 and L3 (for every engine that shares it):
        {"l2": pages dropped from L2, "busy": pages still held after server.request_timeout, "l3": objects
        deleted (None with "error" when L3 could not be cleared)}."""
        return self._run(self._ops.op_simple("clear"))

    def stats(self) -> dict[str, Any]:
        return self._run(self._ops.op_simple("stats"))

    def status(self) -> dict[str, Any]:
        return self._run(self._ops.op_simple("status"))

    def register_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        """Register engine memory (a tensor from `shared_buffer`, a CUDA tensor, or a memfd's fd, sealed or
        not) whose pages the daemon copies; `segments` are (offset, length, stride) per page. Returns a
        handle. Should an unsealed memfd shrink, its requests fail (copy_failed) and the handle goes."""
        return self._run(self._ops.op_register_region(memory, page_bytes, segments, num_pages))

    def register_local_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        """Register memory of this process only (any contiguous CPU tensor or writable buffer) whose pages
        this client copies between it and the pool itself (hicached.engine.local): store_pages / load_pages
        as for a region, one copy a page, while the daemon never maps the memory. A negative handle."""
        return self._run(self._ops.op_register_local(memory, page_bytes, segments, num_pages))

    def unregister_region(self, handle: int) -> None:
        self._run(self._ops.op_unregister_region(handle))

    def store_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> list[bool]:
        """The daemon copies pages `page_indices` of the region into L2 under `keys`."""
        return self._run(self._ops.op_store_pages(handle, page_indices, keys))

    def load_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> int:
        """The daemon fills pages `page_indices` of the region with the leading hits of `keys`."""
        return self._run(self._ops.op_load_pages(handle, page_indices, keys))

    def _run(self, op: Op) -> Any:
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
                gone = self._broken is not None and not self._active
            if gone:
                # The connection is dead and no call copies through the pool's mapping any more: let go
                # of it now, not at close(). After a daemon restart its memory is the old pool's, which
                # the new daemon may need (pool.memory_wait).
                self._ops._detach()

    def _request(self, req: Any, held: list[bytes]) -> Any:
        if isinstance(req, SideAttach):
            if self._broken:
                raise HicachedError(CONNECTION, self._broken)
            return side_attach(_connect, self._path, req, self.timeout)
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
        rid = next(self._ids)
        req["id"] = rid
        held.append(protocol.encode(req))
        with self._cv:
            if self._broken:
                held.clear()
                raise HicachedError(CONNECTION, self._broken)
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
                self._sock.sendall(data)
        except OSError as e:
            self._fail(f"the connection to the daemon broke: {e}")

    def _collect(self, rid: int) -> dict[str, Any]:
        answered = False
        try:
            answer = self._await(rid, time.monotonic() + self.timeout)
            answered = True
            return protocol.raise_for_error(answer)
        finally:
            follow = None
            with self._cv:
                self._waiting.discard(rid)
                req = self._sent.pop(rid, None)
                late = self._results.pop(rid, None)
                if not answered and req is not None and not self._broken:
                    if late is not None:  # answered just as we gave up
                        follow = self._ops._orphaned(req, late)
                    else:
                        self._orphans[rid] = req
            if follow is not None:
                self._send_follow([follow])

    def _send_follow(self, reqs: list[dict[str, Any]]) -> None:
        """Sends requests that give back what orphaned answers held; nobody waits for their answers."""
        frames = []
        for req in reqs:
            req["id"] = next(self._ids)
            frames.append(protocol.encode(req))
        with contextlib.suppress(HicachedError):
            self._write(frames)

    def _await(self, rid: int, deadline: float) -> dict[str, Any]:
        with self._cv:
            while True:
                if rid in self._results:
                    return self._results.pop(rid)
                if self._broken:
                    raise HicachedError(CONNECTION, self._broken)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HicachedError(TIMEOUT, f"no answer from the daemon within {self.timeout}s")
                if not self._reading:
                    self._reading = True
                    break
                self._cv.wait(remaining)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._poll.poll(remaining * 1000):
                    raise HicachedError(TIMEOUT, f"no answer from the daemon within {self.timeout}s")
                try:
                    got = self._sock.recv_into(self._rbuf)
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
                            req = self._ops._orphaned(self._orphans.pop(mid), m)
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
        self._ops._drop_reserved()
        with self._cv:
            self._broken = self._broken or why
            self._orphans.clear()  # the daemon gave back what the connection held
            self._cv.notify_all()
        raise HicachedError(CONNECTION, why)


class _AsyncProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = protocol.FrameDecoder(_CLIENT_MAX_FRAME)
        self.waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.transport: asyncio.Transport | None = None
        self.broken: str | None = None
        self.on_broken: Callable[[], None] = lambda: None
        # Requests whose caller stopped waiting (time-out, cancelled): their answers go to on_orphan.
        self.orphans: dict[int, dict[str, Any]] = {}
        self.on_orphan: Callable[[dict[str, Any], Any], None] = lambda req, answer: None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            msgs = self.decoder.feed(data)
        except protocol.FrameError as e:
            self.transport.abort()
            self._fail(f"unreadable answer from the daemon: {e}")
            return
        for m in msgs:
            mid = m.get("id") if isinstance(m, dict) else None
            fut = self.waiters.pop(mid, None)
            if fut is not None and not fut.done():
                fut.set_result(m)
            elif mid in self.orphans:
                self.on_orphan(self.orphans.pop(mid), m)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("the daemon closed the connection")

    def _fail(self, why: str) -> None:
        self.broken = self.broken or why
        self.orphans.clear()
        self.on_broken()
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(HicachedError(CONNECTION, why))
        self.waiters.clear()


class AsyncClient:
    """The same methods as `Client`, as coroutines, for engines that run an event loop.
    Use `async with AsyncClient(...) as c` or `await AsyncClient(...).connect()`."""

    def __init__(
        self, socket_path: str, namespace: str, page_bytes: int, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self._ops = _Ops(namespace, page_bytes)
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        self._proto: _AsyncProtocol | None = None
        self._ids = itertools.count(1)
        self._unwinding: set[asyncio.Task[None]] = set()

    async def connect(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        # The handshake carries an fd, which a transport cannot receive: do it on a blocking socket in a
        # thread, then hand the socket to the loop.
        sock, welcome, fd = await loop.run_in_executor(None, _connect, self.socket_path, self.timeout)
        self._ops._attach(welcome, fd)
        sock.setblocking(False)
        _, self._proto = await loop.create_unix_connection(_AsyncProtocol, sock=sock)
        # The connection gone, the pool's mapping goes too (its memory may be a previous daemon's pool,
        # which a restarted daemon needs): every copy runs on this loop's thread, so none is under way.
        self._proto.on_broken = self._ops._detach
        self._proto.on_orphan = self._orphan_answer
        self._ops.peer_closed = peer_closed_check(sock.fileno())
        try:
            await self._run(self._ops.op_hello())
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
            self._proto._fail("the client is closed")
        if self._unwinding:  # cancelled operations: their last waits end at once now
            await asyncio.gather(*self._unwinding, return_exceptions=True)
        self._ops._detach()

    async def exists(self, keys: Sequence[str]) -> int:
        return await self._run(self._ops.op_exists(keys))

    async def present(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(self._ops.op_present(keys))

    async def store(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        return await self._run(self._ops.op_store(keys, pages))

    async def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> int:
        return await self._run(self._ops.op_load(keys, buffers))

    async def get(self, keys: Sequence[str]) -> list[bytes]:
        return await self._run(self._ops.op_get(keys))

    async def prefetch(self, keys: Sequence[str], priority: int = 0) -> int:
        return await self._run(self._ops.op_prefetch(keys, priority))

    async def wait(self, handle: int, timeout: float | None = None) -> int:
        return await self._run(self._ops.op_wait(handle, timeout))

    async def pin(self, keys: Sequence[str]) -> int:
        return await self._run(self._ops.op_pin(keys))

    async def unpin(self, keys: Sequence[str]) -> int:
        return await self._run(self._ops.op_unpin(keys))

    async def clear(self) -> dict[str, Any]:
        """Client.clear()."""
        return await self._run(self._ops.op_simple("clear"))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._ops.op_simple("stats"))

    async def status(self) -> dict[str, Any]:
        return await self._run(self._ops.op_simple("status"))

    async def register_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        return await self._run(self._ops.op_register_region(memory, page_bytes, segments, num_pages))

    async def register_local_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        return await self._run(self._ops.op_register_local(memory, page_bytes, segments, num_pages))

    async def unregister_region(self, handle: int) -> None:
        await self._run(self._ops.op_unregister_region(handle))

    async def store_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> list[bool]:
        return await self._run(self._ops.op_store_pages(handle, page_indices, keys))

    async def load_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> int:
        return await self._run(self._ops.op_load_pages(handle, page_indices, keys))

    async def _run(self, op: Op) -> Any:
        return await self._drive(op, next, op)

    async def _drive(self, op: Op, step: Callable[..., Any], arg: Any) -> Any:
        held: list[bytes] = []  # frames held (hicached.engine.ops._held), written at the next wait or send
        try:
            req = step(arg)
            while True:
                try:
                    answer = await self._request(req, held)
                except HicachedError as e:
                    req = op.throw(e)
                    continue
                except asyncio.CancelledError:
                    # The caller gave up (a cancelled task, asyncio.timeout): the operation still gives
                    # back what it holds (aborts its slots, collects the answers it is owed), in a task
                    # of its own, as it would after an error.
                    cancelled = HicachedError(CONNECTION, "the call was cancelled")
                    task = asyncio.get_running_loop().create_task(self._drive(op, op.throw, cancelled))
                    self._unwinding.add(task)
                    task.add_done_callback(self._unwound)
                    raise
                req = op.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            if held and self._proto is not None and not self._proto.broken:
                self._proto.transport.write(b"".join(held))

    def _unwound(self, task: asyncio.Task[None]) -> None:
        self._unwinding.discard(task)
        if not task.cancelled():
            task.exception()  # the error thrown into the operation, raised again by it: expected

    def _orphan_answer(self, req: dict[str, Any], answer: Any) -> None:
        follow = self._ops._orphaned(req, answer)
        proto = self._proto
        if follow is not None and proto is not None and not proto.broken:
            follow["id"] = next(self._ids)
            proto.transport.write(protocol.encode(follow))

    async def _request(self, req: Any, held: list[bytes]) -> Any:
        proto = self._proto
        if proto is None or proto.broken:
            raise HicachedError(CONNECTION, proto.broken if proto else "the client is not connected")
        if isinstance(req, SideAttach):
            loop = asyncio.get_running_loop()
            path, timeout = self.socket_path, self.timeout
            return await loop.run_in_executor(None, side_attach, _connect, path, req, timeout)
        if isinstance(req, _Await):
            if held:
                proto.transport.write(b"".join(held))
                held.clear()
            return await self._collect(*req.ticket)
        rid = next(self._ids)
        req["id"] = rid
        held.append(protocol.encode(req))
        fut = None
        if not isinstance(req, _NoReply):
            fut = asyncio.get_running_loop().create_future()
            proto.waiters[rid] = fut
        if not _held(req):
            proto.transport.write(held[0] if len(held) == 1 else b"".join(held))
            held.clear()
        if isinstance(req, _Send):
            return (rid, fut, req)  # the ticket: collected by a later _Await
        return None if fut is None else await self._collect(rid, fut, req)

    async def _collect(
        self, rid: int, fut: asyncio.Future[dict[str, Any]], req: dict[str, Any]
    ) -> dict[str, Any]:
        answered = False
        try:
            async with asyncio.timeout(self.timeout):
                answer = await fut
            answered = True
            return protocol.raise_for_error(answer)
        except TimeoutError:
            raise HicachedError(TIMEOUT, f"no answer from the daemon within {self.timeout}s") from None
        finally:
            proto = self._proto
            if proto is not None:
                proto.waiters.pop(rid, None)
                if not answered and not proto.broken:
                    if fut.done() and not fut.cancelled() and fut.exception() is None:
                        self._orphan_answer(req, fut.result())  # answered just as we gave up
                    elif not fut.done() or fut.cancelled():
                        proto.orphans[rid] = req


def control(socket_path: str, op: str, timeout: float = DEFAULT_TIMEOUT, **args: Any) -> dict[str, Any]:
    """One operator request (status, stats, reload, backend, drain, flush) on a connection of its own;
    used by `hicached ctl`."""
    sock, _, fd = _connect(socket_path, timeout)
    os.close(fd)
    try:
        sock.settimeout(timeout)
        sock.sendall(protocol.encode({**args, "id": 1, "op": op}))
        decoder = protocol.FrameDecoder(_CLIENT_MAX_FRAME)
        while True:
            data = sock.recv(_RECV_BYTES)
            if not data:
                raise HicachedError(CONNECTION, "the daemon closed the connection")
            for m in decoder.feed(data):
                if m.get("id") == 1:
                    return protocol.raise_for_error(m)
    except TimeoutError:
        raise HicachedError(TIMEOUT, f"no answer from the daemon within {timeout}s") from None
    finally:
        sock.close()
