"""The engine-side client: `Client` (blocking, thread-safe), and `control()` for operator requests.
`AsyncClient` (the same methods as coroutines) lives in hicached.engine.async_client and is importable from
here too.

Control messages go over the daemon's Unix socket; page bytes are copied straight into and out of the shared
L2 pool, whose fd the daemon hands over when the connection opens. Each operation is written once, as a
generator that yields requests and receives answers (`_Ops`); the two clients only differ in how they carry
a request to the daemon and back, and both reconnect by themselves when the daemon restarts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicached.common import protocol
from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.engine.async_client import AsyncClient
from hicached.engine.ops import Op, _Ops
from hicached.engine.ops import _NoReply as _NoReply
from hicached.engine.reconnect import DEFAULT_RECONNECT_S, _Reconnecting, _Redial, _tagged, _wait_op
from hicached.engine.regions import shared_buffer
from hicached.engine.wire import _CLIENT_MAX_FRAME, _RECV_BYTES, DEFAULT_TIMEOUT, _connect, _Wire

__all__ = ["AsyncClient", "Client", "control", "shared_buffer"]


class Client(_Reconnecting):
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
        super().__init__(namespace, page_bytes, timeout, reconnect)
        self._path = os.fspath(socket_path)
        self._dial_lock = threading.Lock()  # one reconnect at a time; the others wait for it
        self._state_lock = threading.Lock()  # guards _wire and _closed together
        self._wire = self._dial()

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

    def _dial(self) -> _Wire:
        """A new connection: the welcome's pool mapped, hello said with this client's namespace and page
        size."""
        ops = self._new_ops()
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
        return wire if self._usable(wire) else self._replace(wire)

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
            tries = _Redial(self, self._path, cur.broken)
            while True:
                if self._closed:
                    raise HicachedError(CONNECTION, "the client is closed")
                wire = None
                try:
                    wire = self._dial()
                    self._register_again(wire)
                    break
                except HicachedError as e:
                    if wire is not None:
                        wire.close("the reconnect failed")
                    time.sleep(tries.pause(e))
            with self._state_lock:
                if self._closed:
                    wire.close("the client is closed")
                    raise HicachedError(CONNECTION, "the client is closed")
                self._wire = wire
            tries.done()
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
            if not self._may_retry(wire, retry):
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
