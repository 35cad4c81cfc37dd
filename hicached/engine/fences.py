"""The client's side of fences (hicached.common.fence): its board of one connection, the slots of the region
requests in flight, the daemon process that took them, and the wait, after a request's answer timed out
or its connection broke, until no copy of it can touch the engine's memory any more."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref

import numpy as np

from hicached.common import fence
from hicached.common.errors import BUSY, HicachedError
from hicached.common.memfd import SEALS

log = logging.getLogger("hicached.engine.fences")

WARN_AFTER_S = 1.0  # a wait longer than this is logged (once a wait): the daemon is stopped mid-copy
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.05
_said_unfenced = False


def unfenced_once(why: str) -> None:
    """Logs once a process that region requests go without fences, and why."""
    global _said_unfenced
    if not _said_unfenced:
        _said_unfenced = True
        log.warning(
            "hicached: region copies are not fenced (%s): a request whose answer times out, or whose "
            "connection breaks, may still be copied by the daemon after the call raised, into or out of "
            "memory the engine reuses",
            why,
        )


class DaemonProcess:
    """The daemon process that serves one connection, watched through a pidfd (readable once it has exited;
    no pid-reuse race). The pid is the welcome's (the process that accepted the connection): the socket's
    SO_PEERCRED names the process that called listen(), which is another one after a takeover (the new
    daemon inherits the listening socket) or under systemd's socket activation. Where the two differ
    because the daemon lives in a pid namespace of its own, SO_PEERCRED's (ours for it) is taken. Once a
    fence board is registered, the daemon's own pidfd (sent with the board's answer) is watched instead: it
    works from any pid namespace. Without either, `gone()` says False: the wait ends on its count alone."""

    def __init__(self, sock: socket.socket, welcome_pid: object) -> None:
        self.pid = _daemon_pid(sock, welcome_pid)
        self._fd = -1
        if self.pid > 0:
            try:
                self._fd = os.pidfd_open(self.pid)
            except (OSError, AttributeError):
                self.pid = 0
            else:
                weakref.finalize(self, os.close, self._fd)

    def watch(self, pidfd: int) -> None:
        """The daemon's own pidfd, sent with the fence board's answer: it tells the daemon's exit wherever
        the engine runs (another pid namespace, a container, where the daemon's pid names nothing); owned
        from here on."""
        self._fd = pidfd  # a pidfd opened by pid, if any, stays open until its own finalizer closes it
        weakref.finalize(self, os.close, pidfd)

    def gone(self, wait_s: float = 0.0) -> bool:
        """Whether the process has exited, waiting up to `wait_s` for it to."""
        if self._fd < 0:
            if wait_s:
                time.sleep(wait_s)
            return False
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(wait_s * 1000))


def _daemon_pid(sock: socket.socket, welcome_pid: object) -> int:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer = struct.unpack("3i", creds)[0]
    except OSError:
        peer = 0
    if not isinstance(welcome_pid, int) or isinstance(welcome_pid, bool) or welcome_pid <= 0:
        return peer
    if peer in (0, welcome_pid):
        # 0: the daemon is in no namespace we see; its own pid names nothing here, so nothing is watched.
        return welcome_pid if peer else 0
    if _ns_pid(peer) == welcome_pid:  # the same process, numbered in its own namespace by the welcome
        return peer
    return welcome_pid  # a takeover (or socket activation): another process listened than accepted


def _ns_pid(pid: int) -> int:
    """The pid that process `pid` has in its innermost pid namespace (0 if not known)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Board:
    """One connection's fence board: a sealed memfd of `slots` words, mapped here and handed to the daemon
    (`fd`), and which words are free. A word is taken for a request and given back once its answer came
    (the daemon answers only after every copy job of the request has ended); one whose answer never came
    stays taken: a copy job of it may still enter later, and a new request in that word would let it in."""

    def __init__(self, slots: int = fence.DEFAULT_SLOTS) -> None:
        self.slots = slots
        fd = os.memfd_create("hicached-fences", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, slots * fence.WORD_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.mm = mmap.mmap(fd, slots * fence.WORD_BYTES, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        self._words = np.frombuffer(self.mm, dtype=np.uint64)
        self._free = list(range(slots - 1, -1, -1))
        self._taken: set[int] = set()  # only these are freed (a request may name any slot: tests, adapters)
        self._settling: set[int] = set()  # slots whose requests are being settled (hold)
        self._answered: set[int] = set()  # of those, the ones whose answers came meanwhile
        self._lock = threading.Lock()
        self.registered = False  # the daemon has mapped it (for this connection)

    def take(self) -> int:
        """A free slot, zeroed; busy when every slot has a request in flight."""
        with self._lock:
            if not self._free:
                raise HicachedError(
                    BUSY, f"{self.slots} region requests are in flight on this connection: wait for some"
                )
            slot = self._free.pop()
            self._taken.add(slot)
        self._words[slot] = 0  # before the request is sent (a system call: every store is seen by then)
        return slot

    def free(self, slot: int) -> None:
        """The request's answer came: no copy job of it runs, nor will. A slot being settled is freed once
        the settling is over (a new request in it would be cancelled by the settle)."""
        with self._lock:
            if slot in self._settling:
                self._answered.add(slot)
            elif slot in self._taken:
                self._taken.discard(slot)
                self._free.append(slot)

    def owns(self, slot: object) -> bool:
        """Whether `slot` was taken here for a request (one not taken here is not this board's to settle)."""
        with self._lock:
            return slot in self._taken

    def hold(self, slot: int) -> None:
        """The slot's request is about to be settled (settle): an answer meanwhile does not free it yet."""
        with self._lock:
            self._settling.add(slot)

    def unhold(self, slot: int) -> None:
        with self._lock:
            self._settling.discard(slot)
            if slot in self._answered and slot in self._taken:
                self._taken.discard(slot)
                self._free.append(slot)
            self._answered.discard(slot)

    def in_use(self) -> int:
        with self._lock:
            return self.slots - len(self._free)

    def cancel(self, slot: int) -> int:
        return fence.cancel(self.mm, slot)

    def count(self, slot: int) -> int:
        return fence.count(self.mm, slot)


def _still_copying(board: Board, slot: int, daemon: DaemonProcess) -> bool:
    return board.count(slot) > 0 and not daemon.gone()


def _warn(what: str, daemon: DaemonProcess, slot: int, board: Board) -> None:
    log.warning(
        "hicached: %s; daemon pid %s still has %d copy jobs inside the engine's memory for it, and does not "
        "progress (stopped mid-copy?): the memory is not given back until they end or the daemon exits",
        what,
        daemon.pid or "?",
        board.count(slot),
    )


def settle(board: Board, slot: int, daemon: DaemonProcess, what: str) -> None:
    """Blocking: cancels the slot's request and waits until no copy job of it is inside the engine's memory:
    its count is 0 (none is, and none will enter) or the daemon process has exited. Without a time bound,
    on purpose: a copy that may still run cannot be declared over; a daemon stopped mid-copy (SIGSTOP) holds
    the caller until it continues or exits. `what` says which request, for the log."""
    if board.cancel(slot) == 0:
        return
    start = time.monotonic()
    delay = _POLL_MIN_S
    warned = False
    while _still_copying(board, slot, daemon):
        if not warned and time.monotonic() - start > WARN_AFTER_S:
            warned = True
            _warn(what, daemon, slot, board)
        daemon.gone(delay)  # sleeps, and wakes at once if the daemon exits
        delay = min(delay * 2, _POLL_MAX_S)
    if warned:
        log.warning(
            "hicached: %s: its copies ended after %.1fs; memory given back", what, time.monotonic() - start
        )


async def settle_async(board: Board, slot: int, daemon: DaemonProcess, what: str) -> None:
    """settle() for an event loop: the same wait, in short sleeps, and not cut short by a cancellation (the
    caller's task may be cancelled: CancelledError is raised once the wait is over)."""
    if board.cancel(slot) == 0:
        return
    start = time.monotonic()
    delay = _POLL_MIN_S
    warned = cancelled = False
    while _still_copying(board, slot, daemon):
        if not warned and time.monotonic() - start > WARN_AFTER_S:
            warned = True
            _warn(what, daemon, slot, board)
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            cancelled = True
        delay = min(delay * 2, _POLL_MAX_S)
    if warned:
        log.warning(
            "hicached: %s: its copies ended after %.1fs; memory given back", what, time.monotonic() - start
        )
    if cancelled:
        raise asyncio.CancelledError
