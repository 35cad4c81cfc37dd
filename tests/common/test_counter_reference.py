"""docs/counters.md is generated from the counters' declarations: the committed page is what they say now."""

from __future__ import annotations

from pathlib import Path

from hicached.common.counter_reference import COMMAND, render
from hicached.common.counters import COUNTERS, METRICS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "counters.md"


def test_the_committed_reference_is_the_generated_one() -> None:
    assert PAGE.read_text() == render(), f"docs/counters.md is out of date: run {COMMAND}"


def test_every_counter_and_metric_is_on_the_page() -> None:
    page = render()
    for c in COUNTERS:
        assert f"- `{c.name}`: " in page
    for m in METRICS.values():
        assert f"- `{m.exposed}" in page
    flat = page.replace("\n  ", " ")
    hits = 'Metric: `hicached_lookup_hits_total{tier="l2"}`'
    assert f"`lookup.l2_hits`: Keys found in L2 by lookups and loads. {hits}" in flat
    assert "`misfit.{reason}`: " in flat and "`reason`: one of `version`, `length`." in flat
    assert (
        '`touch.pages`: Pages touched (marked used) by engines. Metric: `hicached_events_total{event="'
        in flat
    )
