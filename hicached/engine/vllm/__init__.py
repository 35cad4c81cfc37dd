"""The vLLM adapter: `HicachedTier`, a secondary tier of vLLM 0.33's KV offloading that vLLM's
SecondaryTierFactory loads from `"module_path": "hicached.engine.vllm"` (launch flags: docs/engines.md,
"vLLM"). `tier` is the tier, `daemon` its connection, `lookup` its batched lookups and touches, `rows` how
vLLM's rows are named and cut. The tier's names are imported on first use: `lookup` and `rows` import
without vLLM."""

from typing import Any

# hicached.engine.vllm.tier's public names (it imports vLLM).
_TIER = frozenset(
    {
        "HicachedTier",
        "CONNECTS",
        "DROPPED_TOUCHES",
        "L2_LOADED",
        "L3_LOADED",
        "LATE_LOOKUPS",
        "REACHABLE",
        "DEFAULT_IO_THREADS",
        "DEFAULT_LOOKUP_WAIT_S",
        "DEFAULT_RECONNECT_S",
        "DEFAULT_TIMEOUT_S",
    }
)

__all__ = ["HicachedTier"]


def __getattr__(name: str) -> Any:
    if name in _TIER:
        from hicached.engine.vllm import tier

        return getattr(tier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TIER)
