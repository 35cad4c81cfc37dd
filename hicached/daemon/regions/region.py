"""What the daemon keeps of a registered region (its geometry, the memory it maps or opened, the copies on
it) and of one connection's regions."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicached.common.geometry import Geometry
from hicached.daemon.sched.tiers import Session

log = logging.getLogger("hicached.regions")


class Region:
    """One registered region: its geometry, and the memory it maps (host) or opened (CUDA)."""

    def __init__(self, handle: int, kind: str, geom: Geometry, nbytes: int) -> None:
        self.handle = handle
        self.kind = kind
        self.geom = geom
        self.nbytes = nbytes
        self.users = 0  # copies running on it
        self.closed = False  # unregistered: released once `users` drops to 0
        self.released = False
        self.gone: str | None = None  # dropped, its memory gone: what its requests are answered
        self.mm: mmap.mmap | None = None
        self.array: np.ndarray | None = None  # host: uint8 view of the region's bytes
        self.end = 0  # host: the memfd's bytes the region reaches
        self.may_shrink = False  # host: an unsealed memfd, or a tmpfs file (copied guarded)
        self.memory = "memfd"  # host: what the fd is (hicached.common.memfd), as messages name it
        self.device: int | None = None  # cuda: device index in this process
        self.tensor: Any = None  # cuda: uint8 tensor over the region

    def unmap(self) -> None:
        self.array = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                log.warning("region %d still has views; it stays mapped until they go", self.handle)
            self.mm = None


@dataclass
class SessionRegions:
    """The regions of one connection, and the copies it has running."""

    regions: dict[int, Region] = field(default_factory=dict)
    bytes: int = 0  # registered, plus being registered
    opening: int = 0
    inflight: int = 0
    closing: bool = False
    session: Session | None = None
    after: Callable[[Session], None] | None = None
    dropped: dict[int, str] = field(default_factory=dict)  # handle -> why, for regions whose memory went
    board: mmap.mmap | None = None  # the fence board (hicached.common.fence), once registered
