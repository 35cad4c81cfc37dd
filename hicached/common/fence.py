"""Fence boards: a small memfd of 8-byte words that an engine hands the daemon once a connection, one word a
store_pages / load_pages request in flight, so that the engine can tell when no copy of a request it gave up
on touches its memory any more.

A word: bit 63 CANCELLED (set by the engine), the bits below the number of the daemon's copy jobs inside the
engine's memory for the request. A copy job enters (count + 1) unless CANCELLED is set, copies, and leaves
(count - 1), all in C with the GIL released (hicached.common._pageio.copy_ranges); the engine sets CANCELLED
and waits for a count of 0. Atomic only where the C module is built (`AVAILABLE`): without it, neither side
uses fences."""

from __future__ import annotations

from typing import Any

try:  # the compiled part (setup.py)
    from hicached.common import _pageio

    AVAILABLE = getattr(_pageio, "FENCES", 0) >= 1
except ImportError:
    _pageio = None
    AVAILABLE = False

WORD_BYTES = 8
CANCELLED = 1 << 63
DEFAULT_SLOTS = 4096  # region requests one connection may have in flight at once (32 KiB)
MAX_SLOTS = 1 << 16  # what a daemon maps for one connection at most (512 KiB)
# The region_attach kind that registers a board (on a side connection, with the memfd, as a host region).
KIND = "fence"


def cancel(board: Any, slot: int) -> int:
    """Sets the slot's CANCELLED bit; the count of copy jobs inside the memory then (0: none, and none will
    enter)."""
    return _pageio.fence_cancel(board, slot)


def count(board: Any, slot: int) -> int:
    """The count of copy jobs inside the memory for the slot."""
    return _pageio.fence_count(board, slot)


def enter(board: Any, slot: int) -> bool:
    """A copy job that is not one C call (a CUDA job: its copies run on a stream) counts itself in: True
    when it may copy, False when the request is cancelled (it must copy nothing)."""
    return bool(_pageio.fence_enter(board, slot))


def leave(board: Any, slot: int) -> None:
    """That job counts itself out, once none of its copies can touch the engine's memory any more."""
    _pageio.fence_exit(board, slot)
