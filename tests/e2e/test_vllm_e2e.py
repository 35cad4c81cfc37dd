"""HicachedTier against the real daemon (a subprocess) and vLLM 0.33's real offloading classes, with vLLM's fs
tier as the oracle: the same trace into both, every lookup answer and every loaded byte compared; engines in
other processes sharing blocks; the daemon restarted, emptied, down and back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

vllm_spec = pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (.ci/run installs it)"
)
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm_rig import Engine, chain_keys, fs_tier, hicached_tier, row_bytes_of  # noqa: E402

from hicached.engine.vllm import L2_LOADED, L3_LOADED, REACHABLE, HicachedTier  # noqa: E402

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
SUPPORT = str(Path(__file__).resolve().parent.parent / "support")


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(engine_id: str, tiers: list[dict], **config) -> Engine:
        e = Engine(f"{engine_id}-{os.getpid()}", tiers, **config)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def counters(stats) -> dict[str, float]:
    """Counters and gauges of a stats payload, summed over their labels (histograms left out)."""
    if stats is None:
        return {}
    kinds = stats.data["types"]
    return {name: sum(v.values()) for name, v in stats.data["data"].items() if kinds[name] != "histogram"}


def test_vllms_factory_loads_the_tier_through_module_path(daemon, engines):
    config = hicached_tier(daemon.socket)
    assert SecondaryTierFactory.get_tier_class(config) is HicachedTier
    e = engines("factory", [config])
    assert isinstance(e.tier, HicachedTier) and e.tier.tier_type == "HicachedTier"
    assert e.tier.namespace.startswith("org-model-x.bfloat16.t16.")
    with pytest.raises(TypeError):  # `socket` is the one key a user must give
        engines("nosocket", [{"type": "HicachedTier", "module_path": "hicached.engine.vllm"}])


def test_the_same_trace_into_the_fs_tier_and_hicached_gives_the_same_answers_and_bytes(
    daemon, engines, tmp_path
):
    """Writers store prefixes (two KV groups, prefixes that share blocks); fresh readers look up stored,
    partly stored and unknown prefixes and load what hits. The fs tier is the oracle."""
    root = str(tmp_path / "fs")
    writers = {
        "fs": engines("w-fs", [fs_tier(root)]),
        "hicached": engines("w-hc", [hicached_tier(daemon.socket)]),
    }
    readers = {
        "fs": engines("r-fs", [fs_tier(root)]),
        "hicached": engines("r-hc", [hicached_tier(daemon.socket)]),
    }
    base = chain_keys("shared", 6)
    stored = [base[:4], base, chain_keys("other", 5, group=1), chain_keys("short", 2, hash_len=16)]
    asked = [
        base,
        chain_keys("other", 5, group=1),
        chain_keys("short", 3, hash_len=16),
        chain_keys("never", 3),
    ]
    seen = {}
    for name, w in writers.items():
        for i, keys in enumerate(stored):
            ctx = w.request(f"store-{i}")
            w.store(ctx, keys)
            w.settle()
            w.finish(ctx)
        assert w.job_results and all(r.success for r in w.job_results), name
    for name, r in readers.items():
        out = []
        for i, keys in enumerate(asked):
            ctx = r.request(f"load-{i}")
            results = r.lookups(ctx, keys)
            hits = [k for k, res in zip(keys, results, strict=True) if res is HIT]
            out.append((results, r.read(ctx, hits) if hits else []))
            r.finish(ctx)
        finals = {k: answers[-1] for k, answers in r.tier_answers.items()}
        seen[name] = (out, finals)
    assert seen["hicached"] == seen["fs"]
    out, finals = seen["hicached"]
    assert [res.count(HIT) for res, _ in out] == [6, 5, 2, 0]
    for (res, rows), keys in zip(out, asked, strict=True):
        hits = [k for k, x in zip(keys, res, strict=True) if x is HIT]
        assert rows == [row_bytes_of(k, readers["hicached"].row) for k in hits]
    # The tier answered RETRY while the daemon's answer was on its way, then that answer each time.
    for key, answers in readers["hicached"].tier_answers.items():
        waited = answers.count(RETRY)
        assert set(answers[:waited]) <= {RETRY} and len(set(answers[waited:])) == 1, (key.hex(), answers)
    for e in (writers["hicached"], readers["hicached"]):  # each job reported once (vLLM asserts it too)
        assert len({r.job_id for r in e.job_results}) == len(e.job_results)
    row = readers["hicached"].row
    loads = readers["hicached"].job_results
    assert sum(r.transfer_bytes for r in loads) == 13 * row and all(r.success for r in loads)


ENGINE_B = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from vllm_rig import Engine, chain_keys, hicached_tier, row_bytes_of
    from hicached.engine.vllm import L2_LOADED, L3_LOADED
    socket, engine_id, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    e = Engine(engine_id, [hicached_tier(socket)])
    try:
        keys = chain_keys("node", n)
        ctx = e.request("b")
        results = e.lookups(ctx, keys)
        rows = e.read(ctx, [k for k, r in zip(keys, results) if r.name == "HIT"])
        e.finish(ctx)
        stats = e.tier.get_stats().data["data"]
        print(json.dumps({
            "results": [r.name for r in results],
            "answers": [[a.name for a in e.tier_answers[k]] for k in keys],
            "bytes_ok": rows == [row_bytes_of(k, e.row) for k in keys[: len(rows)]],
            "l2": sum(stats.get(L2_LOADED, {}).values()),
            "l3": sum(stats.get(L3_LOADED, {}).values()),
            "namespace": e.tier.namespace,
        }))
    finally:
        e.close()
    """
)


def engine_b(daemon, engine_id: str, n: int) -> dict:
    """A second engine in another process, with a fresh primary tier: looks up and loads the prefix."""
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_B, SUPPORT, daemon.socket, f"{engine_id}-{os.getpid()}", str(n)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engines_of_the_node_share_blocks_through_l2_and_l3(daemon_factory, engines):
    daemon = daemon_factory()
    a = engines("node-a", [hicached_tier(daemon.socket)])
    keys = chain_keys("node", 8)
    ctx = a.request("a")
    a.store(ctx, keys)
    a.settle()
    a.finish(ctx)
    assert [r.success for r in a.job_results] == [True]
    namespace = a.tier.namespace
    a.close()

    # Engine B, another process, fresh primary tier: every key HIT after one RETRY, loaded from L2 alone.
    b = engine_b(daemon, "node-b", 8)
    assert b["results"] == ["HIT"] * 8 and b["bytes_ok"] and b["namespace"] == namespace
    assert b["answers"] == [["RETRY", "HIT"]] * 8
    assert (b["l2"], b["l3"]) == (8, 0)
    # A restarted (same engine id, a new primary tier) finds its blocks.
    again = engines("node-a", [hicached_tier(daemon.socket)])
    ctx = again.request("a2")
    assert again.lookups(ctx, keys) == [HIT] * 8
    assert again.read(ctx, keys) == [row_bytes_of(k, again.row) for k in keys]
    again.finish(ctx)
    again.close()

    # The daemon on a fresh pool (L2 empty, nothing kept; warm-up off): the blocks come from L3.
    daemon.ctl("flush")
    daemon.restart()
    b = engine_b(daemon, "node-c", 8)
    assert b["results"] == ["HIT"] * 8 and b["bytes_ok"]
    assert (b["l2"], b["l3"]) == (0, 8)


def test_with_the_daemon_down_lookups_miss_jobs_fail_and_a_daemon_back_is_used(daemon_factory, engines):
    daemon = daemon_factory(start=False)
    e = engines("down", [hicached_tier(daemon.socket)])
    assert e.tier.namespace == ""
    keys = chain_keys("down", 4)
    ctx = e.request("r1")
    e.store(ctx, keys)
    e.settle()
    assert [(r.success, r.transfer_bytes) for r in e.job_results] == [(False, 0)]
    assert counters(e.tier.get_stats())[REACHABLE] == 0
    e.finish(ctx)

    daemon.start()  # back: used again without a restart of the engine (once its backoff has passed)
    for attempt in range(200):
        ctx = e.request(f"up-{attempt}")
        e.store(ctx, chain_keys(f"up-{attempt}", 4))
        e.settle()
        e.finish(ctx)
        if e.job_results[-1].success:
            break
        time.sleep(0.05)
    assert e.job_results[-1].transfer_bytes == 4 * e.row
    assert counters(e.tier.get_stats())[REACHABLE] == 1
    up = chain_keys(f"up-{attempt}", 4)

    # Killed: lookups miss, nothing hangs; started again, it serves what L3 kept.
    daemon.ctl("flush")
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    reader = engines("down-reader", [hicached_tier(daemon.socket)])
    ctx = reader.request("r3")
    assert reader.lookups(ctx, up) == [MISS] * 4
    reader.finish(ctx)
    daemon.start()
    for attempt in range(200):
        ctx = reader.request(f"r4-{attempt}")
        if reader.lookups(ctx, up) == [HIT] * 4:
            break
        reader.finish(ctx)
        time.sleep(0.05)
    assert reader.read(ctx, up) == [row_bytes_of(k, reader.row) for k in up]
    reader.finish(ctx)
    assert counters(reader.tier.get_stats())[L3_LOADED] == 4


def test_a_row_larger_than_the_slab_is_split_into_parts_with_a_key_each(daemon, engines):
    """pool.slab_size is 4 MiB here; a row of 6 MiB goes as two parts of 3 MiB."""
    big = {"worker_bytes": 6 << 20, "chunks": 8}
    a = engines("big-a", [hicached_tier(daemon.socket)], **big)
    b = engines("big-b", [hicached_tier(daemon.socket)], **big)
    keys = chain_keys("big", 3)
    ctx = a.request("a")
    a.store(ctx, keys)
    a.settle()
    a.finish(ctx)
    assert [r.success for r in a.job_results] == [True]
    # Two pages of 3 MiB a row in L2, under the row's key and a part each.
    assert daemon.ctl("stats")["pool"]["slabs"]["classes"][str(3 << 20)]["used"] == 6
    ctx = b.request("b")
    assert b.lookups(ctx, keys) == [HIT] * 3
    assert b.read(ctx, keys) == [row_bytes_of(k, b.row) for k in keys]
    b.finish(ctx)


def test_drain_and_shutdown_leave_no_copy_and_no_export_of_vllms_region(daemon, engines):
    e = engines("drain", [hicached_tier(daemon.socket)])
    path = e.spec._scheduler_mmap.mmap_path
    ctx = e.request("r")
    e.store(ctx, chain_keys("drain", 16))
    with e.manager.lock:
        # vLLM's own caller of drain_jobs: it asserts that every job has ended once they returned.
        e.manager.reset_cache()
    e.finish(ctx)
    assert daemon.ctl("stats")["regions"]["count"] == 1
    region = e.spec._scheduler_mmap
    e.close()
    assert region.mmap_obj is None and not os.path.exists(path)  # unmapped: no export was left
    assert daemon.ctl("stats")["regions"]["count"] == 0
    e.tier.shutdown()  # again: nothing to do


def test_stats_are_declared_and_split_loads_by_tier(daemon, engines):
    a = engines("stats-a", [hicached_tier(daemon.socket)])
    b = engines("stats-b", [hicached_tier(daemon.socket)])
    keys = chain_keys("stats", 5)
    ctx = a.request("a")
    a.store(ctx, keys)
    a.settle()
    a.finish(ctx)
    ctx = b.request("b")
    assert b.lookups(ctx, keys) == [HIT] * 5
    b.finish(ctx)
    # What the manager hands vLLM's metrics (the tier's figures folded in): each one declared, as vLLM's
    # Prometheus side looks them up by name (KeyError otherwise), with its kind and label count.
    stats = b.manager.get_stats()
    declared = vllm_spec.TieringOffloadingSpec.build_metric_definitions(dict(b.spec.extra_config))
    kinds = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}
    for name, kind in stats.data["types"].items():
        assert type(declared[name]).__name__ == f"Offloading{kinds[kind]}Metadata", name
        assert all(len(labels) == len(declared[name].labelnames) for labels in stats.data["data"][name])
    got = counters(stats)
    assert got[L2_LOADED] == 5 and got.get(L3_LOADED, 0) == 0 and got[REACHABLE] == 1
    assert counters(b.tier.get_stats()).get(L2_LOADED, 0) == 0  # handed over once


def test_blocks_are_shared_only_within_a_namespace(daemon, engines):
    keys = chain_keys("tenant", 3)
    a = engines("ns-a", [hicached_tier(daemon.socket, namespace_prefix="tenant-a")])
    ctx = a.request("a")
    a.store(ctx, keys)
    a.settle()
    a.finish(ctx)
    assert a.tier.namespace.startswith("tenant-a.org-model-x.")
    others = {
        "another tenant": engines("ns-b", [hicached_tier(daemon.socket, namespace_prefix="tenant-b")]),
        "another dtype": engines(
            "ns-c", [hicached_tier(daemon.socket, namespace_prefix="tenant-a")], dtype="fp8"
        ),
        "the same rows": engines("ns-d", [hicached_tier(daemon.socket, namespace_prefix="tenant-a")]),
    }
    found = {}
    for name, e in others.items():
        ctx = e.request(name)
        found[name] = e.lookups(ctx, keys)
        e.finish(ctx)
    assert found == {"another tenant": [MISS] * 3, "another dtype": [MISS] * 3, "the same rows": [HIT] * 3}


def test_vllms_region_shrinking_under_the_daemon_fails_jobs_not_the_daemon(daemon, engines):
    e = engines("shrinks", [hicached_tier(daemon.socket)])
    path, size = e.spec._scheduler_mmap.mmap_path, e.spec.num_chunks * e.row
    ctx = e.request("r1")
    with e.manager.lock:
        out = e.manager.prepare_store(chain_keys("shrinks", 4), ctx)
    os.truncate(path, 4096)  # nothing in this process touches the rows until the size is back
    try:
        with e.manager.lock:
            e.manager.complete_store(out.keys_to_store, ctx)
        e.settle()
    finally:
        os.truncate(path, size)
    assert [r.success for r in e.job_results] == [False] and daemon.alive
    assert "shrank under the daemon" in daemon.log()
    e.store(ctx, chain_keys("after", 4))  # the tier registers the region again and goes on
    e.settle()
    e.finish(ctx)
    assert e.job_results[-1].success


def test_stored_blocks_are_announced_as_kv_events_when_asked(daemon, engines):
    e = engines("events", [hicached_tier(daemon.socket, enable_kv_events=True)], events=True)
    keys = chain_keys("events", 3)
    ctx = e.request("r")
    e.store(ctx, keys)
    e.settle()
    e.finish(ctx)
    with e.manager.lock:
        ours = [ev for ev in e.manager.take_events() if ev.medium is Medium.CPU and ev.locality is not None]
    assert [(ev.keys, ev.removed, ev.locality) for ev in ours] == [(keys, False, Locality.LOCAL)]
    with e.manager.lock:
        assert not [ev for ev in e.manager.take_events() if ev.locality is not None]  # taken once
