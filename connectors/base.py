"""The interface every L3 backend implements, its errors, and the counters it keeps.

Connectors move page payloads between the pool's memory and a store. They write the page header
(connectors.header) in front of every payload and verify it on every read: a read that does not verify is
a miss, is counted, and the object is removed. Failures of the store itself (unreachable, timed out) raise
BackendUnavailable for the whole call; the caller counts it and treats the pages as misses.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger("hicached.connectors")

PROBE_NAMESPACE = "_hicached_probe"
# Where the nodes of a fleet keep what they share besides pages (marks: each namespace's clear epoch,
# hicached.daemon.sched.epochs; the file backend's janitor lease and ledgers): a name that no namespace can
# take (the "~": hicached.common.keys.valid_namespace), so that no page call of any engine reaches them.
FLEET_NAMESPACE = ".fleet~"
MAX_MARK = 4096  # bytes of a mark (Connector.read_marks): a few words, never a page


class BackendError(Exception):
    """Base of the errors a connector raises for a whole call. `code` is the daemon's stable error code."""

    code = "backend_unavailable"

    def __init__(self, backend: str, message: str, reason: str = "error") -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(f"{backend}: {message}")


class BackendUnavailable(BackendError):
    """The store cannot be reached or did not answer in time. Transient: retried with backoff."""


class BackendMisconfigured(BackendError):
    """The store answered, but refuses us (credentials, permissions, missing bucket). Not a miss."""

    code = "backend_misconfigured"


class BackendUnsupported(BackendError):
    """The backend cannot do what was asked at all (an operation it does not implement). Not transient:
    retrying will not help."""

    code = "unsupported"


@dataclass(frozen=True)
class Capabilities:
    shared: bool  # other nodes can see what this node writes
    persistent: bool  # survives a restart of the store
    ttl: bool  # objects can expire by themselves


class Hold:
    """The buffers of one call (a put's payloads, a get_into's destinations), held past its answer.

    A call answers when its time is up, but a thread that is in the middle of a page (a pwritev into a
    file, a preadv into a slot, a copy) cannot be stopped there. A connector that runs such work adds each
    piece still running when it answers (`track`, `track_thread`); the caller reuses the buffers only once
    every piece ended (`released`, `when_released`). Work that had not started when the call answered is
    cancelled by the connector and never touches them. A call with nothing left running holds nothing."""

    __slots__ = ("_pending", "_callbacks")

    def __init__(self) -> None:
        self._pending = 0
        self._callbacks: list[Callable[[], None]] = []

    @property
    def released(self) -> bool:
        return self._pending == 0

    @property
    def pending(self) -> int:
        """Pieces of work still running on the buffers."""
        return self._pending

    def when_released(self, fn: Callable[[], None]) -> None:
        """Calls `fn` on the event loop once nothing runs on the buffers: now, if nothing does."""
        if self._pending:
            self._callbacks.append(fn)
        else:
            fn()

    def track(self, fut: asyncio.Future[Any]) -> None:
        """An asyncio future that completes (on the event loop) when its piece of work ended."""
        if fut.done():
            return
        self._pending += 1
        fut.add_done_callback(self._ended)

    def track_thread(self, fut: concurrent.futures.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        """A thread pool's future: cancelled if it has not started, else held until it ends."""
        if fut.cancel() or fut.done():
            return
        self._pending += 1

        def ended(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to give buffers to
                loop.call_soon_threadsafe(self._ended, None)

        fut.add_done_callback(ended)

    def _ended(self, _: object) -> None:
        self._pending -= 1
        if not self._pending:
            callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                fn()


def put_checksums(
    keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int | None] | None
) -> list[int | None] | None:
    """The checks of every put's arguments: one payload and, if given, one checksum a key (ValueError
    otherwise). Returns the checksums, or None when not one is known (every page is hashed)."""
    if len(keys) != len(payloads) or (checksums is not None and len(checksums) != len(keys)):
        n = len(keys) if checksums is None else len(checksums)
        raise ValueError(f"{len(keys)} keys, {len(payloads)} payloads and {n} checksums")
    if checksums is None or all(c is None for c in checksums):
        return None
    return list(checksums)


class Connector(abc.ABC):
    """An L3 backend. All methods are coroutines on the daemon's event loop and must never block it."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self) -> None:
        # Counted by reason: "corrupt.checksum", "errors.timeout", ... Read by `stats`.
        self.counters: collections.Counter[str] = collections.Counter()
        # Pieces of work the store has finished so far (objects, jobs), bumped within calls: what tells the
        # daemon's stall watch that a long call still moves. A call that ends counts as progress anyway.
        self.progress = 0
        # Each connector probes under a key of its own: nodes that share a store (Redis, S3) and probe it
        # at once must not delete each other's probe object between its write and its read.
        self._probe_key = f"probe-{secrets.token_hex(8)}"
        self._misfit_logged: set[str] = set()  # namespaces whose misfit pages were logged (bounded)

    async def start(self) -> None:
        """Open clients, create directories. Raises BackendError if the store is not usable."""

    @abc.abstractmethod
    async def put(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        checksums: Sequence[int | None] | None = None,
        hold: Hold | None = None,
    ) -> list[bool]:
        """Stores each payload under its key with a header; True per page written. `checksums`: each
        payload's xxh3-64 as the page entered L2 (the daemon passes one for every page): it goes into the
        header, and a page is published (made readable under its key) only if its bytes, as written, hash
        to it; a page whose bytes changed since is not stored (False), so L3 never holds under a key bytes
        other than those acknowledged under it. None (or an item None): computed here (probes, tests).
        `hold`: see Hold; the payloads may be reused once it is released."""

    @abc.abstractmethod
    async def get_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], hold: Hold | None = None
    ) -> list[bool]:
        """Reads each page's payload into its buffer (of exactly the payload length); True per page that
        was present and verified. A corrupt or short object is a miss, is counted and is removed.
        `hold`: see Hold; the buffers may be reused once it is released."""

    @abc.abstractmethod
    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        """How many leading keys are present; the first absent key ends the answer."""

    async def present(self, namespace: str, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present, holes and all. This default asks `exists` for the leading run from
        each hole on: one call per hole, plus one."""
        out = [False] * len(keys)
        i = 0
        while i < len(keys):
            n = await self.exists(namespace, keys[i:])
            out[i : i + n] = [True] * n
            i += n + 1
        return out

    @abc.abstractmethod
    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        """Removes the keys; returns how many existed."""

    async def clear_namespace(self, namespace: str) -> int:
        """Deletes every page of `namespace` in this store; returns how many objects were removed. Objects
        of other namespaces are never touched, those whose name starts with this one's included (`ns` and
        `ns2`, `a` and `a.b`). Pages written into the namespace while the call runs may or may not be
        removed. An invalid namespace (hicached.common.keys.valid_stored_namespace) holds no pages: 0. Raises
        BackendUnavailable when the store fails or the call passes the connector's time-out (some pages may
        be gone by then); this default, for backends that cannot do it, raises BackendUnsupported."""
        raise BackendUnsupported(self.name, "clearing a namespace is not supported", "unsupported")

    async def read_marks(self, names: Sequence[str]) -> list[bytes | None]:
        """Marks: small values that the nodes sharing this store keep besides pages (each namespace's clear
        epoch, hicached.daemon.sched.epochs), by name (a valid key); None where a mark is absent. A store
        keeps them apart from pages: no page bound, eviction or time to live of the connector's removes
        them. Raises BackendError as the page calls do; this default, for a store that cannot keep them,
        BackendUnsupported (clears then stay node-local)."""
        raise BackendUnsupported(self.name, "marks are not supported", "unsupported")

    async def write_mark(self, name: str, value: bytes) -> None:
        """Replaces the mark `name` with `value` (a few bytes), whole: a reader sees the old or the new."""
        raise BackendUnsupported(self.name, "marks are not supported", "unsupported")

    async def close(self) -> None:
        """Release clients and threads. Idempotent."""

    def info(self) -> dict:
        """What an operator may want to know of how this connector runs (`ctl stats`: backend_info)."""
        return {}

    def location(self) -> tuple:
        """What names the store this connector reads and writes: two connectors with the same location
        see the same pages (a backend re-attached, or rebuilt for a new timeout). Default: only itself."""
        return (self.name, id(self))

    async def probe(self, timeout: float = 10.0) -> None:
        """Write, read back and delete a probe object; raises BackendError if any step fails."""
        payload = memoryview(b"hicached-probe-" + bytes(range(256)))
        key = self._probe_key
        async with asyncio.timeout(timeout):
            try:
                if not (await self.put(PROBE_NAMESPACE, [key], [payload]))[0]:
                    raise BackendUnavailable(self.name, "probe write failed", "probe")
                back = memoryview(bytearray(len(payload)))
                if not (await self.get_into(PROBE_NAMESPACE, [key], [back]))[0] or back != payload:
                    raise BackendUnavailable(self.name, "probe read did not return what was written", "probe")
                await self.delete(PROBE_NAMESPACE, [key])
            except TimeoutError:
                raise BackendUnavailable(
                    self.name, f"probe did not finish within {timeout}s", "timeout"
                ) from None

    def misfit(self, namespace: str, key: str, reason: str, detail: str) -> None:
        """Count one page that does not fit its reader (header.MisfitPage), left in place; logged once a
        namespace (a node of the fleet configured otherwise reads or writes many)."""
        self.counters[f"misfit.{reason}"] += 1
        if namespace in self._misfit_logged or len(self._misfit_logged) >= 1024:
            return
        self._misfit_logged.add(namespace)
        log.warning(
            "%s: page %s/%s does not fit this daemon (%s): a miss, left in place for the nodes it fits "
            "(another page size or format for the same namespace; counted in misfit.*, logged once a "
            "namespace)",
            self.name,
            namespace,
            key,
            detail,
        )

    def corrupt(self, namespace: str, key: str, reason: str, detail: str) -> None:
        """Count and log one corrupt object (the caller removes it)."""
        self.counters[f"corrupt.{reason}"] += 1
        log.warning(
            "%s: page %s/%s is corrupt (%s); treated as a miss and removed", self.name, namespace, key, detail
        )
