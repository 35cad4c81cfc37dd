"""Where the file backend keeps a page, `{root}/{namespace}/{key[0:2]}/{key[2:4]}/{key}`, and how its
directories are opened and made beneath the root: one at a time, never through a symlink."""

from __future__ import annotations

import contextlib
import os

# Pages are opened beneath the root one directory at a time, none through a symlink (O_NOFOLLOW; with
# O_DIRECTORY a symlink fails as ENOTDIR), and a read never waits in open() (O_NONBLOCK: a FIFO's open
# would wait for a writer; a regular file reads the same).
ROOT_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def shard_dirs(key: str) -> tuple[str, str]:
    """The two shard directories of a page: key[0:2] and key[2:4], the key padded with '_' to 4 characters."""
    shard = key if len(key) >= 4 else key.ljust(4, "_")
    return shard[0:2], shard[2:4]


def open_dir(root: int, parts: tuple[str, ...]) -> int:
    """The directory root/parts[0]/parts[1]/... opened (O_PATH) one level at a time, none through a symlink
    (NotADirectoryError where one is); FileNotFoundError where one is missing."""
    fd = root
    try:
        for part in parts:
            fd, parent = os.open(part, DIR_FLAGS, dir_fd=fd), fd
            if parent != root:
                os.close(parent)
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd


def size_at(directory: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_size
    except (FileNotFoundError, NotADirectoryError):
        return 0


def make_shard(root: int, parts: tuple[str, ...]) -> int:
    """The directories of a page (namespace, k0k1, k2k3) made where missing, beneath `root` and never
    through a symlink; the last one opened. Never the root itself: a missing root fails the call
    (BackendUnavailable) instead of being quietly re-created."""
    fd = root
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):  # or another thread made it
                os.mkdir(part, 0o700, dir_fd=fd)
            fd, parent = os.open(part, DIR_FLAGS, dir_fd=fd), fd
            if parent != root:
                os.close(parent)
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd
