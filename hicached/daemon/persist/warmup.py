"""Warmup: after a cold start, refill L2 from L3 with what was in it before, pinned pages first.

The daemon keeps a warm list: the pages of L2 that are also in L3, pinned ones first, then the most
recently used, with their namespace and page size. It is written atomically at shutdown and every
`warmup.snapshot_interval`, so a crash still leaves a recent one. At start-up the list is read back and
prefetched at a priority below any engine's request, up to `warmup.max_fraction` of the pool (of each
tenant's pool, with tenants: a Budget); pinned pages are pinned again.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import msgpack

from hicached.common.keys import valid_key, valid_namespace
from hicached.daemon.l2.index import READY, PageIndex
from hicached.daemon.l2.slabs import slot_size

log = logging.getLogger("hicached.warmup")

FORMAT = 1
PINNED_PRIORITY = -1  # below every engine prefetch (priority >= 0), above the rest of the warmup
WARM_PRIORITY = -2
CHUNK = 16  # keys per fetch: a page gone from L3 then only skips its own chunk


@dataclass(frozen=True)
class WarmPage:
    ns: str
    key: str
    page_bytes: int
    pinned: bool


class Budget:
    """The bytes of slots the warm list may take: `limits[a]` for the pages of arena a (a tenant's pool:
    warmup.max_fraction of each), the arena of a namespace by `arena_of`. An int is one bound for the whole
    pool. take() counts a page against its arena's bound and says whether it still fits; `full` once every
    arena's is passed."""

    def __init__(self, limits: int | list[int], arena_of: Callable[[str], int] | None = None) -> None:
        self.limits = [limits] if isinstance(limits, int) else list(limits)
        self.arena_of = arena_of if arena_of is not None and len(self.limits) > 1 else (lambda ns: 0)
        self.used = [0] * len(self.limits)
        self._open = len(self.limits)

    def take(self, ns: str, nbytes: int) -> bool:
        a = self.arena_of(ns)
        if not 0 <= a < len(self.limits):
            return False  # a namespace no arena holds now
        if self.used[a] > self.limits[a]:
            return False
        self.used[a] += nbytes
        if self.used[a] > self.limits[a]:
            self._open -= 1
            return False
        return True

    @property
    def full(self) -> bool:
        return self._open <= 0


def _budget(limit: int | Budget) -> Budget:
    return limit if isinstance(limit, Budget) else Budget(limit)


def snapshot(index: PageIndex, limit_bytes: int | Budget) -> list[WarmPage]:
    """Pages worth warming, in the order to warm them: pinned, then most recently used first, each page
    size keeping its share of the list (see _by_share)."""
    pinned = [e for e in index.entries.values() if e.pinned]
    mru_first = [lst[::-1] for lst in index.lru_lists()]
    return _take(itertools.chain(pinned, _by_share(mru_first)), _budget(limit_bytes))


async def snapshot_async(index: PageIndex, limit_bytes: int | Budget, step: int = 20000) -> list[WarmPage]:
    """The same, giving the event loop a turn every `step` pages (a large pool holds many)."""
    pinned = [e for e in list(index.entries.values()) if e.pinned]
    mru_first = []
    for values in index.lru_lists():
        await asyncio.sleep(0)
        values.reverse()
        mru_first.append(values)
    merged = itertools.chain(pinned, _by_share(mru_first))
    out: list[WarmPage] = []
    budget = _budget(limit_bytes)
    while chunk := list(itertools.islice(merged, step)):
        out += _take_more(chunk, budget)
        if budget.full:
            break
        await asyncio.sleep(0)
    return out


def _by_share(lists: list[list]) -> Iterator:
    """The size classes' LRU lists (most recent first) merged so that a cut anywhere keeps the same share
    of each: the j-th of a list of n sits at (j + 0.5) / n. L2 keeps no time of use across classes, and
    one class after another would cut the last class's pages however recently they were used."""
    return (e for _, _, e in heapq.merge(*(_ranked(c, lst) for c, lst in enumerate(lists))))


def _ranked(c: int, lst: list) -> Iterator[tuple[float, int, object]]:
    n = len(lst)
    return (((j + 0.5) / n, c, e) for j, e in enumerate(lst))


def _take(entries: Iterable, budget: Budget) -> list[WarmPage]:
    return _take_more(entries, budget)


def _take_more(entries: Iterable, budget: Budget) -> list[WarmPage]:
    """The ready pages of `entries` in L3 whose slots fit in what `budget` has left for their arena."""
    out = []
    for e in entries:
        if e.state != READY or not e.in_l3:
            continue
        if budget.take(e.ns, e.cls.slot_bytes):
            out.append(WarmPage(e.ns, e.key, e.size, e.pinned))
        elif budget.full:
            break
    return out


def merge(first: list[WarmPage], rest: list[WarmPage], limit_bytes: int | Budget) -> list[WarmPage]:
    """`first` (a snapshot of L2) and the pages of `rest` (a warm list not yet replayed) that it lacks,
    pinned ones of both first, up to `limit_bytes` of slots: a stop before the replay is done must not
    lose the rest of the list."""
    if not rest:
        return first
    seen = {(p.ns, p.key) for p in first}
    extra = [p for p in rest if (p.ns, p.key) not in seen]
    ordered = [p for p in first if p.pinned] + [p for p in extra if p.pinned]
    ordered += [p for p in first if not p.pinned] + [p for p in extra if not p.pinned]
    out = []
    budget = _budget(limit_bytes)
    for p in ordered:
        if budget.take(p.ns, slot_size(p.page_bytes)):
            out.append(p)
        elif budget.full:
            break
    return out


def save(path: str, pages: list[WarmPage]) -> None:
    """Write the warm list atomically (temporary file, then rename). Blocking: run it in a thread."""
    body = msgpack.packb(
        {"format": FORMAT, "pages": [[p.ns, p.key, p.page_bytes, p.pinned] for p in pages]}, use_bin_type=True
    )
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".warm.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: str, max_bytes: int = 1 << 30) -> list[WarmPage]:
    """The warm list, or [] when there is none or it cannot be read (logged): warmup is best effort."""
    try:
        if os.path.getsize(path) > max_bytes:
            raise ValueError(f"larger than {max_bytes} bytes")
        with open(path, "rb") as f:
            data = msgpack.unpackb(f.read(), raw=False)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("unknown format")
        pages = []
        for ns, key, page_bytes, pinned in data["pages"]:
            if valid_namespace(ns) and valid_key(key) and isinstance(page_bytes, int) and page_bytes > 0:
                pages.append(WarmPage(ns, key, page_bytes, bool(pinned)))
        return pages
    except FileNotFoundError:
        return []
    except Exception as e:
        log.warning("ignoring the warm list %s: %s", path, e)
        return []


async def warm(tiers, pages: list[WarmPage], limit_bytes: int | Budget) -> int:
    """Prefetch `pages` into L2 (tiers: hicached.daemon.sched.tiers.Tiers); returns how many arrived. The
    pages end up in L2's LRU in the order they had: the first of the list (the most recently used) the last
    evicted."""
    done, arrived = 0, 0
    todo = []
    warmed = []
    budget = _budget(limit_bytes)
    for p in pages:
        if slot_size(p.page_bytes) > tiers.cfg.pool.slab_size:
            continue  # pool.slab_size was lowered since the list was written: no slot can hold it
        known = tiers.namespaces.setdefault(p.ns, p.page_bytes)
        if known != p.page_bytes:
            continue
        if budget.take(p.ns, p.page_bytes):
            todo.append(p)
        elif budget.full:
            break
    for start in range(0, len(todo), CHUNK):
        chunk = todo[start : start + CHUNK]
        by_ns: dict[tuple[str, int, bool], list[str]] = {}
        for p in chunk:
            by_ns.setdefault((p.ns, p.page_bytes, p.pinned), []).append(p.key)
        for (ns, page_bytes, pinned), keys in by_ns.items():
            priority = PINNED_PRIORITY if pinned else WARM_PRIORITY
            entries = tiers.prefetcher.fetch(ns, keys, page_bytes, priority)
            futures = {e.fill for e in entries if e.fill is not None}
            if futures:
                await asyncio.wait(futures)
            for e in entries:
                if e.state == READY and tiers.index.live(e):
                    arrived += 1
                    warmed.append(e)
                    if pinned:
                        tiers.pin_entry(e)
            done += len(keys)
    # They came in most recently used first: file them back the other way, giving the loop a turn now and
    # then (a large pool holds many).
    for i, e in enumerate(reversed(warmed), 1):
        tiers.index.touch(e)
        if i % 20000 == 0:
            await asyncio.sleep(0)
    tiers.counters["warmup.pages"] += arrived
    log.info("warmup: %d of %d pages brought back from L3", arrived, len(todo))
    return arrived
