"""Page keys compatible with SGLang's chained SHA-256 page hashes, and validation of keys and namespaces."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

NAMESPACE_MAX_LEN = 128
KEY_MAX_LEN = 128
_NAMESPACE_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{NAMESPACE_MAX_LEN}}}")
# SGLang keys are 64 lowercase hex characters; other engines may bring their own hashes, so any key made of
# characters that are safe in a file name, a Redis key and an S3 object name is accepted.
_KEY_RE = re.compile(rf"[A-Za-z0-9_-]{{1,{KEY_MAX_LEN}}}")
_KEY_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"


def page_keys(token_ids: Any, page_size: int, prior: str | None = None) -> list[str]:
    """Chained keys of every full page of `token_ids`, exactly as SGLang computes them.

    `d0 = sha256(tokens of page 0)`, `di = sha256(d(i-1) as 32 raw bytes || tokens of page i)`, each token
    as 4-byte little-endian unsigned. `prior` is the key of the page before the first one (a continuation).
    A trailing partial page has no key. Accepts lists, numpy arrays and tensors (on any device).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    tokens = _as_uint32(token_ids)
    raw = tokens.astype("<u4", copy=False).tobytes()
    step = page_size * 4
    digest = bytes.fromhex(prior) if prior else b""
    if prior is not None and len(digest) != 32:
        raise ValueError("prior must be a 64-character hex key")
    keys = []
    for start in range(0, len(raw) - step + 1, step):
        h = hashlib.sha256(digest)
        h.update(raw[start : start + step])
        digest = h.digest()
        keys.append(digest.hex())
    return keys


def _as_uint32(token_ids: Any) -> np.ndarray:
    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # a torch tensor, possibly on a GPU
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.uint32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError("token ids cannot be negative")
    if int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must fit in 32 bits")
    return arr.astype(np.uint32, copy=False)


def valid_namespace(namespace: Any) -> bool:
    if not isinstance(namespace, str) or namespace in (".", ".."):
        return False
    return bool(_NAMESPACE_RE.fullmatch(namespace))


# A namespace's objects in L3 after its first clear: `{namespace}~{epoch}` (hicached.daemon.sched.epochs). The
# "~" keeps them apart from every namespace an engine can name.
EPOCH_SEP = "~"
_EPOCH_RE = re.compile(r"[0-9a-f]{16}")


def stored_namespace(namespace: str, epoch: str) -> str:
    """The name of a namespace's objects in L3 under clear epoch `epoch` ("" before any clear: the name)."""
    return f"{namespace}{EPOCH_SEP}{epoch}" if epoch else namespace


def valid_stored_namespace(name: Any) -> bool:
    """A namespace as the connectors take it: an engine's namespace, or one with its clear epoch."""
    if not isinstance(name, str):
        return False
    base, sep, epoch = name.partition(EPOCH_SEP)
    return valid_namespace(base) and (not sep or bool(_EPOCH_RE.fullmatch(epoch)))


def check_namespace(namespace: Any) -> str:
    if not valid_namespace(namespace):
        raise ValueError(
            f"invalid namespace {namespace!r}: use 1 to {NAMESPACE_MAX_LEN} characters from "
            "A-Z a-z 0-9 . _ - (and not '.' or '..')"
        )
    return namespace


def valid_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_KEY_RE.fullmatch(key))


def all_valid_keys(keys: Sequence[Any]) -> bool:
    """valid_key of every key, for a whole batch at once: ~0.1 us a key instead of ~0.5 us. The bytes left
    after deleting the allowed characters must be exactly the separators, and every key within bounds."""
    if not keys:
        return True
    try:
        joined = "\n".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return False
    return (
        joined.translate(None, _KEY_CHARS) == b"\n" * (len(keys) - 1)
        and 0 < min(map(len, keys))
        and max(map(len, keys)) <= KEY_MAX_LEN
    )


def check_keys(keys: Iterable[Any]) -> Sequence[str]:
    keys = list(keys)
    if all_valid_keys(keys):  # the fast path for a whole request (tens of keys on every lookup)
        return keys
    for key in keys:
        if not valid_key(key):
            raise ValueError(
                f"invalid key {key!r}: keys are 1 to {KEY_MAX_LEN} characters from A-Z a-z 0-9 _ - "
                "(SGLang keys are 64 lowercase hex characters)"
            )
    return keys
