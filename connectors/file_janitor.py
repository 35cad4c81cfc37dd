"""The file backend's janitor work, run on its own thread: walk the page tree, count its bytes, remove
temporary files left by a crash, and remove pages least recently used first; and the removal of a cleared
namespace's tree, which the janitor finishes when a clear did not."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Container, Iterator

from .base import FLEET_NAMESPACE

STALE_TMP_S = 600.0  # a temporary file this old belongs to a write that died with its daemon
# A namespace being cleared is renamed to `{TRASH_PREFIX}{tag}.{seq}` under the root, then removed. The "~"
# keeps the name out of every namespace (hicached.common.keys.valid_namespace): no call reads or writes there.
TRASH_PREFIX = ".trash~"
# What the daemons sharing the root keep besides pages (file_fleet's ledgers and lease, file_marks): never
# walked as a namespace, so nothing there is counted or evicted.
FLEET_DIR = FLEET_NAMESPACE
# What evict() did with a page.
REMOVED = "removed"  # this janitor removed it
GONE = "gone"  # someone else did first (another daemon's janitor, a delete, a clear): it is out of the tree
KEPT = "kept"  # used or written again since the scan, or it could not be removed: it stays
# Passes over a trash tree before it is left to the janitor: a write that had opened its shard before the
# rename may still publish a page there (one per writing thread), after the pass that emptied the shard.
_TRASH_PASSES = 3
_TREE_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def scan(
    root: str, stop: threading.Event, collect: bool, own_tag: str = "", clearing: Container[str] = ()
) -> tuple[int, list[tuple[float, int, int, str]], int, float | None] | None:
    """Walks root/namespace/ab/cd: the bytes of the page files, with `collect` each page's (last use,
    size, inode, path), how many stale temporary files it removed, and when the oldest temporary file
    that is not stale yet will be (None if none), leaving out this daemon's own writes in flight (names
    with `own_tag`): a crash followed by a quick restart leaves files that only a later scan can remove.
    The trees of namespaces this daemon is clearing (trash names in `clearing`) count their pages' bytes,
    which the clear takes off the estimate as it removes them, and offer none to evict. None if `stop` was
    set."""
    total = stale = 0
    pages: list[tuple[float, int, int, str]] = []
    young: float | None = None
    now = time.time()
    for shard, cleared in _shards(root, clearing):
        if stop.is_set():
            return None
        try:
            with os.scandir(shard) as entries:
                for entry in entries:
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                        if cleared:
                            total += 0 if entry.name.startswith(".") else st.st_size
                            continue
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
    """The shard directories, root/namespace/ab/cd; anything else in the tree is left alone, and so are the
    trees of namespaces being cleared."""
    for shard, _ in _shards(root):
        yield shard


def _shards(root: str, clearing: Container[str] = ()) -> Iterator[tuple[str, bool]]:
    """shards(), each with whether it is in a tree being cleared: those named in `clearing` are walked too."""
    for ns in _subdirs(root, missing_ok=False):
        name = os.path.basename(ns)
        cleared = name.startswith(TRASH_PREFIX)
        if name == FLEET_DIR or (cleared and name not in clearing):
            continue
        for a in _subdirs(ns):
            for shard in _subdirs(a):
                yield shard, cleared


def remove_trash(root: str, clearing: Container[str], stop: threading.Event) -> int:
    """Removes the trees of clears that did not finish (a crash, a time-out of a clear whose removal then
    failed), all but those in `clearing`, still being removed; how many. Their pages count nowhere: the
    scans leave them out."""
    removed = 0
    try:
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        with os.scandir(root) as entries:
            names = [e.name for e in entries if e.name.startswith(TRASH_PREFIX) and e.name not in clearing]
        for name in names:
            if stop.is_set():
                break
            with contextlib.suppress(FileNotFoundError):  # another daemon on this root was faster
                remove_tree(fd, name)
                removed += 1
    finally:
        os.close(fd)
    return removed


def remove_tree(parent: int, name: str, freed: Callable[[int], None] | None = None) -> int:
    """Removes the namespace tree `name` beneath the directory `parent` (an fd), never following a symlink:
    each directory is opened with O_NOFOLLOW beneath the one before, and a symlink (or anything else that is
    not a directory) is unlinked itself, `name` included. Returns how many page files (regular files at
    name/ab/cd/, not a write's temporary file) it removed, and hands `freed` their bytes, a shard at a time.
    A tree that a late write keeps refilling is left after a few passes (the janitor removes it later)."""
    fd = _open_tree(parent, name)
    if fd is None:
        return 0
    pages = 0
    try:
        for _ in range(_TRASH_PASSES):
            pages += _empty(fd, 0, freed)
            try:
                os.rmdir(name, dir_fd=parent)
                break
            except FileNotFoundError:  # removed meanwhile by another daemon's janitor on this root
                break
            except OSError as e:
                if e.errno != errno.ENOTEMPTY:
                    raise
    finally:
        os.close(fd)
    return pages


def _open_tree(parent: int, name: str) -> int | None:
    """The directory `name` opened beneath `parent` for listing; None, with the entry unlinked, where it is
    not a directory (a symlink included: never followed); FileNotFoundError where it is gone."""
    try:
        return os.open(name, _TREE_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=parent)
    return None


def _empty(fd: int, depth: int, freed: Callable[[int], None] | None) -> int:
    """Removes everything in the directory `fd`, `depth` levels beneath a namespace's; the page files
    removed (at depth 2)."""
    pages = nbytes = 0
    with os.scandir(fd) as entries:
        listed = list(entries)
    try:
        for entry in listed:
            try:
                if entry.is_dir(follow_symlinks=False):
                    sub = _open_tree(fd, entry.name)
                    if sub is not None:
                        try:
                            pages += _empty(sub, depth + 1, freed)
                        finally:
                            os.close(sub)
                        os.rmdir(entry.name, dir_fd=fd)
                    continue
                page = depth == 2 and not entry.name.startswith(".")
                st = entry.stat(follow_symlinks=False) if page else None
                os.unlink(entry.name, dir_fd=fd)
                if st is not None and stat.S_ISREG(st.st_mode):
                    pages += 1
                    nbytes += st.st_size
            except FileNotFoundError:  # removed since listed (another daemon's janitor on this root)
                continue
            except OSError as e:
                if e.errno != errno.ENOTEMPTY:  # a late write refilled a shard: the next pass takes it
                    raise
    finally:  # what is gone is taken off the estimate, even when the rest of the tree cannot be removed
        if nbytes and freed is not None:
            freed(nbytes)
    return pages


def evict(path: str, ino: int, used: float) -> str:
    """Removes a page unless it was read or written again since the scan (a new inode, a later mtime):
    REMOVED, GONE (removed by someone else since the scan: out of the tree all the same) or KEPT. Janitors
    of several daemons that run at once each count the pages the others removed as gone, so together
    they remove no more than the excess."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if now.st_ino != ino or now.st_mtime > used:
            return KEPT
        os.unlink(path)
        return REMOVED
    except (FileNotFoundError, NotADirectoryError):
        return GONE
    except OSError:
        return KEPT


def _subdirs(path: str, missing_ok: bool = True) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return []
        raise
