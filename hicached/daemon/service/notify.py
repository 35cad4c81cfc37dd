"""The systemd notify protocol, written with the standard library: datagrams to $NOTIFY_SOCKET.

READY=1, RELOADING=1 with MONOTONIC_USEC, STOPPING=1, STATUS=..., WATCHDOG=1, and the file-descriptor
store (FDSTORE=1, FDSTOREREMOVE=1). Without $NOTIFY_SOCKET (not under systemd) every call does nothing.
The fds systemd passes at start ($LISTEN_FDS, $LISTEN_FDNAMES): the activated socket and the stored fds.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import re
import socket
import time

from hicached.daemon.persist.keep import is_kept_fdname

log = logging.getLogger("hicached.notify")

SD_LISTEN_FDS_START = 3
# What systemd accepts as an FDNAME= (sd_notify(3): at most 255 printable ASCII characters, no colon).
_FDNAME_RE = re.compile(r"[\x21-\x39\x3b-\x7e]{1,255}")
# STATUS= is one line of a datagram: a reason quoted from a file or a library is cut to this many characters.
STATUS_MAX_CHARS = 1024
# A datagram to a service manager whose queue is full (a stalled PID 1, a reader that stopped) waits at most
# this long: the event loop sends it, and must not stall with it. A store of an fd given up is logged and
# reported False to its caller (L2 then not kept), never taken for done.
SEND_TIMEOUT_S = 2.0


class Notifier:
    def __init__(self, address: str | None = None, timeout: float = SEND_TIMEOUT_S) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            if address.startswith("@"):
                address = "\0" + address[1:]  # abstract namespace
            self._target = address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(timeout)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str, fds: list[int] | None = None) -> bool:
        """Sends one datagram of `fields` (and `fds` with SCM_RIGHTS); False if it could not be sent."""
        if self._sock is None:
            return False
        data = "\n".join(fields).encode()
        try:
            if fds:
                # socket.send_fds drops its address argument (CPython 3.11): sendmsg names the target itself.
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                self._sock.sendmsg([data], rights, 0, self._target)
            else:
                self._sock.sendto(data, self._target)
        except OSError as e:
            if not self._failed:  # once: a service manager that went away must not flood the log
                log.warning("could not notify the service manager at %s: %s", self.address, e)
                self._failed = True
            return False
        return True

    def store_fd(self, name: str, fd: int) -> bool:
        """Hands `fd` to systemd's file-descriptor store under `name` (the unit needs
        FileDescriptorStoreMax=); the next start of the service gets it back in $LISTEN_FDS. True if sent."""
        if not _FDNAME_RE.fullmatch(name):
            raise ValueError(f"{name!r} is not a name systemd accepts for a stored fd")
        return self.send("FDSTORE=1", f"FDNAME={name}", fds=[fd])

    def remove_stored_fd(self, name: str) -> bool:
        """Drops the fds stored under `name` from systemd's store (FDSTOREREMOVE=1): systemd closes its
        copies, so a later start (after a crash, say) is not handed them again."""
        if not _FDNAME_RE.fullmatch(name):
            raise ValueError(f"{name!r} is not a name systemd accepts for a stored fd")
        return self.send("FDSTOREREMOVE=1", f"FDNAME={name}")

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


def fd_store_max() -> int | None:
    """How many fds the unit's store may hold ($FDSTORE, set by systemd >= 254 when FileDescriptorStoreMax=
    is set); None when systemd does not say (older systemd, or not under systemd)."""
    try:
        return int(os.environ["FDSTORE"])
    except (KeyError, ValueError):
        return None


_passed: dict[str, list[int]] | None = None


def passed_fds() -> dict[str, list[int]]:
    """The fds systemd passed at start, by name ($LISTEN_FDNAMES; "unknown" where it names none), read once:
    the variables are removed from the environment (children must not take them as theirs) and the fds
    made close-on-exec, as sd_listen_fds does. Empty when none were passed to this process ($LISTEN_PID)."""
    global _passed
    if _passed is not None:
        return _passed
    _passed = {}
    pid, count, names = (os.environ.pop(v, None) for v in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))
    if pid != str(os.getpid()):
        return _passed
    try:
        n = int(count or "0")
    except ValueError:
        log.warning("ignoring fds passed by the service manager: LISTEN_FDS=%r is not a number", count)
        return _passed
    labels = names.split(":") if names else []
    if labels and len(labels) != n:
        log.warning(
            "LISTEN_FDNAMES names %d fds but LISTEN_FDS is %d; taking them as unnamed", len(labels), n
        )
        labels = []
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        except OSError:
            continue  # not open: nothing to take
        _passed.setdefault(labels[i] if labels else "unknown", []).append(fd)
    return _passed


def take_passed(name: str) -> list[int]:
    """The fds passed under `name`, now the caller's to close (taken once)."""
    return passed_fds().pop(name, [])


def listen_socket(reserved: tuple[str, ...] = ()) -> socket.socket | None:
    """The listening Unix socket passed by systemd socket activation, if any ($LISTEN_FDS, $LISTEN_PID):
    the first passed fd not named in `reserved` (names of fds the daemon stored itself: they stay for
    take_passed). Other passed fds not reserved are closed: only one socket is used."""
    fds = passed_fds()
    kept = (lambda name: name in reserved) if reserved else is_kept_fdname
    others = [fd for name in list(fds) if not kept(name) for fd in sorted(fds.pop(name))]
    if not others:
        return None
    others.sort()
    sock = socket.socket(fileno=others[0])
    for fd in others[1:]:
        os.close(fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise RuntimeError("socket activation passed an fd that is not a listening Unix stream socket")
    return sock
