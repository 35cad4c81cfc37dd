"""How vLLM's primary tier looks to the daemon: its /dev/shm file as a region, a row's parts and keys, and the
namespace that says what a row's bytes mean (hicached.engine.vllm)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicached.common.keys import NAMESPACE_MAX_LEN

PAGE_ALIGN = 4096  # vLLM rounds a row up to this (SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)
PREFIX_MAX_LEN = 64
_PREFIX_RE = re.compile(rf"[A-Za-z0-9._-]{{0,{PREFIX_MAX_LEN}}}")
# Bumped when the meaning of a key or of a row's bytes in this tier changes: old pages then go unseen.
LAYOUT_VERSION = 1


def row_parts(row_bytes: int, max_page_bytes: int) -> int:
    """Into how many equal parts a row is split so that each fits one daemon page (`pool.slab_size`): the
    fewest parts whose size divides the row and stays a multiple of 4 KiB (a part's key then names bytes
    of that row only, and L2 keeps its slots page-aligned). 1 when the row fits whole."""
    if row_bytes <= max_page_bytes:
        return 1
    if row_bytes % PAGE_ALIGN:
        raise ValueError(f"a row of {row_bytes} bytes is not a multiple of {PAGE_ALIGN}; vLLM aligns rows")
    units = row_bytes // PAGE_ALIGN
    for parts in range(-(-row_bytes // max_page_bytes), units + 1):
        if units % parts == 0 and row_bytes // parts <= max_page_bytes:
            return parts
    raise ValueError(f"pool.slab_size ({max_page_bytes}) is below {PAGE_ALIGN} bytes")


def block_key(key: bytes) -> str:
    """An OffloadKey (block hash, then the KV group as 4 bytes big-endian) as a daemon key: the hash in hex
    and the group, `<hex>-g<group>` (one job may carry blocks of several groups)."""
    return f"{key[:-4].hex()}-g{int.from_bytes(key[-4:], 'big')}"


def daemon_keys(keys: Any, parts: int) -> list[str]:
    """The daemon keys of a job's blocks: one a block, or `<key>-p<i>` for each part of a split row."""
    names = [block_key(k) for k in keys]
    if parts == 1:
        return names
    return [f"{name}-p{i}" for name in names for i in range(parts)]


def daemon_pages(chunk_ids: Any, parts: int) -> list[int]:
    """The region pages of a job's rows: the row itself, or each of its parts (page = row x parts + i)."""
    rows = np.asarray(chunk_ids, dtype=np.int64)
    if parts == 1:
        return rows.tolist()
    return (rows[:, None] * parts + np.arange(parts, dtype=np.int64)[None, :]).ravel().tolist()


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"namespace_prefix must be at most {PREFIX_MAX_LEN} characters of [A-Za-z0-9._-], got {prefix!r}"
        )
    return prefix.strip(".")


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


def row_fields(offloading_spec: Any, row_bytes: int) -> dict[str, Any]:
    """What changes the bytes of a row: what vLLM's FileMapper folds into the fs tier's path (model, dtype,
    tokens per hash, blocks per chunk, the KV groups and their layers, the parallel sizes unless the bytes
    are parallelism-agnostic, replicated MLA, the canonical format), and the row's size."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    return {**mapper.get_run_config(), "row_bytes": row_bytes, "layout": LAYOUT_VERSION}


def namespace(prefix: str, fields: dict[str, Any], part_bytes: int) -> str:
    """`[prefix.]model.dtype.t<tokens>.<digest>`: readable parts for operators, and a digest of every field
    (and of the part size, as a namespace holds pages of one size) so that two engines share pages exactly
    when their rows mean the same. A long model name is cut; the digest keeps the namespace exact."""
    canonical = json.dumps({**fields, "part_bytes": part_bytes}, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:24]
    tail = ".".join(
        p for p in (_clean(str(fields.get("dtype", ""))), f"t{fields.get('tokens_per_hash', 0)}", digest) if p
    )
    head = [prefix] if prefix else []
    room = NAMESPACE_MAX_LEN - len(tail) - sum(len(h) + 1 for h in head) - 1
    model = _clean(str(fields.get("model_name", "")))[: max(0, room)].strip("-.")
    return ".".join([*head, *([model] if model else []), tail])


@dataclass(frozen=True)
class RegionFile:
    """The file behind vLLM's primary view: an fd of our own (dup'd or opened), where row 0 starts in it."""

    fd: int
    offset: int
    size: int


def _view_address(view: memoryview) -> int:
    arr = np.frombuffer(view, dtype=np.uint8, count=1)  # a brief export of the view, dropped at once
    try:
        return int(arr.__array_interface__["data"][0])
    finally:
        del arr


def _mapping_of(address: int) -> tuple[int, int, int, int, str]:
    """(start, end, file offset, inode, path) of this process's mapping that holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                path = fields[5].strip() if len(fields) > 5 else ""
                return lo, hi, int(fields[2], 16), int(fields[4]), path
    raise ValueError(f"no mapping of this process holds address {address:#x}")


def region_file(offloading_spec: Any, view: memoryview) -> RegionFile:
    """The tmpfs file under vLLM's primary view (/dev/shm/vllm_offload_<engine>.mmap), as an fd this tier
    owns: the spec's own fd duplicated when it is that file, else the mapped path opened again. ValueError
    when the view is not one mapping of one file that can be opened."""
    address = _view_address(view)
    nbytes = view.nbytes
    lo, hi, offset, inode, path = _mapping_of(address)
    if address + nbytes > hi:
        raise ValueError("vLLM's primary view spans several mappings, not one file")
    start = offset + (address - lo)
    for own in _candidates(getattr(getattr(offloading_spec, "_scheduler_mmap", None), "fd", None), path):
        st = os.fstat(own)
        if stat.S_ISREG(st.st_mode) and st.st_ino == inode and st.st_size >= start + nbytes:
            return RegionFile(own, start, st.st_size)
        os.close(own)
    raise ValueError(f"cannot open the file under vLLM's primary view ({path or 'anonymous memory'})")


def _candidates(spec_fd: Any, path: str) -> Iterator[int]:
    """Fds of our own that may be the file: the spec's (SharedOffloadRegion.fd) duplicated, then the path
    the mapping names (unless it was unlinked)."""
    if isinstance(spec_fd, int) and not isinstance(spec_fd, bool) and spec_fd >= 0:
        with contextlib.suppress(OSError):
            yield fcntl.fcntl(spec_fd, fcntl.F_DUPFD_CLOEXEC, 0)
    if path.startswith("/") and not path.endswith("(deleted)"):
        with contextlib.suppress(OSError):
            yield os.open(path, os.O_RDWR | os.O_CLOEXEC)
