"""Shared memory both sides map: memfds, mapped shared and prefaulted (the daemon's L2 pool and an engine's
shared buffers, both sealed against shrinking), and what the daemon makes of an fd an engine hands in (a
memfd, or a file on tmpfs such as vLLM's /dev/shm region)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Linux values; Python's mmap module names them only where its build headers had them.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def map_memfd(fd: int, size: int, populate: bool, what: str) -> mmap.mmap:
    """`size` bytes of a memfd mapped shared, read-write; with `populate`, every page allocated now, so that
    memory short for it fails here with MemoryError (not with a SIGBUS or the OOM killer later: MAP_POPULATE
    would ignore the failure, MADV_POPULATE_WRITE reports it).

    Asks for 2 MiB pages first: where the operator lets shared memory have them
    (/sys/kernel/mm/transparent_hugepage/shmem_enabled set to advise), copies take fewer TLB misses,
    populating is ~6x faster, and every process that maps the memory (the pool: the daemon and each
    engine) keeps far smaller page tables. Elsewhere the advice does nothing."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        with contextlib.suppress(OSError):
            mm.madvise(MADV_HUGEPAGE)
        if populate:
            _populate(mm, size, what)
    except BaseException:
        mm.close()
        raise
    return mm


def _populate(mm: mmap.mmap, size: int, what: str) -> None:
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise MemoryError(f"could not allocate {what} ({size} bytes): {e.strerror}") from None
        # Linux < 5.14: one byte written a page.
        step = mmap.PAGESIZE
        for off in range(0, size, 1 << 30):
            n = min(1 << 30, size - off)
            view = memoryview(mm)[off : off + n]
            try:
                view[::step] = bytes(len(range(0, n, step)))
            finally:
                view.release()


@dataclass(frozen=True)
class EngineMemory:
    """An fd an engine handed in: what it is, its size, and whether it can shrink under a mapping of it."""

    kind: str  # MEMFD, TMPFS_FILE, FILE, or what else it is ("pipe", "socket", ...)
    size: int
    can_shrink: bool


# What an fd can be, as inspect_fd tells them apart. Regular files of shared memory other than memfds
# (tmpfs, /dev/shm: vLLM's CPU offload region) behave as an unsealed memfd does (a shrink makes a mapping's
# next access SIGBUS, which guarded copies survive; they can never be sealed), so both are accepted; a file
# elsewhere can also fault on an I/O error, and is not shared memory.
MEMFD = "memfd"
TMPFS_FILE = "tmpfs file"
FILE = "regular file"
ACCEPTED = frozenset({MEMFD, TMPFS_FILE})  # what an engine may register


def inspect_fd(fd: int) -> EngineMemory:
    """What `fd` is (OSError when it cannot be inspected)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return EngineMemory(_not_a_file(st.st_mode), 0, False)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # only shared memory (shmem, hugetlbfs) has seals
    except OSError:
        return EngineMemory(FILE, st.st_size, True)
    can_shrink = not seals & fcntl.F_SEAL_SHRINK
    # Only a memfd can be sealed (other shared memory is born with F_SEAL_SEAL); an unsealed one is told
    # from a tmpfs file by its name, "/memfd:NAME (deleted)".
    if not can_shrink or _link(fd).startswith("/memfd:"):
        return EngineMemory(MEMFD, st.st_size, can_shrink)
    return EngineMemory(TMPFS_FILE, st.st_size, can_shrink)


def _not_a_file(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "device"


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""  # no /proc: not known to be a memfd


def check_region_fd(fd: int, min_size: int) -> EngineMemory:
    """An fd an engine handed in as a region, after checking that it is memory the daemon accepts and holds
    at least `min_size` bytes (ValueError otherwise). Whether it can shrink is the caller's business: a
    copy of memory that can must be guarded."""
    mem = inspect_fd(fd)
    if mem.kind not in ACCEPTED:
        raise ValueError(f"memory must be a memfd or a file on tmpfs; this fd is a {mem.kind}")
    if mem.size < min_size:
        raise ValueError(f"memory of {mem.size} bytes is smaller than the {min_size} bytes asked for")
    return mem
