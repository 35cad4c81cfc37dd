"""The counters and metrics reference, docs/counters.md, generated from the declarations in
hicached/common/counters.py.

    python -m hicached.common.counter_reference > docs/counters.md
"""

from __future__ import annotations

import sys
import textwrap

from .counters import BACKEND, COUNTERS, DAEMON, EVENTS, METRICS, POOL, REGIONS, Counted, Metric

COMMAND = "python -m hicached.common.counter_reference > docs/counters.md"
WIDTH = 110

INTRO = f"""\
# Counters and metrics

<!-- Generated from hicached/common/counters.py by `{COMMAND}`:
edit the declarations, not this page; tests/common/test_counter_reference.py fails when the two disagree. -->

`hicached ctl stats` shows the counters under four keys, one section each below; the metrics listener
(`metrics.listen`, see [operations.md](operations.md#metrics)) exposes the families listed last. A name with a
`{{part}}` is a pattern: the part is filled in at run time, with one of the values listed where they are a
fixed set. Counters count up from the daemon's start. Names and labels are a stable interface: dashboards and
engines read them.
"""

SECTIONS = (
    (DAEMON, "The daemon's traffic: lookups, stores, loads, prefetches, backups, the backend, the fleet."),
    (POOL, "The L2 index, beside the pool's figures (pages, bytes, pins)."),
    (
        BACKEND,
        "The attached L3 backend's (`ctl backend show` too); a backend built anew (a reload, "
        "`ctl backend attach`) counts from 0.",
    ),
    (REGIONS, "The memory regions engines registered (host shared memory, GPU memory, fence boards)."),
)


def render() -> str:
    out = [INTRO]
    for where, about in SECTIONS:
        out += [f"## `{where}`", "", about, ""]
        declared = [c for c in COUNTERS if c.where == where]
        groups = list(dict.fromkeys(c.group for c in declared))  # in the order declared
        for group in groups:
            if len(groups) > 1:
                out += [f"### {group}", ""]
            out += [_wrap(_counter(c), "- ") for c in declared if c.group == group]
            out.append("")
    out += ["## Metrics", "", "Every family `/metrics` exposes, and the counters that feed it.", ""]
    out += [_wrap(_metric(m), "- ") for m in METRICS.values()]
    return "\n".join(out) + "\n"


def _counter(c: Counted) -> str:
    text = f"`{c.name}`: {c.help}."
    for part, values in c.values.items():
        text += f" `{part}`: one of {', '.join(f'`{v}`' for v in values)}."
    series = _series(c)
    if series:
        text += f" Metric: `{series}`."
    return text


def _series(c: Counted) -> str | None:
    """The series a counter shows up as in /metrics, if any."""
    if c.metric is None:
        if c.where != DAEMON:
            return None
        return f'{METRICS[EVENTS].exposed}{{event="{c.name}"}}'
    m = METRICS[c.metric]
    if not m.labels:
        return m.exposed
    labels = ",".join(f'{k}="{c.labels[k]}"' for k in m.labels)
    return f"{m.exposed}{{{labels}}}"


def _metric(m: Metric) -> str:
    labels = f"{{{','.join(m.labels)}}}" if m.labels else ""
    text = f"`{m.exposed}{labels}` ({m.kind}): {m.help}."
    fed = [c for c in COUNTERS if c.metric == m.name]
    if m.name == EVENTS:
        text += " Fed by every daemon counter (`counters`) without a family of its own."
    elif fed:
        text += " Fed by " + ", ".join(f"`{c.where}.{c.name}`" for c in fed) + "."
    return text


def _wrap(text: str, bullet: str = "") -> str:
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=bullet,
        subsequent_indent=" " * len(bullet),
        break_on_hyphens=False,
        break_long_words=False,
    )


if __name__ == "__main__":
    sys.stdout.write(render())
