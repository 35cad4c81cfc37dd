"""The L2 pool's memory: one sealed memfd, mapped shared, prefaulted, handed to engines by fd."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os

log = logging.getLogger("hicached.pool")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            self.mm = mmap.mmap(self.fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
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
