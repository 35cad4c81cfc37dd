"""What region registration accepts, and how it maps it: an engine's memfd or tmpfs file checked and mapped
for copies, and its fence board checked and mapped for the daemon's atomic words."""

from __future__ import annotations

import mmap

import numpy as np

from hicached.common import fence as fence_mod
from hicached.common import ranges as ranges_mod
from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.common.memfd import MEMFD, EngineMemory, check_region_fd, inspect_fd


def check_fd(fd: int, min_size: int) -> EngineMemory:
    """bad_request unless `fd` is a memfd or tmpfs file of at least `min_size` bytes that this daemon can copy
    safely: one that may shrink (an unsealed memfd, any tmpfs file) only where copies can be guarded (the C
    module is built)."""
    try:
        mem = check_region_fd(fd, min_size)
    except ValueError as e:
        raise HicachedError(BAD_REQUEST, f"region refused: {e}") from None
    except OSError as e:
        raise HicachedError(BAD_REQUEST, f"region refused: cannot inspect its fd ({e.strerror})") from None
    if mem.can_shrink and not ranges_mod.can_guard():
        what = f"this {mem.kind} may shrink"
        if mem.kind == MEMFD:
            what = "this memfd is not sealed with F_SEAL_SHRINK"
        raise HicachedError(
            BAD_REQUEST,
            f"region refused: {what}, and this daemon cannot copy memory that may shrink under it safely "
            "(hicached.common._pageio is not built); seal it, or reinstall hicached where a C compiler is "
            "at hand",
        )
    return mem


def map_host(fd: int, offset: int, nbytes: int) -> tuple[mmap.mmap, np.ndarray, EngineMemory]:
    """Map an engine's memfd or tmpfs file shared, read-write; also what it is, and whether it may shrink
    under us (its copies must then be guarded: a shrink makes our next access SIGBUS). Blocking: prefaulting
    a big region takes a while."""
    mem = check_fd(fd, offset + nbytes)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(
            fd,
            offset + nbytes - start,
            flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start,
        )
    except OSError as e:
        raise HicachedError(
            BAD_REQUEST, f"region refused: cannot map it read-write ({e.strerror}); pass an fd opened O_RDWR"
        ) from None
    if hasattr(mmap, "MADV_DONTDUMP"):
        mm.madvise(mmap.MADV_DONTDUMP)
    return mm, np.frombuffer(mm, dtype=np.uint8)[offset - start :], mem


def map_board(fd: int, slots: int) -> mmap.mmap:
    """An engine's fence board, mapped shared read-write: bad_request unless `fd` is a memfd sealed against
    shrinking (the daemon's atomic words in it must never fault) of at least `slots` words, `slots` within
    bounds."""
    if not 1 <= slots <= fence_mod.MAX_SLOTS:
        raise HicachedError(BAD_REQUEST, f"a fence board has 1 to {fence_mod.MAX_SLOTS} slots, got {slots}")
    if not ranges_mod.COPY_FENCES:
        raise HicachedError(
            BAD_REQUEST,
            "this daemon cannot fence copies (hicached.common._pageio is not built, or older); send region "
            "requests without fences",
        )
    nbytes = slots * fence_mod.WORD_BYTES
    try:
        mem = inspect_fd(fd)
    except OSError as e:
        raise HicachedError(
            BAD_REQUEST, f"fence board refused: cannot inspect its fd ({e.strerror})"
        ) from None
    if mem.kind != MEMFD or mem.can_shrink:
        raise HicachedError(
            BAD_REQUEST,
            f"fence board refused: it must be a memfd sealed with F_SEAL_SHRINK, not a {mem.kind}"
            + (" that may shrink" if mem.kind == MEMFD else ""),
        )
    if mem.size < nbytes:
        raise HicachedError(
            BAD_REQUEST, f"fence board refused: {mem.size} bytes hold fewer than {slots} slots"
        )
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise HicachedError(
            BAD_REQUEST,
            f"fence board refused: cannot map it read-write ({e.strerror}); pass an fd opened O_RDWR",
        ) from None
