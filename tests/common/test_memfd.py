"""Memory an engine hands in (hicached.common.memfd): memfds, sealed against shrinking or not, and tmpfs files
(vLLM's /dev/shm region) accepted, told apart from regular files, pipes and sockets."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from hicached.common.memfd import EngineMemory, check_region_fd, inspect_fd

SIZE = 1 << 20


def _memfd(size: int, seals: int = 0, allow_sealing: bool = True) -> int:
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0)
    fd = os.memfd_create("hicached-test-region", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_sealed_memfd_cannot_shrink() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    try:
        assert check_region_fd(fd, SIZE) == EngineMemory("memfd", SIZE, can_shrink=False)
        assert check_region_fd(fd, 4096).size == SIZE  # the real size, not the one asked for
    finally:
        os.close(fd)


def test_the_shrink_seal_alone_is_enough() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK)
    try:
        assert not check_region_fd(fd, SIZE).can_shrink
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "seals, allow_sealing",
    [(0, True), (fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, True), (0, False)],
    ids=["unsealed", "grow-only", "sealing-not-allowed"],
)
def test_a_memfd_that_can_shrink_is_accepted_as_one(seals: int, allow_sealing: bool) -> None:
    fd = _memfd(SIZE, seals, allow_sealing)
    try:
        assert check_region_fd(fd, SIZE) == EngineMemory("memfd", SIZE, can_shrink=True)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # the same memfd, another open file
        try:
            assert inspect_fd(ro) == EngineMemory("memfd", SIZE, can_shrink=True)
        finally:
            os.close(ro)
    finally:
        os.close(fd)


def test_a_too_small_memfd_is_refused() -> None:
    fd = _memfd(SIZE, fcntl.F_SEAL_SHRINK)
    try:
        with pytest.raises(ValueError, match="smaller") as e:
            check_region_fd(fd, SIZE + 1)
        assert str(SIZE) in str(e.value)
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (tmpfs) on this machine")
def test_a_tmpfs_file_is_accepted_and_can_shrink() -> None:
    # As vLLM makes its CPU offload region: O_CREAT|O_EXCL, mode 0600, born with F_SEAL_SEAL.
    path = f"/dev/shm/hicached-test-vllm-{os.getpid()}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
        assert check_region_fd(fd, SIZE) == EngineMemory("tmpfs file", SIZE, can_shrink=True)
        with pytest.raises(ValueError, match="smaller"):
            check_region_fd(fd, SIZE + 1)
    finally:
        os.close(fd)
        os.unlink(path)


def test_what_is_not_shared_memory_is_refused_and_named(tmp_path) -> None:
    r, w = os.pipe()
    a, b = socket.socketpair()
    regular = os.open(tmp_path / "region.bin", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, SIZE)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    null = os.open("/dev/null", os.O_RDWR)
    fds = {r: "pipe", a.fileno(): "socket", regular: "regular file", directory: "directory", null: "device"}
    try:
        for fd, kind in fds.items():
            assert inspect_fd(fd).kind == kind
            with pytest.raises(
                ValueError, match=f"memory must be a memfd or a file on tmpfs; this fd is a {kind}"
            ):
                check_region_fd(fd, 1)
    finally:
        for fd in fds:
            if fd != a.fileno():
                os.close(fd)
        os.close(w)
        a.close()
        b.close()
