"""Every counter the daemon and its backends keep, and every metric /metrics exposes, declared once: where
`ctl stats` shows it, what it counts, and the Prometheus family it feeds.

The daemon's metrics (hicached.daemon.service.metrics) and docs/counters.md are built from these;
tests/common/test_counters.py fails when the code counts a name declared nowhere, or a declaration is counted
nowhere. Names are part of the public surface (`ctl stats` keys, metric names): never rename one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

# Where `ctl stats` shows a counter: the collections.Counter that holds it.
DAEMON = "counters"  # Tiers.counters: the daemon's traffic, shared by its schedulers
POOL = "pool"  # PageIndex.counters, among the L2 pool's figures
BACKEND = "backend_counters"  # Connector.counters: the attached L3 backend's (also `ctl backend show`)
REGIONS = "regions.counters"  # RegionService.counters: the engines' registered memory regions
WHERE = (DAEMON, POOL, BACKEND, REGIONS)

# A daemon counter that feeds no family of its own shows up in this one, labelled with its name.
EVENTS = "hicached_events"


@dataclasses.dataclass(frozen=True)
class Metric:
    """A Prometheus family. `name` as prometheus_client takes it: a counter is exposed as `name`_total."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


@dataclasses.dataclass(frozen=True)
class Counted:
    """One counter, or a pattern of them: `{part}` in `name` is filled in at run time (a reason, a backend).
    `values` lists a part's values where they are a fixed set; a part not in it takes any value."""

    name: str
    where: str
    group: str
    help: str
    values: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    metric: str | None = None  # the family it feeds (None: hicached_events for a daemon counter, else none)
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # "{part}": the part's value
    kind: Kind = "counter"

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.name))

    @property
    def regex(self) -> re.Pattern[str]:
        """Matches the keys this declares: each part one dot-free word, of its values where they are fixed."""
        out = ""
        for text, part in re.findall(r"([^{]*)(?:\{(\w+)\})?", self.name):
            out += re.escape(text)
            if part:
                fixed = self.values.get(part)
                out += f"(?P<{part}>{'|'.join(map(re.escape, fixed)) if fixed else '[^.]+'})"
        return re.compile(out)


def _c(name: str, where: str, group: str, help: str, metric: str | None = None, **labels: str) -> Counted:
    return Counted(name, where, group, help, metric=metric, labels=labels)


_BACKEND_REASON = "the backend error's reason (`timeout`, `connection`, an errno name such as `ENOSPC`, ...)"

COUNTERS: tuple[Counted, ...] = (
    # The daemon's traffic: `ctl stats` -> counters.
    _c(
        "lookup.l2_hits",
        DAEMON,
        "lookup",
        "Keys found in L2 by lookups and loads",
        "hicached_lookup_hits",
        tier="l2",
    ),
    _c(
        "lookup.l3_hits",
        DAEMON,
        "lookup",
        "Keys found in L3 by lookups (past L2's hits)",
        "hicached_lookup_hits",
        tier="l3",
    ),
    _c(
        "lookup.misses",
        DAEMON,
        "lookup",
        "Lookups whose leading prefix stopped short of the last key (one a call; `present`: each key missed)",
        "hicached_lookup_misses",
    ),
    _c(
        "lookup.l3_errors.{reason}",
        DAEMON,
        "lookup",
        f"L3 lookups that failed (their keys missed), by {_BACKEND_REASON}",
    ),
    _c(
        "store.pages",
        DAEMON,
        "store",
        "Pages stored into L2 (committed under their keys)",
        "hicached_stored_pages",
    ),
    _c("store.bytes", DAEMON, "store", "Bytes of those pages", "hicached_stored_bytes"),
    _c(
        "store.present",
        DAEMON,
        "store",
        "Pages stored whose key was ready in L2 already: kept, not written again",
    ),
    _c("store.rewritten", DAEMON, "store", "Pages stored again that L2 believed in L3: written to L3 again"),
    _c(
        "store.superseded_fills",
        DAEMON,
        "store",
        "Reads from L3 into L2 that a store of the same key overtook (the read then ends as a miss)",
    ),
    _c(
        "store.busy",
        DAEMON,
        "store",
        "Pages refused as busy: their key being written already, or past the call's room",
    ),
    _c("store.no_space", DAEMON, "store", "Pages refused for want of a free slot in L2"),
    _c("load.pages", DAEMON, "load", "Pages loaded out of L2 into engines", "hicached_loaded_pages"),
    _c("load.bytes", DAEMON, "load", "Bytes of those pages", "hicached_loaded_bytes"),
    _c(
        "load.misses",
        DAEMON,
        "load",
        "Loads that did not find every key asked for (one a call)",
        "hicached_load_misses",
    ),
    _c(
        "prefetch.pages",
        DAEMON,
        "prefetch",
        "Pages read from L3 into L2 by prefetches",
        "hicached_prefetched_pages",
    ),
    _c("prefetch.bytes", DAEMON, "prefetch", "Bytes of those pages", "hicached_prefetched_bytes"),
    _c("prefetch.misses", DAEMON, "prefetch", "Pages a prefetch read did not find in L3"),
    _c(
        "prefetch.dropped",
        DAEMON,
        "prefetch",
        "Keys of a prefetch not queued: past the prefetch queue's room",
    ),
    _c("prefetch.no_space", DAEMON, "prefetch", "Keys of a prefetch not read for want of a free slot in L2"),
    _c(
        "prefetch.skipped_after_hole",
        DAEMON,
        "prefetch",
        "Pages not read because an earlier key of the prefetch missed (only a leading prefix is of use)",
    ),
    _c(
        "prefetch.cleared",
        DAEMON,
        "prefetch",
        "Pages read while their namespace was being cleared: dropped, as misses",
    ),
    _c(
        "prefetch.other_nodes_pages",
        DAEMON,
        "fleet",
        "Pages read from L3 that another node stored (as far as this node can tell)",
        "hicached_l3_other_nodes_pages",
    ),
    _c(
        "prefetch.errors.{reason}",
        DAEMON,
        "prefetch",
        f"Prefetch reads from L3 that failed, by {_BACKEND_REASON}",
    ),
    _c("backup.pages", DAEMON, "backup", "Pages written to L3 by the backup", "hicached_backed_up_pages"),
    _c("backup.bytes", DAEMON, "backup", "Bytes of those pages", "hicached_backed_up_bytes"),
    _c("backup.retries", DAEMON, "backup", "Backup writes tried again after a failure"),
    _c("backup.errors.{reason}", DAEMON, "backup", f"Backup writes to L3 that failed, by {_BACKEND_REASON}"),
    _c(
        "backup.failed",
        DAEMON,
        "backup",
        "Pages the backup gave up on after storage.retry.attempts (a flush queues them again)",
        "hicached_backup_failed_pages",
    ),
    _c(
        "backup.lost",
        DAEMON,
        "backup",
        "Pages lost: owed to L3, and left L2 before reaching it (operations.md, What a flush answers)",
        "hicached_backup_lost_pages",
    ),
    _c(
        "backup.changed",
        DAEMON,
        "backup",
        "Pages whose bytes no longer hashed to the checksum they were stored with: never written to L3",
        "hicached_backup_changed_pages",
    ),
    _c(
        "backup.dropped",
        DAEMON,
        "backup",
        "Pages the backlog bound stopped holding in L2 for L3 (storage.when_backlog_full)",
        "hicached_backup_dropped_pages",
    ),
    _c(
        "backup.dropped_gone",
        DAEMON,
        "backup",
        "Of those, the pages that left L2 before reaching L3",
        "hicached_backup_dropped_gone_pages",
    ),
    _c(
        "backend.swaps",
        DAEMON,
        "backend",
        "Backends attached by a reload or `ctl backend`",
        "hicached_backend_swaps",
        outcome="ok",
    ),
    _c(
        "backend.swap_failures",
        DAEMON,
        "backend",
        "Backend swaps that failed (the backend before stays)",
        "hicached_backend_swaps",
        outcome="failed",
    ),
    _c(
        "backend.breaker_trips",
        DAEMON,
        "backend",
        "Times the circuit breaker detached a failing backend",
        "hicached_breaker_trips",
    ),
    _c(
        "backend.stalls",
        DAEMON,
        "backend",
        "Breaker trips because the backend stalled (calls in flight, none finished in stall_timeout)",
        "hicached_backend_stalls",
    ),
    _c(
        "backend.probe_failures",
        DAEMON,
        "backend",
        "Probes of a tripped backend that failed (tried again with backoff)",
    ),
    _c(
        "backend.reattached",
        DAEMON,
        "backend",
        "Times a tripped backend answered its probe again and was attached",
    ),
    _c(
        "backend.failures.{backend}.{reason}",
        DAEMON,
        "backend",
        "Failed backend calls, by backend and reason (`stalled`, `slow`, or the backend error's reason)",
        "hicached_backend_failures",
        backend="{backend}",
        reason="{reason}",
    ),
    _c(
        "fleet.clears_made",
        DAEMON,
        "fleet",
        "Namespaces cleared here, published to the fleet",
        "hicached_fleet_clears",
        origin="this_node",
    ),
    _c(
        "fleet.clears_seen",
        DAEMON,
        "fleet",
        "Clears of a namespace made by other nodes, seen here",
        "hicached_fleet_clears",
        origin="other_node",
    ),
    _c("fleet.epoch_reads", DAEMON, "fleet", "Reads of the fleet's clear epochs from L3"),
    _c("fleet.epoch_unreadable", DAEMON, "fleet", "Clear epochs found in L3 that could not be read"),
    _c(
        "fleet.epoch_errors.{reason}",
        DAEMON,
        "fleet",
        f"Reads or writes of the clear epochs that failed, by {_BACKEND_REASON}",
    ),
    _c(
        "fleet.cleared_l2_pages",
        DAEMON,
        "fleet",
        "Pages that left L2 because another node cleared their namespace",
    ),
    _c(
        "fleet.cleared_busy",
        DAEMON,
        "fleet",
        "Pages such a clear found held (leased or pinned), left to go later",
    ),
    _c("clear.requests", DAEMON, "clear", "Clears of a namespace asked by engines"),
    _c("clear.l2_pages", DAEMON, "clear", "Pages those clears removed from L2"),
    _c("clear.l3_objects", DAEMON, "clear", "Objects those clears deleted from L3"),
    _c(
        "clear.swept_objects",
        DAEMON,
        "clear",
        "Objects deleted from L3 by a clear's second pass (writes in flight then)",
    ),
    _c("clear.l3_errors.{reason}", DAEMON, "clear", f"Clears whose L3 part failed, by {_BACKEND_REASON}"),
    _c(
        "clear.sweep_errors.{reason}",
        DAEMON,
        "clear",
        f"Second passes of a clear that failed, by {_BACKEND_REASON}",
    ),
    _c("touch.pages", DAEMON, "touch", "Pages touched (marked used) by engines"),
    _c("warmup.pages", DAEMON, "warmup", "Pages read into L2 from L3 by the warm list at start"),
    _c("keep.pages", DAEMON, "keep", "Pages kept over a restart or a takeover, served again"),
    _c(
        "keep.dropped",
        DAEMON,
        "keep",
        "Pages kept over a restart or a takeover that did not verify: dropped, never served",
    ),
    # The L2 index: `ctl stats` -> pool.
    _c("evictions", POOL, "index", "Pages evicted from L2", "hicached_evictions"),
    _c("demotions", POOL, "index", "Pages moved from the protected segment back to probation (slru)"),
    _c(
        "ghost_hits",
        POOL,
        "index",
        "Pages stored again soon after probation evicted them: protected at once (slru)",
    ),
    _c("alloc_failures", POOL, "index", "Slot allocations that found no slot, evictions included"),
    _c("slab_moves", POOL, "index", "Slabs emptied and handed to another size class"),
    _c(
        "quarantined",
        POOL,
        "index",
        "Slots kept out of use while a read from L3 given up on may still write them",
    ),
    _c("gc_freezes", POOL, "index", "Times the index moved its objects out of the garbage collector's scans"),
    # The attached L3 backend: `ctl stats` -> backend_counters.
    _c("puts", BACKEND, "backend", "Pages asked to be written (probes included)"),
    _c("gets", BACKEND, "backend", "Pages asked to be read (probes included)"),
    _c("hits", BACKEND, "backend", "Pages read whole and verified"),
    _c("misses", BACKEND, "backend", "Pages not read: absent, corrupt, of another page size, or failed"),
    _c("bytes_written", BACKEND, "backend", "Payload bytes written"),
    _c("bytes_read", BACKEND, "backend", "Payload bytes read"),
    _c("deletes", BACKEND, "backend", "Objects deleted (clears, corrupt pages, probes)"),
    _c(
        "not_a_page", BACKEND, "backend", "Files under the file backend's root that are not pages: left alone"
    ),
    _c(
        "errors.{reason}",
        BACKEND,
        "backend",
        "Failed operations by reason: an errno name (file), `timeout`, `connection`, `changed` (bytes "
        "changed while written: not published), `oom`, `response`, `auth`, `tls` (redis), `server`, "
        "`refused`, `no_bucket`, `credentials`, `config` (s3), `invalid_namespace`",
    ),
    Counted(
        "corrupt.{reason}",
        BACKEND,
        "backend",
        "Corrupt pages found: misses, removed",
        values={"reason": ("short", "magic", "key", "length", "checksum")},
        metric="hicached_corrupt_pages",
        labels={"reason": "{reason}"},
    ),
    Counted(
        "misfit.{reason}",
        BACKEND,
        "backend",
        "Whole pages of another page size or format (another node's): misses, left in place",
        values={"reason": ("version", "length")},
        metric="hicached_misfit_pages",
        labels={"reason": "{reason}"},
    ),
    _c("janitor.runs", BACKEND, "janitor", "Runs of the file backend's janitor (storage.file.max_bytes)"),
    _c(
        "janitor.skipped_locked",
        BACKEND,
        "janitor",
        "Janitor runs skipped: another daemon's janitor held the lock",
    ),
    _c(
        "janitor.lock_unsupported",
        BACKEND,
        "janitor",
        "Janitor runs on a root that cannot be locked (each daemon on its own)",
    ),
    _c(
        "evictions",
        BACKEND,
        "janitor",
        "L3 pages removed by this node's janitor",
        "hicached_l3_janitor_removed_pages",
    ),
    _c("evicted_bytes", BACKEND, "janitor", "Bytes of those pages", "hicached_l3_janitor_removed_bytes"),
    _c("evicted_gone", BACKEND, "janitor", "Pages the janitor meant to remove that others removed first"),
    _c("stale_temp_removed", BACKEND, "janitor", "Temporary files of writes that never ended, removed"),
    _c(
        "stale_trash_removed",
        BACKEND,
        "janitor",
        "Files left in the trash by a clear that never ended, removed",
    ),
    _c("fleet.errors", BACKEND, "janitor", "Failures to share the file bound's count with the other nodes"),
    # Engines' memory regions: `ctl stats` -> regions.counters.
    Counted(
        "attached.{kind}",
        REGIONS,
        "regions",
        "Regions registered, by kind",
        values={"kind": ("host", "cuda")},
    ),
    _c(
        "attached.unsealed",
        REGIONS,
        "regions",
        "Host regions registered over memory that can shrink (not sealed)",
    ),
    _c("attached.tmpfs", REGIONS, "regions", "Host regions registered over a file rather than a memfd"),
    _c("attached.fence", REGIONS, "regions", "Fence boards registered"),
    _c("dropped.shrunk", REGIONS, "regions", "Regions dropped because their memory shrank under a copy"),
    _c("store_pages", REGIONS, "regions", "Pages copied out of regions into L2"),
    _c("load_pages", REGIONS, "regions", "Pages copied out of L2 into regions"),
    _c("copy_errors", REGIONS, "regions", "Region copies that failed"),
    _c(
        "copies_cancelled",
        REGIONS,
        "regions",
        "Region copy jobs that found their request cancelled by the engine",
    ),
)

METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("hicached_lookup_hits", "counter", "Keys found by lookups and loads, by tier", ("tier",)),
        Metric("hicached_lookup_misses", "counter", "Lookups that stopped short of the last key"),
        Metric("hicached_stored_pages", "counter", "Pages stored into L2"),
        Metric("hicached_stored_bytes", "counter", "Bytes of pages stored into L2"),
        Metric("hicached_loaded_pages", "counter", "Pages loaded out of L2 into engines"),
        Metric("hicached_loaded_bytes", "counter", "Bytes of pages loaded out of L2"),
        Metric("hicached_load_misses", "counter", "Loads that did not find every key"),
        Metric("hicached_prefetched_pages", "counter", "Pages read from L3 into L2 by prefetches"),
        Metric("hicached_prefetched_bytes", "counter", "Bytes of pages prefetched from L3"),
        Metric("hicached_backed_up_pages", "counter", "Pages written to L3 by the backup"),
        Metric("hicached_backed_up_bytes", "counter", "Bytes of pages written to L3 by the backup"),
        Metric("hicached_backup_failed_pages", "counter", "Pages the backup gave up on"),
        Metric("hicached_backup_lost_pages", "counter", "Pages owed to L3 that left L2 before reaching it"),
        Metric(
            "hicached_backup_changed_pages", "counter", "Pages whose bytes no longer matched their checksum"
        ),
        Metric("hicached_backup_dropped_pages", "counter", "Pages the backlog bound stopped holding for L3"),
        Metric(
            "hicached_backup_dropped_gone_pages", "counter", "Of those, pages that left L2 before reaching L3"
        ),
        Metric("hicached_backend_swaps", "counter", "Backend swaps, by outcome", ("outcome",)),
        Metric("hicached_breaker_trips", "counter", "Times the breaker detached a failing backend"),
        Metric("hicached_backend_stalls", "counter", "Breaker trips because the backend stalled"),
        Metric("hicached_l3_other_nodes_pages", "counter", "Pages read from L3 that another node stored"),
        Metric(
            "hicached_fleet_clears", "counter", "Namespace clears, made here or seen from others", ("origin",)
        ),
        Metric("hicached_backend_failures", "counter", "Failed backend calls", ("backend", "reason")),
        Metric(EVENTS, "counter", "Other daemon events, by name", ("event",)),
        Metric("hicached_corrupt_pages", "counter", "Corrupt L3 pages found", ("reason",)),
        Metric(
            "hicached_misfit_pages",
            "counter",
            "L3 pages of another page size or format (another node's), left in place",
            ("reason",),
        ),
        Metric("hicached_l3_janitor_removed_pages", "counter", "L3 pages removed by this node's janitor"),
        Metric("hicached_l3_janitor_removed_bytes", "counter", "Bytes of those pages"),
        Metric(
            "hicached_l3_file_bytes",
            "gauge",
            "Bytes under the file backend's root, all nodes' (an estimate between scans)",
        ),
        Metric("hicached_evictions", "counter", "Pages evicted from L2"),
        Metric("hicached_pool_capacity_bytes", "gauge", "L2 pool capacity"),
        Metric("hicached_pool_used_bytes", "gauge", "L2 bytes in slots in use"),
        Metric("hicached_pool_pages", "gauge", "Pages in L2"),
        Metric("hicached_pool_reserved_bytes", "gauge", "L2 bytes in slots held ahead for stores"),
        Metric("hicached_pool_dirty_pages", "gauge", "Pages in L2 not yet in L3"),
        Metric("hicached_pool_unbacked_bytes", "gauge", "L2 bytes held for pages not yet in L3"),
        Metric("hicached_backup_queue_pages", "gauge", "Pages queued or being written to L3"),
        Metric("hicached_prefetch_queue_pages", "gauge", "Pages queued or being read from L3"),
        Metric("hicached_connections", "gauge", "Engine connections"),
        Metric("hicached_tenant_pool_capacity_bytes", "gauge", "A tenant's L2 pool capacity", ("tenant",)),
        Metric(
            "hicached_tenant_pool_used_bytes",
            "gauge",
            "L2 bytes in slots in use in a tenant's pool",
            ("tenant",),
        ),
        Metric("hicached_tenant_pool_pages", "gauge", "Pages in a tenant's L2 pool", ("tenant",)),
        Metric(
            "hicached_tenant_pool_unbacked_bytes",
            "gauge",
            "Bytes of a tenant's pool held for pages not yet in L3",
            ("tenant",),
        ),
        Metric(
            "hicached_backend_attached", "gauge", "1 when an L3 backend is attached", ("backend", "state")
        ),
        Metric(
            "hicached_backend_detached_since_seconds",
            "gauge",
            "Unix time since the L3 backend is not attached (0 while attached); why: ctl status",
        ),
        Metric("hicached_reloads", "counter", "Configuration reloads", ("outcome",)),
        Metric("hicached_backend_latency_seconds", "histogram", "Backend call latency", ("backend", "op")),
    )
}


def declared(where: str, key: str) -> Counted | None:
    """The declaration of the key `key` counted in `where`: its own, else the pattern it fits."""
    exact = [c for c in COUNTERS if c.where == where and c.name == key]
    if exact:
        return exact[0]
    return next((c for c in COUNTERS if c.where == where and c.parts and c.regex.fullmatch(key)), None)
