"""The L2 pool's memory: one sealed memfd, mapped shared, prefaulted, handed to engines by fd."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os

from hicached.common.memfd import MEMFD, SEALS, inspect_fd, map_memfd
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


class Pool:
    """`size` bytes of shared memory. The fd is sealed so no holder can shrink it (which would make the
    daemon's next access SIGBUS); engines map the same fd and read and write pages in place.

    With `fd`, the pool is that memfd (a previous daemon's pool, kept by systemd's file-descriptor store
    over a restart: see hicached.daemon.l2.keep), checked by check_kept_fd first; the Pool owns it then."""

    def __init__(
        self, size: int, prefault: bool = True, name: str = "hicached-l2", fd: int | None = None
    ) -> None:
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.size = size
        self.kept = fd is not None
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.fd = fd
        try:
            if not self.kept:
                os.ftruncate(self.fd, size)
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.mm = map_memfd(self.fd, size, prefault, "the L2 pool")
        except BaseException:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_DONTDUMP"):
            self.mm.madvise(mmap.MADV_DONTDUMP)  # a core dump of a daemon should not carry the whole cache
        self.view = memoryview(self.mm)

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
        try:
            self.mm.close()
        except BufferError:
            # A connector thread still holds a view; the mapping goes when the process exits.
            log.warning("pool mapping still exported at close; leaving it mapped")
        os.close(self.fd)
        self.fd = -1
