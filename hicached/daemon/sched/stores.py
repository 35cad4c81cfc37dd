"""Stores: a slot for each new page (alloc, or reserve ahead), the engine writes its bytes, then commit or put
publishes it (hicached.daemon.l2.life) and queues it for L3."""

from __future__ import annotations

import collections

from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.common.protocol import (
    ALLOC_BUSY,
    ALLOC_NO_SPACE,
    ALLOC_PRESENT,
    ALLOC_WRITE,
    PUT_BUSY,
    PUT_PRESENT,
    PUT_STORED,
)
from hicached.config import Config
from hicached.daemon.l2.index import READY, Entry
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.slabs import slot_size
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.session import Session
from hicached.daemon.sched.writeback import WritePolicy


class Stores:
    """The store requests of engines' sessions. `cfg` is replaced by a reload (Tiers.cfg)."""

    def __init__(
        self,
        cfg: Config,
        life: PageLife,
        backup: Backup,
        backend: Backend,
        policy: WritePolicy,
        activity: EngineActivity,
        counters: collections.Counter[str],
    ) -> None:
        self.cfg = cfg
        self.life = life
        self.index = life.index
        self.backup = backup
        self.backend = backend
        self.policy = policy
        self.activity = activity
        self.counters = counters

    def _room(self, s: Session, through: bool) -> int:
        """How many more of the session's pages the backup queue (and under when_backlog_full = "refuse",
        the backlog bound) may take now: its slots on their way to the queue count already."""
        held = len(s.writing) + len(s.copying)
        room = self.backup.queue_pages - self.backup.pending - held
        if through and self.cfg.storage.when_backlog_full == "refuse":
            room = min(room, self.policy.backlog_room(s.ns, s.page_bytes) - held)
        return room

    # Store: alloc -> engine writes the bytes -> commit.

    def alloc(self, s: Session, keys: list[str]) -> tuple[list[int], list[int]]:
        """A slot of its own for each key without a READY page in L2 (ALLOC_WRITE, leased until committed or
        aborted; a page being read from L3 is no page yet), in one go: the slots of the whole request are
        taken together (a full pool's evictions in one loop). A key this connection is writing already is
        busy: its first write may still be aborted."""
        self.activity.touch()
        n = len(keys)
        status, offsets = [ALLOC_PRESENT] * n, [-1] * n
        through = self.backend.current is not None and not self.policy.write_back
        room = self._room(s, through) if through else n
        get = self.index.ns_entries(s.ns).get
        owed: list[Entry] = []
        want: list[int] = []  # positions that get a slot
        first: dict[str, int] = {}  # key -> its first position, for a key asked twice
        again: list[tuple[int, int]] = []
        writing = s.writing
        for i, key in enumerate(keys):
            entry = get(key)
            if entry is not None and entry.state is READY:
                self.index.touch(entry)
                if not entry.dirty and self.life.stored_again(entry):
                    owed.append(entry)
            elif key in first:
                again.append((i, first[key]))
            elif key in writing or len(want) >= room:
                self.counters["store.busy"] += 1
                status[i] = ALLOC_BUSY
                first[key] = i
            else:
                want.append(i)
                first[key] = i
        if want:
            entries = self.life.start_writes(s.ns, [keys[i] for i in want], s.page_bytes)
            for i, entry in zip(want, entries, strict=False):  # entries may be fewer
                writing[entry.key] = entry
                status[i] = ALLOC_WRITE
                offsets[i] = entry.offset
            if len(entries) < len(want):
                self.counters["store.no_space"] += len(want) - len(entries)
                self.policy.short()
                for i in want[len(entries) :]:
                    status[i] = ALLOC_NO_SPACE
        for i, j in again:  # as if asked after its first place: there now, or refused alike
            if status[j] != ALLOC_WRITE:
                status[i] = status[j]
                self.counters["store.busy" if status[j] == ALLOC_BUSY else "store.no_space"] += 1
        if owed and not self.policy.write_back:
            self.backup.submit_many(owed)
        return status, offsets

    def commit(self, s: Session, keys: list[str], sums: list[int] | None = None) -> list[bool]:
        """The pages the engine wrote into slots from alloc are stored; `sums`: their checksums, if the
        client took them (the backup then writes them as they are)."""
        out = []
        backup = []
        publish = self.life.publish
        for i, key in enumerate(keys):
            entry = s.writing.pop(key, None)
            if entry is None:
                out.append(False)
                continue
            page, owed = publish(entry, None if sums is None else sums[i])
            if owed:
                backup.append(page)
            out.append(True)
        self._queue_stored(backup)
        return out

    def _queue_stored(self, pages: list[Entry]) -> None:
        """Pages just stored that are owed to L3: queued now under write-through (the caller gathers a
        request's pages), written on pressure under write-back."""
        if not self.policy.write_back:
            self.backup.submit_many(pages)
        self.policy.stored()

    def hold_writing(self, s: Session, keys: list[str]) -> list[Entry]:
        """The slots alloc just gave `keys` (all different), taken out of the engine's reach while the daemon
        copies into them (store_pages): commit_held or abort_held ends them, or close_session."""
        entries = [s.writing.pop(key) for key in keys]
        s.copying.update(entries)
        return entries

    def commit_held(self, s: Session, entries: list[Entry], sums: list[int] | None = None) -> None:
        """commit() of slots from hold_writing, whose copy ended; `sums`: their checksums, taken by the copy
        executor once it had."""
        backup = []
        for i, entry in enumerate(entries):
            s.copying.discard(entry)
            page, owed = self.life.publish(entry, None if sums is None else sums[i])
            if owed:
                backup.append(page)
        self._queue_stored(backup)

    def abort_held(self, s: Session, entries: list[Entry]) -> None:
        """abort() of slots from hold_writing whose copy failed (or never started)."""
        for entry in entries:
            s.copying.discard(entry)
            self.life.abort_write(entry)

    # Store from reserved slots: reserve (ahead, answered while the engine copies) -> the engine writes
    # the bytes into slots it already holds -> put binds each slot to its key. A store then waits on
    # one round trip (the put), not two; the reserve is refilled in the background of the next copies.

    def reserve(self, s: Session, n: int) -> tuple[list[int], int]:
        """Up to `n` more slots set aside for this connection's stores, within pool.reserve_per_connection
        and, over all connections, pool.reserve_max_fraction of the pool. Evicts like a store would.
        Returns their offsets and how many this connection may hold."""
        self.activity.touch()
        slot = slot_size(s.page_bytes)
        arena = self.index.arena_of(s.ns)
        if arena < 0:
            return [], 0
        every = int(self.cfg.pool.reserve_max_fraction * self.index.allocs[arena].capacity)
        limit = min(self.cfg.pool.reserve_per_connection, every) // slot
        n = min(n, limit - len(s.reserved), (every - self.index.arena_reserved[arena]) // slot)
        entries = self.index.reserve(s.ns, s.page_bytes, n) if n > 0 else []
        if len(entries) < n:
            self.counters["store.no_space"] += 1
            self.policy.short()
        offsets = []
        for entry in entries:
            s.reserved[entry.offset] = entry
            offsets.append(entry.offset)
        return offsets, limit

    def put(
        self, s: Session, keys: list[str], offsets: list[int], sums: list[int] | None = None
    ) -> list[int]:
        """Binds reserved slots, whose bytes the engine wrote, to `keys`: a PUT_* status per key. A slot
        whose key is there already, or that the backup queue cannot take, stays reserved. `sums`: as in
        commit."""
        if not all(type(o) is int and o in s.reserved for o in offsets):
            raise HicachedError(BAD_REQUEST, "put names a slot this connection has not reserved")
        if len(offsets) != len(keys) or len(set(offsets)) != len(offsets):
            raise HicachedError(BAD_REQUEST, "put needs one distinct offset per key")
        self.activity.touch()
        through = self.backend.current is not None and not self.policy.write_back
        status = []
        backup: list[Entry] = []  # queued together after the loop, and counted against the bound meanwhile
        room = self._room(s, through)
        owed: list[Entry] = []
        for i, (key, off) in enumerate(zip(keys, offsets, strict=True)):
            entry = self.index.get(s.ns, key)
            if entry is not None and entry.state is READY:
                self.index.touch(entry)
                if not entry.dirty and self.life.stored_again(entry):
                    owed.append(entry)
                status.append(PUT_PRESENT)
                continue
            if through and len(backup) >= room:
                self.counters["store.busy"] += 1
                status.append(PUT_BUSY)
                continue
            page, now = self.life.publish(s.reserved.pop(off), None if sums is None else sums[i], key)
            if now:
                backup.append(page)
            status.append(PUT_STORED)
        self._queue_stored(backup + owed)
        return status

    def abort(self, s: Session, keys: list[str]) -> int:
        n = 0
        for key in keys:
            entry = s.writing.pop(key, None)
            if entry is not None:
                self.life.abort_write(entry)
                n += 1
        return n
