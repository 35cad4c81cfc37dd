"""Takeover without systemd: a new `hicached serve` takes the listening socket, the L2 pool memfd and an
index snapshot from the instance serving the same socket, over SCM_RIGHTS on `<socket>.takeover`.

The exchange, one msgpack map per SOCK_SEQPACKET message (fds ride with the message they belong to):

    new -> old  hello     {version, format, pool_bytes, slab_bytes, pid, [arenas]}
    old -> new  offer     the same fields of the old instance, or refused {reason}
    new -> old  go
    old -> new  handover  {pages, owed, tenant_sockets, [arenas]}; fds: listening socket, pool memfd, index
                          snapshot memfd, then the tenants' listening sockets (the new instance matches
                          them by path)
    old -> new  arena     {name}; fds: that tenant's pool memfd, its index snapshot memfd: with [tenants],
                          one for each arena after the first (whose fds rode with the handover)
    new -> old  serving   (or abort {reason}; or nothing: the old instance then serves again)

With [tenants], hello and offer carry `arenas`, the pool's arenas ([name, bytes], each tenant's pool in the
order the pool maps them): both ends must have the same, or the takeover is refused (a takeover keeps each
tenant's L2 as it is; a changed capacity is a restart's to handle). Without [tenants] neither carries it,
and the exchange is what version 1 always was: an instance of a release before tenants' takeovers takes
over from this one and back; one with [tenants] on either side is refused at the offer, before anything is
handed over.

Both ends check the other's SO_PEERCRED: only the same uid, or root, takes over or is taken over from.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from hicached.config.units import format_size
from hicached.daemon.persist import keep

if TYPE_CHECKING:
    from hicached.config import Config
    from hicached.daemon.l2.pool import Pool
    from hicached.daemon.sched.tiers import Tiers


class Daemon(Protocol):
    """What the endpoint uses of the running daemon (hicached.daemon.service.lifecycle.Daemon has it): a
    Protocol, so that this module does not import the lifecycle that imports it."""

    cfg: Config
    pool: Pool | None
    tiers: Tiers | None
    should_exit: asyncio.Event

    def l2_snapshot(self, arena: int = 0) -> tuple[keep.Snapshot, int]: ...

    async def quiesce(self, drain_timeout: float) -> list[socket.socket]: ...


log = logging.getLogger("hicached.takeover")

VERSION = 1  # of this exchange; a change that an older instance would misread bumps it
SUFFIX = ".takeover"  # the endpoint is the main socket's path with this suffix
SOCKET_FDNAME = "hicached-takeover-socket"  # the listening socket's name when the old instance serves again
# The tenants' listening sockets when the old instance serves again: fds past systemd's ($LISTEN_FDS names
# only server.socket's, which is what socket activation covers), listed in this variable.
TENANT_FDS_ENV = "HICACHED_TAKEOVER_TENANT_FDS"
MAX_TENANT_SOCKETS = 128  # config.schema.MAX_TENANTS: with the 3 other fds, within SCM_RIGHTS' 253
MAX_MESSAGE = 1 << 16
# Bounds on the peer (no config key: these belong to the exchange, not to an operator's tuning, and
# config/ is not to grow for them). The offer is a few map lookups: an old instance that takes longer is
# hung. The hand-over waits for requests in flight (DRAIN_S), stops the backup and prefetch coroutines and
# encodes the snapshot (~100 bytes a page): HANDOVER_S leaves room for all of it. CONFIRM_S covers the new
# instance verifying every page (~0.05 s per GiB) and probing its backend before it serves.
ANSWER_S = 5.0
DRAIN_S = 10.0
HANDOVER_S = DRAIN_S + 20.0
CONFIRM_S = 300.0


class TakeoverError(RuntimeError):
    """The takeover cannot happen; the message (one line) says why. The old instance keeps serving."""


class _PeerError(Exception):
    """The peer broke the exchange: hung, went away, or sent what the exchange does not hold."""


def endpoint_path(socket_path: str) -> str:
    return socket_path + SUFFIX


def mismatch(running: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why the running instance, described by `running` (its offer), cannot hand its L2 to the new one
    described by `new` (its hello), or None when they fit. Pure: both ends run it."""
    for key, what in (("version", "speaks takeover version"), ("format", "writes L2 index format")):
        a, b = running.get(key), new.get(key)
        if a != b or type(a) is not int:
            return f"the running daemon {what} {a!r} and the new instance {b!r}"
    a, b = running.get("arenas"), new.get("arenas")
    if a != b:
        return (
            f"the tenants' pools are {_pools(a)} in the running daemon and {_pools(b)} in the new "
            "instance (a takeover keeps each tenant's L2 as is: restart instead)"
        )
    for key, name in (("pool_bytes", "pool.capacity"), ("slab_bytes", "pool.slab_size")):
        a, b = (_size(d.get(key)) for d in (running, new))
        if a != b:
            return (
                f"{name} is {a} in the running daemon and {b} in the new instance (a takeover keeps L2 as is)"
            )
    return None


def _size(v: Any) -> str:
    return format_size(v) if type(v) is int else repr(v)


def _pools(arenas: Any) -> str:
    if arenas is None:
        return "not set ([tenants] not configured, or a release that does not hand them over)"
    if not isinstance(arenas, list) or not all(isinstance(a, list) and len(a) == 2 for a in arenas):
        return repr(arenas)[:200]
    return ", ".join(f"{name} {_size(size)}" for name, size in arenas)


def describe(pool_bytes: int, slab_bytes: int, arenas: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """What hello and offer say of an instance; `arenas`: its pool's, with [tenants] only."""
    out = {
        "version": VERSION,
        "format": keep.FORMAT,
        "pool_bytes": pool_bytes,
        "slab_bytes": slab_bytes,
        "pid": os.getpid(),
    }
    if arenas is not None:
        out["arenas"] = [[name, size] for name, size in arenas]
    return out


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _trusted(uid: int) -> bool:
    return uid in (os.getuid(), 0)


# The exchange on a raw non-blocking socket (an asyncio transport cannot carry fds).


async def _ready(sock: socket.socket, timeout: float, write: bool = False) -> bool:
    """Whether `sock` became readable (writable) within `timeout`."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if write else loop.add_reader)(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        (loop.remove_writer if write else loop.remove_reader)(sock.fileno())


async def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = msgpack.packb(msg, use_bin_type=True)
    while True:
        try:
            socket.send_fds(sock, [data], fds) if fds else sock.send(data)
            return
        except BlockingIOError:
            if not await _ready(sock, ANSWER_S, write=True):
                raise _PeerError(f"the peer did not take a message within {ANSWER_S:.0f}s") from None
        except OSError as e:
            raise _PeerError(f"the peer went away ({e.strerror})") from None


async def _recv(
    sock: socket.socket, timeout: float, want: int = 0, extra: int = 0
) -> tuple[dict[str, Any], list[int]]:
    """One message and its fds (`want` of them, and up to `extra` more; or _PeerError), within `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, max(want + extra, 1))
            break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            raise _PeerError(f"the peer went away ({e.strerror})") from None
        if not await _ready(sock, max(0.0, deadline - loop.time())):
            raise _PeerError(f"no answer within {timeout:.0f}s")
    try:
        if not data:
            raise _PeerError("the peer closed the connection")
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not want <= len(fds) <= want + extra:
            raise _PeerError(f"a message came with {len(fds)} fds, not {want}, or was cut")
        try:
            msg = msgpack.unpackb(data, raw=False)
        except Exception as e:
            raise _PeerError(f"a message does not parse ({e})") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise _PeerError("a message is not a map with an op")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return msg, fds


# The new instance's side.


@dataclass
class Handed:
    """What the old instance handed over; the caller owns the fds. `confirm` once serving, `abort` if the
    start-up fails before: the old instance then serves again."""

    sock: socket.socket  # the exchange
    listen: socket.socket
    pool_fd: int
    index_fd: int
    pid: int  # of the old instance
    pages: int
    owed: int
    done: bool = False  # confirmed or aborted
    tenant_listen: list[socket.socket] = field(default_factory=list)  # the tenants' listening sockets
    # With [tenants]: each arena's (name, pool memfd, index snapshot memfd), the first's pool_fd, index_fd
    arenas: list[tuple[str, int, int]] = field(default_factory=list)

    async def confirm(self) -> None:
        self.done = True
        with contextlib.suppress(_PeerError):
            await _send(self.sock, {"op": "serving", "pid": os.getpid()})
        self.sock.close()

    async def abort(self, reason: str) -> None:
        self.done = True
        with contextlib.suppress(_PeerError):
            await _send(self.sock, {"op": "abort", "reason": reason})
        self.sock.close()


async def request(
    socket_path: str, pool_bytes: int, slab_bytes: int, arenas: list[tuple[str, int]] | None = None
) -> Handed | None:
    """Takes over from the instance serving `socket_path`: None when none offers a takeover there (nothing
    listens on its endpoint), what it handed over otherwise; TakeoverError, with the old instance left
    serving, when it cannot happen. `arenas`: this instance's pool's ([tenants]), which the old one's must
    be."""
    path = endpoint_path(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    loop = asyncio.get_running_loop()
    try:
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), ANSWER_S)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None  # nobody to take over from: an ordinary start (which refuses a live socket)
        except TimeoutError:
            raise TakeoverError(f"{path} did not accept the takeover within {ANSWER_S:.0f}s") from None
        except OSError as e:
            raise TakeoverError(f"cannot reach the takeover endpoint {path}: {e.strerror}") from None
        pid, uid = _peer_uid(sock)
        if not _trusted(uid):
            raise TakeoverError(f"the takeover endpoint {path} is served by uid {uid} (pid {pid}), not by us")
        mine = describe(pool_bytes, slab_bytes, arenas)
        try:
            await _send(sock, {"op": "hello", **mine})
            offer, _ = await _recv(sock, ANSWER_S)
            if offer["op"] == "refused":
                raise TakeoverError(f"the daemon (pid {pid}) refused the takeover: {offer.get('reason')}")
            why = mismatch(offer, mine) if offer["op"] == "offer" else f"it answered {offer['op']!r}"
            if why is not None:
                raise TakeoverError(f"cannot take over from the daemon (pid {pid}): {why}")
            await _send(sock, {"op": "go"})
            msg, fds = await _recv(sock, HANDOVER_S, want=3, extra=MAX_TENANT_SOCKETS)
        except _PeerError as e:
            raise TakeoverError(f"the daemon (pid {pid}) did not hand over: {e}") from None
        if msg["op"] != "handover":
            for fd in fds:
                os.close(fd)
            raise TakeoverError(f"the daemon (pid {pid}) answered {msg['op']!r} instead of handing over")
        listens = [socket.socket(fileno=fd) for fd in (fds[0], *fds[3:])]
        if any(s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM for s in listens):
            for s in listens:
                s.close()
            os.close(fds[1])
            os.close(fds[2])
            raise TakeoverError("the daemon handed over an fd that is not a listening Unix stream socket")
        try:
            pools = await _recv_arenas(sock, msg, [name for name, _ in arenas or []], fds[1], fds[2])
        except _PeerError as e:
            for s in listens:
                s.close()
            os.close(fds[1])
            os.close(fds[2])
            raise TakeoverError(f"the daemon (pid {pid}) did not hand over its tenants' pools: {e}") from None
        pages, owed = int(msg.get("pages", 0)), int(msg.get("owed", 0))
        return Handed(
            sock, listens[0], fds[1], fds[2], pid, pages, owed, tenant_listen=listens[1:], arenas=pools
        )
    except TakeoverError as e:
        sock.close()
        raise TakeoverError(f"{e}; the running daemon serves on, this instance exits") from None
    except BaseException:
        sock.close()
        raise


async def _recv_arenas(
    sock: socket.socket, handover: dict[str, Any], names: list[str], pool_fd: int, index_fd: int
) -> list[tuple[str, int, int]]:
    """With [tenants] (`names`: the arenas agreed in hello and offer), each arena's pool and index snapshot
    fds: the first arena's came with the handover, the others' come one message each. _PeerError if they
    do not come as agreed (the fds that did are closed, but the first arena's: the caller's)."""
    if handover.get("arenas") != (names or None):
        raise _PeerError(f"it handed over arenas {handover.get('arenas')!r}, not {names!r}")
    if not names:
        return []
    out = [(names[0], pool_fd, index_fd)]
    try:
        for name in names[1:]:
            msg, fds = await _recv(sock, HANDOVER_S, want=2)
            out.append((name, fds[0], fds[1]))
            if msg["op"] != "arena" or msg.get("name") != name:
                raise _PeerError(
                    f"it sent {msg['op']!r} {msg.get('name')!r} where tenant {name}'s pool was due"
                )
    except BaseException:
        for _, p, i in out[1:]:
            os.close(p)
            os.close(i)
        raise
    return out


# The old instance's side.


class Endpoint:
    """Listens on `<socket>.takeover` while the daemon serves, and hands the daemon over to the first
    trusted instance that fits it."""

    def __init__(self, daemon: Daemon, socket_path: str) -> None:
        self.daemon = daemon
        self.path = endpoint_path(socket_path)
        self._lsock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        self.handed_to: int | None = None  # pid of the instance that took over

    def start(self) -> None:
        """Binds the endpoint, with the main socket's mode (SO_PEERCRED decides who may take over). A
        daemon that cannot bind it serves on without it (one log line)."""
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)  # a previous instance's, that it did not remove
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            old = os.umask(0o777 & ~self.daemon.cfg.server.socket_mode)
            try:
                sock.bind(self.path)
            except BaseException:
                sock.close()
                raise
            finally:
                os.umask(old)
            sock.listen(4)
            sock.setblocking(False)
        except OSError as e:
            log.warning("takeover endpoint %s not available (%s): no takeover without systemd", self.path, e)
            return
        self._lsock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop(), name="takeover")

    def close(self) -> None:
        """No more takeovers (shutdown, or one under way): the next instance binds the path again."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        while self._lsock is not None:
            try:
                conn, _ = await loop.sock_accept(self._lsock)
            except OSError as e:
                log.warning("takeover endpoint: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            t = loop.create_task(self._serve(conn))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def _refuse(self, conn: socket.socket, pid: int, reason: str) -> None:
        log.warning("refused a takeover from pid %d: %s; serving on", pid, reason)
        with contextlib.suppress(_PeerError):
            await _send(conn, {"op": "refused", "reason": reason})
        conn.close()

    async def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid = _peer_uid(conn)
        except OSError:
            conn.close()
            return
        d = self.daemon
        try:
            hello, _ = await _recv(conn, ANSWER_S)
        except _PeerError as e:
            log.warning("takeover from pid %d abandoned before it began: %s; serving on", pid, e)
            conn.close()
            return
        # Checked once its hello is read: closing a socket with bytes unread resets it, and the refusal
        # would not reach the peer.
        if not _trusted(uid):
            await self._refuse(
                conn, pid, f"uid {uid} may not take over this daemon (only uid {os.getuid()} or 0)"
            )
            return
        if self._busy or d.should_exit.is_set() or d.tiers is None:
            await self._refuse(conn, pid, "the daemon is already being taken over or stopping")
            return
        arenas = [(a.name, a.size) for a in d.pool.arenas] if d.tiers.tenanted else None
        mine = describe(d.pool.size, d.cfg.pool.slab_size, arenas)
        why = (
            mismatch(mine, hello)
            if hello["op"] == "hello"
            else f"the exchange opens with hello, not {hello['op']!r}"
        )
        if why is not None:
            await self._refuse(conn, pid, why)
            return
        self._busy = True
        try:
            await _send(conn, {"op": "offer", **mine})
            go, _ = await _recv(conn, ANSWER_S)
            if go["op"] != "go":
                raise _PeerError(f"it answered {go['op']!r} to the offer")
        except _PeerError as e:
            log.warning("takeover from pid %d abandoned before the hand-over: %s; serving on", pid, e)
            self._busy = False
            conn.close()
            return
        await self._hand_over(conn, pid)

    async def _hand_over(self, conn: socket.socket, pid: int) -> None:
        d = self.daemon
        log.info("pid %d takes over: no longer accepting; answering the requests in flight", pid)
        self.close()
        snaps: list[tuple[keep.Snapshot, int]] = []
        try:
            lsocks = await d.quiesce(DRAIN_S)
            lsock = lsocks[0]
            # Each arena's snapshot, with [tenants]: a tenant's pool is handed over on its own.
            for a in d.pool.arenas if d.tiers.tenanted else d.pool.arenas[:1]:
                snaps.append(d.l2_snapshot(a.index))
        except Exception:
            for _, fd in snaps:
                os.close(fd)
            # A bug: nothing was handed over. The new instance hears the connection close and exits; this one
            # stops as on SIGTERM (its final flush writes what is owed to L3).
            log.exception("the hand-over to pid %d failed; stopping", pid)
            conn.close()
            d.should_exit.set()
            return
        pages = sum(len(snap.pages) for snap, _ in snaps)
        owed = sum(p.owed for snap, _ in snaps for p in snap.pages)
        arenas = d.pool.arenas[: len(snaps)]
        # What the old instance serves again from if the new one does not take over: as systemd's fd store
        # would hand it to a start (a tenant's pool and index under its names, or the pool's).
        if d.tiers.tenanted:
            kept = [
                (keep.tenant_fdname(n, a.name), fd)
                for a, (_, snap_fd) in zip(arenas, snaps, strict=True)
                for n, fd in ((keep.POOL_FDNAME, a.fd), (keep.INDEX_FDNAME, snap_fd))
            ]
        else:
            kept = [(keep.POOL_FDNAME, d.pool.fd), (keep.INDEX_FDNAME, snaps[0][1])]
        msg = {"op": "handover", "pages": pages, "owed": owed, "tenant_sockets": len(lsocks) - 1}
        if d.tiers.tenanted:
            msg["arenas"] = [a.name for a in arenas]
        try:
            await _send(
                conn, msg, [lsock.fileno(), arenas[0].fd, snaps[0][1], *(s.fileno() for s in lsocks[1:])]
            )
            for a, (_, snap_fd) in zip(arenas[1:], snaps[1:], strict=True):
                await _send(conn, {"op": "arena", "name": a.name}, [a.fd, snap_fd])
            answer, _ = await _recv(conn, CONFIRM_S)
            if answer["op"] != "serving":
                raise _PeerError(f"it gave up: {answer.get('reason', answer['op'])}")
        except _PeerError as e:
            conn.close()
            log.error(
                "pid %d did not take over after the hand-over (%s): serving again in this process, from the "
                "same socket and L2",
                pid,
                e,
            )
            _serve_again(lsocks, kept)
        conn.close()
        for _, snap_fd in snaps:
            os.close(snap_fd)
        self.handed_to = pid
        log.info(
            "handed over to pid %d: the socket, L2 (%d pages, %d owed to L3 and backed up by it%s) and its "
            "index; exiting",
            pid,
            pages,
            owed,
            f"; {len(snaps)} tenants' pools" if d.tiers.tenanted else "",
        )
        d.should_exit.set()


def _serve_again(listens: list[socket.socket], kept: list[tuple[str, int]]) -> None:
    """Runs this same command again in this process (exec), handing it the socket, and L2 (`kept`: the pool
    and the index, or each tenant's, with their fd store names) as systemd hands kept fds to a start
    (LISTEN_FDS, LISTEN_FDNAMES): the start-up's own restore adopts them, verifies the pages and serves
    them, pages owed to L3 still owed. The tenants' sockets follow them, listed in
    $HICACHED_TAKEOVER_TENANT_FDS (passed_tenant_sockets). Does not return."""
    named = (listens[0].fileno(), *(fd for _, fd in kept))
    every = (*named, *(s.fileno() for s in listens[1:]))
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16 + len(every)) for fd in every]
    for i, fd in enumerate(fds):
        os.dup2(fd, 3 + i, inheritable=True)
    env = {
        **os.environ,
        "LISTEN_PID": str(os.getpid()),
        "LISTEN_FDS": str(len(named)),
        "LISTEN_FDNAMES": ":".join([SOCKET_FDNAME, *(name for name, _ in kept)]),
        TENANT_FDS_ENV: ",".join(str(3 + i) for i in range(len(named), len(fds))),
    }
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def passed_tenant_sockets() -> list[socket.socket]:
    """The tenants' listening sockets that _serve_again passed to this process (none at an ordinary start),
    taken once: the variable leaves the environment, and the fds become close-on-exec."""
    out = []
    for word in filter(None, os.environ.pop(TENANT_FDS_ENV, "").split(",")):
        try:
            fd = int(word)
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError) as e:
            log.warning("ignoring %s entry %r: %s", TENANT_FDS_ENV, word, e)
            continue
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.close()
            continue
        out.append(sock)
    return out
