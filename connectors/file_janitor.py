"""The file backend's janitor work, run on its own thread: walk the page tree, count its bytes, remove
temporary files left by a crash, and remove pages least recently used first."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

STALE_TMP_S = 600.0  # a temporary file this old belongs to a write that died with its daemon


def scan(
    root: str, stop: threading.Event, collect: bool, own_tag: str = ""
) -> tuple[int, list[tuple[float, int, int, str]], int, float | None] | None:
    """Walks root/namespace/ab/cd: the bytes of the page files, with `collect` each page's (last use,
    size, inode, path), how many stale temporary files it removed, and when the oldest temporary file
    that is not stale yet will be (None if none), leaving out this daemon's own writes in flight (names
    with `own_tag`): a crash followed by a quick restart leaves files that only a later scan can remove.
    None if `stop` was set."""
    total = stale = 0
    pages: list[tuple[float, int, int, str]] = []
    young: float | None = None
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
                            if entry.name.endswith(".tmp"):
                                if now - st.st_mtime > STALE_TMP_S:
                                    os.unlink(entry.path)
                                    stale += 1
                                elif not (own_tag and _written_by(entry.name, own_tag)):
                                    due = st.st_mtime + STALE_TMP_S
                                    young = due if young is None else min(young, due)
                            continue
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # removed or renamed since listed
                    total += st.st_size
                    if collect:
                        # atime when the filesystem keeps it; reads also set mtime (FileConnector._read_one).
                        pages.append((max(st.st_atime, st.st_mtime), st.st_size, st.st_ino, entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total, pages, stale, young


def _written_by(name: str, tag: str) -> bool:
    """Whether temporary file `name` (".{key}.{tag}{seq}.tmp", the C path's "{tag}c{seq}") is a write of the
    daemon whose tag is `tag`."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[1].startswith(tag)


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
