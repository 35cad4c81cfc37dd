"""`AsyncClient`: the same methods as `Client`, as coroutines, for engines that run an event loop; its
connection is an asyncio protocol, and it reconnects as `Client` does (hicached.engine.reconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from hicached.common import protocol
from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.engine.ops import Op, _Await, _held, _NoReply, _Ops, _Send, peer_closed_check
from hicached.engine.reconnect import DEFAULT_RECONNECT_S, _Reconnecting, _Redial, _tagged, _wait_op
from hicached.engine.regions import SideAttach, side_attach
from hicached.engine.wire import _CLIENT_MAX_FRAME, DEFAULT_TIMEOUT, _connect


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
        if self.broken is not None:
            return
        self.broken = why
        self.orphans.clear()
        self.on_broken()
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(HicachedError(CONNECTION, why))
        self.waiters.clear()


class _AsyncWire:
    """One connection of an `AsyncClient`: its protocol, and the operations' state for it (the pool mapped
    from its welcome, the slots held ahead)."""

    def __init__(self, proto: _AsyncProtocol, ops: _Ops, gen: int) -> None:
        self.proto = proto
        self.ops = ops
        self.gen = gen

    @property
    def broken(self) -> str | None:
        return self.proto.broken

    def gone(self) -> bool:
        if self.proto.broken is None and self.ops.peer_closed():
            self.proto._fail("the daemon closed the connection")
            self.proto.transport.abort()
        return self.proto.broken is not None


def _close_connected(fut: asyncio.Future[tuple[socket.socket, dict[str, Any], int]]) -> None:
    """A connection made in a thread for a caller that stopped waiting: closed, its pool fd too."""
    if not fut.cancelled() and fut.exception() is None:
        sock, _, fd = fut.result()
        sock.close()
        os.close(fd)


class AsyncClient(_Reconnecting):
    """The same methods as `Client`, as coroutines, for engines that run an event loop, and the same
    reconnects. Use `async with AsyncClient(...) as c` or `await AsyncClient(...).connect()`."""

    def __init__(
        self,
        socket_path: str,
        namespace: str,
        page_bytes: int,
        timeout: float = DEFAULT_TIMEOUT,
        reconnect: float = DEFAULT_RECONNECT_S,
    ) -> None:
        super().__init__(namespace, page_bytes, timeout, reconnect)
        self.socket_path = os.fspath(socket_path)
        self._wire: _AsyncWire | None = None
        self._redialing: asyncio.Task[_AsyncWire] | None = None
        self._ids = itertools.count(1)
        self._unwinding: set[asyncio.Task[None]] = set()

    @property
    def _ops(self) -> _Ops | None:
        return None if self._wire is None else self._wire.ops

    async def connect(self) -> AsyncClient:
        self._wire = await self._dial()
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        redial = self._redialing
        if redial is not None and not redial.done():
            redial.cancel()
            await asyncio.gather(redial, return_exceptions=True)
        wire = self._wire
        if wire is not None and wire.proto.transport is not None:
            wire.proto.transport.close()
            wire.proto._fail("the client is closed")
        if self._unwinding:  # cancelled operations: their last waits end at once now
            await asyncio.gather(*self._unwinding, return_exceptions=True)
        if wire is not None:
            wire.ops._detach()
        self._regions.close()

    # -- connections ---------------------------------------------------------------------------------

    async def _dial(self) -> _AsyncWire:
        loop = asyncio.get_running_loop()
        ops = self._new_ops()
        # The handshake carries an fd, which a transport cannot receive: do it on a blocking socket in a
        # thread, then hand the socket to the loop.
        fut = loop.run_in_executor(None, _connect, self.socket_path, self.timeout)
        try:
            sock, welcome, fd = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_close_connected)
            raise
        try:
            ops._attach(welcome, fd, sock)
            sock.setblocking(False)
            _, proto = await loop.create_unix_connection(_AsyncProtocol, sock=sock)
        except BaseException:
            sock.close()
            ops._detach()
            raise
        wire = _AsyncWire(proto, ops, next(self._gens))
        # The connection gone, the pool's mapping goes too (its memory may be a previous daemon's pool,
        # which a restarted daemon needs): every copy runs on this loop's thread, so none is under way.
        proto.on_broken = ops._detach
        proto.on_orphan = lambda req, answer: self._orphan_answer(wire, req, answer)
        ops.peer_closed = peer_closed_check(sock.fileno())
        try:
            await self._drive(wire, ops.op_hello())
        except BaseException:
            proto.transport.close()
            proto._fail("the handshake failed")
            raise
        return wire

    async def _live(self) -> _AsyncWire:
        wire = self._wire
        return wire if self._usable(wire) else await self._replace(wire)

    async def _replace(self, old: _AsyncWire) -> _AsyncWire:
        """A new wire in place of `old`: one reconnect, in a task of its own that every caller waits on (a
        caller cancelled does not cancel it for the others)."""
        cur = self._wire
        if cur is not old and cur is not None and not cur.gone():
            return cur
        task = self._redialing
        if task is None or task.done():
            task = self._redialing = asyncio.get_running_loop().create_task(self._redial(cur or old))
            task.add_done_callback(_retrieved)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._closed:  # close() stopped the reconnect, not this caller
                raise HicachedError(CONNECTION, "the client is closed") from None
            raise

    async def _redial(self, old: _AsyncWire) -> _AsyncWire:
        tries = _Redial(self, self.socket_path, old.proto.broken)
        while True:
            if self._closed:
                raise HicachedError(CONNECTION, "the client is closed")
            wire = None
            try:
                wire = await self._dial()
                await self._register_again(wire)
                break
            except HicachedError as e:
                if wire is not None:
                    wire.proto.transport.close()
                    wire.proto._fail("the reconnect failed")
                await asyncio.sleep(tries.pause(e))
        if self._closed:
            wire.proto.transport.close()
            wire.proto._fail("the client is closed")
            raise HicachedError(CONNECTION, "the client is closed")
        self._wire = wire
        tries.done()
        return wire

    async def _register_again(self, wire: _AsyncWire) -> None:
        """Client._register_again."""
        for handle, entry in self._regions.entries():
            if entry.memory is None:
                continue
            op = wire.ops.op_register_region(entry.memory, entry.page_bytes, entry.segments, entry.num_pages)
            try:
                daemon = await self._drive(wire, op)
            except HicachedError as e:
                if e.code == CONNECTION:
                    raise
                self._regions.lose(handle, f"registering it again after a reconnect failed: {e.message}")
                continue
            if not self._regions.moved(handle, wire.gen, daemon):
                with contextlib.suppress(HicachedError):
                    await self._drive(wire, wire.ops.op_unregister_region(daemon))

    async def _run(self, op: Op) -> Any:
        """Client._run."""
        return await self._drive(await self._live(), op)

    async def _call(self, make: Callable[[_AsyncWire], Op], retry: bool) -> Any:
        """Client._call."""
        wire = await self._live()
        try:
            return await self._drive(wire, make(wire))
        except HicachedError:
            if not self._may_retry(wire, retry):
                raise
        wire = await self._replace(wire)
        return await self._drive(wire, make(wire))

    # -- operations (retried where Client's are, for the same reasons) -----------------------------

    async def exists(self, keys: Sequence[str]) -> int:
        return await self._call(lambda w: w.ops.op_exists(keys), retry=True)

    async def present(self, keys: Sequence[str]) -> list[bool]:
        return await self._call(lambda w: w.ops.op_present(keys), retry=True)

    async def touch(self, keys: Sequence[str]) -> int:
        return await self._call(lambda w: w.ops.op_touch(keys), retry=True)

    async def store_pages_copied(
        self, handle: int, page_indices: Sequence[int], keys: Sequence[str]
    ) -> tuple[list[bool], int | None]:
        return await self._call(
            lambda w: w.ops.op_store_pages_copied(
                self._regions.daemon_handle(handle, w.gen), page_indices, keys
            ),
            retry=True,
        )

    async def store(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        return await self._call(lambda w: w.ops.op_store(keys, pages), retry=True)

    async def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> int:
        return await self._call(lambda w: w.ops.op_load(keys, buffers), retry=True)

    async def get(self, keys: Sequence[str]) -> list[bytes]:
        return await self._call(lambda w: w.ops.op_get(keys), retry=True)

    async def prefetch(self, keys: Sequence[str], priority: int = 0) -> int:
        return await self._call(lambda w: _tagged(w.ops.op_prefetch(keys, priority), w.gen), retry=True)

    async def wait(self, handle: int, timeout: float | None = None) -> int:
        """Client.wait: a handle from before a reconnect answers 0."""
        return await self._call(lambda w: _wait_op(w.ops, w.gen, handle, timeout), retry=True)

    async def pin(self, keys: Sequence[str]) -> int:
        return await self._call(lambda w: w.ops.op_pin(keys), retry=True)

    async def unpin(self, keys: Sequence[str]) -> int:
        return await self._call(lambda w: w.ops.op_unpin(keys), retry=True)

    async def clear(self) -> dict[str, Any]:
        """Client.clear()."""
        return await self._call(lambda w: w.ops.op_simple("clear"), retry=False)

    async def stats(self) -> dict[str, Any]:
        return await self._call(lambda w: w.ops.op_simple("stats"), retry=True)

    async def status(self) -> dict[str, Any]:
        return await self._call(lambda w: w.ops.op_simple("status"), retry=True)

    async def register_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        """Client.register_region: the handle stays valid across reconnects."""
        gen = [0]

        def make(w: _AsyncWire) -> Op:
            gen[0] = w.gen
            return w.ops.op_register_region(memory, page_bytes, segments, num_pages)

        daemon = await self._call(make, retry=True)
        current = self._wire.gen if self._wire is not None else gen[0]
        return self._regions.add(memory, page_bytes, segments, num_pages, gen[0], daemon, current)

    async def register_local_region(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None = None,
        *,
        num_pages: int | None = None,
    ) -> int:
        return await self._call(
            lambda w: w.ops.op_register_local(memory, page_bytes, segments, num_pages), retry=False
        )

    async def unregister_region(self, handle: int) -> None:
        entry = self._regions.pop(handle)
        if entry is None:
            await self._call(lambda w: w.ops.op_unregister_region(handle), retry=False)
            return
        wire = self._wire
        if wire is None or entry.gen != wire.gen or entry.lost is not None or wire.gone():
            return  # the daemon that had it is gone, and the region with it
        try:
            await self._drive(wire, wire.ops.op_unregister_region(entry.daemon))
        except HicachedError as e:
            if e.code != CONNECTION:
                raise

    async def store_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> list[bool]:
        return await self._call(
            lambda w: w.ops.op_store_pages(self._regions.daemon_handle(handle, w.gen), page_indices, keys),
            retry=True,
        )

    async def load_pages(
        self, handle: int, page_indices: Sequence[int], keys: Sequence[str], fetch: bool = True
    ) -> int:
        return await self._call(
            lambda w: w.ops.op_load_pages(
                self._regions.daemon_handle(handle, w.gen), page_indices, keys, fetch
            ),
            retry=True,
        )

    async def _drive(self, wire: _AsyncWire, op: Op, step: Callable[..., Any] = next, arg: Any = None) -> Any:
        held: list[bytes] = []  # frames held (hicached.engine.ops._held), written at the next wait or send
        try:
            req = step(op if arg is None else arg)
            while True:
                try:
                    answer = await self._request(wire, req, held)
                except HicachedError as e:
                    req = op.throw(e)
                    continue
                except asyncio.CancelledError:
                    # The caller gave up (a cancelled task, asyncio.timeout): the operation still gives
                    # back what it holds (aborts its slots, collects the answers it is owed), in a task
                    # of its own, as it would after an error.
                    cancelled = HicachedError(CONNECTION, "the call was cancelled")
                    task = asyncio.get_running_loop().create_task(self._drive(wire, op, op.throw, cancelled))
                    self._unwinding.add(task)
                    task.add_done_callback(self._unwound)
                    raise
                req = op.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            if held and not wire.proto.broken:
                wire.proto.transport.write(b"".join(held))

    def _unwound(self, task: asyncio.Task[None]) -> None:
        self._unwinding.discard(task)
        if not task.cancelled():
            task.exception()  # the error thrown into the operation, raised again by it: expected

    def _orphan_answer(self, wire: _AsyncWire, req: dict[str, Any], answer: Any) -> None:
        follow = wire.ops._orphaned(req, answer)
        proto = wire.proto
        if follow is not None and not proto.broken:
            follow["id"] = next(self._ids)
            proto.transport.write(protocol.encode(follow))

    async def _request(self, wire: _AsyncWire, req: Any, held: list[bytes]) -> Any:
        proto = wire.proto
        if proto.broken:
            raise HicachedError(CONNECTION, proto.broken)
        if isinstance(req, SideAttach):
            loop = asyncio.get_running_loop()
            path, timeout = self.socket_path, self.timeout
            return await loop.run_in_executor(None, side_attach, _connect, path, req, timeout)
        if isinstance(req, _Await):
            if held:
                proto.transport.write(b"".join(held))
                held.clear()
            return await self._collect(wire, *req.ticket)
        wire.ops._fence_request(req)
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
        return None if fut is None else await self._collect(wire, rid, fut, req)

    async def _collect(
        self, wire: _AsyncWire, rid: int, fut: asyncio.Future[dict[str, Any]], req: dict[str, Any]
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
            proto = wire.proto
            proto.waiters.pop(rid, None)
            late = fut.done() and not fut.cancelled() and fut.exception() is None
            fenced = False
            if answered or (late and proto.broken):
                wire.ops._fence_answered(req)
            elif late:
                self._orphan_answer(wire, req, fut.result())  # answered just as we gave up
            else:
                fenced = wire.ops._fence_hold(req)
                if not proto.broken:
                    proto.orphans[rid] = req
            if fenced:
                # Client._collect: no answer we read; the memory is the caller's again only once no copy of
                # the request touches it. Not cut short by a cancellation of the caller (raised after).
                await wire.ops._fence_settle_async(req)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A reconnect's outcome is read by whoever waits on it; none may be left (all cancelled)."""
    if not task.cancelled():
        task.exception()
