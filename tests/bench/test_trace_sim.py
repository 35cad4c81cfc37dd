"""bench/trace_sim.py on hand-made traces whose answers are worked out by hand, and bench/make_trace.py's
traces (the shape the simulators rely on)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import make_trace  # noqa: E402
import trace_sim  # noqa: E402


def one_by_one(m: int) -> list[tuple[int, int]]:
    """A store that allocates each page by itself."""
    return [(i, i + 1) for i in range(m)]


def test_max_counts_leading_blocks_seen_before() -> None:
    r = trace_sim.max_hits([[1, 2], [1, 3], [1, 2, 4]])
    assert (r.hits, r.blocks) == (3, 7)


def test_max_stops_at_the_first_block_never_seen() -> None:
    assert trace_sim.max_hits([[2], [1, 2]]).hits == 0


def test_lru_evicts_the_least_recently_used() -> None:
    assert trace_sim.lru([[1], [2], [3], [1]], 2).hits == 0
    assert trace_sim.lru([[1], [2], [1], [3], [1]], 2).hits == 2  # 1 used again, so 2 goes


def test_lru_counts_only_leading_hits_but_touches_the_rest() -> None:
    # [1, 2]: 1 misses, so 2 (present) is no hit; the store touches it and takes a free slot for 1.
    r = trace_sim.lru([[2], [1, 2], [2], [1]], 2)
    assert (r.hits, r.blocks) == (2, 5)


def test_lru_touches_present_blocks_of_a_store_before_it_evicts() -> None:
    # Cache 10, 11, 12 (LRU first). [99, 10]: the daemon's allocation touches 10 first, then evicts 11 for
    # 99: 12, 10, 99. 13 and 14 evict 12 and 10: 99 is a hit. Allocating page by page, 99 would evict 10,
    # 10 then evict 11 (12, 99, 10), and 13 and 14 evict 12 and 99: no hit.
    reqs = [[10], [11], [12], [99, 10], [13], [14], [99]]
    assert trace_sim.lru(reqs, 3).hits == 1
    assert trace_sim.lru(reqs, 3, chunks=one_by_one).hits == 0


def test_lru_refuses_what_a_request_cannot_fit() -> None:
    # A page being written is not evictable: 3 new pages in a pool of 2 leave one refused.
    r = trace_sim.lru([[1, 2, 3], [1, 2]], 2)
    assert (r.hits, r.refused) == (2, 1)


def test_lru_refuses_a_block_an_earlier_chunk_of_the_store_is_writing() -> None:
    r = trace_sim.lru([[1, 2, 1]], 5, chunks=one_by_one)
    assert r.refused == 1
    assert trace_sim.lru([[1, 2, 1]], 5).refused == 0  # one allocation: the second ask rides on the first


def test_client_chunks_follow_the_client() -> None:
    assert trace_sim.client_chunks(0) == []
    assert trace_sim.client_chunks(15) == [(0, 15)]
    assert trace_sim.client_chunks(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert trace_sim.client_chunks(18) == [(0, 4), (4, 9), (9, 13), (13, 18)]


def test_next_uses() -> None:
    assert trace_sim.next_uses([[1, 2], [1], [2, 3]]) == [2, 3, 5, 5, 5]


def test_belady_evicts_the_farthest_next_use() -> None:
    reqs = [[1], [2], [3], [1], [2], [3]]
    # 3 evicts 2 (used after 1); 2 then evicts 1 (never used again): 1 and 3 hit. LRU hits nothing.
    assert trace_sim.belady(reqs, 2).hits == 2
    assert trace_sim.lru(reqs, 2).hits == 0


def test_belady_keeps_a_shared_prefix() -> None:
    # A system prompt [1, 2] before every conversation: with 3 pages the optimum keeps it. Caching every
    # block, 4 evicts 3 (the farthest of 1, 2, 3); declining 4 and 5 keeps 3 for its second use.
    reqs = [[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 3, 6], [1, 2, 7]]
    assert trace_sim.belady(reqs, 3).hits == 8
    assert trace_sim.belady(reqs, 3, bypass=True).hits == 9
    assert trace_sim.max_hits(reqs).hits == 9


def test_belady_of_no_room_hits_nothing() -> None:
    assert trace_sim.belady([[1], [1]], 0).hits == 0
    assert trace_sim.belady([[1], [1]], 0, bypass=True).hits == 0


def test_belady_bypass_declines_a_block_used_later_than_all_cached() -> None:
    # 1 and 2 come back before 3 does: caching 3 would evict one of them.
    reqs = [[1], [2], [3], [1], [2], [3]]
    assert trace_sim.belady(reqs, 2, bypass=True).hits == 2
    assert trace_sim.belady([[1], [2], [3], [1], [2], [1]], 2, bypass=True).hits == 3


@pytest.mark.parametrize("capacity", [60, 100, 300, 1000])
def test_belady_is_at_least_lru_and_at_most_max_on_a_prefix_trace(capacity: int) -> None:
    reqs = [r["hash_ids"] for r in make_trace.make_trace(150, seed=5)]
    assert capacity >= max(map(len, reqs))  # no store refused: LRU caches every block too
    top = trace_sim.max_hits(reqs).hits
    lru, opt = trace_sim.lru(reqs, capacity), trace_sim.belady(reqs, capacity)
    assert lru.refused == 0
    assert lru.hits <= opt.hits <= trace_sim.belady(reqs, capacity, bypass=True).hits <= top


@pytest.mark.parametrize("capacity", [1, 3, 10, 40])
def test_a_pool_smaller_than_a_request_keeps_its_head_which_only_bypass_bounds(capacity: int) -> None:
    # The daemon refuses the new blocks a full pool cannot evict for, so it keeps a request's first pages:
    # MIN that caches every block (keeping its last ones) may get fewer leading hits; MIN with bypass not.
    reqs = [r["hash_ids"] for r in make_trace.make_trace(150, seed=5)]
    lru = trace_sim.lru(reqs, capacity)
    assert lru.refused > 0
    assert lru.hits <= trace_sim.belady(reqs, capacity, bypass=True).hits


def test_check_prefix_closed() -> None:
    assert trace_sim.check_prefix_closed([[1, 2], [1, 3], [1, 2, 4]])
    assert not trace_sim.check_prefix_closed([[1, 2], [3, 2]])


def test_parse_trace_names_the_bad_line() -> None:
    good = '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}'
    assert trace_sim.parse_trace([good, ""])[0] == trace_sim.TraceRequest(5.0, 700, 3, [1, 2])
    with pytest.raises(ValueError, match="line 2"):
        trace_sim.parse_trace([good, '{"timestamp": 1}'])


def test_make_trace_is_seeded_prefix_closed_and_reuses_prefixes() -> None:
    a = make_trace.make_trace(300, seed=7)
    assert a == make_trace.make_trace(300, seed=7)
    assert a != make_trace.make_trace(300, seed=8)
    assert len(a) == 300
    assert all(r["timestamp"] <= s["timestamp"] for r, s in zip(a, a[1:], strict=False))
    for r in a:
        assert len(r["hash_ids"]) == -(-r["input_length"] // make_trace.BLOCK_TOKENS)
    reqs = [r["hash_ids"] for r in a]
    assert trace_sim.check_prefix_closed(reqs)
    assert 0.2 < trace_sim.max_hits(reqs).hit_rate < 0.9
