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

from hicached.daemon.sched.backend import LATENCY_BUCKETS

if TYPE_CHECKING:
    from hicached.daemon.sched.tiers import Tiers
    from hicached.daemon.server.listener import Server

log = logging.getLogger("hicached.metrics")

# Tier counters -> (metric, label values). Anything else counted shows up in hicached_events_total.
_COUNTERS = {
    "lookup.l2_hits": ("hicached_lookup_hits_total", {"tier": "l2"}),
    "lookup.l3_hits": ("hicached_lookup_hits_total", {"tier": "l3"}),
    "lookup.misses": ("hicached_lookup_misses_total", {}),
    "store.pages": ("hicached_stored_pages_total", {}),
    "store.bytes": ("hicached_stored_bytes_total", {}),
    "load.pages": ("hicached_loaded_pages_total", {}),
    "load.bytes": ("hicached_loaded_bytes_total", {}),
    "load.misses": ("hicached_load_misses_total", {}),
    "prefetch.pages": ("hicached_prefetched_pages_total", {}),
    "prefetch.bytes": ("hicached_prefetched_bytes_total", {}),
    "backup.pages": ("hicached_backed_up_pages_total", {}),
    "backup.bytes": ("hicached_backed_up_bytes_total", {}),
    "backup.failed": ("hicached_backup_failed_pages_total", {}),
    "backup.lost": ("hicached_backup_lost_pages_total", {}),
    # Pages whose bytes no longer hashed to the checksum they were stored with: never written to L3.
    "backup.changed": ("hicached_backup_changed_pages_total", {}),
    "backend.swaps": ("hicached_backend_swaps_total", {"outcome": "ok"}),
    "backend.swap_failures": ("hicached_backend_swaps_total", {"outcome": "failed"}),
    "backend.breaker_trips": ("hicached_breaker_trips_total", {}),
    # Breaker trips because the backend stalled (calls in flight, none finished in stall_timeout).
    "backend.stalls": ("hicached_backend_stalls_total", {}),
    # Pages that stopped being held in L2 for L3 by the backlog bound (storage.when_backlog_full), and of
    # those, the ones that left L2 before reaching L3.
    "backup.dropped": ("hicached_backup_dropped_pages_total", {}),
    "backup.dropped_gone": ("hicached_backup_dropped_gone_pages_total", {}),
    # The fleet (nodes sharing one L3): pages read from L3 that another node stored (as far as this node can
    # tell: hicached.daemon.sched.origin), and clears made here or seen from other nodes (epochs.py).
    "prefetch.other_nodes_pages": ("hicached_l3_other_nodes_pages_total", {}),
    "fleet.clears_made": ("hicached_fleet_clears_total", {"origin": "this_node"}),
    "fleet.clears_seen": ("hicached_fleet_clears_total", {"origin": "other_node"}),
}


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
        events = CounterMetricFamily("hicached_events", "Other daemon events, by name", labels=["event"])
        failures = CounterMetricFamily(
            "hicached_backend_failures", "Failed backend calls", labels=["backend", "reason"]
        )
        for key, value in sorted(tiers.counters.items()):
            if key in _COUNTERS:
                name, labels = _COUNTERS[key]
                fam = grouped.get(name)
                if fam is None:
                    fam = grouped[name] = CounterMetricFamily(
                        name.removesuffix("_total"), name, labels=sorted(labels)
                    )
                fam.add_metric([labels[k] for k in sorted(labels)], value)
            elif key.startswith("backend.failures."):
                _, _, backend, reason = key.split(".", 3)
                failures.add_metric([backend, reason], value)
            else:
                events.add_metric([key], value)
        yield from grouped.values()
        yield failures
        yield events
        if tiers.connector is not None:
            corrupt = CounterMetricFamily(
                "hicached_corrupt_pages", "Corrupt L3 pages found", labels=["reason"]
            )
            misfit = CounterMetricFamily(
                "hicached_misfit_pages",
                "L3 pages of another page size or format (another node's), left in place",
                labels=["reason"],
            )
            for key, value in tiers.connector.counters.items():
                if key.startswith("corrupt."):
                    corrupt.add_metric([key.removeprefix("corrupt.")], value)
                elif key.startswith("misfit."):
                    misfit.add_metric([key.removeprefix("misfit.")], value)
            yield corrupt
            yield misfit
            if tiers.connector.name == "file":  # the file backend's bound (storage.file.max_bytes)
                c = tiers.connector.counters
                for name, doc, key in (
                    (
                        "hicached_l3_janitor_removed_pages",
                        "L3 pages removed by this node's janitor",
                        "evictions",
                    ),
                    ("hicached_l3_janitor_removed_bytes", "Bytes of those pages", "evicted_bytes"),
                ):
                    family = CounterMetricFamily(name, doc)
                    family.add_metric([], c.get(key, 0))
                    yield family
                yield GaugeMetricFamily(
                    "hicached_l3_file_bytes",
                    "Bytes under the file backend's root, all nodes' (an estimate between scans)",
                    value=tiers.connector.stored_bytes,
                )
        idx = tiers.index
        evictions = CounterMetricFamily("hicached_evictions", "Pages evicted from L2")
        evictions.add_metric([], idx.counters.get("evictions", 0))
        yield evictions
        used = idx.used_bytes()
        for name, doc, value in (
            ("hicached_pool_capacity_bytes", "L2 pool capacity", idx.capacity),
            ("hicached_pool_used_bytes", "L2 bytes in slots in use", used),
            ("hicached_pool_pages", "Pages in L2", len(idx.entries)),
            ("hicached_pool_reserved_bytes", "L2 bytes in slots held ahead for stores", idx.reserved_bytes),
            ("hicached_pool_dirty_pages", "Pages in L2 not yet in L3", idx.dirty_pages),
            ("hicached_pool_unbacked_bytes", "L2 bytes held for pages not yet in L3", idx.dirty_bytes),
            ("hicached_backup_queue_pages", "Pages queued or being written to L3", tiers.backup.pending),
            ("hicached_prefetch_queue_pages", "Pages queued or being read from L3", tiers.prefetcher.pending),
            ("hicached_connections", "Engine connections", len(d.server.connections) if d.server else 0),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if tiers.tenanted:  # each tenant's pool (hicached.daemon.l2.pool: an arena)
            per = {
                key: GaugeMetricFamily(f"hicached_tenant_pool_{key}", doc, labels=["tenant"])
                for key, doc in (
                    ("capacity_bytes", "A tenant's L2 pool capacity"),
                    ("used_bytes", "L2 bytes in slots in use in a tenant's pool"),
                    ("pages", "Pages in a tenant's L2 pool"),
                    ("unbacked_bytes", "Bytes of a tenant's pool held for pages not yet in L3"),
                )
            }
            for a in tiers.pool.arenas:
                figures = tiers.tenant_stats(a.name)
                for key, family in per.items():
                    family.add_metric([a.name], figures[key])
            yield from per.values()
        attached = GaugeMetricFamily(
            "hicached_backend_attached", "1 when an L3 backend is attached", labels=["backend", "state"]
        )
        attached.add_metric([tiers.backend.configured, tiers.backend.state], 1 if tiers.connector else 0)
        yield attached
        yield GaugeMetricFamily(
            "hicached_backend_detached_since_seconds",
            "Unix time since the L3 backend is not attached (0 while attached); why: ctl status",
            value=0.0 if tiers.connector else tiers.backend.since,
        )
        reloads = CounterMetricFamily("hicached_reloads", "Configuration reloads", labels=["outcome"])
        for outcome, n in d.reloads.items():
            reloads.add_metric([outcome], n)
        yield reloads
        hist = HistogramMetricFamily(
            "hicached_backend_latency_seconds", "Backend call latency", labels=["backend", "op"]
        )
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
