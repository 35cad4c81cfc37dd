"""Region geometry, with bytes alone: validation errors name the field, and copy plans (coalesced and
split) move exactly the bytes a page-by-page, segment-by-segment copy would."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicached.common.errors import HicachedError
from hicached.common.geometry import (
    MAX_SEGMENTS,
    Geometry,
    Segment,
    check_pages,
    default_num_pages,
    parse_geometry,
    plan,
    split,
)


def bad(req: dict, region_bytes: int = 1 << 20) -> str:
    with pytest.raises(HicachedError) as e:
        parse_geometry(req, region_bytes)
    assert e.value.code == "bad_request"
    return e.value.message


def test_default_geometry_is_one_contiguous_segment():
    g = parse_geometry({"page_bytes": 4096, "num_pages": 8}, 8 * 4096)
    assert g.segments == (Segment(0, 4096, 4096),)
    assert g.extent == 8 * 4096 and g.contiguous


def test_segments_k_and_v_halves():
    # K for all pages first, then V: page i's K at i*2048, its V at 64 KiB + i*2048.
    g = parse_geometry(
        {"page_bytes": 4096, "num_pages": 32, "segments": [[0, 2048, 2048], [65536, 2048, 2048]]}, 1 << 17
    )
    assert g.extent == 65536 + 31 * 2048 + 2048 and not g.contiguous


@pytest.mark.parametrize(
    "req, needle",
    [
        ({"num_pages": 1}, "page_bytes must be an integer"),
        ({"page_bytes": True, "num_pages": 1}, "page_bytes must be an integer"),
        ({"page_bytes": 0, "num_pages": 1}, "page_bytes must be at least 1"),
        ({"page_bytes": 4096, "num_pages": 0}, "num_pages must be at least 1"),
        ({"page_bytes": 4096, "num_pages": 1.5}, "num_pages must be an integer"),
        ({"page_bytes": 4096, "num_pages": 1, "segments": []}, "segments must be a non-empty list"),
        ({"page_bytes": 4096, "num_pages": 1, "segments": "x"}, "segments must be a non-empty list"),
        (
            {"page_bytes": 4096, "num_pages": 1, "segments": [[0, 4096]]},
            "segments[0] must be [offset, length",
        ),
        (
            {"page_bytes": 4096, "num_pages": 1, "segments": [[-1, 4096, 4096]]},
            "segments[0].offset must be at",
        ),
        ({"page_bytes": 4096, "num_pages": 1, "segments": [[0, 0, 4096]]}, "segments[0].length must be at"),
        ({"page_bytes": 4096, "num_pages": 2, "segments": [[0, 4096, 0]]}, "segments[0].stride must be at"),
        (
            {"page_bytes": 4096, "num_pages": 2, "segments": [[0, 4096, 2048]]},
            "segments[0].stride (2048) is smaller",
        ),
        ({"page_bytes": 4096, "num_pages": 2, "segments": [[0, 2048, 4096]]}, "lengths add up to 2048"),
        (
            {"page_bytes": 4096, "num_pages": 1, "segments": [[0, 2048, 2048], [0, "a", 2048]]},
            "segments[1].length",
        ),
    ],
)
def test_bad_geometry_names_the_field(req, needle):
    assert needle in bad(req)


def test_geometry_past_the_end_of_the_region():
    assert "num_pages * page_bytes: page 16 ends at byte 69632" in bad(
        {"page_bytes": 4096, "num_pages": 17}, 65536
    )
    msg = bad({"page_bytes": 4096, "num_pages": 4, "segments": [[0, 2048, 2048], [60000, 2048, 2048]]}, 65536)
    assert msg.startswith("segments[1]: page 3 ends at byte 68192, past the end of the region (65536 bytes)")
    many = [[i * 8, 1, 8] for i in range(MAX_SEGMENTS + 1)]
    assert "at most" in bad({"page_bytes": MAX_SEGMENTS + 1, "num_pages": 1, "segments": many})


@pytest.mark.parametrize(
    "req, region_bytes, needle",
    [
        # strides past int64, in segments that the overlap test (numpy, int64) has to compare
        (
            {
                "page_bytes": 8192,
                "num_pages": 8,
                "segments": [[0, 4096, 1 << 63], [4096, 4096, (1 << 63) - 1]],
            },
            65536,
            "larger than any region",
        ),
        (
            {"page_bytes": 8192, "num_pages": 1, "segments": [[0, 4096, 1 << 64], [2048, 4096, 1 << 63]]},
            65536,
            "larger than any region",
        ),
        (
            {
                "page_bytes": 8192,
                "num_pages": (1 << 64) - 1,
                "segments": [[0, 4096, 8192], [4096, 4096, 16384]],
            },
            65536,
            "past the end of the region",
        ),
        # a region as large as a CUDA request may claim: its extent check alone would let these through
        (
            {
                "page_bytes": 8192,
                "num_pages": 2,
                "segments": [[0, 4096, 1 << 61], [4096, 4096, (1 << 61) + 1]],
            },
            (1 << 64) - 1,
            "larger than any memory",
        ),
    ],
)
def test_huge_numbers_are_refused_not_overflowed(req, region_bytes, needle):
    assert needle in bad(req, region_bytes)


def test_check_pages():
    g = Geometry(4096, 10, (Segment(0, 4096, 4096),))
    assert check_pages([0, 9, 3], g, 3, unique=True) == [0, 9, 3]
    cases = [
        ((3, g, 1, False), "page_indices must be a list"),
        (([0, 1], g, 3, False), "page_indices has 2 entries but keys has 3"),
        (([0, 10], g, 2, False), "page_indices[1] = 10 is out of range: the region has 10 pages"),
        (([-1], g, 1, False), "page_indices[0] = -1 is out of range"),
        (([True], g, 1, False), "page_indices[0] must be an integer, got bool"),
        (([1.0], g, 1, False), "page_indices[0] must be an integer, got float"),
        (([2, 2], g, 2, True), "names a page twice"),
    ]
    for args, needle in cases:
        with pytest.raises(HicachedError) as e:
            check_pages(*args)
        assert e.value.code == "bad_request" and needle in e.value.message, (args, e.value.message)
    assert check_pages([2, 2], g, 2, unique=False) == [2, 2]  # a store may read one page twice


def test_default_num_pages():
    assert default_num_pages(4096, None, 10 * 4096 + 100) == 10
    assert default_num_pages(4096, [(0, 2048, 2048), (40960, 2048, 2048)], 81920) == 20
    assert default_num_pages(4096, [(0, 4096, 4096)], 100) == 0


def reference_copy(geom: Geometry, region: np.ndarray, pool: np.ndarray, pages, slots) -> None:
    """Page by page, segment by segment: what any plan must be equivalent to."""
    for i, slot in zip(pages, slots, strict=True):
        at = slot
        for s in geom.segments:
            pool[at : at + s.length] = region[s.offset + i * s.stride : s.offset + i * s.stride + s.length]
            at += s.length


def apply(p, region: np.ndarray, pool: np.ndarray) -> None:
    for r, q, n in zip(p.region_off, p.pool_off, p.length, strict=True):
        pool[q : q + n] = region[r : r + n]


def random_geometry(rng: random.Random) -> tuple[Geometry, int]:
    nseg = rng.choice([1, 1, 2, 3, 8])
    lengths = [rng.randint(1, 300) for _ in range(nseg)]
    num_pages = rng.randint(1, 40)
    segs, at = [], rng.randint(0, 50)
    for n in lengths:
        stride = n + rng.choice([0, 0, rng.randint(1, 64)])
        segs.append(Segment(at, n, stride))
        at += stride * num_pages + rng.randint(0, 16)
    return Geometry(sum(lengths), num_pages, tuple(segs)), at


def test_plans_move_the_same_bytes_as_a_page_by_page_copy():
    rng = random.Random(7)
    for _ in range(300):
        geom, size = random_geometry(rng)
        region = np.frombuffer(rng.randbytes(size), dtype=np.uint8)
        n = rng.randint(1, geom.num_pages)
        pages = rng.sample(range(geom.num_pages), n) if rng.random() < 0.5 else list(range(n))
        slot_bytes = geom.page_bytes + rng.choice([0, 0, 7])
        slots = [k * slot_bytes for k in range(n)]
        if rng.random() < 0.5:
            rng.shuffle(slots)
        want = np.zeros(n * slot_bytes, dtype=np.uint8)
        reference_copy(geom, region, want, pages, slots)
        p = plan(geom, pages, slots)
        got = np.zeros_like(want)
        apply(p, region, got)
        assert np.array_equal(got, want)
        parts = split(p, rng.randint(1, 5), rng.choice([1, 64, 1000]))
        assert sum(q.nbytes for q in parts) == p.nbytes
        got2 = np.zeros_like(want)
        for q in parts:
            assert (q.length > 0).all()
            apply(q, region, got2)
        assert np.array_equal(got2, want)


def test_contiguous_neighbours_coalesce_into_one_copy():
    g = Geometry(4096, 64, (Segment(0, 4096, 4096),))
    p = plan(g, list(range(10, 20)), [k * 8192 for k in range(10)])
    assert len(p) == 10  # slots not adjacent: nothing merges
    p = plan(g, list(range(10, 20)), [(1 << 20) + k * 4096 for k in range(10)])
    assert len(p) == 1 and p.nbytes == 40960 and p.region_off[0] == 40960
    two = Geometry(4096, 64, (Segment(0, 2048, 2048), Segment(131072, 2048, 2048)))
    assert len(plan(two, [0, 1, 2], [0, 4096, 8192])) == 6  # K and V are far apart: one range each


def test_split_cuts_ranges_into_equal_parts():
    g = Geometry(1 << 20, 8, (Segment(0, 1 << 20, 1 << 20),))
    p = plan(g, list(range(8)), [k << 20 for k in range(8)])
    assert len(p) == 1
    parts = split(p, 4, 1 << 20)
    assert [q.nbytes for q in parts] == [2 << 20] * 4
    assert [int(q.region_off[0]) for q in parts] == [0, 2 << 20, 4 << 20, 6 << 20]
    assert len(split(p, 4, 4 << 20)) == 2  # each job gets at least min_bytes
    assert len(split(p, 4, 64 << 20)) == 1


@pytest.mark.parametrize(
    "segments",
    [
        [[0, 64, 128], [128, 64, 128]],  # segment 1 of page i is segment 0 of page i+1
        [[0, 64, 128], [256, 64, 128]],  # ... of page i+2
        [[0, 64, 128], [32, 64, 128]],  # two segments of one page share bytes
        [[0, 64, 64], [100, 64, 128]],  # different strides whose extents meet
    ],
)
def test_overlapping_segments_are_refused(segments):
    assert "overlap" in bad({"page_bytes": 128, "num_pages": 4, "segments": segments}, 1 << 12)


def test_interleaved_layouts_are_accepted():
    page, n, layers = 4096, 64, 8
    layer_first = [[lay * n * page, page, page] for lay in range(2 * layers)]
    page_first = [[lay * page, page, 2 * layers * page] for lay in range(2 * layers)]
    for segs in (layer_first, page_first):
        g = parse_geometry({"page_bytes": 2 * layers * page, "num_pages": n, "segments": segs}, 1 << 30)
        assert len(g.segments) == 2 * layers
