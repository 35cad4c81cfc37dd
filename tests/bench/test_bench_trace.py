"""bench/bench_trace.py's smoke run: a small generated trace (bench/make_trace.py) replayed through a real
daemon by one engine, whose L2 hits must be exactly the offline LRU's (bench/trace_sim.py: the L2 is an
exact LRU, and the simulator models the daemon's access pattern), and by two engines over a file L3; every
loaded byte is checked by the engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_trace  # noqa: E402
import make_trace  # noqa: E402
import trace_sim  # noqa: E402

CAPACITY = 50  # pages: below the longest request's blocks, so that stores are refused too


@pytest.fixture(scope="module")
def trace() -> list[trace_sim.TraceRequest]:
    return trace_sim.parse_trace(json.dumps(r) for r in make_trace.make_trace(300, seed=3))


def test_one_engine_gets_exactly_the_offline_lru(trace, tmp_path) -> None:
    reqs = [r.hash_ids for r in trace]
    lru = trace_sim.lru(reqs, CAPACITY)
    assert lru.refused > 0 and lru.hits > 100  # the trace exercises evictions, refusals and hits
    r = bench_trace.replay(trace, CAPACITY, tmp_path, engines=1, page_bytes=8192, eviction="lru")
    assert (r["wrong_bytes"], r["wrong_pages"]) == (0, 0)
    assert (r["requests"], r["blocks"]) == (len(trace), lru.blocks)
    assert r["loaded"] == r["exists_hits"] == r["l2_hits"]
    assert (r["l2_hits"], r["refused"]) == (lru.hits, lru.refused)
    assert r["refused"] == r["no_space"]
    assert r["p50_ms"] > 0 and r["blocks_per_s"] > 0


def test_two_engines_over_a_file_l3(trace, tmp_path) -> None:
    reqs = [r.hash_ids for r in trace]
    top = trace_sim.max_hits(reqs)
    r = bench_trace.replay(trace, CAPACITY, tmp_path, engines=2, page_bytes=8192, l3="file")
    assert (r["wrong_bytes"], r["wrong_pages"]) == (0, 0)
    assert r["requests"] == len(trace) and r["blocks"] == top.blocks
    # Every block's first use is a miss in whatever order the engines run: none gets more than the max.
    assert r["l2_hits"] <= r["l2_hits"] + r["l3_hits"] <= top.hits
    assert r["loaded"] <= r["exists_hits"] <= top.hits
    assert r["l3_hits"] > 0
    assert trace_sim.lru(reqs, CAPACITY).hits <= trace_sim.belady(reqs, CAPACITY, bypass=True).hits


def test_routes_keep_a_prefix_on_one_engine(trace) -> None:
    by_prefix = bench_trace.route(trace, 3, "prefix")
    assert sorted(i for e in by_prefix for i in e) == list(range(len(trace)))
    first = {}
    for e, mine in enumerate(by_prefix):
        for i in mine:
            assert first.setdefault(trace[i].hash_ids[0], e) == e
    rr = bench_trace.route(trace, 3, "round-robin")
    assert [len(e) for e in rr] == [100, 100, 100]


def test_pages_are_a_function_of_the_block_id() -> None:
    base = bench_trace.page_base(4096)
    out = bench_trace.np.empty((3, 512), bench_trace.np.uint64)
    a = bench_trace.pages_of(bench_trace.np.array([7, 8, 7], bench_trace.np.uint64), base, out).copy()
    assert (a[0] == a[2]).all() and (a[0] != a[1]).all()


def test_sim_only_command(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, str(BENCH / "make_trace.py"), str(path), "--requests", "120"], check=True)
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_trace.py"), str(path), "--sim-only", "--capacities", "20,80"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "| 20 |" in out and "| 80 |" in out
