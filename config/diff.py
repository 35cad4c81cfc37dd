"""What a reload changes: the keys that differ between two configurations, split into those the daemon
applies live and those that need a restart (which a reload reports and leaves as they were)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from .schema import Config

# Keys (or sections) a running daemon cannot change: the socket it listens on and the pool it shares.
RESTART_REQUIRED = (
    "server.socket",
    "server.socket_mode",
    "pool.capacity",
    "pool.slab_size",
    "pool.prefault",
    "pool.memory_wait",
    "metrics.listen",
    "regions.copy_threads",
)


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("internal"):
            continue
        value = getattr(cfg, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def changed(old: Config, new: Config) -> list[str]:
    a, b = flatten(old), flatten(new)
    return sorted(k for k in a if a[k] != b[k])


def _needs_restart(key: str) -> bool:
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
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: Any, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    setattr(cfg, last, copy.deepcopy(value))
