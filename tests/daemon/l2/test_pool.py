"""The L2 pool's memory: a sealed memfd that engines map as well."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator

import pytest

from hicached.common.memfd import SEALS, EngineMemory, check_region_fd
from hicached.daemon.l2.pool import Pool, available_memory, check_capacity

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


def test_check_region_fd_sees_the_pool_as_a_memfd_that_cannot_shrink(pool: Pool) -> None:
    assert check_region_fd(pool.fd, SIZE) == EngineMemory("memfd", SIZE, can_shrink=False)


GiB = 1 << 30


def _node(tmp_path, mem_available_kib: int | None, cgroup: str | None, limits: dict[str, tuple[str, int]]):
    """Fake /proc/meminfo, /proc/self/cgroup and a cgroup v2 tree: limits maps a cgroup path to
    (memory.max, memory.current)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    meminfo = tmp_path / "meminfo"
    lines = ["MemTotal:       99999999 kB"]
    if mem_available_kib is not None:
        lines.append(f"MemAvailable:   {mem_available_kib} kB")
    meminfo.write_text("\n".join(lines) + "\n")
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text(f"0::{cgroup}\n" if cgroup is not None else "")
    root = tmp_path / "fs"
    for path, (limit, current) in limits.items():
        d = root / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{current}\n")
    return {"meminfo": str(meminfo), "cgroup_root": str(root), "self_cgroup": str(self_cgroup)}


def test_available_memory_is_memavailable_without_a_cgroup_limit(tmp_path) -> None:
    paths = _node(tmp_path, 8 * 1024 * 1024, "/system.slice/hicached.service", {"/system.slice": ("max", 0)})
    assert available_memory(**paths) == (8 * GiB, "MemAvailable in /proc/meminfo")


def test_the_tightest_cgroup_above_the_process_bounds_the_memory_left(tmp_path) -> None:
    limits = {
        "/system.slice/hicached.service": (str(6 * GiB), 1 * GiB),  # 5 GiB left here
        "/system.slice": (str(10 * GiB), 7 * GiB),  # 3 GiB left for the whole slice: the tightest
        "/": ("max", 0),
    }
    paths = _node(tmp_path, 64 * 1024 * 1024, "/system.slice/hicached.service", limits)
    assert available_memory(**paths) == (3 * GiB, "memory.max of cgroup /system.slice")


def test_available_memory_unknown_and_a_cgroup_over_its_limit(tmp_path) -> None:
    assert available_memory(**_node(tmp_path / "a", None, None, {})) is None
    over = _node(tmp_path / "b", None, "/c", {"/c": (str(GiB), 2 * GiB)})
    assert available_memory(**over) == (0, "memory.max of cgroup /c")


def test_check_capacity_refuses_a_prefaulted_pool_that_does_not_fit() -> None:
    left = (4 * GiB, "MemAvailable in /proc/meminfo")
    with pytest.raises(ValueError, match=r"pool.capacity is 5.0GiB but only 4.0GiB .*lower pool.capacity"):
        check_capacity(5 * GiB, True, left)
    assert "may run out" in check_capacity(5 * GiB, False, left)  # allocated as it fills: a warning
    assert "more than 90%" in check_capacity(int(3.8 * GiB), True, left)
    assert check_capacity(2 * GiB, True, left) is None
    assert check_capacity(1 << 50, True, None) is None  # nothing known: no opinion


def _proc_kib(path: str, field: str) -> int:
    """A `field:  N kB` line of a /proc file of this process."""
    for line in open(path):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _shmem_kib() -> int:
    """Shared memory this process has faulted in."""
    return _proc_kib("/proc/self/status", "RssShmem")


def test_prefault_allocates_every_page_and_without_it_none() -> None:
    before = _shmem_kib()
    p = Pool(32 << 20, prefault=True)
    try:
        assert _shmem_kib() - before >= 32 << 10
    finally:
        p.close()
    before = _shmem_kib()
    q = Pool(32 << 20, prefault=False)
    try:
        assert _shmem_kib() - before < 1 << 10
    finally:
        q.close()


def test_prefault_falls_back_to_touching_pages_on_kernels_without_populate(monkeypatch) -> None:
    import hicached.common.memfd as memfd_mod

    monkeypatch.setattr(memfd_mod, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL, as before 5.14
    before = _shmem_kib()
    p = Pool(8 << 20, prefault=True)
    try:
        assert _shmem_kib() - before >= 8 << 10
        assert p.size == 8 << 20 and not any(p.view[:: 1 << 12])
    finally:
        p.close()


def _shmem_thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.mark.skipif(
    _shmem_thp_mode() not in ("advise", "always", "within_size"),
    reason="this node does not give shared memory 2 MiB pages "
    "(/sys/kernel/mm/transparent_hugepage/shmem_enabled is not advise, always or within_size)",
)
def test_the_pool_is_in_2mib_pages_where_the_node_allows_them() -> None:
    def pmd_mapped_kib() -> int:
        return _proc_kib("/proc/self/smaps_rollup", "ShmemPmdMapped")

    before = pmd_mapped_kib()
    p = Pool(64 << 20, prefault=True)
    try:
        assert pmd_mapped_kib() - before >= 32 << 10  # most of it; the ends may not be 2 MiB aligned
    finally:
        p.close()
