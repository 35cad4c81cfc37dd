"""Where the pages of an SGLang host pool lie in its memory, for hicached's regions.

A page of an SGLang host pool, as `get_data_page(index, flat=True)` returns it, is a strided view of the
pool's buffer, flattened. That view is the concatenation of contiguous runs of bytes (for MHA's
`layer_first`, one run per layer for K and one for V; for `page_first`, one for K and one for V), each at
the same offset from the page's start in every page: a region's segments. They are read off SGLang's own
view (`get_data_page(index, flat=False)`), not from a table of layouts, and checked against the flat page
SGLang makes, so that a layout this module does not know is refused rather than copied wrong."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from hicached.common.geometry import MAX_SEGMENTS


@dataclass(frozen=True)
class PageGeometry:
    """`segments`: (offset, length, stride) in bytes from the start of the pool's storage, page-major:
    page `i`'s segment `j` starts at `offset_j + i * stride_j`. `storage`: the torch storage they are in."""

    page_bytes: int
    num_pages: int
    tokens: int  # tokens per page: host indices are token indices
    segments: tuple[tuple[int, int, int], ...]
    storage: Any
    storage_bytes: int


class NotSegmentable(ValueError):
    """The pool's pages are not whole runs of one buffer at fixed offsets (or do not read back as SGLang
    makes them): they move through SGLang's own page methods instead."""


def page_geometry(pool: Any) -> PageGeometry:
    """The geometry of `pool`'s pages, checked against `get_data_page(.., flat=True)` on the first and last
    page. NotSegmentable when it cannot be described as a region."""
    import torch

    tokens = int(getattr(pool, "page_size", 1) or 1)
    flat = pool.get_dummy_flat_data_page()
    page_bytes = flat.numel() * flat.element_size()
    num_pages = _num_pages(pool, tokens)
    if num_pages < 2:
        raise NotSegmentable("the pool holds fewer than two pages")
    first, second = pool.get_data_page(0, flat=False), pool.get_data_page(tokens, flat=False)
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        raise NotSegmentable("its pages are not CPU tensors")
    storage = first.untyped_storage()
    base = storage.data_ptr()
    if second.untyped_storage().data_ptr() != base:
        raise NotSegmentable("its pages are not in one buffer")
    size = first.element_size()
    if first.numel() * size != page_bytes:
        raise NotSegmentable("a page's view does not hold a page")
    stride = second.data_ptr() - first.data_ptr()
    # Dims of size 1 say nothing of the layout; the others, innermost first, merge while contiguous.
    dims = [(n, s) for n, s in zip(first.shape, first.stride(), strict=True) if n != 1]
    run, k = 1, len(dims)
    while k and dims[k - 1][1] == run:
        run *= dims[k - 1][0]
        k -= 1
    if k == len(dims) and dims:
        raise NotSegmentable("the innermost dimension of a page is not contiguous")
    outer = dims[:k]
    count = 1
    for n, _ in outer:
        count *= n
    if count > MAX_SEGMENTS:
        raise NotSegmentable(f"a page is made of {count} runs, more than {MAX_SEGMENTS}")
    start = first.data_ptr() - base
    segments = tuple(
        (start + size * sum(i * s for i, (_, s) in zip(idx, outer, strict=True)), run * size, stride)
        for idx in itertools.product(*(range(n) for n, _ in outer))
    )
    geom = PageGeometry(page_bytes, num_pages, tokens, segments, storage, storage.nbytes())
    if any(off < 0 or off + (num_pages - 1) * st + ln > geom.storage_bytes for off, ln, st in segments):
        raise NotSegmentable("its pages do not all lie inside its buffer")
    for page in (0, num_pages - 1):
        if read_page(geom, page) != _bytes(pool.get_data_page(page * tokens, flat=True)):
            raise NotSegmentable(f"page {page} read as segments differs from SGLang's flat page")
    return geom


def _num_pages(pool: Any, tokens: int) -> int:
    for attr in ("page_num", "num_pages"):
        n = getattr(pool, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    size = getattr(pool, "size", 0)
    return int(size) // tokens if isinstance(size, int) else 0


def storage_bytes(geom: PageGeometry) -> Any:
    """The pool's whole storage as a uint8 tensor (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(geom.storage, 0, (geom.storage_bytes,))


def read_page(geom: PageGeometry, page: int) -> bytes:
    raw = storage_bytes(geom).numpy()
    return b"".join(raw[o + page * s : o + page * s + n].tobytes() for o, n, s in geom.segments)


def _bytes(t: Any) -> bytes:
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def shared_fd(pool: Any, geom: PageGeometry) -> tuple[int, int] | None:
    """The memfd of a pool SGLang allocated with `"allocator": "shm"` and where the pool's storage starts in
    it, found in /proc/self/maps (the mapping of that file's inode that holds the storage); None for a pool
    in private memory."""
    fd = getattr(pool, "fd", None)
    if fd is None:
        fd = getattr(getattr(pool, "allocator", None), "fd", None)
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        st = os.fstat(fd)
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return None
    base = geom.storage.data_ptr()
    for line in maps:
        parts = line.split()
        if len(parts) < 5 or int(parts[4]) != st.st_ino:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= base and base + geom.storage_bytes <= hi:
            start = base - lo + int(parts[2], 16)  # the storage's offset in the file
            if start + geom.storage_bytes <= st.st_size:
                return fd, start
    return None
