"""L2 kept over a planned restart: at shutdown the pool memfd and a snapshot of its index go to systemd's
file-descriptor store; the next start takes both back, verifies every page and serves them again.

The snapshot lives in a second memfd handed to the store beside the pool, not in a file: it then lives
exactly as long as the pool it describes (systemd drops both together), costs no disk I/O, and nothing
stale is left on disk for a later start to pair with another pool. The codec (encode, decode, check) is
pure functions over bytes.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from hicached.common.keys import stored_namespace, valid_key, valid_namespace, valid_stored_namespace
from hicached.daemon.l2.index import QUARANTINED, READY, Entry
from hicached.daemon.l2.pool import DEFAULT_ARENA
from hicached.daemon.l2.slabs import ALIGN, slot_size

if TYPE_CHECKING:
    from hicached.daemon.l2.pool import Pool
    from hicached.daemon.sched.tiers import Tiers

log = logging.getLogger("hicached.keep")

POOL_FDNAME = "hicached-l2"
INDEX_FDNAME = "hicached-l2-index"
# The slot headers a crash rebuilds L2 from (hicached.daemon.persist.headers): stored beside the pool while
# the daemon runs.
META_FDNAME = "hicached-l2-meta"
FDNAMES = (POOL_FDNAME, INDEX_FDNAME, META_FDNAME)


def tenant_fdname(name: str, tenant: str) -> str:
    """The fd store name of a tenant's pool, of its index snapshot or of its slot headers (with [tenants],
    each tenant's pool is kept on its own: POOL_FDNAME.TENANT beside INDEX_FDNAME.TENANT and
    META_FDNAME.TENANT)."""
    return f"{name}.{tenant}"


def arena_fdname(name: str, arena: str, narenas: int) -> str:
    """The fd store name of an arena's pool, index snapshot or slot headers (`name`: POOL_FDNAME, ...) in a
    pool of `narenas`: NAME.ARENA (tenant_fdname), but NAME for the default tenant's arena alone (a pool
    without [tenants]): what a release before tenants stored, and reads."""
    return name if narenas == 1 and arena == DEFAULT_ARENA else tenant_fdname(name, arena)


def is_kept_fdname(name: str) -> bool:
    """Whether an fd store name is one of L2's (an arena's): never a socket to listen on."""
    return name in FDNAMES or any(name.startswith(n + ".") for n in FDNAMES)


FORMAT = 1
MAGIC = b"HICL2IDX"
_HEADER = struct.Struct("<8sIQQ")  # magic, format, body length, xxh3-64 of the body
# A snapshot is ~100 bytes a page: this bounds what a start reads from an fd someone else may have stored.
MAX_SNAPSHOT_BYTES = 1 << 31
# Pages verified per job on the verifying thread (bytes): small enough that a stop asked for meanwhile
# is heard soon, large enough that the hops to the thread cost nothing beside the hashing (~10 GB/s).
VERIFY_SLICE_BYTES = 256 << 20
# A connection's slots the previous daemon had handed out but not filled (reserved, being written) are
# quarantined this long after the connection closed, as tiers.CLOSED_SLOT_QUARANTINE_S does: an engine
# copy started before it saw the close may still land in them. Same value; kept here so that the restore
# does not import the scheduler.
HELD_QUARANTINE_S = 5.0
_HELD_NS = "\0held"  # never a valid namespace: no engine can name these placeholders

_IN_L3, _OWED, _PINNED, _HOT = 1, 2, 4, 8


class SnapshotError(ValueError):
    """The snapshot cannot be used; the message says why, for the one log line."""


@dataclass(frozen=True)
class KeptPage:
    ns: str
    key: str
    offset: int
    size: int  # page bytes
    checksum: int  # xxh3-64 of the payload
    in_l3: bool
    owed: bool  # acknowledged and owed to L3, not in it yet
    pinned: bool
    hot: bool = False  # used again since it entered L2 (pool.eviction = "slru": protected)


@dataclass(frozen=True)
class Snapshot:
    capacity: int  # bytes the slabs cover (the allocator's capacity)
    pool_bytes: int  # the memfd's size (pool.capacity)
    slab_bytes: int
    slabs: list[int]  # per slab: the slot size of the class it was given to, 0 for a free slab
    pages: list[KeptPage]  # ready pages, per class least recently used first
    held: list[int] = field(default_factory=list)  # offsets handed out but not filled at shutdown
    inode: int = 0  # of the pool memfd
    l3: str | None = None  # the L3 store in_l3 refers to (repr of its location), None if none attached
    written: float = 0.0  # CLOCK_MONOTONIC when taken (system-wide: comparable across processes)
    # The clear epoch of each namespace as the daemon knew it (hicached.daemon.sched.epochs): the next one
    # compares it with the shared L3's, so kept pages of a namespace cleared meanwhile are forgotten, and
    # those of one cleared before are not. A namespace not here (a crash): its pages are of unknown age.
    epochs: dict[str, str] = field(default_factory=dict)


# The codec: pure functions over bytes.


def encode(snap: Snapshot) -> bytes:
    names: dict[str, int] = {}
    rows = []
    for p in snap.pages:
        i = names.setdefault(p.ns, len(names))
        flags = (_IN_L3 if p.in_l3 else 0) | (_OWED if p.owed else 0) | (_PINNED if p.pinned else 0)
        flags |= _HOT if p.hot else 0
        rows.append((i, p.key, p.offset, p.size, p.checksum, flags))
    body = msgpack.packb(
        {
            "capacity": snap.capacity,
            "pool_bytes": snap.pool_bytes,
            "slab_bytes": snap.slab_bytes,
            "slabs": snap.slabs,
            "held": snap.held,
            "inode": snap.inode,
            "l3": snap.l3,
            "written": snap.written,
            "epochs": dict(snap.epochs),
            "namespaces": list(names),
            "pages": rows,
        },
        use_bin_type=True,
    )
    return _HEADER.pack(MAGIC, FORMAT, len(body), xxhash.xxh3_64_intdigest(body)) + body


def decode(data: bytes | memoryview) -> Snapshot:
    """The snapshot in `data`, checked whole: header, checksum, types, and a geometry where every page
    has a slot of its own in a slab of its size class. SnapshotError saying what is wrong otherwise."""
    if len(data) < _HEADER.size:
        raise SnapshotError(f"the snapshot is {len(data)} bytes, shorter than its header")
    magic, fmt, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("the snapshot does not start with hicached's magic bytes")
    if fmt != FORMAT:
        raise SnapshotError(f"the snapshot is of format {fmt}; this daemon reads format {FORMAT}")
    body = memoryview(data)[_HEADER.size :]
    if len(body) != length:
        raise SnapshotError(f"the snapshot's body is {len(body)} bytes, its header says {length}")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise SnapshotError("the snapshot's checksum does not match its bytes (damaged)")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:
        raise SnapshotError(f"the snapshot does not parse: {e}") from None
    try:
        return _check(d)
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SnapshotError(f"the snapshot is malformed: {type(e).__name__}: {e}") from None


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 64) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise SnapshotError(f"the snapshot's {what} is {v!r}")
    return v


def _check(d: Any) -> Snapshot:
    if not isinstance(d, dict):
        raise SnapshotError("the snapshot is not a map")
    slab_bytes = _int(d["slab_bytes"], "slab size", ALIGN)
    capacity = _int(d["capacity"], "capacity", slab_bytes)
    pool_bytes = _int(d["pool_bytes"], "pool size", capacity)
    if slab_bytes % ALIGN or capacity % slab_bytes:
        raise SnapshotError("the snapshot's slabs do not tile its capacity")
    slabs = d["slabs"]
    if not isinstance(slabs, list) or len(slabs) != capacity // slab_bytes:
        raise SnapshotError("the snapshot's slab table does not match its capacity")
    for s in slabs:
        if _int(s, "slot size", 0, slab_bytes + 1) % ALIGN:
            raise SnapshotError(f"the snapshot's slot size {s} is not a multiple of {ALIGN}")
    names = d["namespaces"]
    if not isinstance(names, list) or not all(valid_namespace(n) for n in names):
        raise SnapshotError("the snapshot names a namespace that is not valid")

    def slot_of(offset: Any, what: str) -> int:
        offset = _int(offset, what, 0, capacity)
        slot = slabs[offset // slab_bytes]
        if not slot or (offset % slab_bytes) % slot or (offset % slab_bytes) // slot >= slab_bytes // slot:
            raise SnapshotError(f"the snapshot's {what} {offset} is not a slot of its slab")
        return slot

    pages: list[KeptPage] = []
    taken: set[int] = set()
    seen: set[tuple[str, str]] = set()
    ns_bytes: dict[str, int] = {}
    for row in d["pages"]:
        i, key, offset, size, checksum, flags = row
        ns = names[_int(i, "namespace index", 0, len(names))]
        if not valid_key(key):
            raise SnapshotError(f"the snapshot holds a key that is not valid: {key!r}")
        size = _int(size, "page size", 1)
        if slot_of(offset, "page offset") != slot_size(size):
            raise SnapshotError(f"the snapshot puts a page of {size} bytes in a slot of another size class")
        if ns_bytes.setdefault(ns, size) != size:
            raise SnapshotError(f"the snapshot holds pages of two sizes in namespace {ns}")
        if offset in taken or (ns, key) in seen:
            raise SnapshotError(f"the snapshot holds slot {offset} or key {ns}/{key} twice")
        taken.add(offset)
        seen.add((ns, key))
        flags = _int(flags, "page flags", 0, 16)
        pages.append(
            KeptPage(
                ns, key, offset, size, _int(checksum, "checksum"), *(bool(flags & f) for f in (1, 2, 4, 8))
            )
        )
    held = d["held"]
    for offset in held:
        slot_of(offset, "held offset")
        if offset in taken:
            raise SnapshotError(f"the snapshot holds slot {offset} twice")
        taken.add(offset)
    l3 = d["l3"]
    if l3 is not None and not isinstance(l3, str):
        raise SnapshotError("the snapshot's L3 location is not a string")
    written = d["written"]
    if not isinstance(written, float):
        raise SnapshotError("the snapshot's time is not a number")
    epochs = d.get("epochs", {})  # absent from snapshots of daemons before clear epochs
    if not isinstance(epochs, dict) or not all(
        valid_namespace(ns) and isinstance(e, str) and valid_stored_namespace(stored_namespace(ns, e))
        for ns, e in epochs.items()
    ):
        raise SnapshotError("the snapshot's clear epochs are malformed")
    return Snapshot(
        capacity, pool_bytes, slab_bytes, slabs, pages, held, _int(d["inode"], "inode"), l3, written, epochs
    )


def check(snap: Snapshot, pool_bytes: int, slab_bytes: int, inode: int) -> None:
    """SnapshotError unless `snap` describes a pool of this configuration, and this very memfd."""
    if snap.pool_bytes != pool_bytes:
        raise SnapshotError(f"pool.capacity was {snap.pool_bytes} bytes and is now {pool_bytes}")
    if snap.slab_bytes != slab_bytes:
        raise SnapshotError(f"pool.slab_size was {snap.slab_bytes} bytes and is now {slab_bytes}")
    if snap.inode != inode:
        raise SnapshotError("the snapshot describes another memfd than the kept pool")


# Taking a snapshot of a running daemon's L2 (at shutdown, once nothing changes it any more).


def take(tiers: Tiers, pool: Pool, l3: str | None, arena: int = 0) -> Snapshot:
    """Every ready page of L2, with the allocator's slabs and the slots handed out but not filled: of one
    arena of the pool (a tenant's, with [tenants]), with offsets within that arena's memfd."""
    index = tiers.index
    alloc = index.allocs[arena]
    base = alloc.base
    lru = [e for lst in index.lru_lists() for e in lst]  # each class's in eviction order
    # Pages outside the LRU (pinned, owed to L3) first: they were in use more recently than most.
    listed = {id(e) for e in lru}
    ready = [e for e in index.entries.values() if e.state is READY and id(e) not in listed]
    pages = []
    for e in ready + lru:
        if e.state is not READY or e.cls.arena != arena:
            continue
        checksum = e.checksum
        if checksum is None:  # taken as each page entered L2; a page without one is hashed now
            checksum = xxhash.xxh3_64_intdigest(pool.slot(e.offset, e.size))
        owed = tiers.life.owed(e)
        pages.append(KeptPage(e.ns, e.key, e.offset - base, e.size, checksum, e.in_l3, owed, e.pinned, e.hot))
    slabs = [0] * alloc.nslabs
    for cls in alloc.classes.values():
        for slab in cls.slabs:
            slabs[slab] = cls.slot_bytes
    # Slots in use by the allocator's count that no ready page holds: quarantined after a connection
    # closed, or given up mid-write. The next daemon keeps them out of use for the rest of the quarantine.
    kept = {p.offset for p in pages}
    held = []
    for cls in alloc.classes.values():
        free = set(cls.free)
        for slab in cls.slabs:
            held += [o - base for o in alloc.slots_of(slab) if o not in free and o - base not in kept]
    memory = pool.arenas[arena]
    return Snapshot(
        alloc.capacity,
        memory.size,
        alloc.slab_bytes,
        slabs,
        pages,
        held,
        os.fstat(memory.fd).st_ino,
        l3,
        time.clock_gettime(time.CLOCK_MONOTONIC),
        {ns: e for ns in {p.ns for p in pages} if (e := tiers.epochs.known(ns)) is not None},
    )


def to_memfd(data: bytes) -> int:
    """A sealed memfd holding `data` (nobody can change it while systemd keeps it)."""
    fd = os.memfd_create(INDEX_FDNAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, max_bytes: int = MAX_SNAPSHOT_BYTES) -> bytes:
    """The bytes of a stored snapshot fd (from its start, whatever its offset)."""
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise SnapshotError(f"the snapshot is {size} bytes, more than {max_bytes}")
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, size - len(out), len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


# Restoring.


def verify(view: memoryview, pages: list[KeptPage], base: int = 0) -> list[bool]:
    """Whether each page's payload in the pool (its arena from `base`) still hashes to its checksum. Runs
    on a thread."""
    h = xxhash.xxh3_64_intdigest
    return [h(view[base + p.offset : base + p.offset + p.size]) == p.checksum for p in pages]


@dataclass
class Restored:
    pages: int = 0  # served again
    dropped: int = 0  # did not verify
    owed: int = 0  # not in L3 yet: queued for backup once a backend is attached
    seconds: float = 0.0
    l3: str | None = None
    entries: list[Entry] = field(default_factory=list)


async def restore(
    tiers: Tiers, pool: Pool, snap: Snapshot, slice_bytes: int = VERIFY_SLICE_BYTES, arena: int = 0
) -> Restored:
    """Fills a fresh Tiers (nothing in its index yet, or in that arena, no backend attached yet) from `snap`
    over the kept pool (`arena`: the arena of the pool it describes, a tenant's). Every page's payload is
    verified first, on a thread, in slices (the loop stays free for signals); the index is filled once all
    are, before the daemon listens: a page is never served unverified, and nothing sees the allocator half
    rebuilt. A page that does not verify is dropped, counted (keep.dropped) and its slot freed."""
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    base = pool.arenas[arena].base
    ok: list[bool] = []
    batch: list[KeptPage] = []
    nbytes = 0
    for p in snap.pages:
        batch.append(p)
        nbytes += p.size
        if nbytes >= slice_bytes:
            ok += await loop.run_in_executor(None, verify, pool.view, batch, base)
            batch, nbytes = [], 0
    if batch:
        ok += await loop.run_in_executor(None, verify, pool.view, batch, base)
    out = fill(tiers, snap, ok, arena)
    out.seconds = time.perf_counter() - start
    return out


def fill(tiers: Tiers, snap: Snapshot, ok: list[bool], arena: int = 0) -> Restored:
    """The allocator's slabs and the index's entries as `snap` had them, for the pages whose `ok` is
    true; the slots held at shutdown stay out of use for the rest of their quarantine. `arena`: the arena
    of the pool the snapshot describes (its offsets are within it). A page of a namespace that another
    tenant holds now (the tenants' namespaces changed over the restart) is not served: dropped."""
    index = tiers.index
    alloc = index.allocs[arena]
    base = alloc.base
    now = time.clock_gettime(time.CLOCK_MONOTONIC)
    quarantine = HELD_QUARANTINE_S - (now - snap.written)
    held = [o + base for o in snap.held] if quarantine > 0 else []
    moved = {p.ns for p in snap.pages if tiers.arena_of(p.ns) != arena}
    ok = [good and p.ns not in moved for p, good in zip(snap.pages, ok, strict=True)]
    used = {p.offset + base for p, good in zip(snap.pages, ok, strict=True) if good}
    used.update(held)
    alloc.restore(snap.slabs, used)
    if moved:
        log.warning(
            "kept pages of %d namespaces (%s) are not served again: they belong to another tenant now",
            len(moved),
            ", ".join(sorted(moved)[:5]),
        )
    out = Restored(l3=snap.l3)
    for p, good in zip(snap.pages, ok, strict=True):
        if not good:
            out.dropped += 1
            continue
        if tiers.namespaces.setdefault(p.ns, p.size) != p.size:
            raise RuntimeError(f"namespace {p.ns} already holds pages of another size")
        entry = index.entry_at(p.ns, p.key, p.size, index.size_class(p.size, arena), p.offset + base, READY)
        # Owed to L3 while no backend is attached yet (the restore runs before the attach), as a page stored
        # then would be: the attach queues them (Tiers._attached); should they leave L2 first, they count
        # as lost. Hot as it was: filed in the list it left (slru's protected one), in the order it left it.
        out.owed += tiers.life.restored(entry, p.checksum, p.in_l3, p.owed, p.hot)
        if p.pinned:
            tiers.pin_entry(entry)
        index.update(entry)
        out.entries.append(entry)
    out.pages = len(out.entries)
    tiers.epochs.restored({e.ns for e in out.entries}, snap.epochs)
    if held:
        _hold(tiers, snap, held, quarantine, arena)
    tiers.counters["keep.pages"] += out.pages
    tiers.counters["keep.dropped"] += out.dropped
    return out


def _hold(tiers: Tiers, snap: Snapshot, held: list[int], seconds: float, arena: int = 0) -> None:
    """Placeholders in the held slots (pool offsets, in `arena`): leased (never evicted), listed by offset
    (so no slab holding one is moved to another class), under a namespace no engine can name; freed when
    the quarantine ends."""
    index = tiers.index
    slab_bytes = snap.slab_bytes
    base = index.allocs[arena].base
    entries = []
    for offset in held:
        slot = snap.slabs[(offset - base) // slab_bytes]
        cls = index.size_class(slot, arena)
        entry = index.entry_at(_HELD_NS, str(offset), slot, cls, offset, QUARANTINED)
        index.lease(entry)
        entries.append(entry)

    def release() -> None:
        for entry in entries:
            index.remove(entry)

    asyncio.get_running_loop().call_later(seconds, release)


def after_attach(tiers: Tiers, restored: Restored) -> None:
    """Once a backend is attached: pages the snapshot found in another store than this one are not taken
    for pages in L3 (as after a swap to another store)."""
    conn = tiers.connector
    if conn is None or repr(conn.location()) == restored.l3:
        return
    n = 0
    for entry in restored.entries:
        if entry.in_l3 and tiers.index.live(entry):
            tiers.life.not_in(entry)
            n += 1
    if n:
        log.info(
            "%d kept pages were in another L3 store (%s) than %s: not taken as in L3",
            n,
            restored.l3,
            conn.name,
        )
