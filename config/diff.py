"""What a reload changes: the keys that differ between two configurations, split into those the daemon
applies live and those that need a restart (which a reload reports and leaves as they were).

Tenants: their members and namespaces reload; a tenant's socket and capacity, and the set of tenants itself
(a tenant added or removed is reported as `tenants.NAME`), change on restart only."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from .loader import resolve_path
from .schema import Config
from .tenants import check_tenants

# Keys (or sections) a running daemon cannot change: the socket it listens on and the pool it shares.
RESTART_REQUIRED = (
    "server.socket",
    "server.socket_mode",
    "pool.capacity",
    "pool.slab_size",
    "pool.prefault",
    "pool.memory_wait",
    "pool.eviction",
    "metrics.listen",
    "regions.copy_threads",
    "tenants.*.socket",
    "tenants.*.capacity",
)
_ABSENT = object()  # a key of a tenant that one of the two configurations does not have


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("internal"):
            continue
        value = getattr(cfg, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, path))
        elif isinstance(value, dict) and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, table in value.items():
                out.update(flatten(table, f"{path}.{name}"))
        else:
            out[path] = value
    return out


def changed(old: Config, new: Config) -> list[str]:
    """The keys that differ; a tenant that only one of the two has is one key, `tenants.NAME`."""
    a, b = flatten(old), flatten(new)
    out = {k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT)}
    added_or_removed = old.tenants.keys() ^ new.tenants.keys()
    out = {k for k in out if not (k.startswith("tenants.") and k.split(".")[1] in added_or_removed)}
    return sorted(out | {f"tenants.{name}" for name in added_or_removed})


def _needs_restart(key: str) -> bool:
    parts = key.split(".")
    if parts[0] == "tenants":
        # tenants.NAME (added or removed), tenants.NAME.socket, tenants.NAME.capacity
        return len(parts) == 2 or ".".join(["tenants", "*", *parts[2:]]) in RESTART_REQUIRED
    return any(key == r or key.startswith(r + ".") for r in RESTART_REQUIRED)


@dataclasses.dataclass
class Plan:
    config: Config  # the configuration to run with: the new one, with restart-only keys kept as they were
    live: list[str]
    restart: list[str]
    swap_backend: bool  # the backend, or the options of the configured backend, changed


def plan(old: Config, new: Config) -> Plan:
    keys = changed(old, new)
    restart = [k for k in keys if _needs_restart(k)]
    live = [k for k in keys if not _needs_restart(k)]
    effective = copy.deepcopy(new)
    for key in restart:
        _set(effective, key, _get(old, key))
    if effective.tenants != new.tenants:
        # What it runs with mixes the two files: a tenant kept or a capacity kept must still fit the rest.
        check_tenants(effective, resolve_path)
    backend = new.storage.backend
    swap = any(
        k == "storage.backend"
        or k.startswith(f"storage.{backend}.")
        or k == "storage.operation_timeout"
        # redis-py does the Redis connector's retrying: its client is built with storage.retry
        or (backend == "redis" and k.startswith("storage.retry."))
        for k in live
    )
    return Plan(effective, live, restart, swap)


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg.get(part, _ABSENT) if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _set(cfg: Any, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    if not isinstance(cfg, dict):
        setattr(cfg, last, copy.deepcopy(value))
    elif value is _ABSENT:
        del cfg[last]  # a tenant added by the file: not before a restart
    else:
        cfg[last] = copy.deepcopy(value)  # a tenant removed from the file: kept until a restart
