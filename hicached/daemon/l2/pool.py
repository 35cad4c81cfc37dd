"""The L2 pool's memory: sealed memfds, mapped shared, prefaulted, handed to engines by fd.

One memfd holds the whole pool where there is one tenant. With tenants (hicached.daemon.server.tenants),
each tenant's share is an arena: a memfd of its own, so that an engine is handed, and can map, only its
tenant's pages. The daemon maps the arenas back to back in one reserved range of address space, so that the
rest of it (index, copier, backup, prefetch) sees one pool of contiguous offsets; an engine's offsets are
those within its arena (Pool.arena(...).base off)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import sys
from dataclasses import dataclass

from hicached.common.memfd import MADV_HUGEPAGE, MADV_POPULATE_WRITE, MEMFD, SEALS, inspect_fd, map_memfd
from hicached.config.units import format_size

log = logging.getLogger("hicached.pool")

_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux >= 5.1; Python names it from 3.9


def available_memory(
    meminfo: str = "/proc/meminfo",
    cgroup_root: str = "/sys/fs/cgroup",
    self_cgroup: str = "/proc/self/cgroup",
) -> tuple[int, str] | None:
    """Bytes this process may still allocate, and where that bound comes from: the node's MemAvailable,
    or less where a cgroup (v2) above this process has a memory.max (a systemd MemoryMax=, a container's
    limit) with less left under it. None where neither can be read."""
    best: tuple[int, str] | None = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(self_cgroup) as f:
            path = next((ln.strip()[3:] for ln in f if ln.startswith("0::")), None)
    except OSError:
        path = None
    while path is not None:
        d = os.path.join(cgroup_root, path.strip("/"))
        try:
            with open(os.path.join(d, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(d, "memory.current")) as f:
                    left = max(0, int(limit) - int(f.read().strip()))
                if best is None or left < best[0]:
                    best = (left, f"memory.max of cgroup {path or '/'}")
        except (OSError, ValueError):
            pass
        if path in ("", "/"):
            break
        path = os.path.dirname(path.rstrip("/"))
    return best


def check_kept_fd(fd: int, size: int) -> None:
    """A kept pool must be a memfd of exactly `size` bytes, sealed as Pool seals its own (no shrink, no
    grow, no more seals) and still writable; ValueError saying what it is otherwise."""
    mem = inspect_fd(fd)
    if mem.kind != MEMFD:
        raise ValueError(f"the kept pool is a {mem.kind}, not a memfd")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ValueError(
            f"the kept pool's memfd lacks the seals the pool needs (has {seals:#x}, needs {SEALS:#x})"
        )
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise ValueError("the kept pool's memfd is sealed against writes")
    if mem.size != size:
        raise ValueError(
            f"the kept pool holds {format_size(mem.size)} but pool.capacity is {format_size(size)}"
        )
    if os.fstat(fd).st_nlink:
        raise ValueError("the kept pool is a file with a name, not an anonymous memfd")


def check_capacity(size: int, prefault: bool, available: tuple[int, str] | None) -> str | None:
    """Refuses (ValueError) a pool that cannot fit in the memory left, when it is prefaulted: the kernel
    would pick a process to kill to make room, likely an engine. A warning to log otherwise, or None."""
    if available is None:
        return None
    left, where = available
    if size > left:
        what = f"pool.capacity is {format_size(size)} but only {format_size(left)} can be allocated ({where})"
        if prefault:
            raise ValueError(f"{what}: lower pool.capacity, or free memory")
        return f"{what}; with pool.prefault off the pool is allocated as it fills, and may run out"
    if size > 0.9 * left:
        return (
            f"pool.capacity ({format_size(size)}) takes more than 90% of the memory left "
            f"({format_size(left)}, {where}): engines may be short of host memory"
        )
    return None


DEFAULT_ARENA = "default"  # hicached.config.tenants.DEFAULT: the tenant of engines that match no other


def arena_sizes(tenants: dict[str, int], capacity: int, slab_bytes: int) -> list[tuple[str, int]] | None:
    """The pool's arenas for tenants of these capacities (name -> bytes): the default tenant's share first
    (what the tenants leave of `capacity`, if it holds a slab), then each tenant's, each cut down to whole
    slabs (a slab never straddles two arenas). None without tenants: one memfd holds the pool."""
    if not tenants:
        return None
    out = []
    rest = capacity - sum(tenants.values())
    if rest >= slab_bytes:
        out.append((DEFAULT_ARENA, rest // slab_bytes * slab_bytes))
    for name, size in tenants.items():
        if size < slab_bytes:
            raise ValueError(f"tenant {name!r} has {size} bytes of L2, less than one slab ({slab_bytes})")
        out.append((name, size // slab_bytes * slab_bytes))
    return out


@dataclass(frozen=True)
class Arena:
    """One tenant's share of the pool: `size` bytes from pool offset `base`, in a memfd of its own."""

    index: int
    name: str
    base: int
    size: int
    fd: int


def _new_memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Pool:
    """`size` bytes of shared memory. The fds are sealed so no holder can shrink them (which would make the
    daemon's next access SIGBUS); engines map their arena's fd and read and write pages in place.

    With `fd`, the pool is that memfd (a previous daemon's pool, kept by systemd's file-descriptor store
    over a restart: see hicached.daemon.persist.keep), checked by check_kept_fd first; the Pool owns it then.
    With `arenas` ((name, bytes) pairs, more than one), the pool is one memfd an arena, mapped back to back
    (their sizes multiples of the page size); `size` is then their sum. `kept`: arena name -> a previous
    daemon's memfd of that arena (checked by check_kept_fd first), owned by the Pool from here on."""

    def __init__(
        self,
        size: int,
        prefault: bool = True,
        name: str = "hicached-l2",
        fd: int | None = None,
        arenas: list[tuple[str, int]] | None = None,
        kept: dict[str, int] | None = None,
    ) -> None:
        if arenas is not None and len(arenas) > 1:
            if fd is not None:
                raise ValueError("a pool of several arenas cannot be a kept memfd")
            self._init_arenas(arenas, prefault, name, dict(kept or {}))
            return
        if kept and arenas:
            fd = kept.pop(arenas[0][0], fd)
        if arenas:
            size = arenas[0][1]  # one tenant holds the whole pool: its one memfd
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.size = size
        self.kept = fd is not None
        if fd is None:
            fd = _new_memfd(name, size)
        self.fd = fd
        try:
            self.mm: mmap.mmap | ctypes.Array[ctypes.c_ubyte]
            self.mm = map_memfd(self.fd, size, prefault, "the L2 pool")
        except BaseException:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_DONTDUMP"):
            self.mm.madvise(mmap.MADV_DONTDUMP)  # a core dump of a daemon should not carry the whole cache
        self.view = memoryview(self.mm)
        arena_name = arenas[0][0] if arenas else DEFAULT_ARENA
        self.arenas = [Arena(0, arena_name, 0, size, fd)]
        self._addr = 0  # set for a pool of arenas: the start of the range they are mapped in

    def _init_arenas(
        self, arenas: list[tuple[str, int]], prefault: bool, name: str, kept: dict[str, int]
    ) -> None:
        page = mmap.PAGESIZE
        self.arenas = []
        self._addr = 0
        try:
            if any(n <= 0 or n % page for _, n in arenas):
                raise ValueError(f"each arena must be a positive multiple of {page} bytes")
            if len({a for a, _ in arenas}) != len(arenas) or set(kept) - {a for a, _ in arenas}:
                raise ValueError("arena names must differ, and each kept memfd be of one of them")
            self.size = sum(n for _, n in arenas)
            self.kept = bool(kept)
            self.fd = -1  # no single memfd: see arenas
            base = 0
            for i, (arena, n) in enumerate(arenas):
                fd = kept.pop(arena, None)
                self.arenas.append(
                    Arena(i, arena, base, n, _new_memfd(f"{name}-{arena}", n) if fd is None else fd)
                )
                base += n
            self._addr = _map_arenas(self.arenas, self.size, prefault)
        except BaseException:
            for fd in [a.fd for a in self.arenas] + list(kept.values()):
                os.close(fd)
            self.arenas = []
            raise
        self.mm = (ctypes.c_ubyte * self.size).from_address(self._addr)
        self.view = memoryview(self.mm).cast("B")
        self.fd = self.arenas[0].fd  # open (for `fd >= 0` checks); a pool of arenas is handed out by arena

    def arena(self, name: str) -> Arena:
        """The arena of that name (KeyError if none)."""
        for a in self.arenas:
            if a.name == name:
                return a
        raise KeyError(name)

    @property
    def inode(self) -> int:
        """The memfd's inode number: what ties an index snapshot to the very memory it describes."""
        return os.fstat(self.fd).st_ino

    def slot(self, offset: int, length: int) -> memoryview:
        return self.view[offset : offset + length]

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        if self._addr:
            # ctypes cannot refuse to unmap memory still viewed (mmap.close can): unmapped only when no
            # view of it is left (every numpy array or memoryview over it holds a reference to self.mm).
            if sys.getrefcount(self.mm) <= 2:
                self.mm = None  # type: ignore[assignment]
                _munmap(self._addr, self.size)
            else:
                log.warning("pool mapping still exported at close; leaving it mapped")
            self._addr = 0
        else:
            try:
                self.mm.close()  # type: ignore[union-attr]
            except BufferError:
                # A connector thread still holds a view; the mapping goes when the process exits.
                log.warning("pool mapping still exported at close; leaving it mapped")
        for a in self.arenas:
            os.close(a.fd)
        self.fd = -1


# The arenas' mapping: Python's mmap cannot place a mapping, so libc's mmap does (MAP_FIXED over a range
# reserved first, so that nothing else can land between the arenas).
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_MADV_DONTDUMP = 16
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_C_INT = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _C_INT, _C_INT, _C_INT, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _munmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        log.warning("munmap of the pool failed: %s", os.strerror(ctypes.get_errno()))


def _map_arenas(arenas: list[Arena], size: int, prefault: bool) -> int:
    """Maps each arena's memfd at its base within one reserved range; returns the range's address."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    addr = _libc.mmap(None, size, _PROT_NONE, flags, -1, 0)
    if addr in (None, _MAP_FAILED):
        raise MemoryError(f"could not reserve {size} bytes of address space for the L2 pool")
    try:
        for a in arenas:
            got = _libc.mmap(addr + a.base, a.size, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, a.fd, 0)
            if got != addr + a.base:
                raise OSError(ctypes.get_errno(), f"could not map arena {a.name!r} of the L2 pool")
            _libc.madvise(addr + a.base, a.size, MADV_HUGEPAGE)  # as map_memfd: ignored where not allowed
            _libc.madvise(addr + a.base, a.size, _MADV_DONTDUMP)
            if prefault:
                _populate(addr + a.base, a.size, a.name)
    except BaseException:
        _munmap(addr, size)
        raise
    return addr


def _populate(addr: int, size: int, arena: str) -> None:
    """Every page of the arena allocated now (as hicached.common.memfd.map_memfd does for a whole pool)."""
    if _libc.madvise(addr, size, MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:
        why = os.strerror(err)
        raise MemoryError(f"could not allocate arena {arena!r} of the L2 pool ({size} bytes): {why}")
    view = memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")  # Linux < 5.14: a byte a page
    try:
        step = mmap.PAGESIZE
        for off in range(0, size, 1 << 30):
            n = min(1 << 30, size - off)
            view[off : off + n : step] = bytes(len(range(0, n, step)))
    finally:
        view.release()
