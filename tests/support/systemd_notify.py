"""A datagram socket standing in for systemd's $NOTIFY_SOCKET that keeps every notification in the order it
came, so that tests can check what follows what (READY=1 after each RELOADING=1); and systemd's
file-descriptor store: fds sent with FDSTORE=1 (SCM_RIGHTS) are kept under their FDNAME (one copy of each
file, as systemd keeps), FDSTOREREMOVE=1 drops them, and `launch` starts a process with them as systemd does
(fds from 3, LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID set to the process's own pid)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# Runs in the child, then execs the command with the same pid: what systemd does between fork and exec.
# argv: N, then N source fds, then N names, then the command.
_WRAPPER = """
import fcntl, os, sys
n = int(sys.argv[1])
src = [int(x) for x in sys.argv[2 : 2 + n]]
names = sys.argv[2 + n : 2 + 2 * n]
cmd = sys.argv[2 + 2 * n :]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in src]  # out of the way of 3..3+n
for fd in src:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
if n:
    os.environ["LISTEN_FDS"] = str(n)
    os.environ["LISTEN_FDNAMES"] = ":".join(names)
    os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(cmd[0], cmd)
"""


class NotifySocket:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[dict[str, str]] = []  # every notification so far, oldest first
        self._seen = 0  # messages[:_seen] were handed out by next()
        self.stored: list[tuple[str, int]] = []  # the fd store: (FDNAME, fd), in the order they came

    def _receive(self, timeout: float) -> None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 65536, 16)
        except TimeoutError:
            return
        msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(msg)
        if fds and msg.get("FDSTORE") == "1":
            for fd in fds:
                if self._holds(fd):  # systemd keeps one copy of a file it already holds ("duplicate fd")
                    os.close(fd)
                else:
                    self.stored.append((msg.get("FDNAME", "stored"), fd))
        else:
            for fd in fds:  # fds without FDSTORE=1: systemd closes them
                os.close(fd)
        if msg.get("FDSTOREREMOVE") == "1":
            self.remove(msg.get("FDNAME", ""))

    def _holds(self, fd: int) -> bool:
        st = os.fstat(fd)
        return any(
            (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino) for o in (os.fstat(f) for _, f in self.stored)
        )

    def remove(self, name: str) -> None:
        for fd in [fd for n, fd in self.stored if n == name]:
            os.close(fd)
        self.stored = [x for x in self.stored if x[0] != name]

    def names(self) -> list[str]:
        return [n for n, _ in self.stored]

    def launch(
        self, cmd: list[str], fds: list[tuple[str, int]] | None = None, **popen: Any
    ) -> subprocess.Popen:
        """Starts `cmd` with the stored fds (or `fds`) passed as systemd passes them (they stay stored)."""
        fds = self.stored if fds is None else fds
        argv = [sys.executable, "-c", _WRAPPER, str(len(fds)), *(str(fd) for _, fd in fds)]
        argv += [n for n, _ in fds] + cmd
        return subprocess.Popen(argv, pass_fds=[fd for _, fd in fds], **popen)

    def next(self, match: Callable[[dict[str, str]], bool], timeout: float = 30.0) -> dict[str, str]:
        """The first notification after the last one returned that `match` accepts (those it skips stay in
        `messages`)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(self._seen, len(self.messages)):
                if match(self.messages[i]):
                    self._seen = i + 1
                    return self.messages[i]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no such notification in {timeout}s; got {self.messages[self._seen :]}")
            self._receive(remaining)

    def drain(self, quiet: float = 0.3) -> list[dict[str, str]]:
        """Every notification, once none has come for `quiet` seconds."""
        n = -1
        while n != len(self.messages):
            n = len(self.messages)
            self._receive(quiet)
        return self.messages

    def close(self) -> None:
        self.sock.close()
        for _, fd in self.stored:
            os.close(fd)
        self.stored = []
