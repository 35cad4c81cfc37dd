"""How the vLLM tier names and cuts vLLM's rows (hicached.engine.vllm.rows): parts of a row larger than the
daemon's largest page, daemon keys and pages, the namespace from vLLM's own FileMapper fields, and the file
found under vLLM's primary view (its real SharedOffloadRegion)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (.ci/run installs it)"
)
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_rig import offloading_config  # noqa: E402

from hicached.common.keys import check_keys, check_namespace  # noqa: E402
from hicached.engine.vllm.rows import (  # noqa: E402
    block_key,
    check_prefix,
    daemon_keys,
    daemon_pages,
    namespace,
    region_file,
    row_fields,
    row_parts,
)

MiB = 1 << 20


@pytest.mark.parametrize(
    "row, slab, parts",
    [
        (256 * 1024, 32 * MiB, 1),
        (32 * MiB, 32 * MiB, 1),  # exactly one page: whole
        (48 * MiB, 32 * MiB, 2),
        (40 * MiB, 32 * MiB, 2),
        (6 * MiB, 4 * MiB, 2),
        (33 * MiB, 32 * MiB, 2),
        (4096 * 8449, 32 * MiB, 7),  # 8449 = 7 x 17 x 71 pages of 4 KiB: 2 to 6 parts do not divide it
        (4096 * 8191, 4 * MiB, 8191),  # 8191 pages of 4 KiB is prime: only 4 KiB parts divide it
    ],
)
def test_a_row_is_cut_into_the_fewest_equal_parts_that_fit(row: int, slab: int, parts: int) -> None:
    assert row_parts(row, slab) == parts
    assert row % parts == 0 and row // parts <= slab and (row // parts) % 4096 == 0


def test_keys_fold_the_group_in_and_name_each_part() -> None:
    sha, xx = bytes(range(32)), bytes(range(16))
    assert block_key(make_offload_key(sha, 0)) == sha.hex() + "-g0"
    assert block_key(make_offload_key(xx, 3)) == xx.hex() + "-g3"
    keys = [make_offload_key(sha, 0), make_offload_key(sha, 1)]
    assert daemon_keys(keys, 1) == [sha.hex() + "-g0", sha.hex() + "-g1"]
    split = daemon_keys(keys, 2)
    assert split == [f"{sha.hex()}-g{g}-p{p}" for g in (0, 1) for p in (0, 1)]
    check_keys(split)  # daemon keys: valid, at most 128 characters
    assert daemon_pages([5, 0], 1) == [5, 0]
    assert daemon_pages([5, 0], 3) == [15, 16, 17, 0, 1, 2]


def _fields(**config) -> dict:
    spec = TieringOffloadingSpec(offloading_config("fields", [], **config))
    return row_fields(spec, spec.kv_bytes_per_chunk)


def test_the_namespace_changes_with_whatever_changes_a_rows_bytes() -> None:
    base = namespace("", _fields(), 64 * 1024)
    assert base == namespace("", _fields(), 64 * 1024)  # the same rows: the same namespace, for sharing
    check_namespace(base)
    assert base.startswith("org-model-x.bfloat16.t16.")
    others = [
        namespace("", _fields(dtype="float16"), 64 * 1024),
        namespace("", _fields(model="org/model-y"), 64 * 1024),
        namespace("", _fields(tokens=32), 64 * 1024),
        namespace("", _fields(world_size=2, worker_bytes=32 * 1024), 64 * 1024),  # same row size, 2 workers
        namespace("", _fields(groups=2), 64 * 1024),
        namespace("", _fields(), 32 * 1024),  # split into parts: a namespace holds one page size
        namespace("tenant-a", _fields(), 64 * 1024),
    ]
    assert len({base, *others}) == len(others) + 1


def test_namespaces_stay_valid_and_distinct_for_long_names_and_prefixes() -> None:
    long_a = _fields(model="org/" + "a" * 200 + "/x")
    long_b = _fields(model="org/" + "a" * 200 + "/y")
    prefix = "t" * 64
    for fields in (long_a, long_b):
        for p in ("", prefix):
            check_namespace(namespace(p, fields, 4096))
    assert namespace(prefix, long_a, 4096) != namespace(prefix, long_b, 4096)
    assert namespace(prefix, long_a, 4096).startswith(prefix + ".org-aaa")
    for bad in ("a/b", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="namespace_prefix"):
            check_prefix(bad)


def test_the_file_under_vllms_primary_view_is_found_and_no_export_is_kept() -> None:
    engine = f"rows-{os.getpid()}"
    region = SharedOffloadRegion(
        engine_id=engine, num_chunks=4, rank=None, kv_bytes_per_chunk=8192, cpu_page_size=8192
    )
    view = region.create_kv_memoryview()

    class Spec:  # what TieringOffloadingSpec holds: its scheduler-side region
        _scheduler_mmap = region

    try:
        for spec in (Spec(), object()):  # the spec's fd duplicated; else the mapped path opened again
            found = region_file(spec, view)
            try:
                assert found.fd != region.fd and found.offset == 0 and found.size == 4 * 8192
                assert os.fstat(found.fd).st_ino == os.stat(region.mmap_path).st_ino
            finally:
                os.close(found.fd)
        with pytest.raises(ValueError, match="cannot open the file"):
            region_file(object(), memoryview(bytearray(8192)))
    finally:
        view.release()  # raises BufferError if anything above kept an export of the view
        region.cleanup()
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)
