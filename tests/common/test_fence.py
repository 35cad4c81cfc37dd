"""The fence words (hicached.common.fence, in hicached.common._pageio): copy jobs count themselves in and out
atomically, a cancel answers how many are inside and lets no new one in, and a copy_ranges with a fence
copies nothing once its slot is cancelled, from many threads at once; what an engine may write into its
own board only skips or runs copies; the daemon maps only a sealed memfd of bounded size as a board."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest

from hicached.common import fence
from hicached.common.errors import HicachedError
from hicached.common.geometry import Geometry, Segment, plan
from hicached.common.memfd import SEALS

pytestmark = pytest.mark.skipif(not fence.AVAILABLE, reason="hicached.common._pageio is not built")

if fence.AVAILABLE:
    from hicached.common import _pageio
    from hicached.common.ranges import copy_ranges

COUNT = fence.CANCELLED - 1


def board(slots: int = 8) -> np.ndarray:
    return np.zeros(slots, dtype=np.uint64)


def test_enter_exit_cancel_count():
    b = board()
    assert _pageio.fence_enter(b, 3) and _pageio.fence_enter(b, 3)
    assert fence.count(b, 3) == 2 and int(b[3]) == 2
    assert fence.cancel(b, 3) == 2  # two jobs inside when it was cancelled
    assert int(b[3]) == fence.CANCELLED | 2
    assert not _pageio.fence_enter(b, 3)  # none enters after
    _pageio.fence_exit(b, 3)
    _pageio.fence_exit(b, 3)
    assert fence.count(b, 3) == 0 and int(b[3]) == fence.CANCELLED
    assert fence.cancel(b, 3) == 0
    assert not b[[0, 1, 2, 4, 5, 6, 7]].any()  # other slots untouched


def test_hostile_words_only_skip_or_run_copies():
    b = board(2)
    b[0] = COUNT  # a count at its bound: refused as cancelled, nothing wraps into CANCELLED
    assert not _pageio.fence_enter(b, 0)
    assert int(b[0]) == COUNT
    _pageio.fence_exit(b, 1)  # leaving a slot at 0 (an engine zeroed it meanwhile): stays 0
    assert int(b[1]) == 0
    b[1] = 5  # garbage count: a job enters and leaves, the garbage stays
    assert _pageio.fence_enter(b, 1)
    _pageio.fence_exit(b, 1)
    assert int(b[1]) == 5


def test_slot_bounds_and_writability():
    b = board(4)
    for slot in (-1, 4, 1 << 40):
        with pytest.raises(IndexError):
            fence.count(b, slot)
    with pytest.raises((TypeError, BufferError, ValueError)):
        _pageio.fence_enter(bytes(32), 0)
    with pytest.raises(ValueError, match="aligned"):
        _pageio.fence_enter(memoryview(bytearray(40))[1:33], 0)


def _plan(nbytes: int, page: int):
    pages = nbytes // page
    geom = Geometry(page, pages, (Segment(0, page, page),))
    return plan(geom, list(range(pages)), [i * page for i in range(pages)])


def test_copy_ranges_with_a_fence_copies_until_cancelled():
    page = 4096
    pool = np.full(16 * page, 7, dtype=np.uint8)
    region = np.zeros(16 * page, dtype=np.uint8)
    b = board()
    p = _plan(16 * page, page)
    assert copy_ranges(pool, region, p, False, fence=(b, 2)) is True
    assert (region == 7).all() and int(b[2]) == 0  # in and out again
    region[:] = 0
    assert fence.cancel(b, 2) == 0
    assert copy_ranges(pool, region, p, False, fence=(b, 2)) is False
    assert copy_ranges(region, pool, p, True, sums=(page, np.zeros(16, np.uint64)), fence=(b, 2)) is False
    assert not region.any() and (pool == 7).all()  # neither way
    with pytest.raises(IndexError):
        copy_ranges(pool, region, p, False, fence=(b, 8))


def test_cancel_from_another_thread_stops_every_later_copy():
    """Threads copy a marker into a region in a loop, each through the same fence slot, while the main
    thread cancels it: once the count it waits for is 0, no byte of the region changes again, and every
    later copy answers that it copied nothing."""
    page = 64 << 10
    n = 64
    pool = np.full(n * page, 0x5A, dtype=np.uint8)
    regions = [np.zeros(n * page, dtype=np.uint8) for _ in range(4)]
    p = _plan(n * page, page)
    b = board()
    stop = threading.Event()
    copied = [0] * len(regions)
    late = [0] * len(regions)
    settled = threading.Event()

    def job(i: int) -> None:
        while not stop.is_set():
            was_settled = settled.is_set()
            if copy_ranges(pool, regions[i], p, False, fence=(b, 5)):
                copied[i] += 1
                if was_settled:
                    late[i] += 1

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(regions))]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while sum(copied) < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        inside = fence.cancel(b, 5)
        assert 0 <= inside <= len(regions)
        while fence.count(b, 5):
            time.sleep(0.0001)
        settled.set()
        for r in regions:
            r[:] = 0
        time.sleep(0.3)  # the threads keep trying
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert sum(copied) >= 8
    assert late == [0] * len(regions)
    assert all(not r.any() for r in regions)
    assert int(b[5]) == fence.CANCELLED


def _memfd(size: int, seals: int = SEALS) -> int:
    fd = os.memfd_create("test-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(
    ("size", "seals", "slots", "match"),
    [
        (64, 0, 8, "may shrink"),  # unsealed: it could shrink under the daemon's atomics (SIGBUS)
        (32, SEALS, 8, "fewer than 8 slots"),
        (64, SEALS, 0, "1 to"),
        (64, SEALS, fence.MAX_SLOTS + 1, "1 to"),
    ],
)
def test_daemon_maps_only_sealed_memfds_of_bounded_size(size, seals, slots, match):
    from hicached.daemon.regions.service import map_board

    fd = _memfd(size, seals)
    try:
        with pytest.raises(HicachedError, match=match) as e:
            map_board(fd, slots)
        assert e.value.code == "bad_request"
    finally:
        os.close(fd)


def test_daemon_refuses_a_tmpfs_file_as_board(tmp_path):
    from hicached.daemon.regions.service import map_board

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/hicached-test-board-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 64)
        with pytest.raises(HicachedError, match="memfd"):
            map_board(fd, 8)
    finally:
        os.close(fd)
        os.unlink(path)


def test_daemon_maps_a_sealed_board():
    from hicached.daemon.regions.service import map_board

    fd = _memfd(64)
    try:
        mm = map_board(fd, 8)
        assert len(mm) == 64
        assert _pageio.fence_enter(mm, 7)
        mm.close()
    finally:
        os.close(fd)
