"""/metrics exposes the families declared in hicached.common.counters, with their kind, help and labels, and
routes each counter to the family its declaration names."""

from __future__ import annotations

import re
from types import SimpleNamespace

from hicached.common.counters import METRICS
from hicached.daemon.service.metrics import MetricsServer
from tests.support.tiers_rig import close_tiers, make_tiers, session, write


async def test_every_family_exposed_is_declared_with_its_kind_help_and_labels(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        write(t, session(t), ["k0", "k1"])
        assert await t.backup.drain(2)
        for key in ("lookup.l2_hits", "lookup.l3_hits", "fleet.clears_seen", "backend.failures.file.stalled"):
            t.counters[key] += 1
        t.counters["touch.pages"] += 3
        t.connector.counters["misfit.length"] += 2
        t.connector.counters["evicted_bytes"] += 5
        t.index.counters["evictions"] += 4
        text = MetricsServer(SimpleNamespace(tiers=t, server=None, reloads={"ok": 1})).render().decode()
    finally:
        await close_tiers(t)
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    exposed = {m.exposed: m for m in METRICS.values()}
    assert kinds
    for name, kind in kinds.items():
        m = exposed[name]
        assert (kind, helps[name]) == (m.kind, m.help)
        for labels in re.findall(rf"^{m.exposed}(?:_bucket|_sum|_count)?{{(.*?)}}", text, re.M):
            assert set(re.findall(r'(\w+)="', labels)) - {"le"} == set(m.labels), (name, labels)
    # Each counter in the family its declaration names.
    for line in (
        'hicached_lookup_hits_total{tier="l2"} 1.0',
        'hicached_lookup_hits_total{tier="l3"} 1.0',
        'hicached_fleet_clears_total{origin="other_node"} 1.0',
        'hicached_backend_failures_total{backend="file",reason="stalled"} 1.0',
        'hicached_events_total{event="touch.pages"} 3.0',
        'hicached_misfit_pages_total{reason="length"} 2.0',
        "hicached_l3_janitor_removed_bytes_total 5.0",
        "hicached_evictions_total 4.0",
        "hicached_stored_pages_total 2.0",
    ):
        assert line in text.splitlines(), line
