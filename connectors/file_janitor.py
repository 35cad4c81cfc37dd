"""The file backend's janitor work, run on its own thread: walk the page tree, count its bytes, remove
temporary files left by a crash, and remove pages least recently used first."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

STALE_TMP_S = 600.0  # a temporary file this old belongs to a write that died with its daemon


def scan(
    root: str, stop: threading.Event, collect: bool
) -> tuple[int, list[tuple[float, int, int, str]], int] | None:
    """Walks root/namespace/ab/cd: the bytes of the page files, with `collect` each page's (last use,
    size, inode, path), and how many stale temporary files it removed. None if `stop` was set."""
    total = stale = 0
    pages: list[tuple[float, int, int, str]] = []
    now = time.time()
    for shard in shards(root):
        if stop.is_set():
            return None
        try:
            with os.scandir(shard) as entries:
                for entry in entries:
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                        if entry.name.startswith("."):  # a write's temporary file (keys never start so)
                            if entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                                os.unlink(entry.path)
                                stale += 1
                            continue
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # removed or renamed since listed
                    total += st.st_size
                    if collect:
                        # atime when the filesystem keeps it; reads also set mtime (FileConnector._read_one).
                        pages.append((max(st.st_atime, st.st_mtime), st.st_size, st.st_ino, entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total, pages, stale


def shards(root: str) -> Iterator[str]:
    """The shard directories, root/namespace/ab/cd; anything else in the tree is left alone."""
    for ns in _subdirs(root, missing_ok=False):
        for a in _subdirs(ns):
            yield from _subdirs(a)


def evict(path: str, ino: int, used: float) -> bool:
    """Removes a page unless it was read or written again since the scan (a new inode, a later mtime)."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if now.st_ino != ino or now.st_mtime > used:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _subdirs(path: str, missing_ok: bool = True) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return []
        raise
