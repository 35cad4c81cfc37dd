"""Shared memory both sides map: memfds sealed against shrinking, mapped shared and prefaulted. The daemon's
L2 pool and an engine's shared buffers are both made of these."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os

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


def check_sealed_fd(fd: int, min_size: int) -> int:
    """Size of a memfd an engine handed in, after checking it cannot shrink under us."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("memory must be a memfd (this fd cannot carry seals)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("memory must be a memfd sealed with F_SEAL_SHRINK")
    size = os.fstat(fd).st_size
    if size < min_size:
        raise ValueError(f"memory of {size} bytes is smaller than the {min_size} bytes asked for")
    return size
