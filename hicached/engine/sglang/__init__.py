"""The SGLang adapter: `HicachedStorage`, a HiCache storage backend that SGLang's `dynamic` backend loads from
`module_path="hicached.engine.sglang"` (launch flags: docs/engines.md, "SGLang"). `storage` is the backend,
`pools` a host pool's link and region, `pages` where an SGLang pool's pages lie, `namespace` a pool's
namespace, `metrics` the figures for `get_stats`."""

from hicached.engine.sglang.namespace import KV, namespace_prefix, pool_namespace
from hicached.engine.sglang.storage import (
    DEFAULT_RECONNECT_S,
    DEFAULT_SOCKET,
    DEFAULT_TIMEOUT_S,
    HicachedStorage,
)

__all__ = [
    "DEFAULT_RECONNECT_S",
    "DEFAULT_SOCKET",
    "DEFAULT_TIMEOUT_S",
    "KV",
    "HicachedStorage",
    "namespace_prefix",
    "pool_namespace",
]
