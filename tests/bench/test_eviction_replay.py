"""bench/eviction_replay.py: the index alone on a trace. Under LRU it agrees with the offline LRU of
bench/trace_sim.py page for page (a store allocating page by page); every policy runs to the end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import eviction_replay  # noqa: E402
import make_trace  # noqa: E402
import trace_sim  # noqa: E402


def test_the_index_under_lru_hits_what_the_offline_lru_hits() -> None:
    requests = [r["hash_ids"] for r in make_trace.make_trace(600, seed=3)]
    for capacity in (64, 256):
        rate, state = eviction_replay.replay(requests, capacity, "lru")
        offline = trace_sim.lru(requests, capacity, chunks=lambda m: [(i, i + 1) for i in range(m)])
        assert state is None
        assert round(rate * offline.blocks) == offline.hits


def test_every_policy_replays_the_trace() -> None:
    requests = [r["hash_ids"] for r in make_trace.make_trace(300, seed=1)]
    for eviction in ("slru", "auto"):
        rate, state = eviction_replay.replay(requests, 128, eviction)
        assert 0 < rate < 1
        assert (state is not None) == (eviction == "auto")
