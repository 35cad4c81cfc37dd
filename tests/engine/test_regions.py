"""The engine-side region helpers without a daemon: shared_buffer's sealed memfd and its lifetime, and how
a tensor or an fd (sealed or not) becomes region_attach fields."""

from __future__ import annotations

import fcntl
import gc
import os

import pytest
import torch

from hicached.common.errors import HicachedError
from hicached.engine import regions as client_regions
from hicached.engine.client import shared_buffer
from hicached.engine.regions import describe

PAGE = 4096


def test_shared_buffer_is_a_sealed_memfd_that_lives_with_its_tensors():
    t = shared_buffer(8 * PAGE, name="test-shared")
    assert t.dtype == torch.uint8 and t.numel() == 8 * PAGE and not t.is_cuda
    fields, fd = describe(t, PAGE, None, None)
    assert fields == {"kind": "host", "offset": 0, "nbytes": 8 * PAGE, "page_bytes": PAGE, "num_pages": 8}
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:test-shared")
    t[PAGE : 2 * PAGE] = 7
    assert os.pread(fd, 4, PAGE) == b"\x07" * 4  # the tensor is the memfd's memory
    view = t[2 * PAGE : 6 * PAGE]
    fields, fd2 = describe(view, PAGE, None, None)
    assert fd2 == fd and fields["offset"] == 2 * PAGE and fields["num_pages"] == 4
    base = t.data_ptr()
    del t
    gc.collect()
    assert base in client_regions._shared  # a view keeps the memory (and the fd) alive
    del view
    gc.collect()
    assert base not in client_regions._shared
    with pytest.raises(OSError):
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # closed with the last tensor


def test_describe_refuses_what_cannot_be_a_region():
    cases = [
        (torch.zeros(4 * PAGE, dtype=torch.uint8), "not in shared memory"),
        (shared_buffer(4 * PAGE).view(4, PAGE)[:, :128], "contiguous"),
        ("memory", "a region is a tensor"),
        (shared_buffer(PAGE // 2), "does not hold one whole page"),
    ]
    for memory, needle in cases:
        with pytest.raises(HicachedError) as e:
            describe(memory, PAGE, None, None)
        assert e.value.code == "bad_request" and needle in e.value.message, needle
    with pytest.raises(HicachedError) as e:
        describe(shared_buffer(PAGE), PAGE, [(0, "x", 4)], None)
    assert "segments must be" in e.value.message
    with pytest.raises(HicachedError):
        shared_buffer(0)


def test_describe_segments_and_fds():
    t = shared_buffer(64 * PAGE)
    fields, _ = describe(t, PAGE, [(0, PAGE // 2, PAGE // 2), (32 * PAGE, PAGE // 2, PAGE)], None)
    assert fields["segments"] == [[0, 2048, 2048], [131072, 2048, 4096]] and fields["num_pages"] == 32
    fields, _ = describe(t, PAGE, None, 10)
    assert fields["num_pages"] == 10  # explicit: the daemon checks it
    fd = os.memfd_create("plain", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 3 * PAGE)
        fields, got = describe(fd, PAGE, None, None)
        assert got == fd and fields["nbytes"] == 3 * PAGE and fields["num_pages"] == 3
    finally:
        os.close(fd)
    with pytest.raises(HicachedError) as e:
        describe(fd, PAGE, None, None)
    assert e.value.code == "bad_request"


def test_an_unsealed_memfd_is_described_as_it_is():
    """SGLang's memfd is made without MFD_ALLOW_SEALING: the client neither seals nor maps it; the daemon
    accepts it as memory that may shrink."""
    for flags in (os.MFD_CLOEXEC, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING):
        fd = os.memfd_create("sglang-like", flags)
        try:
            os.ftruncate(fd, 4 * PAGE)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            fields, got = describe(fd, PAGE, None, None)
            assert got == fd and fields == {
                "kind": "host",
                "offset": 0,
                "nbytes": 4 * PAGE,
                "page_bytes": PAGE,
                "num_pages": 4,
            }
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == seals
            with open("/proc/self/maps") as f:
                assert "/memfd:sglang-like" not in f.read()
        finally:
            os.close(fd)


class FakeCudaTensor:
    """What describe() reads of a CUDA tensor (exporting it is faked too: no GPU here)."""

    is_cuda = True

    def data_ptr(self):
        return 1 << 20

    def is_contiguous(self):
        return True

    def numel(self):
        return 1 << 16

    def element_size(self):
        return 1

    def storage_offset(self):
        return 0


def test_a_refused_cuda_region_gives_its_export_reference_back(monkeypatch):
    from hicached.common.errors import CONNECTION, UNSUPPORTED
    from hicached.engine import regions as client_regions
    from hicached.engine.regions import RegionOps

    exported, released = [], []

    def fields(tensor):
        exported.append(tensor)
        return {"ref_counter_handle": b"/torch_1_2_0", "ref_counter_offset": len(exported)}

    monkeypatch.setattr(client_regions, "cuda_fields", fields)
    monkeypatch.setattr(client_regions, "release_cuda_fields", released.append)
    ops = RegionOps()
    ops.regions = {}
    # Refused before export: nothing to give back.
    with pytest.raises(HicachedError):
        next(ops.op_register_region(FakeCudaTensor(), 1 << 17, None, None))  # not one whole page
    assert exported == []
    # Refused by the daemon (here: no CUDA there): the reference it never took is given back.
    op = ops.op_register_region(FakeCudaTensor(), 4096, None, None)
    assert next(op)["op"] == "region_attach"
    with pytest.raises(HicachedError):
        op.throw(HicachedError(UNSUPPORTED, "CUDA regions are not supported here"))
    assert released == [{"ref_counter_handle": b"/torch_1_2_0", "ref_counter_offset": 1}]
    # No answer: the daemon may still open it, and gives the reference back itself.
    op = ops.op_register_region(FakeCudaTensor(), 4096, None, None)
    next(op)
    with pytest.raises(HicachedError):
        op.throw(HicachedError(CONNECTION, "the daemon went away"))
    assert len(released) == 1 and ops.regions == {}
