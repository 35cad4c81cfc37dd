"""The namespace an SGLang host pool's pages live in: what changes their bytes (model, dtype, tokens per
page, layout, parallel ranks, salt) and, for an extra pool of the v2 interface, its name."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from hicached.common.keys import NAMESPACE_MAX_LEN

KV = "kv"  # the anchor pool's name (SGLang's PoolName.KV)


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


def namespace_prefix(storage_config: Any) -> list[str]:
    """The parts of the namespace that SGLang's storage config decides: model, parallel ranks, salt."""
    return _prefix(storage_config, tp_always=False)


def _prefix(storage_config: Any, tp_always: bool) -> list[str]:
    extra = getattr(storage_config, "extra_config", None) or {}
    parts = [_clean(str(getattr(storage_config, "model_name", None) or "")) or "model"]
    # MLA keeps the same KV on every TP rank, so ranks share pages; otherwise each rank holds its heads.
    # Mamba state is TP-sharded even when the model's MLA KV is replicated (`tp_always`).
    if tp_always or not getattr(storage_config, "is_mla_model", False):
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if getattr(storage_config, "pp_size", 1) > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if getattr(storage_config, "attn_cp_size", 1) > 1:  # each context-parallel rank holds a slice of a page
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    if getattr(storage_config, "dcp_size", 1) > 1:  # MLA shards of decode context parallelism
        parts.append(f"dcp{storage_config.dcp_rank}of{storage_config.dcp_size}")
    if extra.get("salt"):
        parts.append(_salt(str(extra["salt"])))
    return parts


def _salt(salt: str) -> str:
    """The salt as a namespace part: as it is when it is made of namespace characters and short, else its
    cleaned start and a digest of all of it, so that salts differing only in other characters (`a/b`, `a:b`)
    or past the cut never share pages."""
    clean = _clean(salt)
    if clean == salt and len(salt) <= 32:
        return salt
    return "-".join(p for p in (clean[:32], hashlib.sha256(salt.encode()).hexdigest()[:16]) if p)


def _join(parts: list[str]) -> str:
    ns = ".".join(p for p in parts if p)
    if len(ns) <= NAMESPACE_MAX_LEN:
        return ns
    # A long model name: keep it recognisable and still distinct.
    digest = hashlib.sha256(parts[0].encode()).hexdigest()[:12]
    room = NAMESPACE_MAX_LEN - len(ns) + len(parts[0]) - len(digest) - 1
    if room >= 1:
        return ".".join(p for p in [f"{parts[0][:room]}-{digest}", *parts[1:]] if p)
    # The other parts alone are too long: the start of the whole, and a digest of all of it.
    digest = hashlib.sha256(ns.encode()).hexdigest()[:16]
    return f"{ns[: NAMESPACE_MAX_LEN - len(digest) - 1]}-{digest}"


def pool_namespace(storage_config: Any, pool: Any, name: str) -> str:
    """The namespace of one host pool's pages: what changes their bytes (model, dtype, tokens per page,
    layout, parallel ranks, salt) and, for an extra pool of the v2 interface, its name."""
    flat = pool.get_dummy_flat_data_page()
    dtype = str(flat.dtype).removeprefix("torch.")
    tokens = int(getattr(pool, "page_size", 1) or 1)
    layout = _clean(str(getattr(pool, "layout", "") or ""))
    parts = _prefix(storage_config, tp_always=name == "mamba")
    model, rest = parts[0], parts[1:]
    return _join([model, dtype, f"p{tokens}", layout, *rest, "" if name == KV else _clean(name)])
