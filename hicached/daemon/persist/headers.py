"""Slot headers that outlive a crash: a record per L2 slot (namespace, key, size, checksum, in L3) in a second
memfd kept in systemd's fd store beside the pool, from which a start without an index snapshot rebuilds L2.

The records live in their own memfd, the meta memfd, not in the pool: engines map the pool only, so no
engine can forge or change a record, and a payload changed after its commit fails its checksum at the scan.
Each arena of the pool (a tenant's pool, a memfd of its own; without [tenants] the one arena is the default
tenant's, the whole pool) has a meta memfd of its own, its records at offsets within that arena; ByArena
hands each page's transitions to its arena's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from hicached.common.keys import KEY_MAX_LEN, valid_namespace
from hicached.common.memfd import MADV_POPULATE_WRITE, MEMFD, SEALS, inspect_fd
from hicached.daemon.l2.slabs import ALIGN, slot_size
from hicached.daemon.persist.keep import META_FDNAME, KeptPage, Snapshot

if TYPE_CHECKING:
    from collections.abc import Callable

    from hicached.daemon.l2.index import Entry, PageRecords
    from hicached.daemon.l2.pool import Pool

log = logging.getLogger("hicached.keep")

FORMAT = 1

# The front: what pool the records describe, when a daemon last took it over, and the L3 store `in_l3`
# refers to. magic, format, record size, pool bytes, slab bytes, slabs, pool inode, adopted (CLOCK_MONOTONIC,
# system-wide: compared with an index snapshot's time), L3 location (length, bytes); xxh3-64 of all that.
FRONT_MAGIC = b"HICL2MET"
L3_MAX = 1024
_FRONT = struct.Struct(f"<8sHHIQQQQdH{L3_MAX}s")
_FRONT_SUM = struct.Struct("<Q")
FRONT_BYTES = ALIGN
_SLAB = struct.Struct("<Q")  # the slab table: per slab, the slot size of its class (0: no class)

# A record: magic, format, flags, namespace and key lengths, slot size and offset (where it must be),
# page bytes, xxh3-64 of the payload, commit sequence (CLOCK_MONOTONIC ns, strictly increasing: orders
# the pages for the LRU and picks the newer of two records of one key), namespace, key; xxh3-64 of those.
RECORD_MAGIC = b"HCKV"
_RECORD = struct.Struct("<4sHBBB3xQQQQQ128s128s")
_RECORD_SUM = struct.Struct("<Q")
_SIGNED = _RECORD.size + _RECORD_SUM.size
_KEY_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"  # hicached.common.keys
_FLAGS_AT = 6
RECORD = 512  # bytes a record takes; 316 used, the rest room for later fields
_TAIL = bytes(RECORD - _SIGNED)
_ZERO = bytes(RECORD)
IN_L3 = 1


class MetaError(ValueError):
    """The kept meta memfd cannot be used; the message says why, for the one log line."""


class Record(NamedTuple):
    ns: str
    key: str
    slot_bytes: int
    offset: int
    size: int  # page bytes
    checksum: int  # xxh3-64 of the payload
    seq: int
    in_l3: bool


# The codec: pure functions over bytes.


def pack_record(r: Record) -> bytes:
    ns, key = r.ns.encode("ascii"), r.key.encode("ascii")
    body = _RECORD.pack(
        RECORD_MAGIC,
        FORMAT,
        IN_L3 if r.in_l3 else 0,
        len(ns),
        len(key),
        r.slot_bytes,
        r.offset,
        r.size,
        r.checksum,
        r.seq,
        ns,
        key,
    )
    return (body + _RECORD_SUM.pack(xxhash.xxh3_64_intdigest(body))).ljust(RECORD, b"\0")


def unpack_record(data: bytes | memoryview) -> Record | None:
    """The record in `data` (RECORD bytes): None for an empty slot (all zero); MetaError saying what is wrong
    with one that is not empty and does not check (a slot being written when the daemon died, damage).
    ~2 us a record: a scan after a crash runs it for every slot in use."""
    data = bytes(data[:RECORD])
    if data == _ZERO:
        return None
    if len(data) < RECORD:
        raise MetaError(f"the record is {len(data)} bytes, not {RECORD}")
    magic, fmt, flags, ns_len, key_len, slot, offset, size, checksum, seq, ns, key = _RECORD.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise MetaError("the record does not start with its magic bytes")
    if fmt != FORMAT:
        raise MetaError(f"the record is of format {fmt}; this daemon reads format {FORMAT}")
    if xxhash.xxh3_64_intdigest(data[: _RECORD.size]) != int.from_bytes(
        data[_RECORD.size : _SIGNED], "little"
    ):
        raise MetaError("the record's checksum does not match its bytes")
    if flags & ~IN_L3 or data[_SIGNED:] != _TAIL:
        raise MetaError("the record has flags or bytes this format does not write")
    name = _namespace(ns[:ns_len])
    k = key[:key_len]
    if name is None or not 0 < key_len <= KEY_MAX_LEN or k.translate(None, _KEY_BYTES):
        raise MetaError(f"the record names a namespace or key that is not valid: {ns[:ns_len]!r}/{k!r}")
    if size < 1 or slot_size(size) != slot:
        raise MetaError(f"the record puts a page of {size} bytes in a slot of {slot}")
    return Record(name, k.decode("ascii"), slot, offset, size, checksum, seq, bool(flags & IN_L3))


@functools.lru_cache(maxsize=4096)
def _namespace(raw: bytes) -> str | None:
    """The namespace named by `raw`, None if it is not a valid one (a node has few: cached)."""
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if valid_namespace(name) else None


def pack_front(
    pool_bytes: int, slab_bytes: int, nslabs: int, inode: int, adopted: float, l3: str | None
) -> bytes:
    loc = b"" if l3 is None else l3.encode("utf-8", "replace")
    # A location cut short would be taken for another store: none is recorded then (pages not taken as in
    # L3 after a crash, as after a swap). n: the location's length + 1, 0 for none.
    n = len(loc) + 1 if l3 is not None and len(loc) <= L3_MAX else 0
    body = _FRONT.pack(
        FRONT_MAGIC,
        FORMAT,
        RECORD,
        0,
        pool_bytes,
        slab_bytes,
        nslabs,
        inode,
        adopted,
        n,
        loc[: n - 1] if n else b"",
    )
    return body + _FRONT_SUM.pack(xxhash.xxh3_64_intdigest(body))


@dataclass(frozen=True)
class Front:
    pool_bytes: int
    slab_bytes: int
    nslabs: int
    inode: int
    adopted: float
    l3: str | None


def unpack_front(data: bytes | memoryview) -> Front:
    data = bytes(data[: _FRONT.size + _FRONT_SUM.size])
    if len(data) < _FRONT.size + _FRONT_SUM.size:
        raise MetaError("the meta memfd is shorter than its front")
    magic, fmt, record, _, pool_bytes, slab_bytes, nslabs, inode, adopted, n, loc = _FRONT.unpack_from(data)
    if magic != FRONT_MAGIC:
        raise MetaError("the meta memfd does not start with hicached's magic bytes")
    if fmt != FORMAT or record != RECORD:
        raise MetaError(f"the slot headers are of format {fmt}; this daemon reads format {FORMAT}")
    (digest,) = _FRONT_SUM.unpack_from(data, _FRONT.size)
    if xxhash.xxh3_64_intdigest(data[: _FRONT.size]) != digest:
        raise MetaError("the meta memfd's front does not match its checksum (damaged)")
    l3 = loc[: n - 1].decode("utf-8", "replace") if n else None
    return Front(pool_bytes, slab_bytes, nslabs, inode, adopted, l3)


def meta_bytes(nslabs: int, slab_bytes: int) -> int:
    """Size of the meta memfd for a pool of `nslabs` slabs. Records are dense per slab (slot i of a slab at
    record i of the slab's area), not one per 4 KiB of pool: the memory they take is ~RECORD per slot in
    use (a memfd allocates only the pages touched), whatever the page size."""
    return FRONT_BYTES + _table_bytes(nslabs) + nslabs * (slab_bytes // ALIGN) * RECORD


def _table_bytes(nslabs: int) -> int:
    return -(-nslabs * _SLAB.size // ALIGN) * ALIGN


@dataclass
class Scanned:
    snapshot: Snapshot
    records: int = 0  # records found (valid or not)
    dropped: int = 0  # records that did not check, or lost to another of the same key or namespace
    seconds: float = 0.0


class Headers:
    """The meta memfd of a pool, mapped, and the writes at each page's transitions (on the event loop: a
    struct pack and a slice assignment a page). `fd` is owned (kept in systemd's fd store while the daemon
    runs, closed by close()). With arenas, of one arena (`arena`, from pool offset `base`): `pool_bytes` is
    its size, and the records' offsets are within it."""

    def __init__(
        self,
        fd: int,
        pool_bytes: int,
        slab_bytes: int,
        inode: int,
        fresh: bool,
        arena: int = 0,
        base: int = 0,
    ) -> None:
        self.fd = fd
        self.arena = arena
        self.base = base
        self.pool_bytes = pool_bytes
        self.slab_bytes = slab_bytes
        self.nslabs = pool_bytes // slab_bytes
        self.inode = inode
        self.size = meta_bytes(self.nslabs, slab_bytes)
        self._slots_per_slab = slab_bytes // ALIGN
        self._records = FRONT_BYTES + _table_bytes(self.nslabs)
        self.fresh = fresh  # created here: holds no record of the pages a restore brings back
        self._seq = 0
        self._l3: str | None = None
        self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_DONTDUMP"):
            self.mm.madvise(mmap.MADV_DONTDUMP)
        self.view = memoryview(self.mm)
        self.adopted = 0.0
        if not fresh:
            front = unpack_front(self.view[:FRONT_BYTES])
            self.adopted, self._l3 = front.adopted, front.l3

    @classmethod
    def create(cls, pool: Pool, slab_bytes: int, arena: int = 0) -> Headers:
        """A new, empty meta memfd for `pool` (its arena `arena`): sealed against shrink and grow, as the
        pool; not prefaulted."""
        a = pool.arenas[arena]
        nslabs = a.size // slab_bytes
        fd = os.memfd_create(META_FDNAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, meta_bytes(nslabs, slab_bytes))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            h = cls(fd, a.size, slab_bytes, os.fstat(a.fd).st_ino, fresh=True, arena=arena, base=a.base)
        except BaseException:
            os.close(fd)
            raise
        h._write_front()
        return h

    @classmethod
    def adopt(cls, fd: int, pool: Pool, slab_bytes: int, arena: int = 0) -> Headers:
        """The kept meta memfd `fd` of `pool` (its arena `arena`), checked against it and this configuration;
        MetaError saying why not otherwise (the caller closes `fd` then)."""
        a = pool.arenas[arena]
        size, inode = a.size, os.fstat(a.fd).st_ino
        nslabs = size // slab_bytes
        want = meta_bytes(nslabs, slab_bytes)
        mem = inspect_fd(fd)
        if mem.kind != MEMFD:
            raise MetaError(f"the kept slot headers are a {mem.kind}, not a memfd")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise MetaError("the kept slot headers' memfd is not sealed as the daemon seals it")
        if mem.size != want:
            raise MetaError(f"the kept slot headers take {mem.size} bytes; this pool's take {want}")
        front = unpack_front(os.pread(fd, _FRONT.size + _FRONT_SUM.size, 0))
        if (front.pool_bytes, front.slab_bytes, front.nslabs) != (size, slab_bytes, nslabs):
            raise MetaError(
                f"the kept slot headers describe a pool of {front.pool_bytes} bytes in slabs of "
                f"{front.slab_bytes}; this one is {size} in slabs of {slab_bytes}"
            )
        if front.inode != inode:
            raise MetaError("the kept slot headers describe another memfd than the kept pool")
        return cls(fd, size, slab_bytes, inode, fresh=False, arena=arena, base=a.base)

    def _write_front(self) -> None:
        front = pack_front(self.pool_bytes, self.slab_bytes, self.nslabs, self.inode, self.adopted, self._l3)
        self.mm[: len(front)] = front

    def mark_adopted(self) -> None:
        """This daemon now changes the pool: an index snapshot taken before is stale from here on."""
        self.adopted = time.clock_gettime(time.CLOCK_MONOTONIC)
        self._write_front()

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        self.mm.close()
        os.close(self.fd)
        self.fd = -1

    # The writes at the pages' transitions.

    def _at(self, offset: int, slot_bytes: int) -> int:
        """Where the record of the slot at `offset` (within the arena) is."""
        slab, within = divmod(offset, self.slab_bytes)
        return self._records + (slab * self._slots_per_slab + within // slot_bytes) * RECORD

    def slab(self, slab: int, slot_bytes: int) -> None:
        """The allocator gave `slab` to the class of `slot_bytes` (rare: a slab's first use, a slab move)."""
        _SLAB.pack_into(self.mm, FRONT_BYTES + slab * _SLAB.size, slot_bytes)
        # The records of its slots allocated now, at once: a page fault per 8 records on the store path
        # otherwise (~0.5 us a page stored). Memory its slots take as they fill anyway.
        base = self._records + slab * self._slots_per_slab * RECORD
        used = self.slab_bytes // slot_bytes * RECORD
        with contextlib.suppress(OSError, ValueError):  # Linux < 5.14: faulted in as records are written
            self.mm.madvise(MADV_POPULATE_WRITE, base, -(-used // ALIGN) * ALIGN)

    def l3(self, location: str | None) -> None:
        """The L3 store pages' in_l3 refers to from now on (a backend attached)."""
        if location != self._l3:
            self._l3 = location
            self._write_front()

    def commit(self, e: Entry) -> None:
        """A page became ready (its checksum taken): its record. Runs for every page stored."""
        seq = time.monotonic_ns()
        self._seq = seq = seq if seq > self._seq else self._seq + 1
        ns, key = e.ns.encode("ascii"), e.key.encode("ascii")
        slot = e.cls.slot_bytes
        offset = e.offset - self.base
        at = (
            self._records
            + (offset // self.slab_bytes * self._slots_per_slab + offset % self.slab_bytes // slot) * RECORD
        )
        body = _RECORD.pack(
            RECORD_MAGIC,
            FORMAT,
            IN_L3 if e.in_l3 else 0,
            len(ns),
            len(key),
            slot,
            offset,
            e.size,
            e.checksum,
            seq,
            ns,
            key,
        )
        # One bytes object, one slice assignment (~0.5 us with the hash; pack_into twice costs more).
        self.mm[at : at + _SIGNED] = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")

    def in_l3(self, e: Entry) -> None:
        """A page reached L3: its record says so (a crash then does not back it up again)."""
        at = self._at(e.offset - self.base, e.cls.slot_bytes)
        mm = self.mm
        if mm[at : at + 4] != RECORD_MAGIC:
            return  # a page without a record (prefetched from L3, which is in L3 already)
        mm[at + _FLAGS_AT] |= IN_L3
        _RECORD_SUM.pack_into(
            mm, at + _RECORD.size, xxhash.xxh3_64_intdigest(self.view[at : at + _RECORD.size])
        )

    def clear(self, entries: list[Entry]) -> None:
        """Pages left L2 (evicted, aborted, cleared, a failed fill): their records go, so that a slot
        freed is never brought back by a scan. Runs for every page a full pool evicts."""
        mm, at, base = self.mm, self._at, self.base
        for e in entries:
            i = at(e.offset - base, e.cls.slot_bytes)
            mm[i : i + RECORD] = _ZERO

    def clear_at(self, offset: int, slot_bytes: int) -> None:
        """Clears the record of the slot at `offset` (within the arena)."""
        i = self._at(offset, slot_bytes)
        self.mm[i : i + RECORD] = _ZERO

    # Start-up: the scan, and the records of pages a restore brought back.

    def scan(self) -> Scanned:
        """Every committed page the records describe, as a snapshot for keep.restore (which verifies each
        payload against its checksum before anything is served). Records that do not check are cleared and
        counted. Reads with pread (a hole of the memfd reads as zeros without being allocated).

        Slots that were being written when the daemon died have no record: they are free again, with no
        quarantine as a snapshot's held slots get. An engine's copy into one ends within its store call,
        long before a new daemon, which verifies every page first, hands the slot out again."""
        start = time.perf_counter()
        slabs = [0] * self.nslabs
        table = os.pread(self.fd, self.nslabs * _SLAB.size, FRONT_BYTES)
        out_dropped = 0
        found: dict[tuple[str, str], Record] = {}
        records = 0
        area = self._slots_per_slab * RECORD
        for s in range(self.nslabs):
            (slot,) = _SLAB.unpack_from(table, s * _SLAB.size)
            base = self._records + s * area
            if not slot or slot % ALIGN or slot > self.slab_bytes:
                if slot:
                    log.warning(
                        "slab %d has a slot size of %d in the kept slot headers: its pages dropped", s, slot
                    )
                    out_dropped += self._clear_area(base, area)
                continue
            slabs[s] = slot
            per_slab = self.slab_bytes // slot
            data = os.pread(self.fd, per_slab * RECORD, base)
            for i in range(per_slab):
                chunk = data[i * RECORD : (i + 1) * RECORD]
                if chunk == _ZERO:
                    continue
                records += 1
                offset = s * self.slab_bytes + i * slot
                try:
                    r = unpack_record(chunk)
                    if r is None:
                        continue
                    if r.offset != offset or r.slot_bytes != slot:
                        raise MetaError(f"the record of slot {offset} describes slot {r.offset}")
                except MetaError:
                    out_dropped += 1
                    self.clear_at(offset, slot)
                    continue
                other = found.get((r.ns, r.key))
                if other is not None:  # never written so; the newer commit wins
                    out_dropped += 1
                    old, r = (other, r) if other.seq < r.seq else (r, other)
                    self.clear_at(old.offset, old.slot_bytes)
                found[(r.ns, r.key)] = r
                self._seq = max(self._seq, r.seq)
        # One page size a namespace (an engine's hello pins it): a record of another is damage; the size of
        # the newest commit wins.
        sizes: dict[str, Record] = {}
        for r in found.values():
            if r.ns not in sizes or sizes[r.ns].seq < r.seq:
                sizes[r.ns] = r
        pages = []
        for r in sorted(found.values(), key=lambda r: r.seq):  # least recent first, as the LRU lists
            if r.size != sizes[r.ns].size:
                out_dropped += 1
                self.clear_at(r.offset, r.slot_bytes)
                continue
            pages.append(KeptPage(r.ns, r.key, r.offset, r.size, r.checksum, r.in_l3, not r.in_l3, False))
        snap = Snapshot(
            self.nslabs * self.slab_bytes,
            self.pool_bytes,
            self.slab_bytes,
            slabs,
            pages,
            [],
            self.inode,
            self._l3,
            time.clock_gettime(time.CLOCK_MONOTONIC),
        )
        return Scanned(snap, records, out_dropped, time.perf_counter() - start)

    def _clear_area(self, base: int, area: int) -> int:
        """Clears the records of a slab the table gives no usable slot size; how many were not empty."""
        data = os.pread(self.fd, area, base)
        n = sum(data[i : i + RECORD] != _ZERO for i in range(0, area, RECORD))
        if n:
            self.mm[base : base + area] = bytes(area)
        return n

    def restored(self, snap: Snapshot, entries: list[Entry]) -> None:
        """After keep.restore: every page brought back gets its record (written again where the kept meta
        memfd has it: a page may have come into L2 without one, read from L3 by an older release), and the
        records of the pages that did not verify go."""
        for e in entries:
            self.commit(e)
        if self.fresh:
            return
        kept = {e.offset - self.base for e in entries}
        for p in snap.pages:
            if p.offset not in kept:
                self.clear_at(p.offset, snap.slabs[p.offset // snap.slab_bytes])


def adopt(
    meta_fds: list[int], pool: Pool, slab_bytes: int, snapshot: Snapshot | None, arena: int = 0
) -> tuple[Headers | None, Snapshot | None]:
    """What a start restores a kept pool (or arena `arena` of it) from: its index snapshot where one came (a
    planned restart: no scan needed) and is not older than the slot headers; else the slot headers (a
    crash), scanned by the caller. Headers None: none usable came, a fresh meta memfd is made. MetaError (a
    ValueError) when neither can be used. The fd in `meta_fds` is taken (owned by the Headers returned, or
    closed)."""
    if not meta_fds:
        if snapshot is None:
            raise MetaError("neither an index snapshot nor slot headers were kept with it")
        return None, snapshot
    if len(meta_fds) != 1:
        for fd in meta_fds:
            os.close(fd)
        raise MetaError(f"{len(meta_fds)} slot header fds were passed, not 1")
    fd = meta_fds.pop()
    try:
        headers = Headers.adopt(fd, pool, slab_bytes, arena)
    except (MetaError, OSError) as e:
        os.close(fd)
        if snapshot is None:
            raise MetaError(str(e)) from None
        log.warning("the kept slot headers are not used (%s): the index snapshot is", e)
        return None, snapshot
    if snapshot is not None and headers.adopted > snapshot.written:
        # A daemon started on this pool after the snapshot was taken, and its removal from the store did
        # not happen before that daemon died: the pool has changed since. The headers are current.
        log.warning(
            "the index snapshot kept with L2 is older than its slot headers (a daemon ran on the pool after "
            "it was taken): L2 is rebuilt from the slot headers"
        )
        snapshot = None
    return headers, snapshot


class ByArena:
    """The PageRecords of a pool, of one arena or several: each page's transitions, and each slab given to a
    class, go to its arena's Headers (None: that arena keeps no records)."""

    def __init__(self, headers: list[Headers | None]) -> None:
        self.by_arena = headers

    def slab(self, arena: int, slab: int, slot_bytes: int) -> None:
        h = self.by_arena[arena]
        if h is not None:
            h.slab(slab, slot_bytes)

    def commit(self, e: Entry) -> None:
        h = self.by_arena[e.cls.arena]
        if h is not None:
            h.commit(e)

    def in_l3(self, e: Entry) -> None:
        h = self.by_arena[e.cls.arena]
        if h is not None:
            h.in_l3(e)

    def clear(self, entries: list[Entry]) -> None:
        by_arena = self.by_arena
        for e in entries:
            h = by_arena[e.cls.arena]
            if h is not None:
                h.clear([e])

    def l3(self, location: str | None) -> None:
        for h in self.by_arena:
            if h is not None:
                h.l3(location)


class Observers(NamedTuple):
    """What the tiers are handed as they are built (Tiers(..., records=, on_slab=)) for slot headers to follow
    L2: the page lifecycle's transitions, and the slabs each arena's allocator gives to a class."""

    records: PageRecords | None
    on_slab: Callable[[int, int, int], None] | None


def observers(headers: list[Headers], narenas: int = 1) -> Observers:
    """The Observers of `headers` (one Headers an arena at most; the arenas of the pool's `narenas` without
    one keep no records): a pool of one arena is the default tenant's, and its records go the same way as
    every tenant's. Built before the tiers: their allocators have given out no slab yet, so the slab table
    hears of every one."""
    if not headers:
        return Observers(None, None)
    by_arena: list[Headers | None] = [None] * narenas
    for h in headers:
        by_arena[h.arena] = h
    records = ByArena(by_arena)
    return Observers(records, records.slab)
