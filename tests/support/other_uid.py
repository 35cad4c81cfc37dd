"""Plays other uids in tests that run as root (CI): system users made once with useradd, and forked children
that become one of them before they connect (SO_PEERCRED is taken at connect). The child runs only what was
imported before the fork: the interpreter under /root is out of other users' reach."""

from __future__ import annotations

import os
import pickle
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

ENGINE_USER = "hicached-test-other"
OPERATOR_USER = "hicached-test-operator"


def other_user(name: str = ENGINE_USER) -> pwd.struct_passwd:
    """The system user `name`, made with `useradd --system` when missing; the test is skipped, saying why,
    where that cannot be done (not root, or no useradd)."""
    if os.getuid() != 0:
        pytest.skip("playing another uid needs root (CI runs as root): setuid to a system user")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no other uid to play")
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True, capture_output=True)
    return pwd.getpwnam(name)


def shared_workdir(prefix: str) -> str:
    """A directory under /tmp that every uid can reach (pytest's tmp_path is root's alone)."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o755)
    return path


def become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def run_as(uid: int, gid: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """fn(*args) in a child forked here that becomes uid/gid first; returns what it returned (pickled back
    through a pipe). An exception in the child is raised here as a RuntimeError carrying its traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here, only what was imported before the fork
        code = 0
        try:
            os.close(read)
            try:
                become(uid, gid)
                out = ("ok", fn(*args))
            except BaseException:
                out = ("error", traceback.format_exc())
            data = pickle.dumps(out)
            view = memoryview(data)
            while view:
                view = view[os.write(write, view) :]
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeError(f"the child of uid {uid} did not finish within {timeout}s")
            ready, _, _ = select.select([read], [], [], left)
            if ready:
                chunk = os.read(read, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"the child of uid {uid} died without an answer")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "error":
        raise RuntimeError(f"in the child of uid {uid}:\n{value}")
    return value
