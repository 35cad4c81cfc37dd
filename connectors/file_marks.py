"""The file backend's marks (Connector.read_marks / write_mark): small values the nodes sharing a root keep
besides pages, each a file `{root}/.fleet~/marks/{name}` replaced whole by a rename (a reader never sees
half of one). The "~" keeps the directory out of every namespace, and the janitor's scans pass it by."""

from __future__ import annotations

import contextlib
import os

from .base import FLEET_NAMESPACE, MAX_MARK
from .file_layout import READ_FLAGS, TMP_FLAGS, make_shard, open_dir

FLEET_DIR = FLEET_NAMESPACE
MARKS = (FLEET_DIR, "marks")


def read(root: int, names: list[str]) -> list[bytes | None]:
    """Each mark's value beneath the root (an fd), None where there is none."""
    try:
        fd = open_dir(root, MARKS)
    except FileNotFoundError:
        return [None] * len(names)
    try:
        return [_read_one(fd, name) for name in names]
    finally:
        os.close(fd)


def _read_one(directory: int, name: str) -> bytes | None:
    try:
        f = os.open(name, READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return None
    try:
        return os.read(f, MAX_MARK)
    finally:
        os.close(f)


def write(root: int, name: str, value: bytes, tag: str, fsync: bool) -> None:
    """Replaces the mark `name` with `value`: written under a temporary name, then renamed over it."""
    if len(value) > MAX_MARK:
        raise ValueError(f"a mark holds at most {MAX_MARK} bytes")
    fd = make_shard(root, MARKS)
    tmp = f".{name}.{tag}.tmp"
    try:
        f = os.open(tmp, TMP_FLAGS, 0o600, dir_fd=fd)
        try:
            os.write(f, value)
            if fsync:
                os.fsync(f)
        finally:
            os.close(f)
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise
    finally:
        os.close(fd)
