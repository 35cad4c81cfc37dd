"""The systemd notify protocol, written with the standard library: datagrams to $NOTIFY_SOCKET.

READY=1, RELOADING=1 with MONOTONIC_USEC, STOPPING=1, STATUS=..., WATCHDOG=1. Without $NOTIFY_SOCKET
(not under systemd) every call does nothing. Socket activation: the fds from $LISTEN_FDS.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("hicached.notify")

SD_LISTEN_FDS_START = 3
# STATUS= is one line of a datagram: a reason quoted from a file or a library is cut to this many characters.
STATUS_MAX_CHARS = 1024


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            if address.startswith("@"):
                address = "\0" + address[1:]  # abstract namespace
            self._target = address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._target)
        except OSError as e:
            if not self._failed:  # once: a service manager that went away must not flood the log
                log.warning("could not notify the service manager at %s: %s", self.address, e)
                self._failed = True

    def ready(self, status: str = "") -> None:
        self.send("READY=1", *([f"STATUS={one_line(status)}"] if status else []))

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def status(self, text: str) -> None:
        self.send(f"STATUS={one_line(text)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def one_line(text: str) -> str:
    """`text` as a STATUS= value: a line break in it would start a field of its own (a reason quoting a file
    could then send systemd READY=1 or STOPPING=1), and a long one is cut."""
    text = " ".join(text.split())
    return text if len(text) <= STATUS_MAX_CHARS else text[: STATUS_MAX_CHARS - 3] + "..."


def watchdog_interval() -> float | None:
    """Half of the watchdog period systemd asked for ($WATCHDOG_USEC), or None when there is none."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


def listen_socket() -> socket.socket | None:
    """The listening Unix socket passed by systemd socket activation, if any ($LISTEN_FDS, $LISTEN_PID)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if n < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise RuntimeError("socket activation passed an fd that is not a listening Unix stream socket")
    for fd in range(SD_LISTEN_FDS_START + 1, SD_LISTEN_FDS_START + n):
        os.close(fd)  # only the first socket is used
    return sock
