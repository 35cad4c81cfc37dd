"""Memory that shrinks under the daemon: guarded copies (hicached.common._pageio.copy_ranges with `guard`)
over a memfd whose file is truncated raise RegionShrunk instead of dying of SIGBUS, on their own thread
only; a fault outside any guard still kills the process; and the copier turns such a fault into RegionGone
(copy_failed) for its request."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from hicached.common import ranges as ranges_mod
from hicached.common.errors import HicachedError
from hicached.common.geometry import Geometry, Segment
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions.copier import Copier
from hicached.daemon.regions.jobs import RegionGone

pytestmark = pytest.mark.skipif(
    not ranges_mod.can_guard(), reason="hicached.common._pageio is not built (no C compiler): no guards"
)

SIZE = 1 << 20
CHUNK = 64 << 10


def unsealed(size: int = SIZE, name: str = "test-shrinking") -> tuple[int, mmap.mmap, np.ndarray]:
    """A memfd made as SGLang makes its own (no MFD_ALLOW_SEALING), mapped shared and filled."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    return fd, mm, arr


def i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def ranges(n: int = SIZE // CHUNK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    offs = np.arange(0, n * CHUNK, CHUNK, dtype=np.int64)
    return offs, offs, np.full(n, CHUNK, dtype=np.int64)


@pytest.fixture(params=["avx2", "sse2", ""])
def streaming(request):
    """Each streaming store the copy into the pool may use (a fault must end any of them)."""
    from hicached.common import _pageio

    try:
        before = _pageio.stream_impl(request.param)
    except ValueError:
        pytest.skip(f"no {request.param} here")
    yield request.param
    _pageio.stream_impl(before)


@pytest.mark.parametrize("to_pool, sums", [(True, False), (True, True), (False, False)])
def test_a_guarded_copy_of_a_shrunk_memfd_raises_instead_of_sigbus(streaming, to_pool, sums):
    from hicached.common._pageio import RegionShrunk, copy_ranges

    fd, mm, region = unsealed()
    pool = np.zeros(SIZE, dtype=np.uint8)
    try:
        hashes = np.zeros(SIZE // CHUNK, dtype=np.uint64)
        extra = (CHUNK, hashes, True) if sums else (0, None, True)
        copy_ranges(pool, region, *ranges(), True, *extra)  # whole: nothing to catch
        assert np.array_equal(pool, region)
        os.ftruncate(fd, 5 * CHUNK + 100)  # pages past the new end are gone from every mapping
        with pytest.raises(RegionShrunk) as e:
            copy_ranges(pool, region, *ranges(), to_pool, *extra)
        assert isinstance(e.value, OSError) and e.value.errno == errno.EFAULT
        at = re.fullmatch(
            rf"the region's memory is gone from byte (\d+) of its {SIZE}: its file shrank under the mapping "
            r"\(SIGBUS\)",
            e.value.strerror,
        )
        # In the first range the file no longer holds all of (memcpy may take a range's end first), past
        # the page that holds the new end.
        assert at and 5 * CHUNK + 4096 <= int(at[1]) < 6 * CHUNK, e.value.strerror
        # The thread goes on: ranges the file still holds copy, guarded or not, and fault again past it.
        pool[:] = 0
        copy_ranges(pool, region, *ranges(5), True, *((CHUNK, hashes[:5], True) if sums else (0, None, True)))
        copy_ranges(pool, region, i64(5 * CHUNK), i64(5 * CHUNK), i64(100), True)
        assert np.array_equal(pool[: 5 * CHUNK + 100], region[: 5 * CHUNK + 100])
        with pytest.raises(RegionShrunk):
            copy_ranges(pool, region, *ranges(), to_pool, *extra)
    finally:
        del region
        mm.close()
        os.close(fd)


def test_guards_belong_to_their_thread():
    """One thread's region shrinks while another copies a region of its own, guarded too, without a stop:
    only the first sees the fault, and the second's bytes are right every time."""
    from hicached.common._pageio import RegionShrunk, copy_ranges

    bad_fd, bad_mm, bad = unsealed(name="test-shrinks")
    good_fd, good_mm, good = unsealed(name="test-stays")
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def shrinking(bad: np.ndarray) -> None:
        pool = np.zeros(SIZE, dtype=np.uint8)
        n = 0
        try:
            while True:
                copy_ranges(pool, bad, *ranges(), True, 0, None, True)
                n += 1
                if n == 20:
                    started.set()
        except RegionShrunk as e:
            seen["fault"] = e.strerror  # not the exception: its traceback holds the mapping
        finally:
            started.set()

    def steady(good: np.ndarray) -> None:
        pool = np.zeros(SIZE, dtype=np.uint8)
        n = 0
        while not stop.is_set() or n < 50:
            pool[:] = 0
            copy_ranges(pool, good, *ranges(), True, 0, None, True)
            if not np.array_equal(pool, good):
                seen["wrong"] = n
                return
            n += 1
        seen["steady"] = n

    threads = [threading.Thread(target=shrinking, args=(bad,)), threading.Thread(target=steady, args=(good,))]
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        os.ftruncate(bad_fd, 4096)
        threads[0].join(30)
        stop.set()
        threads[1].join(30)
        assert "its file shrank under the mapping" in seen.get("fault", "")
        assert "wrong" not in seen and seen["steady"] >= 50
    finally:
        stop.set()
        del bad, good
        for mm, fd in ((bad_mm, bad_fd), (good_mm, good_fd)):
            mm.close()
            os.close(fd)


PROLOGUE = textwrap.dedent(
    """
    import faulthandler, mmap, os, signal, sys
    import numpy as np
    from hicached.common._pageio import RegionShrunk, copy_ranges

    def shrunk_memfd():
        fd = os.memfd_create("test-crash", os.MFD_CLOEXEC)
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED)
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[:] = 1
        os.ftruncate(fd, 4096)
        return arr

    one = [np.array([8192], dtype=np.int64)] * 2 + [np.array([4096], dtype=np.int64)]
    region, other = shrunk_memfd(), np.zeros(1 << 20, dtype=np.uint8)
    try:  # the guard's handler is in place from the first guarded copy on
        copy_ranges(other, region, *one, True, 0, None, True)
    except RegionShrunk:
        print("guarded", flush=True)
    """
)

CRASHES = {
    # No guard asked for: the handler passes the fault on to the default action.
    "unguarded": "copy_ranges(other, region, *one, True)",
    # Guarded, but the fault is in the pool, not in the guarded region.
    "outside the guarded range": "copy_ranges(region, other, *one, True, 0, None, True)",
    # A guarded copy runs on the main thread (most likely at the moment of the fault); the fault is on
    # another thread.
    "another thread": textwrap.dedent(
        """
        import threading, time
        healthy = np.ones(32 << 20, dtype=np.uint8)
        big = [np.array([0], dtype=np.int64)] * 2 + [np.array([32 << 20], dtype=np.int64)]
        def other_thread():
            time.sleep(0.2)
            np.asarray(region)[8192:].sum()
        threading.Thread(target=other_thread).start()
        dst = np.zeros_like(healthy)
        for _ in range(2000):
            copy_ranges(dst, healthy, *big, True, 0, None, True)
        """
    ),
}


@pytest.mark.parametrize("faulthandler_on", [False, True], ids=["plain", "faulthandler"])
@pytest.mark.parametrize("case", list(CRASHES))
def test_a_fault_outside_any_guard_still_kills_the_process(case, faulthandler_on):
    """A real bug must still crash: the guard catches only a fault of a thread in a guarded copy inside the
    region it guards. With Python's faulthandler enabled first (pytest, `python -X faulthandler`), the fault
    reaches it: its report, then the default action."""
    code = PROLOGUE + CRASHES[case] + "\nprint('survived', flush=True)\n"
    args = [sys.executable, *(["-X", "faulthandler"] if faulthandler_on else []), "-c", code]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["guarded"]
    assert ("Fatal Python error: Bus error" in r.stderr) == faulthandler_on


def test_a_handler_put_in_front_of_the_guard_makes_guarded_copies_refuse():
    """faulthandler.enable() after the first guarded copy puts its handler in front: it would report a
    guarded fault as fatal before the guard saw it, so guarded copies refuse until it is gone again."""
    code = PROLOGUE + textwrap.dedent(
        """
        faulthandler.enable()
        try:
            copy_ranges(other, region, *one, True, 0, None, True)
        except RuntimeError as e:
            print("refused:", e, flush=True)
        faulthandler.disable()  # puts back what it found: the guard's handler
        try:
            copy_ranges(other, region, *one, True, 0, None, True)
        except RegionShrunk:
            print("guarded", flush=True)
        signal.signal(signal.SIGBUS, signal.SIG_DFL)  # the handler taken away: put back at the next copy
        try:
            copy_ranges(other, region, *one, True, 0, None, True)
        except RegionShrunk:
            print("guarded", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "guarded" and lines[2:] == ["guarded", "guarded"]
    assert lines[1].startswith("refused: another SIGBUS handler was installed in front")


@pytest.fixture
def pool():
    p = Pool(4 << 20, prefault=False)
    yield p
    p.close()


@pytest.mark.parametrize("to_pool", [True, False], ids=["store", "load"])
async def test_the_copier_fails_a_request_whose_region_shrank_with_region_gone(pool, to_pool):
    fd, mm, arr = unsealed()
    region = SimpleNamespace(kind="host", array=arr, may_shrink=True)
    c = Copier(pool, threads=2)
    try:
        geom = Geometry(CHUNK, SIZE // CHUNK, (Segment(0, CHUNK, CHUNK),))
        pages, slots = list(range(16)), [k * CHUNK for k in range(16)]
        await c.copy(region, to_pool, geom, pages, slots)
        os.ftruncate(fd, 2 * CHUNK)
        with pytest.raises(RegionGone) as e:
            await c.copy(region, to_pool, geom, pages, slots)
        assert e.value.code == "copy_failed"
        assert re.match(r"copy failed: the region's memory is gone from byte \d+ of its", e.value.message)
        assert c.stats()["jobs_failed"] == 1
        await c.copy(region, to_pool, geom, [0, 1], slots[:2])  # the pages the file still holds
    finally:
        await asyncio.to_thread(c.close)
        del region, arr
        mm.close()
        os.close(fd)


async def test_without_the_c_module_memory_that_may_shrink_is_never_copied(pool, monkeypatch):
    monkeypatch.setattr(ranges_mod, "_copy_ranges", None)
    assert not ranges_mod.can_guard()
    c = Copier(pool, threads=1)
    try:
        geom = Geometry(CHUNK, 4, (Segment(0, CHUNK, CHUNK),))
        region = SimpleNamespace(kind="host", array=np.zeros(4 * CHUNK, dtype=np.uint8), may_shrink=True)
        with pytest.raises(HicachedError) as e:
            await c.copy(region, True, geom, [0], [0])
        assert not isinstance(e.value, RegionGone)
        assert e.value.code == "copy_failed" and "cannot guard copies" in e.value.message
    finally:
        await asyncio.to_thread(c.close)
