"""Memory an engine hands in: memfds sealed against shrinking (hicached.common.memfd)."""

from __future__ import annotations

import fcntl
import os

import pytest

from hicached.common.memfd import check_sealed_fd

SIZE = 1 << 20


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
