"""clear() across the fleet: each namespace's clear epoch, kept in the shared L3, read by every node.

The nodes of a fleet share one L3 and each keep their own L2. A namespace's objects in L3 live under its
stored name, `ns~{epoch}` (just `ns` before its first clear: hicached.common.keys.stored_namespace). A clear
on any node draws a new epoch and writes it to the shared store as a mark (Connector.write_mark), then
deletes the objects of the epoch before. Every node reads the marks of the namespaces it uses every
storage.epoch_interval; when one changed, it forgets its L2 pages of that namespace (held ones as soon as
they are let go, and never written to L3 again) and reads and writes under the new epoch from then on.

So once clear() has returned on any node, no node serves a page of the namespace stored before it after
epoch_interval plus one store call: not from L2 (forgotten), not from L3 (the old name is read by nobody;
a write still in flight to it, or made by a node that has not seen the clear yet, lands where nobody reads,
and the clearing node deletes that name again once the bound has passed).

A node that first uses a namespace (a hello) learns its epoch on the first read; a clear recorded as younger
than the node's first use of the namespace (less a second of clock skew between nodes) means its L2 pages
may be older than the clear: they are forgotten too. Pages kept over a restart come with the epochs the
daemon before knew (hicached.daemon.persist.keep): compared with the store's on the first read. Without them
(a crash: the index rebuilt from slot headers) they are of unknown age: any clear ever recorded forgets them.
A store whose connector keeps no marks (BackendUnsupported) has node-local clears, as before fleets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable

import xxhash

from hicached.common.keys import stored_namespace
from hicached.connectors.base import BackendError, BackendUnsupported
from hicached.daemon.sched.backend import Backend

log = logging.getLogger("hicached.epochs")

# Clocks of the nodes may differ by this much: a clear recorded up to this long before a node first used the
# namespace is taken as younger (its L2 pages forgotten: misses, never stale pages).
CLOCK_SKEW_S = 1.0
# A namespace with no page in L2 and no L3 call for this long is no longer watched (its epoch is read again
# on its next use).
IDLE_S = 60.0
_PREFIX = b"hicached-epoch "


def mark_name(ns: str) -> str:
    """The mark that holds `ns`'s epoch: a valid key whatever the namespace's characters."""
    return f"epoch-{xxhash.xxh3_128_hexdigest(ns.encode())}"


def encode(epoch: str, when: float) -> bytes:
    return _PREFIX + f"{epoch} {when:.6f}".encode()


def decode(value: bytes | None) -> tuple[str, float] | None:
    """(epoch, when the clear was made: wall clock of its node); ("", 0.0) for no mark; None if unreadable."""
    if value is None:
        return "", 0.0
    if not value.startswith(_PREFIX):
        return None
    try:
        epoch, when = value[len(_PREFIX) :].decode().split()
        if len(epoch) != 16 or int(epoch, 16) < 0:
            return None
        return epoch, float(when)
    except ValueError:
        return None


async def plain(ns: str) -> str:
    """The stored name of a namespace where no epochs are kept (parts built alone, in tests): itself."""
    return ns


class Epochs:
    """The clear epoch of each namespace this node uses, as last read from the shared store.

    `changed(ns)` is called when a namespace's epoch moved under this node (another node's clear): the
    tiers forget their L2 pages of it. `in_l2()` gives the namespaces with pages in L2 (watched whatever
    their last use)."""

    def __init__(
        self,
        backend: Backend,
        counters: collections.Counter[str],
        interval: Callable[[], float],
        changed: Callable[[str], None],
        in_l2: Callable[[], Iterable[str]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.counters = counters
        self._interval = interval
        self._changed = changed
        self._in_l2 = in_l2
        self._clock = clock
        self._wall = wall
        self._known: dict[str, str] = {}  # ns -> epoch ("" before its first clear)
        self._used: dict[str, float] = {}  # ns -> when last used (clock)
        self._first: dict[str, float] = {}  # ns -> when this node first used it (wall clock)
        self._store = backend.epoch  # the store (Backend.epoch) the epochs were read from
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.supported = True  # False once the store says it keeps no marks: clears stay on this node

    @property
    def enabled(self) -> bool:
        return self.supported and self._interval() > 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="hicached-epochs")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def using(self, ns: str) -> None:
        """`ns` is used on this node from now (a hello). Pages of it already in L2 and of unknown age (kept
        over a restart) date it back to the beginning of time."""
        if ns not in self._first:
            self._first[ns] = 0.0 if ns in self._in_l2() else self._wall()
        self._used[ns] = self._clock()

    def known(self, ns: str) -> str | None:
        return self._known.get(ns)

    def restored(self, namespaces: set[str], known: dict[str, str]) -> None:
        """Pages of `namespaces` were kept over a restart, by a daemon that knew their epochs as `known`:
        the first read compares with those (a namespace cleared meanwhile is forgotten, one cleared before
        is not). A namespace missing from `known` (a crash) is of unknown age: any clear forgets it."""
        for ns in namespaces:
            if ns in known:
                self._known.setdefault(ns, known[ns])
            else:
                self._first[ns] = 0.0

    async def stored(self, ns: str) -> str:
        """The name of `ns`'s objects in L3 now, for a call about to be made. The first time, the epoch is
        read from the store first (BackendError if it cannot be)."""
        self._forget_other_store()
        self._used[ns] = self._clock()
        if not self.enabled:
            return ns
        epoch = self._known.get(ns)
        if epoch is None:
            epoch = await self._read_first(ns)
        return stored_namespace(ns, epoch)

    def _forget_other_store(self) -> None:
        if self.backend.epoch != self._store:  # another store attached: its marks are not the old one's
            self._store = self.backend.epoch
            self._known.clear()

    async def _read_first(self, ns: str) -> str:
        """The first read of `ns`'s epoch on this node (calls that meet here each read: a few bytes)."""
        self._settle(await self._read([ns]))
        return self._known.get(ns, "")

    async def _read(self, names: list[str]) -> dict[str, tuple[str, float] | None]:
        try:
            values = await self.backend.call("epoch", lambda c: c.read_marks([mark_name(n) for n in names]))
        except BackendUnsupported:
            if self.supported:
                log.warning(
                    "the L3 backend keeps no marks: clear() forgets pages on this node and in L3, but other "
                    "nodes sharing the store keep their L2 copies"
                )
            self.supported = False
            return {ns: ("", 0.0) for ns in names}
        return {ns: decode(v) for ns, v in zip(names, values, strict=True)}

    def _settle(self, read: dict[str, tuple[str, float] | None]) -> None:
        for ns, got in read.items():
            if got is None:
                self.counters["fleet.epoch_unreadable"] += 1
                continue
            epoch, when = got
            old = self._known.get(ns)
            self._known[ns] = epoch
            if old is None:
                # The first read: a clear younger than this node's first use of the namespace may postdate
                # pages in its L2.
                first = self._first.get(ns)
                if epoch and first is not None and when >= first - CLOCK_SKEW_S:
                    self._moved(ns)
            elif old != epoch:
                self._moved(ns)

    def _moved(self, ns: str) -> None:
        self.counters["fleet.clears_seen"] += 1
        log.info("namespace %s was cleared on another node: its pages in this node's L2 are forgotten", ns)
        self._changed(ns)

    async def refresh(self) -> None:
        """Reads the epochs of the namespaces in use (and in L2) once."""
        self._forget_other_store()
        now = self._clock()
        in_l2 = set(self._in_l2())
        for ns in [ns for ns, t in self._used.items() if now - t > IDLE_S and ns not in in_l2]:
            del self._used[ns]
            self._known.pop(ns, None)
            self._first.pop(ns, None)
        for ns in in_l2:
            if ns not in self._known:  # pages of unknown age (kept over a restart): any clear may be younger
                self._first.setdefault(ns, 0.0)
        names = sorted(in_l2 | self._used.keys())
        if not names or self.backend.current is None or not self.enabled:
            return
        try:
            read = await self._read(names)
        except BackendError as e:
            self.counters[f"fleet.epoch_errors.{e.reason}"] += 1
            if not self._failing:
                log.warning(
                    "cannot read the clear epochs from L3 (%s): clears on other nodes go unseen until then",
                    e,
                )
            self._failing = True
            return
        if self._failing:
            log.info("clear epochs read from L3 again")
        self._failing = False
        self.counters["fleet.epoch_reads"] += 1
        self._settle(read)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval() or 1.0)
            try:
                await self.refresh()
            except Exception:
                log.exception("reading clear epochs failed")

    async def bump(self, ns: str) -> list[str]:
        """A clear of `ns` on this node: a new epoch written to the store. Returns the stored names whose
        objects the clear deletes: the epoch read from the store just before (another node may have cleared
        meanwhile) and the one this node knew. BackendError if the new epoch cannot be written."""
        self._forget_other_store()
        self._used[ns] = self._clock()
        if not self.enabled:
            return [ns]
        known = self._known.get(ns)
        before = (await self._read([ns]))[ns]
        old = {before[0] if before is not None else "", known or ""}
        if self.supported:
            new = secrets.token_hex(8)
            await self.backend.call("epoch", lambda c: c.write_mark(mark_name(ns), encode(new, self._wall())))
            self._known[ns] = new
            self.counters["fleet.clears_made"] += 1
        else:
            self._known[ns] = ""
        return sorted(stored_namespace(ns, epoch) for epoch in old)
