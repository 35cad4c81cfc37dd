"""Prometheus text exposition of the daemon's figures, on an optional loopback listener (metrics.listen).

The figures are read from the daemon at scrape time, on the event loop, by a custom collector: the hot
paths only bump plain counters. The listener is a minimal HTTP/1.0 server for GET /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from hicached.common.counters import BACKEND, COUNTERS, DAEMON, EVENTS, METRICS
from hicached.daemon.sched.backend import LATENCY_BUCKETS

if TYPE_CHECKING:
    from hicached.daemon.sched.tiers import Tiers
    from hicached.daemon.server.listener import Server

log = logging.getLogger("hicached.metrics")

# The daemon's counters that feed a family of their own -> (family, label values); the names, help texts and
# labels are declared in hicached.common.counters. Any other daemon counter shows up in hicached_events_total;
# backend.failures.<backend>.<reason> in hicached_backend_failures_total.
_COUNTERS = {
    c.name: (c.metric, dict(c.labels))
    for c in COUNTERS
    if c.where == DAEMON and c.metric is not None and not c.parts
}
_FAILURES = "backend.failures."
# The attached backend's counters that feed a family, by reason (corrupt.<reason>, misfit.<reason>), and the
# file backend's janitor (storage.file.max_bytes).
_BY_REASON = {
    c.name.removesuffix("{reason}"): c.metric
    for c in COUNTERS
    if c.where == BACKEND and c.metric is not None and c.parts == ("reason",)
}
_JANITOR = [(c.metric, c.name) for c in COUNTERS if c.where == BACKEND and c.group == "janitor" and c.metric]


def _counter(name: str) -> CounterMetricFamily:
    m = METRICS[name]
    return CounterMetricFamily(m.name, m.help, labels=list(m.labels) or None)


def _gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    m = METRICS[name]
    return GaugeMetricFamily(m.name, m.help, value=value, labels=list(m.labels) or None)


class Figures(Protocol):
    """What a scrape reads: the daemon's parts (hicached.daemon.service.lifecycle.Daemon has them)."""

    tiers: Tiers
    server: Server | None
    reloads: dict[str, int]


class DaemonCollector(Collector):
    def __init__(self, daemon: Figures) -> None:
        self.daemon = daemon

    def collect(self):
        d = self.daemon
        tiers = d.tiers
        grouped: dict[str, CounterMetricFamily] = {}
        events = _counter(EVENTS)
        failures = _counter("hicached_backend_failures")
        for key, value in sorted(tiers.counters.items()):
            if key in _COUNTERS:
                name, labels = _COUNTERS[key]
                fam = grouped.get(name)
                if fam is None:
                    fam = grouped[name] = _counter(name)
                fam.add_metric([labels[k] for k in METRICS[name].labels], value)
            elif key.startswith(_FAILURES):
                backend, _, reason = key.removeprefix(_FAILURES).partition(".")
                failures.add_metric([backend, reason], value)
            else:
                events.add_metric([key], value)
        yield from grouped.values()
        yield failures
        yield events
        if tiers.connector is not None:
            by_reason = {prefix: _counter(name) for prefix, name in _BY_REASON.items()}
            for key, value in tiers.connector.counters.items():
                prefix, _, reason = key.partition(".")
                if prefix + "." in by_reason:
                    by_reason[prefix + "."].add_metric([reason], value)
            yield from by_reason.values()
            if tiers.connector.name == "file":  # the file backend's bound (storage.file.max_bytes)
                c = tiers.connector.counters
                for name, key in _JANITOR:
                    family = _counter(name)
                    family.add_metric([], c.get(key, 0))
                    yield family
                yield _gauge("hicached_l3_file_bytes", tiers.connector.stored_bytes)
        idx = tiers.index
        evictions = _counter("hicached_evictions")
        evictions.add_metric([], idx.counters.get("evictions", 0))
        yield evictions
        used = idx.used_bytes()
        for name, value in (
            ("hicached_pool_capacity_bytes", idx.capacity),
            ("hicached_pool_used_bytes", used),
            ("hicached_pool_pages", len(idx.entries)),
            ("hicached_pool_reserved_bytes", idx.reserved_bytes),
            ("hicached_pool_dirty_pages", idx.dirty_pages),
            ("hicached_pool_unbacked_bytes", idx.dirty_bytes),
            ("hicached_backup_queue_pages", tiers.backup.pending),
            ("hicached_prefetch_queue_pages", tiers.prefetcher.pending),
            ("hicached_connections", len(d.server.connections) if d.server else 0),
        ):
            yield _gauge(name, value)
        if tiers.cfg.tenants:  # each tenant's pool (hicached.daemon.l2.pool: an arena)
            per = {
                key: _gauge(f"hicached_tenant_pool_{key}")
                for key in ("capacity_bytes", "used_bytes", "pages", "unbacked_bytes")
            }
            for a in tiers.pool.arenas:
                figures = tiers.tenant_stats(a.name)
                for key, family in per.items():
                    family.add_metric([a.name], figures[key])
            yield from per.values()
        attached = _gauge("hicached_backend_attached")
        attached.add_metric([tiers.backend.configured, tiers.backend.state], 1 if tiers.connector else 0)
        yield attached
        yield _gauge(
            "hicached_backend_detached_since_seconds", 0.0 if tiers.connector else tiers.backend.since
        )
        reloads = _counter("hicached_reloads")
        for outcome, n in d.reloads.items():
            reloads.add_metric([outcome], n)
        yield reloads
        m = METRICS["hicached_backend_latency_seconds"]
        hist = HistogramMetricFamily(m.name, m.help, labels=list(m.labels))
        for (backend, op), h in sorted(tiers.backend.latency.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            hist.add_metric([backend, op], buckets, h.sum)
        yield hist


class MetricsServer:
    def __init__(self, daemon: Figures) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(daemon))
        self._server: asyncio.base_events.Server | None = None

    async def start(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        self._server = await asyncio.start_server(self._handle, host.strip("[]"), int(port))
        log.info("metrics on http://%s/metrics", listen)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request = await reader.readuntil(b"\r\n\r\n")
            line = request.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body, status = self.render(), b"200 OK"
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.0 "
                + status
                + b"\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
