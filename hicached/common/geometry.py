"""Region geometry, without I/O: where each page of an engine's memory region lives, and the copy plan
(coalesced byte ranges) that moves a batch of pages between a region and L2 pool slots.

Page `i`'s segment `j` lives at `segments[j].offset + i * segments[j].stride` in the region and is
`segments[j].length` bytes long; in L2 a page is the concatenation of its segments, in order. A region
without segments is one contiguous array of pages: a single segment `(0, page_bytes, page_bytes)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hicached.common.errors import BAD_REQUEST, HicachedError

MAX_SEGMENTS = 4096  # per page: a model with 128 layers and K and V halves needs 256
MAX_REGION_BYTES = 1 << 62  # the overlap test computes in int64; no region comes near this


@dataclass(frozen=True)
class Segment:
    offset: int
    length: int
    stride: int


@dataclass(frozen=True)
class Geometry:
    page_bytes: int
    num_pages: int
    segments: tuple[Segment, ...]

    @property
    def extent(self) -> int:
        """Bytes of the region that the last page's segments reach."""
        return max(s.offset + (self.num_pages - 1) * s.stride + s.length for s in self.segments)

    @property
    def contiguous(self) -> bool:
        return len(self.segments) == 1 and self.segments[0].offset == 0


def _bad(message: str) -> HicachedError:
    return HicachedError(BAD_REQUEST, message)


def _int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{what} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise _bad(f"{what} must be at least {minimum}, got {value}")
    return value


def default_num_pages(page_bytes: int, segments: list[tuple[int, int, int]] | None, nbytes: int) -> int:
    """How many whole pages of this geometry fit in `nbytes` (0 when not even one does)."""
    if not segments:
        return nbytes // page_bytes if page_bytes > 0 else 0
    n = None
    for off, length, stride in segments:
        room = nbytes - off - length
        if room < 0:
            return 0
        fit = room // stride + 1 if stride > 0 else 1
        n = fit if n is None else min(n, fit)
    return n or 0


_OVERLAP_ROWS = 256  # segments compared with all the others at once (bounds the arrays to 256 x 4096)


def _apart(segments: tuple[Segment, ...], num_pages: int) -> bool:
    """The two layouts engines use, recognised in O(n log n): segments each in a block of its own (layer
    first: their extents do not meet), or one stride with every segment in the same cell of it at offsets
    that do not meet (page first: each page is one cell). True only when no bytes can meet."""
    by_start = sorted((s.offset, s.offset + (num_pages - 1) * s.stride + s.length) for s in segments)
    if all(end <= nxt for (_, end), (nxt, _) in zip(by_start, by_start[1:], strict=False)):
        return True
    stride = segments[0].stride
    if any(s.stride != stride for s in segments):
        return False
    cells = {s.offset // stride for s in segments}
    arcs = sorted((s.offset % stride, s.length) for s in segments)
    if len(cells) != 1 or arcs[-1][0] + arcs[-1][1] > stride:
        return False
    return all(r + n <= nxt for (r, n), (nxt, _) in zip(arcs, arcs[1:], strict=False))


def _overlap(segments: tuple[Segment, ...], num_pages: int) -> tuple[int, int] | None:
    """A pair (j, k), j < k, of segments whose bytes meet in some pages i, i' (i == i' included), or None.

    Same stride s (each length <= s): segment k of page i + m meets segment j of page i iff
    -length_k < offset_k - offset_j + m * s < length_j for some |m| < num_pages, an interval of m. Different
    strides: refused when their extents meet at all (no engine layout interleaves those)."""
    if len(segments) < 2 or _apart(segments, num_pages):
        return None
    off = np.array([s.offset for s in segments], dtype=np.int64)
    ln = np.array([s.length for s in segments], dtype=np.int64)
    st = np.array([s.stride for s in segments], dtype=np.int64)
    end = off + (num_pages - 1) * st + ln
    n = len(segments)
    for a in range(0, n, _OVERLAP_ROWS):
        j = np.arange(a, min(a + _OVERLAP_ROWS, n))[:, None]
        k = np.arange(n)[None, :]
        spans = (off[j] < end[k]) & (off[k] < end[j]) & (k > j)
        if not spans.any():
            continue
        d = off[k] - off[j]
        s = st[j]
        m_lo = np.floor_divide(-ln[k] - d, s) + 1
        m_hi = -np.floor_divide(d - ln[j], s) - 1
        exact = np.maximum(m_lo, 1 - num_pages) <= np.minimum(m_hi, num_pages - 1)
        bad = spans & np.where(st[j] == st[k], exact, True)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            return int(j[r, 0]), int(c)
    return None


def parse_geometry(req: dict[str, Any], region_bytes: int) -> Geometry:
    """The geometry of a `region_attach` request, checked against the region's size; every error is a
    bad_request naming the field."""
    page_bytes = _int(req.get("page_bytes"), "page_bytes", 1)
    num_pages = _int(req.get("num_pages"), "num_pages", 1)
    raw = req.get("segments")
    if raw is None:
        segments = (Segment(0, page_bytes, page_bytes),)
    else:
        if not isinstance(raw, list | tuple) or not raw:
            raise _bad("segments must be a non-empty list of [offset, length, stride]")
        if len(raw) > MAX_SEGMENTS:
            raise _bad(f"segments has {len(raw)} entries; at most {MAX_SEGMENTS} per page")
        out = []
        for j, seg in enumerate(raw):
            if not isinstance(seg, list | tuple) or len(seg) != 3:
                raise _bad(f"segments[{j}] must be [offset, length, stride]")
            off = _int(seg[0], f"segments[{j}].offset", 0)
            length = _int(seg[1], f"segments[{j}].length", 1)
            stride = _int(seg[2], f"segments[{j}].stride", 1)
            if stride > MAX_REGION_BYTES:
                raise _bad(f"segments[{j}].stride ({stride}) is larger than any region")
            if stride < length:
                # Segment j of page i and of page i+1 would overlap: a load would race with itself.
                raise _bad(f"segments[{j}].stride ({stride}) is smaller than its length ({length})")
            out.append(Segment(off, length, stride))
        segments = tuple(out)
        total = sum(s.length for s in segments)
        if total != page_bytes:
            raise _bad(f"segments: lengths add up to {total} bytes, but page_bytes is {page_bytes}")
    if region_bytes > MAX_REGION_BYTES:
        raise _bad(f"a region of {region_bytes} bytes is larger than any memory ({MAX_REGION_BYTES} at most)")
    # Before the overlap test, whose arithmetic is in int64: every offset it meets is then within the region.
    for j, s in enumerate(segments):
        end = s.offset + (num_pages - 1) * s.stride + s.length
        if end > region_bytes:
            what = f"segments[{j}]" if raw is not None else "num_pages * page_bytes"
            raise _bad(
                f"{what}: page {num_pages - 1} ends at byte {end}, past the end of the region "
                f"({region_bytes} bytes)"
            )
    clash = _overlap(segments, num_pages)
    if clash is not None:
        j, k = clash
        # Two pages (or one page twice) would share bytes: a load writes into a page it was not asked to.
        raise _bad(f"segments[{j}] and segments[{k}] overlap (in one page or in two pages)")
    return Geometry(page_bytes, num_pages, segments)


def check_pages(value: Any, geom: Geometry, n_keys: int, unique: bool) -> list[int]:
    """`page_indices` of a store_pages/load_pages request: one in-range index per key (distinct for a load,
    where two keys written into one page would race)."""
    if not isinstance(value, list):
        raise _bad("page_indices must be a list of integers")
    if len(value) != n_keys:
        raise _bad(f"page_indices has {len(value)} entries but keys has {n_keys}")
    for k, i in enumerate(value):
        if type(i) is not int:
            raise _bad(f"page_indices[{k}] must be an integer, got {type(i).__name__}")
        if not 0 <= i < geom.num_pages:
            raise _bad(f"page_indices[{k}] = {i} is out of range: the region has {geom.num_pages} pages")
    if unique and len(set(value)) != len(value):
        raise _bad("page_indices names a page twice: two keys cannot be loaded into one page")
    return value


@dataclass
class Plan:
    """Byte ranges to copy: region bytes [region_off, +length) <-> pool bytes [pool_off, +length)."""

    region_off: np.ndarray
    pool_off: np.ndarray
    length: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


def plan(geom: Geometry, pages: list[int], slots: list[int]) -> Plan:
    """The coalesced copy plan for pages `pages` of the region and the pool slots at `slots`."""
    idx = np.asarray(pages, dtype=np.int64)
    slot = np.asarray(slots, dtype=np.int64)
    off = np.array([s.offset for s in geom.segments], dtype=np.int64)
    stride = np.array([s.stride for s in geom.segments], dtype=np.int64)
    length = np.array([s.length for s in geom.segments], dtype=np.int64)
    within = np.concatenate(([0], np.cumsum(length)[:-1]))
    # Page-major order: a page's segments are adjacent in its slot, so consecutive pages in consecutive
    # slots of a contiguous region merge into one range.
    region_off = (off[None, :] + idx[:, None] * stride[None, :]).ravel()
    pool_off = (slot[:, None] + within[None, :]).ravel()
    lengths = np.broadcast_to(length, (len(idx), len(length))).ravel()
    return coalesce(Plan(region_off, pool_off, np.ascontiguousarray(lengths)))


def coalesce(p: Plan) -> Plan:
    """Merge ranges that continue each other on both sides."""
    if len(p) < 2:
        return p
    ends_r = p.region_off[:-1] + p.length[:-1]
    ends_p = p.pool_off[:-1] + p.length[:-1]
    cont = (ends_r == p.region_off[1:]) & (ends_p == p.pool_off[1:])
    if not cont.any():
        return p
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    return Plan(p.region_off[starts], p.pool_off[starts], np.add.reduceat(p.length, starts))


def split(p: Plan, parts: int, min_bytes: int) -> list[Plan]:
    """Cut a plan into at most `parts` plans of about equal bytes (cutting ranges where needed), none
    smaller than `min_bytes` unless the whole plan is: a thread hop costs more than a small copy."""
    total = p.nbytes
    parts = max(1, min(parts, total // max(1, min_bytes)))
    if parts == 1:
        return [p]
    ends = np.cumsum(p.length)
    starts = ends - p.length
    out = []
    prev = 0
    for k in range(1, parts + 1):
        cut = total * k // parts
        i0 = int(np.searchsorted(ends, prev, side="right"))
        i1 = int(np.searchsorted(starts, cut, side="left"))
        r, q, n = p.region_off[i0:i1].copy(), p.pool_off[i0:i1].copy(), p.length[i0:i1].copy()
        head = prev - int(starts[i0])
        r[0] += head
        q[0] += head
        n[0] -= head
        n[-1] -= int(ends[i1 - 1]) - cut
        out.append(Plan(r, q, n))
        prev = cut
    return out
