"""hicached: a node-local tiered KV-cache daemon for LLM inference engines, and the client engines use.

The public names engines need are here: `Client`, `AsyncClient`, `page_keys`, `shared_buffer`,
`HicachedError`. The tree says which process runs what: `hicached.engine` runs in the engine,
`hicached.daemon` in the daemon, `hicached.common` in both; `hicached.connectors` (the L3 backends) and
`hicached.config` (the TOML schema) are the layers below the daemon. The names below are imported on first
use, so that `import hicached.config` or `import hicached.connectors` loads neither side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicached.common.errors import HicachedError
    from hicached.common.keys import page_keys
    from hicached.engine.client import AsyncClient, Client
    from hicached.engine.regions import shared_buffer

__all__ = ["AsyncClient", "Client", "HicachedError", "page_keys", "shared_buffer"]

_WHERE = {
    "Client": "hicached.engine.client",
    "AsyncClient": "hicached.engine.client",
    "HicachedError": "hicached.common.errors",
    "page_keys": "hicached.common.keys",
    "shared_buffer": "hicached.engine.regions",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'hicached' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
