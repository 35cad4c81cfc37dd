"""Offline caches replayed over a prefix-cache trace (bench/bench_trace.py): the theoretical maximum, the LRU
the daemon's L2 is, and the offline optimum (Belady), as pure functions of the requests' block ids.

Every function sees a trace as a list of requests, each the list of its block ids (Mooncake's `hash_ids`:
equal ids, equal prefix), and counts a request's hits as the engine gets them: the *leading* blocks found
when it looks up (a lookup stops at the first miss). After the lookup the engine loads those leading hits
and stores the rest of the request, so every block of every request is accessed once, in the request's
order. What each cache does with those accesses:

- `max_hits`: an unbounded cache: a block is a hit if any earlier request held it.
- `lru`: the daemon's L2 as one engine drives it, one namespace of one page size, no L3, no slots held
  ahead (`pool.reserve_per_connection = 0`). Per request: the leading hits are loaded, which moves them to
  the most recently used end, in order; the rest are stored with `Client.store`, which cuts them into
  chunks (`client_chunks`) whose allocations the daemon answers one after the other before any commit:
  within a chunk, the blocks still present (a lookup stops at the first miss, so a block after it may be
  there) move to the MRU end first, then slots are taken for the absent ones, from free slots, then by
  evicting the LRU end. A page being written is not evictable and not yet in the LRU; the request's new
  pages enter it at the MRU end, in order, once all its chunks are allocated (the commits). A chunk that
  finds no slot left (every page is this request's) has its remaining blocks refused. (A plain LRU of the
  flattened accesses differs only when a block present after a miss sits at the LRU end as the store
  evicts: on the synthetic Mooncake trace both get the same hits at 2,000 to 20,000 pages.)
- `belady`: MIN with demand paging on the same access sequence (the requests' blocks in order, flattened):
  every block accessed is cached, and when full the cached block whose next access is farthest (or never)
  is evicted. It maximizes the hits over all accesses. When every occurrence of a block is preceded in
  its request by its parent block (true of chain ids: `check_prefix_closed`), a parent's next access
  always comes before its child's (or neither comes again), so a child MIN keeps without its parent is
  never accessed again: every hit it gets is a leading one, and no cache that stores every block it is
  given gets more leading hits. A cache that declines some blocks is not bounded by it: an admission
  policy, or the daemon itself when a request has more new blocks than the pool has pages to evict (it
  keeps the request's first pages and refuses the rest, which a capacity of a few pages turns into hits
  MIN does not get).
- `belady(..., bypass=True)`: MIN that may also decline to cache a block (when its next access is no
  nearer than every cached block's): the most hits any cache gets on the sequence, whatever it admits;
  on chain ids, the most leading hits too.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hicached.engine.store import _PIPELINE_CHUNKS, _PIPELINE_MIN_PAGES

Requests = Sequence[Sequence[int]]  # each request's block ids, in order


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace in Mooncake's FAST'25 format."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True)
class SimResult:
    hits: int  # leading hits over all requests
    blocks: int  # blocks over all requests
    refused: int = 0  # blocks a store could not take (no slot left); LRU only

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(
                TraceRequest(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d.get("output_length", 0)),
                    [int(b) for b in d["hash_ids"]],
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"line {n}: not a trace request ({e})") from None
    return out


def read_trace(path: str | Path) -> list[TraceRequest]:
    with open(path) as f:
        return parse_trace(f)


def check_prefix_closed(requests: Requests) -> bool:
    """Whether every block id has one parent (the id before it in its request; None first) across the
    trace: ids are chain ids, a block names its whole prefix."""
    parent: dict[int, int | None] = {}
    for blocks in requests:
        prev = None
        for b in blocks:
            if parent.setdefault(b, prev) != prev:
                return False
            prev = b
    return True


def client_chunks(m: int) -> list[tuple[int, int]]:
    """How `Client.store` cuts a store of `m` pages into allocations (hicached/engine/store.py, with no slots
    held ahead): 4 chunks from 16 pages, else one."""
    if m == 0:
        return []
    chunks = _PIPELINE_CHUNKS if m >= _PIPELINE_MIN_PAGES else 1
    return [(m * c // chunks, m * (c + 1) // chunks) for c in range(chunks)]


def _leading(blocks: Sequence[int], cached: Callable[[int], bool]) -> int:
    n = 0
    for b in blocks:
        if not cached(b):
            break
        n += 1
    return n


def max_hits(requests: Requests) -> SimResult:
    seen: set[int] = set()
    hits = blocks = 0
    for req in requests:
        hits += _leading(req, seen.__contains__)
        blocks += len(req)
        seen.update(req)
    return SimResult(hits, blocks)


def lru(
    requests: Requests,
    capacity: int,
    chunks: Callable[[int], list[tuple[int, int]]] = client_chunks,
) -> SimResult:
    """The daemon's L2 LRU of `capacity` pages (the module's docstring says what it models)."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    hits = blocks = refused = 0
    for req in requests:
        blocks += len(req)
        n = _leading(req, cache.__contains__)
        hits += n
        for b in req[:n]:
            cache.move_to_end(b)
        rest = req[n:]
        writing: list[int] = []  # this request's new pages: slots taken, not yet in the LRU
        taken: set[int] = set()
        for lo, hi in chunks(len(rest)):
            want: list[int] = []
            mine: set[int] = set()
            for b in rest[lo:hi]:
                if b in cache:
                    cache.move_to_end(b)
                elif b in mine:
                    pass  # asked twice in one allocation: stored with the first
                elif b in taken:
                    refused += 1  # being written by an earlier chunk of this store: busy
                else:
                    want.append(b)
                    mine.add(b)
            free = capacity - len(cache) - len(writing)
            evict = min(max(0, len(want) - free), len(cache))
            for _ in range(evict):
                cache.popitem(last=False)
            got = min(len(want), max(0, free) + evict)
            refused += len(want) - got
            writing += want[:got]
            taken.update(want)
        for b in writing:
            cache[b] = None
    return SimResult(hits, blocks, refused)


def next_uses(requests: Requests) -> list[int]:
    """For each access of the flattened sequence, the position of the next access of its block (a number
    past the end when there is none)."""
    flat = [b for req in requests for b in req]
    never = len(flat)
    out = [never] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        out[i] = last.get(flat[i], never)
        last[flat[i]] = i
    return out


def belady(requests: Requests, capacity: int, bypass: bool = False) -> SimResult:
    """MIN of `capacity` pages on the flattened access sequence (the module's docstring says what it models),
    hits counted as leading hits at each request's lookup. With `bypass`, a block is not cached when its
    next access is no nearer than every cached block's."""
    nxt = next_uses(requests)
    cached: dict[int, int] = {}  # block -> the position of its next access
    heap: list[tuple[int, int]] = []  # (-next access, block); stale entries skipped when popped
    hits = blocks = 0
    pos = 0
    for req in requests:
        blocks += len(req)
        hits += _leading(req, cached.__contains__)
        for b in req:
            nu = nxt[pos]
            pos += 1
            if b not in cached:
                if capacity <= 0:
                    continue
                while len(cached) >= capacity:
                    far, victim = heap[0]
                    if cached.get(victim) != -far:
                        heapq.heappop(heap)  # stale: that block was accessed again, or evicted
                    elif bypass and nu >= -far:
                        break
                    else:
                        heapq.heappop(heap)
                        del cached[victim]
                if len(cached) >= capacity:
                    continue
            cached[b] = nu
            heapq.heappush(heap, (-nu, b))
    return SimResult(hits, blocks)
