"""The snapshot codec of a kept L2 (hicached.daemon.persist.keep): bytes in, bytes out, every damage
refused."""

from __future__ import annotations

import struct

import msgpack
import pytest
import xxhash

from hicached.daemon.persist import keep
from hicached.daemon.persist.keep import KeptPage, Snapshot, SnapshotError

SLAB = 1 << 20
KEY = "a" * 64


def _snap(**over) -> Snapshot:
    pages = [
        KeptPage("ns.a", KEY, 0, 65536, 123, True, False, False),
        KeptPage("ns.a", "b" * 64, 65536, 65536, 2**64 - 1, False, True, True, True),
        KeptPage("ns.b", KEY, SLAB, 8192, 7, False, False, False),
    ]
    fields = dict(
        capacity=4 * SLAB,
        pool_bytes=4 * SLAB,
        slab_bytes=SLAB,
        slabs=[65536, 8192, 0, 0],
        pages=pages,
        held=[2 * 65536],
        inode=42,
        l3="('file', '/x')",
        written=12.5,
    )
    fields.update(over)
    return Snapshot(**fields)


def _rebody(data: bytes, change) -> bytes:
    """`data` with its body changed by `change` and a header that matches again (checksum included)."""
    body = msgpack.unpackb(data[struct.calcsize("<8sIQQ") :], raw=False)
    change(body)
    raw = msgpack.packb(body, use_bin_type=True)
    return struct.pack("<8sIQQ", keep.MAGIC, keep.FORMAT, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw


def test_round_trip():
    snap = _snap()
    assert keep.decode(keep.encode(snap)) == snap


def test_empty_pool_round_trip():
    snap = _snap(pages=[], held=[], slabs=[0, 0, 0, 0], l3=None)
    assert keep.decode(keep.encode(snap)) == snap


@pytest.mark.parametrize("at", [0, 9, 20, 40, -1])
def test_any_changed_byte_is_refused(at):
    data = bytearray(keep.encode(_snap()))
    data[at] ^= 0x10
    with pytest.raises(SnapshotError):
        keep.decode(bytes(data))


def test_truncated_is_refused():
    data = keep.encode(_snap())
    for n in (0, 10, len(data) - 1):
        with pytest.raises(SnapshotError):
            keep.decode(data[:n])


def test_another_format_is_refused_by_name():
    data = bytearray(keep.encode(_snap()))
    struct.pack_into("<I", data, 8, keep.FORMAT + 1)
    with pytest.raises(
        SnapshotError, match=f"format {keep.FORMAT + 1}; this daemon reads format {keep.FORMAT}"
    ):
        keep.decode(bytes(data))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b["pages"][0].__setitem__(2, 4096), "not a slot of its slab"),  # inside a 64 KiB slot
        (lambda b: b["pages"][2].__setitem__(3, 65536), "another size class"),
        (lambda b: b["pages"][1].__setitem__(2, 0), "twice"),
        (lambda b: b["pages"][2].__setitem__(1, "b" * 64) or b["pages"][2].__setitem__(0, 0), "two sizes"),
        (lambda b: b["pages"][0].__setitem__(1, "../etc"), "key that is not valid"),
        (lambda b: b["namespaces"].__setitem__(0, "a/b"), "namespace that is not valid"),
        (lambda b: b["pages"][0].__setitem__(0, 9), "namespace index"),
        (lambda b: b["pages"][0].__setitem__(2, 3 * SLAB), "not a slot of its slab"),  # a free slab
        (lambda b: b["held"].append(0), "twice"),
        (lambda b: b["slabs"].pop(), "slab table"),
        (lambda b: b["slabs"].__setitem__(0, 5000), "multiple of 4096"),
        (lambda b: b["pages"][0].__setitem__(4, -1), "checksum"),
        (lambda b: b.pop("inode"), "malformed"),
        (lambda b: b["pages"].append([0, KEY]), "malformed"),
    ],
)
def test_inconsistent_body_is_refused(change, match):
    with pytest.raises(SnapshotError, match=match):
        keep.decode(_rebody(keep.encode(_snap()), change))


def test_not_a_map_is_refused():
    raw = msgpack.packb([1, 2, 3])
    data = struct.pack("<8sIQQ", keep.MAGIC, keep.FORMAT, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw
    with pytest.raises(SnapshotError, match="not a map"):
        keep.decode(data)


def test_check_names_what_changed():
    snap = _snap()
    keep.check(snap, 4 * SLAB, SLAB, 42)
    with pytest.raises(SnapshotError, match="pool.capacity was 4194304 bytes and is now 8388608"):
        keep.check(snap, 8 * SLAB, SLAB, 42)
    with pytest.raises(SnapshotError, match="pool.slab_size"):
        keep.check(snap, 4 * SLAB, SLAB // 2, 42)
    with pytest.raises(SnapshotError, match="another memfd"):
        keep.check(snap, 4 * SLAB, SLAB, 43)


def test_verify_tells_changed_payloads():
    pool = bytearray(4 * SLAB)
    pool[0:65536] = b"x" * 65536
    pages = [
        KeptPage("ns.a", KEY, 0, 65536, xxhash.xxh3_64_intdigest(b"x" * 65536), True, False, False),
        KeptPage("ns.a", "b" * 64, 65536, 65536, xxhash.xxh3_64_intdigest(b"y" * 65536), True, False, False),
    ]
    assert keep.verify(memoryview(pool), pages) == [True, False]


def test_the_default_tenants_arena_alone_is_kept_under_the_names_of_a_release_before_tenants():
    """A pool without [tenants] is the default tenant's arena alone: kept under the bare names, which a
    release before the one arena model stored and reads (an upgrade by restart keeps L2 both ways)."""
    assert keep.arena_fdname(keep.POOL_FDNAME, "default", 1) == "hicached-l2"
    assert keep.arena_fdname(keep.META_FDNAME, "default", 1) == "hicached-l2-meta"
    assert keep.arena_fdname(keep.INDEX_FDNAME, "default", 3) == "hicached-l2-index.default"
    assert keep.arena_fdname(keep.POOL_FDNAME, "a", 1) == "hicached-l2.a"
