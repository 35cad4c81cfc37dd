"""The L2 pool's memory: a sealed memfd that engines map as well."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator

import pytest

from hicached.pool import SEALS, Pool, check_sealed_fd

SIZE = 1 << 20


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(SIZE, prefault=False)
    yield p
    p.close()


def _fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


@pytest.mark.parametrize("size", [0, -4096])
def test_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError):
        Pool(size)


@pytest.mark.parametrize("prefault", [True, False])
def test_memfd_has_the_size(prefault: bool) -> None:
    p = Pool(SIZE, prefault=prefault)
    try:
        assert p.size == SIZE
        assert os.fstat(p.fd).st_size == SIZE
        assert len(p.view) == SIZE
        assert not p.view.readonly
    finally:
        p.close()


def test_fd_is_a_named_memfd_not_inherited() -> None:
    p = Pool(SIZE, prefault=False, name="hicached-test")
    try:
        assert "memfd:hicached-test" in os.readlink(f"/proc/self/fd/{p.fd}")
        assert not os.get_inheritable(p.fd)
    finally:
        p.close()


def test_seals_present(pool: Pool) -> None:
    seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK
    assert seals & fcntl.F_SEAL_GROW
    assert seals & fcntl.F_SEAL_SEAL
    assert seals & SEALS == SEALS
    # Writes stay allowed: engines write pages in place.
    assert not seals & fcntl.F_SEAL_WRITE


@pytest.mark.parametrize("new_size", [0, SIZE // 2, SIZE * 2])
def test_ftruncate_is_refused(pool: Pool, new_size: int) -> None:
    with pytest.raises(OSError) as e:
        os.ftruncate(pool.fd, new_size)
    assert e.value.errno == errno.EPERM
    assert os.fstat(pool.fd).st_size == SIZE


def test_no_more_seals_can_be_added(pool: Pool) -> None:
    with pytest.raises(OSError) as e:
        fcntl.fcntl(pool.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert e.value.errno == errno.EPERM


def test_slot_is_a_writable_window(pool: Pool) -> None:
    s = pool.slot(8192, 4096)
    assert len(s) == 4096
    s[:5] = b"hello"
    assert bytes(pool.view[8192:8197]) == b"hello"
    assert bytes(pool.view[8187:8192]) == bytes(5)
    s.release()


def test_a_second_mapping_sees_the_same_bytes(pool: Pool) -> None:
    # An engine receives a duplicate of the fd (SCM_RIGHTS) and maps it shared.
    fd = os.dup(pool.fd)
    try:
        client = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        data = bytes(range(256)) * 16
        pool.view[SIZE - 4096 : SIZE] = data
        assert client[SIZE - 4096 : SIZE] == data
        client[0:7] = b"engine!"
        assert bytes(pool.slot(0, 7)) == b"engine!"
        assert client[4096:8192] == bytes(4096)
    finally:
        client.close()


def test_close_is_idempotent() -> None:
    p = Pool(SIZE, prefault=False)
    fd = p.fd
    p.close()
    assert p.fd == -1
    assert _fd_closed(fd)
    p.close()
    assert p.fd == -1
    with pytest.raises(ValueError):
        p.view[0]


def test_close_with_a_slot_still_exported(caplog: pytest.LogCaptureFixture) -> None:
    p = Pool(SIZE, prefault=False)
    fd = p.fd
    held = p.slot(0, 4096)
    with caplog.at_level(logging.WARNING, logger="hicached.pool"):
        p.close()
    assert "still exported" in caplog.text
    assert _fd_closed(fd)
    assert p.fd == -1
    # The mapping stays valid for whoever still holds a view.
    held[:3] = b"abc"
    assert bytes(held[:3]) == b"abc"
    p.close()
    held.release()


# Memory an engine hands in.


def _memfd(size: int, seals: int = 0, allow_sealing: bool = True) -> int:
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0)
    fd = os.memfd_create("hicached-test-region", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_check_sealed_fd_accepts_a_sealed_memfd() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    try:
        assert check_sealed_fd(fd, SIZE) == SIZE
        assert check_sealed_fd(fd, 4096) == SIZE  # the real size, not the one asked for
    finally:
        os.close(fd)


def test_check_sealed_fd_needs_only_the_shrink_seal() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK)
    try:
        assert check_sealed_fd(fd, SIZE) == SIZE
    finally:
        os.close(fd)


def test_check_sealed_fd_accepts_the_pool_itself(pool: Pool) -> None:
    assert check_sealed_fd(pool.fd, SIZE) == SIZE


@pytest.mark.parametrize(
    "seals, allow_sealing",
    [(0, True), (fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, True), (0, False)],
    ids=["unsealed", "grow-only", "sealing-not-allowed"],
)
def test_check_sealed_fd_refuses_a_memfd_that_can_shrink(seals: int, allow_sealing: bool) -> None:
    fd = _memfd(SIZE, seals, allow_sealing)
    try:
        with pytest.raises(ValueError, match="F_SEAL_SHRINK"):
            check_sealed_fd(fd, SIZE)
    finally:
        os.close(fd)


def test_check_sealed_fd_refuses_a_too_small_memfd() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK)
    try:
        with pytest.raises(ValueError, match="smaller") as e:
            check_sealed_fd(fd, SIZE + 1)
        assert str(SIZE) in str(e.value)
    finally:
        os.close(fd)


def test_check_sealed_fd_refuses_a_fd_that_is_not_a_memfd() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError):
            check_sealed_fd(r, 1)
    finally:
        os.close(r)
        os.close(w)
