"""The L2 pool's memory: one sealed memfd, mapped shared, prefaulted, handed to engines by fd."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os

from config.units import format_size

log = logging.getLogger("hicached.pool")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Linux values; Python's mmap module names them only where its build headers had them.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


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


class Pool:
    """`size` bytes of shared memory. The fd is sealed so no holder can shrink it (which would make the
    daemon's next access SIGBUS); engines map the same fd and read and write pages in place."""

    def __init__(self, size: int, prefault: bool = True, name: str = "hicached-l2") -> None:
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.mm = map_memfd(self.fd, size, prefault, "the L2 pool")
        except BaseException:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_DONTDUMP"):
            self.mm.madvise(mmap.MADV_DONTDUMP)  # a core dump of a daemon should not carry the whole cache
        self.view = memoryview(self.mm)

    def slot(self, offset: int, length: int) -> memoryview:
        return self.view[offset : offset + length]

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            # A connector thread still holds a view; the mapping goes when the process exits.
            log.warning("pool mapping still exported at close; leaving it mapped")
        os.close(self.fd)
        self.fd = -1


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
