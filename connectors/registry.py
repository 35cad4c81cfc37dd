"""Builds the configured L3 connector by name ("none" gives no connector: an L2-only daemon)."""

from __future__ import annotations

import importlib

from hicached.config import Config

from .base import Connector

# name -> "module:Class", imported on demand so that a backend's library is loaded only when it is used.
CONNECTORS = {
    "file": "hicached.connectors.file:FileConnector",
    "redis": "hicached.connectors.redis:RedisConnector",
    "s3": "hicached.connectors.s3:S3Connector",
}


def build(cfg: Config, backend: str | None = None) -> Connector | None:
    """A new, not yet started connector for `backend` (default: storage.backend of `cfg`)."""
    name = backend or cfg.storage.backend
    if name == "none":
        return None
    try:
        target = CONNECTORS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: none, {', '.join(CONNECTORS)}") from None
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(cfg)
