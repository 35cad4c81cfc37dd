"""The engine-side client: `Client` (blocking, thread-safe) and `AsyncClient` (the same methods as
coroutines). Control messages go over the daemon's Unix socket; page bytes are copied straight into and out
of the shared L2 pool, whose fd the daemon hands over when the connection opens.

Each operation is written once, as a generator that yields requests and receives answers (`_Ops`); the two
clients only differ in how they carry a request to the daemon and back, and both reconnect by themselves
when the daemon restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicached.common import protocol
from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.common.retry import Backoff
from hicached.engine.ops import Op, _Await, _held, _NoReply, _Ops, _Send, peer_closed_check
from hicached.engine.regions import RegionBook, SideAttach, shared_buffer, side_attach

__all__ = ["AsyncClient", "Client", "control", "shared_buffer"]

log = logging.getLogger(__name__)

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


# A call that finds its connection gone dials again for up to `reconnect` seconds (the daemon restarting:
# stopping, then starting and verifying a kept pool, takes a second or two here), waiting between tries as
# this backoff says; once a whole wait has failed, later calls try one dial each until the daemon is back.
DEFAULT_RECONNECT_S = 3.0
_REDIAL = Backoff(attempts=0, base=0.05, max=0.5, jitter=0.2)
# A prefetch handle carries the number of the connection it was made on above these bits (none on the
# first), so that a handle from before a reconnect is told from the new connection's handles.
_GEN_SHIFT = 40


def _tagged(op: Op, gen: int) -> Op:
    return (yield from op) + (gen << _GEN_SHIFT)


def _answer(value: Any) -> Op:
    """An operation that needs no request."""
    return value
    yield  # a generator like every op


def _wait_op(ops: _Ops, gen: int, handle: int, timeout: float | None) -> Op:
    made_on = handle >> _GEN_SHIFT if isinstance(handle, int) and handle >= 0 else gen
    if made_on < gen:
        # Its prefetch went with the connection it was made on (the daemon restarted): nothing to wait
        # for. 0 says "no page is known to have arrived"; a load still finds every page L2 or L3 has.
        return _answer(0)
    return ops.op_wait(handle - (gen << _GEN_SHIFT) if made_on == gen else handle, timeout)


def _gone_message(path: str, why: str | None, waited: float, last: HicachedError) -> str:
    if not waited:  # an earlier call waited the whole `reconnect` already
        return f"the daemon at {path} is still not back ({last.message}); the next call tries again"
    return (
        f"the connection to the daemon at {path} broke ({why}) and no daemon answered again within "
        f"{waited:g}s (last try: {last.message}); the next call tries again"
    )


class _Wire:
    """One connection of a `Client` and what belongs to it: the pool mapped from its welcome, the requests
    in flight, the slots held ahead. A call runs on one wire from start to end; a reconnect makes a new one,
    so nothing of a dead connection (a lease, an offset in the old pool) ever reaches the new one."""

    def __init__(self, client: Client, sock: socket.socket, ops: _Ops, gen: int) -> None:
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


class Client:
    """Blocking client; one instance may be shared by many threads (requests from several threads are in
    flight together; whichever thread waits reads the socket and hands answers to their owners).

    When the daemon goes away (a restart), the next call dials again, for up to `reconnect` seconds (0: never
    reconnect, the calls answer `connection` errors), says hello, maps the pool from the new welcome,
    registers the regions again (their handles stay valid), and retries once the call that found the
    connection gone, where that is safe (each method says why)."""

    def __init__(
        self,
        socket_path: str,
        namespace: str,
        page_bytes: int,
        timeout: float = DEFAULT_TIMEOUT,
        reconnect: float = DEFAULT_RECONNECT_S,
    ) -> None:
        first = _Ops(namespace, page_bytes)  # checks both before anything is dialled
        self._namespace, self._page_bytes = first.namespace, first.page_bytes
        self.timeout = timeout
        self.reconnect = reconnect
        self._path = os.fspath(socket_path)
        self._local = first.local  # local regions: this process's memory, the same on every connection
        self._regions = RegionBook()
        self._gens = itertools.count()
        self._dial_lock = threading.Lock()  # one reconnect at a time; the others wait for it
        self._state_lock = threading.Lock()  # guards _wire and _closed together
        self._closed = False
        self._down = False  # a whole reconnect wait failed: the next calls try one dial each
        self.reconnects = 0
        self._wire = self._dial(first)

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def _ops(self) -> _Ops:
        return self._wire.ops

    @property
    def _sock(self) -> socket.socket:
        return self._wire.sock

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._state_lock:
            self._closed = True
            wire = self._wire
        wire.close("the client is closed")
        self._regions.close()

    # -- connections ---------------------------------------------------------------------------------

    def _dial(self, ops: _Ops | None = None) -> _Wire:
        """A new connection: the welcome's pool mapped, hello said with this client's namespace and page
        size."""
        if ops is None:
            ops = _Ops(self._namespace, self._page_bytes)
            ops.local = self._local
        sock, welcome, fd = _connect(self._path, self.timeout)
        try:
            sock.settimeout(None)
            ops._attach(welcome, fd, sock)
        except BaseException:
            sock.close()
            raise
        wire = _Wire(self, sock, ops, next(self._gens))
        try:
            wire.run(ops.op_hello())
        except BaseException:
            wire.close("the handshake failed")
            raise
        return wire

    def _live(self) -> _Wire:
        """The wire for a new call: the current one, or a new one if the daemon went away."""
        wire = self._wire
        if self._closed:
            raise HicachedError(CONNECTION, "the client is closed")
        if not wire.gone():
            return wire
        if self.reconnect <= 0:
            raise HicachedError(CONNECTION, wire.broken or "the connection broke")
        return self._replace(wire)

    def _replace(self, old: _Wire) -> _Wire:
        """A new wire in place of `old`, which is gone; threads that find it gone at once wait for the
        one reconnect (bounded: the reconnect wait, a dial, and one registration per region)."""
        budget = self.reconnect + self.timeout * (2 + len(self._regions))
        if not self._dial_lock.acquire(timeout=budget):
            raise HicachedError(CONNECTION, f"another thread has been reconnecting for {budget:g}s")
        try:
            cur = self._wire
            if cur is not old and not cur.gone():
                return cur  # another thread reconnected meanwhile
            why = cur.broken
            wait = 0.0 if self._down else self.reconnect
            deadline = time.monotonic() + wait
            attempt = 0
            while True:
                if self._closed:
                    raise HicachedError(CONNECTION, "the client is closed")
                attempt += 1
                wire = None
                try:
                    wire = self._dial()
                    self._register_again(wire)
                    break
                except HicachedError as e:
                    if wire is not None:
                        wire.close("the reconnect failed")
                    # A daemon that answers and refuses (unauthorized, a bad hello) will not change its
                    # mind: say so now. connection / timeout: not up (again) yet.
                    if e.code not in (CONNECTION, TIMEOUT):
                        raise
                    delay = _REDIAL.delay(attempt)
                    if time.monotonic() + delay > deadline:
                        self._down = True
                        raise HicachedError(CONNECTION, _gone_message(self._path, why, wait, e)) from None
                    time.sleep(delay)
            with self._state_lock:
                if self._closed:
                    wire.close("the client is closed")
                    raise HicachedError(CONNECTION, "the client is closed")
                self._wire = wire
            self._down = False
            self.reconnects += 1
            log.info("hicached: connected again to %s (%s)", self._path, why)
            return wire
        finally:
            self._dial_lock.release()

    def _register_again(self, wire: _Wire) -> None:
        """Registers each region of the book on `wire`. One the daemon refuses is marked lost (its calls
        then say to register it again); a connection error fails the reconnect, to be tried again."""
        for handle, entry in self._regions.entries():
            if entry.memory is None:
                continue
            op = wire.ops.op_register_region(entry.memory, entry.page_bytes, entry.segments, entry.num_pages)
            try:
                daemon = wire.run(op)
            except HicachedError as e:
                if e.code == CONNECTION:
                    raise
                self._regions.lose(handle, f"registering it again after a reconnect failed: {e.message}")
                continue
            if not self._regions.moved(handle, wire.gen, daemon):  # unregistered meanwhile
                with contextlib.suppress(HicachedError):
                    wire.run(wire.ops.op_unregister_region(daemon))

    def _run(self, op: Op) -> Any:
        """Runs a raw operation (tests, benchmarks, adapters' own ops) on the current connection, once."""
        return self._live().run(op)

    def _call(self, make: Callable[[_Wire], Op], retry: bool) -> Any:
        """Runs the operation `make` builds for a wire. If the daemon went away during it and `retry` (the
        operation is safe to run twice), it runs once more on a new connection."""
        wire = self._live()
        try:
            return wire.run(make(wire))
        except HicachedError:
            if not retry or self.reconnect <= 0 or self._closed or not wire.gone():
                raise
        wire = self._replace(wire)
        return wire.run(make(wire))

    # -- operations ----------------------------------------------------------------------------------
    # Safe to retry: lookups read; a store of a key the daemon has already answers that it is there; a
    # load or get copies the same key's bytes into the same buffers again; pins are flags, not counts;
    # stats and status read. Not: clear (a second clear would also forget pages stored in between).

    def exists(self, keys: Sequence[str]) -> int:
        return self._call(lambda w: w.ops.op_exists(keys), retry=True)

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in L2 or L3, holes and all (exists counts the leading ones only)."""
        return self._call(lambda w: w.ops.op_present(keys), retry=True)

    def touch(self, keys: Sequence[str]) -> int:
        """Makes the keys' pages in L2 the most recently used, so that eviction follows the engine's own
        use of them (no lease, no L3 read, nothing copied): how many were in L2."""
        return self._call(lambda w: w.ops.op_touch(keys), retry=True)

    def store_pages_copied(
        self, handle: int, page_indices: Sequence[int], keys: Sequence[str]
    ) -> tuple[list[bool], int | None]:
        """store_pages, and how many of the pages the daemon copied into L2 (the others it held already, or
        did not take): None where it does not say (an older daemon, or a local region)."""
        return self._call(
            lambda w: w.ops.op_store_pages_copied(
                self._regions.daemon_handle(handle, w.gen), page_indices, keys
            ),
            retry=True,
        )

    def store(self, keys: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        return self._call(lambda w: w.ops.op_store(keys, pages), retry=True)

    def load(self, keys: Sequence[str], buffers: Sequence[Any]) -> int:
        return self._call(lambda w: w.ops.op_load(keys, buffers), retry=True)

    def get(self, keys: Sequence[str]) -> list[bytes]:
        return self._call(lambda w: w.ops.op_get(keys), retry=True)

    def prefetch(self, keys: Sequence[str], priority: int = 0) -> int:
        # Retried: a prefetch only asks for pages to come to L2; the handle is the new connection's.
        return self._call(lambda w: _tagged(w.ops.op_prefetch(keys, priority), w.gen), retry=True)

    def wait(self, handle: int, timeout: float | None = None) -> int:
        """How many leading keys of the prefetch are in L2. A handle from before a reconnect answers 0 at
        once: its prefetch went with the old connection (load still finds what L2 or L3 holds)."""
        return self._call(lambda w: _wait_op(w.ops, w.gen, handle, timeout), retry=True)

    def pin(self, keys: Sequence[str]) -> int:
        return self._call(lambda w: w.ops.op_pin(keys), retry=True)

    def unpin(self, keys: Sequence[str]) -> int:
        return self._call(lambda w: w.ops.op_unpin(keys), retry=True)

    def clear(self) -> dict[str, Any]:
        """Forgets every page of this client's namespace in L2 and L3 (for every engine that shares it):
        {"l2": pages dropped from L2, "busy": pages still held after server.request_timeout, "l3": objects
        deleted (None with "error" when L3 could not be cleared)}. Never retried."""
        return self._call(lambda w: w.ops.op_simple("clear"), retry=False)

    def stats(self) -> dict[str, Any]:
        return self._call(lambda w: w.ops.op_simple("stats"), retry=True)

    def status(self) -> dict[str, Any]:
        return self._call(lambda w: w.ops.op_simple("status"), retry=True)

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
        handle, valid across reconnects: the client keeps the tensor (or a duplicate of the fd) and
        registers it again on a new connection. Should an unsealed memfd shrink, its requests fail
        (copy_failed) and the handle goes."""
        gen = [0]

        def make(w: _Wire) -> Op:
            gen[0] = w.gen
            return w.ops.op_register_region(memory, page_bytes, segments, num_pages)

        # Retried: a region registered on a connection goes with it, so a daemon that went away holds none.
        daemon = self._call(make, retry=True)
        return self._regions.add(memory, page_bytes, segments, num_pages, gen[0], daemon, self._wire.gen)

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
        return self._call(lambda w: w.ops.op_register_local(memory, page_bytes, segments, num_pages), False)

    def unregister_region(self, handle: int) -> None:
        entry = self._regions.pop(handle)
        if entry is None:  # a local region, or one this client does not know: as before
            self._call(lambda w: w.ops.op_unregister_region(handle), retry=False)
            return
        wire = self._wire
        if entry.gen != wire.gen or entry.lost is not None or wire.gone():
            return  # the daemon that had it is gone, and the region with it
        try:
            wire.run(wire.ops.op_unregister_region(entry.daemon))
        except HicachedError as e:
            if e.code != CONNECTION:
                raise

    def store_pages(self, handle: int, page_indices: Sequence[int], keys: Sequence[str]) -> list[bool]:
        """The daemon copies pages `page_indices` of the region into L2 under `keys` (retried as store).

        A host region's request is fenced (hicached.engine.fences): if its answer times out or its connection
        breaks, the call cancels it and raises only once no copy of it touches the region any more (its jobs
        have ended, or the daemon process has exited). That wait has no time bound, on purpose: a copy that
        may still run cannot be declared over, and the caller reuses the memory once the call failed; a
        daemon stopped mid-copy holds the call until it continues or exits (logged once after a second).
        load_pages likewise."""
        return self._call(
            lambda w: w.ops.op_store_pages(self._regions.daemon_handle(handle, w.gen), page_indices, keys),
            retry=True,
        )

    def load_pages(
        self, handle: int, page_indices: Sequence[int], keys: Sequence[str], fetch: bool = True
    ) -> int:
        """The daemon fills pages `page_indices` of the region with the leading hits of `keys` (retried as
        load); with `fetch` False, of what L2 holds only (no L3 read). A time-out or a broken connection
        raises only once no copy of the request touches the region (store_pages: no time bound)."""
        return self._call(
            lambda w: w.ops.op_load_pages(
                self._regions.daemon_handle(handle, w.gen), page_indices, keys, fetch
            ),
            retry=True,
        )


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


class AsyncClient:
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
        first = _Ops(namespace, page_bytes)  # checks both before anything is dialled
        self._namespace, self._page_bytes = first.namespace, first.page_bytes
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        self.reconnect = reconnect
        self._local = first.local
        self._regions = RegionBook()
        self._gens = itertools.count()
        self._wire: _AsyncWire | None = None
        self._closed = False
        self._down = False
        self._redialing: asyncio.Task[_AsyncWire] | None = None
        self.reconnects = 0
        self._ids = itertools.count(1)
        self._unwinding: set[asyncio.Task[None]] = set()

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

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
        ops = _Ops(self._namespace, self._page_bytes)
        ops.local = self._local
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
        if self._closed:
            raise HicachedError(CONNECTION, "the client is closed")
        if wire is None:
            raise HicachedError(CONNECTION, "the client is not connected")
        if not wire.gone():
            return wire
        if self.reconnect <= 0:
            raise HicachedError(CONNECTION, wire.proto.broken or "the connection broke")
        return await self._replace(wire)

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
        why = old.proto.broken
        wait = 0.0 if self._down else self.reconnect
        deadline = time.monotonic() + wait
        attempt = 0
        while True:
            if self._closed:
                raise HicachedError(CONNECTION, "the client is closed")
            attempt += 1
            wire = None
            try:
                wire = await self._dial()
                await self._register_again(wire)
                break
            except HicachedError as e:
                if wire is not None:
                    wire.proto.transport.close()
                    wire.proto._fail("the reconnect failed")
                if e.code not in (CONNECTION, TIMEOUT):  # a daemon that answers and refuses: say so now
                    raise
                delay = _REDIAL.delay(attempt)
                if time.monotonic() + delay > deadline:
                    self._down = True
                    raise HicachedError(CONNECTION, _gone_message(self.socket_path, why, wait, e)) from None
                await asyncio.sleep(delay)
        if self._closed:
            wire.proto.transport.close()
            wire.proto._fail("the client is closed")
            raise HicachedError(CONNECTION, "the client is closed")
        self._wire = wire
        self._down = False
        self.reconnects += 1
        log.info("hicached: connected again to %s (%s)", self.socket_path, why)
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
            if not retry or self.reconnect <= 0 or self._closed or not wire.gone():
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
