"""Local regions: memory of the engine's own process (any CPU tensor or buffer: private, or shared) whose
pages the client copies between it and the shared pool itself, in one C call a batch with the GIL released,
taking each stored page's checksum in the same pass. The daemon never maps it: for memory an engine cannot
hand over (SGLang's default host pool is private anonymous memory). The same geometry as a region the
daemon copies (segments of (offset, length, stride)), the same store_pages / load_pages."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.common.geometry import Geometry, default_num_pages, parse_geometry, plan
from hicached.common.ranges import copy_ranges


def _as_uint8(memory: Any) -> np.ndarray:
    """A writable 1-D uint8 array over `memory` (a CPU tensor, a numpy array or a writable buffer)."""
    if hasattr(memory, "is_cuda") and hasattr(memory, "view"):
        import torch

        if memory.is_cuda or not memory.is_contiguous():
            raise HicachedError(BAD_REQUEST, "a local region is a contiguous CPU tensor")
        return memory.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(memory)
    except TypeError:
        raise HicachedError(BAD_REQUEST, "a local region is a CPU tensor or a writable buffer") from None
    if view.readonly or not view.c_contiguous:
        raise HicachedError(BAD_REQUEST, "a local region must be writable and contiguous")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


class LocalRegion:
    __slots__ = ("memory", "array", "geom")

    def __init__(self, memory: Any, page_bytes: int, segments: Any, num_pages: int | None) -> None:
        self.memory = memory  # kept alive while registered
        self.array = _as_uint8(memory)
        segs = [[int(v) for v in s] for s in segments] if segments is not None else None
        if num_pages is None:
            num_pages = default_num_pages(
                page_bytes, [tuple(s) for s in segs] if segs else None, self.array.size
            )
        req: dict[str, Any] = {"page_bytes": page_bytes, "num_pages": num_pages}
        if segs is not None:
            req["segments"] = segs
        self.geom: Geometry = parse_geometry(req, self.array.size)  # the daemon's checks, raised here

    def copy(self, pool: np.ndarray, pages: list[int], slots: list[int], to_pool: bool) -> list[int] | None:
        """Pages `pages` into (or out of) the pool's slots at `slots`; into the pool, their checksums."""
        p = plan(self.geom, pages, slots)
        if not to_pool:
            copy_ranges(pool, self.array, p, False)
            return None
        sums = np.zeros(len(pages), dtype=np.uint64)
        copy_ranges(pool, self.array, p, True, (self.geom.page_bytes, sums))
        return sums.tolist()


class RegionPage(NamedTuple):
    """Page `index` of a local region, where a store or load takes a page buffer."""

    region: LocalRegion
    index: int
