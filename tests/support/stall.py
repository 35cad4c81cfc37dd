"""Memory that stalls whoever touches it first: a thread (a Python one, or a C thread of the page I/O) that
copies from it or into it waits in the kernel, in the middle of its system call, until `release()`. It
plays a disk or a mount that hangs in the middle of a page, the one thing a page I/O thread cannot be
stopped in. After release the memory reads as zeros.

Built on userfaultfd(2): a fault in a kernel copy (pwritev, preadv) is only caught for root, or where
vm.unprivileged_userfaultfd is 1. `available()` says whether this machine allows it."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import platform
import struct

import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFD_API = 0xAA
_REGISTER_MODE_MISSING = 1


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _iowr(0x3F, 24)  # struct uffdio_api: api, features, ioctls
_UFFDIO_REGISTER = _iowr(0x00, 32)  # struct uffdio_register: range (start, len), mode, ioctls


def available() -> str | None:
    """None where stalled memory can be made here, else why not."""
    if _SYS_USERFAULTFD is None:
        return f"no userfaultfd number known for {platform.machine()}"
    if os.geteuid() != 0:
        try:
            with open("/proc/sys/vm/unprivileged_userfaultfd") as f:
                if f.read().strip() != "1":
                    return "userfaultfd catches faults in kernel copies only for root here"
        except OSError:
            return "userfaultfd is not available"
    try:
        StalledMemory(mmap.PAGESIZE).release()
    except OSError as e:
        return f"userfaultfd is not permitted here: {e}"
    return None


class StalledMemory:
    """`nbytes` of memory (`view`, a writable byte memoryview) whose first touch waits for release()."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        fd = _libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self._fd = fd
        try:
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
            addr = _libc.mmap(
                None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
            )
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            self._addr = addr
            fcntl.ioctl(
                fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", addr, nbytes, _REGISTER_MODE_MISSING, 0))
            )
        except BaseException:
            os.close(fd)
            raise
        self.view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")

    def release(self) -> None:
        """Every thread waiting on the memory goes on (it reads zeros); later touches do not wait."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Releases and unmaps; the caller has let go of every view of it."""
        self.release()
        self.view.release()
        with contextlib.suppress(OSError):
            _libc.munmap(self._addr, self.nbytes)


_WHY = available()
# Marks a test that needs a thread stuck in the middle of a page.
needs_stall = pytest.mark.skipif(_WHY is not None, reason=f"no thread can be stalled mid-page here: {_WHY}")
