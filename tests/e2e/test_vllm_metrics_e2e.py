"""HicachedTier's get_stats through vLLM 0.33's own Prometheus side: the payload that TieringOffloadingManager
folds the tier's figures into (what the connector's scheduler hands on each step) observed by vLLM's
KVConnectorProm, which builds OffloadPromMetrics from a VllmConfig and looks every metric up in the
definitions build_metric_definitions declares; the samples read back from a prometheus_client registry."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (.ci/run installs it)"
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm_rig import Engine, chain_keys, hicached_tier  # noqa: E402

from hicached.engine.vllm import (  # noqa: E402
    CONNECTS,
    DROPPED_TOUCHES,
    L2_LOADED,
    L3_LOADED,
    LATE_LOOKUPS,
    REACHABLE,
)

LABELS = {"model_name": "org/model-x", "engine": "0"}  # vLLM's PrometheusStatLogger labels every metric so


def registered(cls: type, registry: CollectorRegistry) -> type:
    """`cls` with its metrics in `registry` instead of prometheus_client's global one."""

    class Bound(cls):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("registry", registry)
            super().__init__(*args, **kwargs)

    return Bound


def prometheus_side(tier: dict, registry: CollectorRegistry) -> KVConnectorProm:
    """What vLLM's PrometheusStatLogger builds for the OffloadingConnector, on CPU: a VllmConfig with the same
    kv-transfer-config a user passes (device "cpu": no accelerator to infer it from)."""
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 22,
                "secondary_tiers": [tier],
            },
        ),
        device_config=DeviceConfig(device="cpu"),
    )

    class Prom(KVConnectorProm):
        _gauge_cls = registered(Gauge, registry)
        _counter_cls = registered(Counter, registry)
        _histogram_cls = registered(Histogram, registry)

    return Prom(config, list(LABELS), {0: list(LABELS.values())})


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(engine_id: str, tiers: list[dict]) -> Engine:
        e = Engine(f"{engine_id}-{os.getpid()}", tiers)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_the_tiers_stats_arrive_as_prometheus_samples_over_intervals(daemon, engines):
    tier = hicached_tier(daemon.socket)
    registry = CollectorRegistry()
    prom = prometheus_side(tier, registry)
    assert isinstance(prom.prom_metrics, OffloadPromMetrics)
    a, b = engines("prom-a", [tier]), engines("prom-b", [tier])
    keys = chain_keys("prom", 5)
    ctx = a.request("a")
    a.store(ctx, keys)
    a.settle()
    a.finish(ctx)

    # Interval 1: B finds A's 5 blocks and loads them from L2.
    ctx = b.request("b")
    assert b.lookups(ctx, keys) == [LookupResult.HIT] * 5
    b.finish(ctx)
    with b.manager.lock:
        payload = b.manager.get_stats()
    prom.observe(payload.to_dict(), 0)
    assert sample(registry, f"{L2_LOADED}_total") == 5
    assert sample(registry, f"{L3_LOADED}_total") is None  # nothing counted: no sample yet
    assert sample(registry, f"{CONNECTS}_total") == 1
    assert sample(registry, REACHABLE) == 1
    # vLLM's own figures from the same payload (the promotion job's bytes), by tier.
    assert sample(registry, "vllm:kv_offload_tiering_read_bytes_total", tier="1:HicachedTier") == 5 * b.row

    # Interval 2: the daemon goes; touches are dropped, a store fails and the connection with it.
    daemon.proc.kill()
    daemon.proc.wait()
    daemon.proc = None
    ctx = b.request("b2")
    with b.manager.lock:
        b.manager.touch(keys, ctx)
    b.store(ctx, chain_keys("prom-lost", 2))
    b.settle()
    b.finish(ctx)
    deadline = time.monotonic() + 30
    while b.tier._touches.dropped < 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with b.manager.lock:
        payload = b.manager.get_stats()
    prom.observe(payload.to_dict(), 0)
    assert sample(registry, f"{L2_LOADED}_total") == 5  # a counter adds each interval's increase once
    assert sample(registry, f"{DROPPED_TOUCHES}_total") == 5
    assert sample(registry, REACHABLE) == 0
    assert sample(registry, f"{CONNECTS}_total") == 1
    assert sample(registry, f"{LATE_LOOKUPS}_total") is None
    failures = "vllm:kv_offload_tiering_cascade_job_failures_total"
    assert sample(registry, failures, tier="1:HicachedTier") == 1
