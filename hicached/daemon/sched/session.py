"""An engine connection's state in the tiers (Session) and a prefetch it has not waited on yet (Handle)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.daemon.l2.index import Entry


@dataclass
class Handle:
    entries: list[Entry]
    created: float = field(default_factory=time.monotonic)
    placed: asyncio.Future[None] | None = None  # while keys are still being placed: done when all are


@dataclass
class Session:
    """One engine connection's view: everything it holds is released by Tiers.close_session."""

    peer: str = ""
    tenant: str = "default"  # the tenant the peer belongs to (hicached.daemon.server.tenants)
    ns: str = ""
    page_bytes: int = 0
    leases: dict[int, list[Entry]] = field(default_factory=dict)
    writing: dict[str, Entry] = field(default_factory=dict)
    reserved: dict[int, Entry] = field(default_factory=dict)  # offset -> slot set aside for its stores
    # Slots the daemon copies a store_pages into: out of reach of the engine's commit, abort and hello, which
    # would give them away while the copy still writes them; committed or aborted by the copy's request.
    copying: set[Entry] = field(default_factory=set)
    # Leases of the pages a load_pages copies out of, by lease id: out of reach of the engine's release,
    # which would let the slots be reused while the copy still reads them.
    loading: dict[int, list[Entry]] = field(default_factory=dict)
    handles: dict[int, Handle] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # hicached.daemon.regions.service.SessionRegions once the connection registers a memory region.
    regions: Any = None

    def require_hello(self) -> None:
        if not self.ns:
            raise HicachedError(BAD_REQUEST, "send hello with a namespace and page_bytes first")
