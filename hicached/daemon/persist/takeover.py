"""Takeover without systemd: a new `hicached serve` takes the listening socket, the L2 pool memfd and an
index snapshot from the instance serving the same socket, over SCM_RIGHTS on `<socket>.takeover`.

The exchange, one msgpack map per SOCK_SEQPACKET message (fds ride with the message they belong to):

    new -> old  hello     {version, format, pool_bytes, slab_bytes, pid, [arenas], named}
    old -> new  offer     the same fields of the old instance, or refused {reason}
    new -> old  go
    old -> new  handover  {pages, owed, fds, more}; fds: each named in `fds` ([role, arena] an fd, in the
                          order they ride): the listening socket ("listen"), each arena's pool memfd
                          ("pool", its name) and index snapshot memfd ("index", its name), the tenants'
                          listening sockets ("tenant_listen": the new instance matches them by path)
    old -> new  fds       {fds, more}: the fds past what one message carries (SCM_MAX_FD), named the same
    new -> old  serving   (or abort {reason}; or nothing: the old instance then serves again)

Every pool is arenas: the default tenant's alone without [tenants]. Hello and offer carry `arenas`, the
pool's arenas ([name, bytes], in the order the pool maps them), where there are tenants: both ends must have
the same, or the takeover is refused (a takeover keeps each tenant's L2 as it is; a changed capacity is a
restart's to handle). A pool of the default tenant's arena alone leaves it out, as a release before tenants
did: such a release takes over from this one and back. Its hello and offer lack `named`, and its hand-over
names no fd: they ride by position (listening socket, pool, index snapshot, then the tenants' sockets), the
arenas after the first one message each ({op: arena, name}; fds: pool, index snapshot). This instance reads
that form from an instance whose offer lacks `named`, and sends it to one whose hello does (_positional).

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
from hicached.daemon.l2.pool import DEFAULT_ARENA
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

    def l2_snapshot(self, arena: int) -> tuple[keep.Snapshot, int]: ...

    async def quiesce(self, drain_timeout: float) -> list[socket.socket]: ...


log = logging.getLogger("hicached.takeover")

VERSION = 1  # of this exchange; a change that an older instance would misread bumps it
SUFFIX = ".takeover"  # the endpoint is the main socket's path with this suffix
SOCKET_FDNAME = "hicached-takeover-socket"  # the listening socket's name when the old instance serves again
# The fds a hand-over names, by role (with an arena's name for a pool and its index snapshot).
LISTEN, POOL, INDEX, TENANT_LISTEN = "listen", "pool", "index", "tenant_listen"
SCM_MAX_FD = 253  # the most fds one message carries (Linux)
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
    """What hello and offer say of an instance; `arenas`: its pool's (left out for the default tenant's
    arena alone, as a release before tenants says nothing of arenas). `named`: it reads and sends a
    hand-over whose fds are named."""
    out: dict[str, Any] = {
        "version": VERSION,
        "format": keep.FORMAT,
        "pool_bytes": pool_bytes,
        "slab_bytes": slab_bytes,
        "pid": os.getpid(),
        "named": True,
    }
    said = _said_arenas(arenas)
    if said is not None:
        out["arenas"] = said
    return out


def _said_arenas(arenas: list[tuple[str, int]] | None) -> list[list[Any]] | None:
    """The pool's arenas as hello and offer say them: None for the default tenant's arena alone."""
    if not arenas or [name for name, _ in arenas] == [DEFAULT_ARENA]:
        return None
    return [[name, size] for name, size in arenas]


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
    pid: int  # of the old instance
    pages: int
    owed: int
    # Each arena's (name, pool memfd, index snapshot memfd), in the order the pool maps them
    arenas: list[tuple[str, int, int]]
    done: bool = False  # confirmed or aborted
    tenant_listen: list[socket.socket] = field(default_factory=list)  # the tenants' listening sockets

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
    serving, when it cannot happen. `arenas`: this instance's pool's, which the old one's must be (None: the
    default tenant's arena alone)."""
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
            names = [name for name, _ in arenas or [(DEFAULT_ARENA, pool_bytes)]]
            receive = _recv_named if offer.get("named") else _recv_positional
            msg, entries = await receive(sock, names)
        except _PeerError as e:
            raise TakeoverError(f"the daemon (pid {pid}) did not hand over: {e}") from None
        try:
            return _handed(sock, pid, msg, entries, names)
        except _PeerError as e:
            for _, _, fd in entries:
                os.close(fd)
            raise TakeoverError(f"the daemon (pid {pid}) did not hand over as agreed: {e}") from None
    except TakeoverError as e:
        sock.close()
        raise TakeoverError(f"{e}; the running daemon serves on, this instance exits") from None
    except BaseException:
        sock.close()
        raise


Entries = list[tuple[str, str, int]]  # (role, arena name or "", fd), in the order they came


def _named(msg: dict[str, Any], fds: list[int]) -> Entries:
    """The fds of one message of a named hand-over, with the names `msg` gives them."""
    names = msg.get("fds")
    if (
        not isinstance(names, list)
        or len(names) != len(fds)
        or not all(isinstance(n, list) and len(n) == 2 and all(isinstance(w, str) for w in n) for n in names)
    ):
        raise _PeerError(f"it handed over {len(fds)} fds named {repr(names)[:200]}")
    return [(role, name, fd) for (role, name), fd in zip(names, fds, strict=True)]


async def _recv_named(sock: socket.socket, names: list[str]) -> tuple[dict[str, Any], Entries]:
    """A hand-over whose fds are named: the handover message, then one more while `more` says so.
    _PeerError if it does not come whole (the fds that came are closed)."""
    entries: Entries = []
    try:
        msg, fds = await _recv(sock, HANDOVER_S, want=1, extra=SCM_MAX_FD - 1)
        entries += [("", "", fd) for fd in fds]
        if msg["op"] != "handover":
            raise _PeerError(f"it answered {msg['op']!r} instead of handing over")
        entries[:] = _named(msg, fds)
        more = msg.get("more")
        while more:
            part, fds = await _recv(sock, HANDOVER_S, want=1, extra=SCM_MAX_FD - 1)
            entries += [("", "", fd) for fd in fds]
            if part["op"] != "fds":
                raise _PeerError(f"it sent {part['op']!r} where the rest of the hand-over was due")
            entries[len(entries) - len(fds) :] = _named(part, fds)
            more = part.get("more")
    except BaseException:
        for _, _, fd in entries:
            os.close(fd)
        raise
    return msg, entries


async def _recv_positional(sock: socket.socket, names: list[str]) -> tuple[dict[str, Any], Entries]:
    """The hand-over of a release before named fds, read as named entries: the listening socket, the first
    arena's pool and index snapshot, then the tenants' sockets; each other arena (`names`: the arenas
    agreed in hello and offer) one message after. _PeerError if they do not come as agreed (the fds that
    came are closed)."""
    entries: Entries = []
    try:
        msg, fds = await _recv(sock, HANDOVER_S, want=3, extra=MAX_TENANT_SOCKETS)
        entries += [(TENANT_LISTEN, "", fd) for fd in fds]
        if msg["op"] != "handover":
            raise _PeerError(f"it answered {msg['op']!r} instead of handing over")
        entries[:3] = [(LISTEN, "", fds[0]), (POOL, names[0], fds[1]), (INDEX, names[0], fds[2])]
        said = [name for name, _ in _said_arenas([(n, 0) for n in names]) or []]
        if msg.get("arenas") != (said or None):
            raise _PeerError(f"it handed over arenas {msg.get('arenas')!r}, not {said!r}")
        for name in names[1:]:
            part, fds = await _recv(sock, HANDOVER_S, want=2)
            entries += [(POOL, name, fds[0]), (INDEX, name, fds[1])]
            if part["op"] != "arena" or part.get("name") != name:
                raise _PeerError(
                    f"it sent {part['op']!r} {part.get('name')!r} where tenant {name}'s pool was due"
                )
    except BaseException:
        for _, _, fd in entries:
            os.close(fd)
        raise
    return msg, entries


def _handed(sock: socket.socket, pid: int, msg: dict[str, Any], entries: Entries, names: list[str]) -> Handed:
    """What the entries of a hand-over are: _PeerError (the caller closes every fd) unless they are one
    listening socket, a pool and an index snapshot for each arena of `names`, and the tenants' sockets."""
    by: dict[tuple[str, str], int] = {}
    tenant_listen = []
    for role, name, fd in entries:
        if role == TENANT_LISTEN:
            tenant_listen.append(fd)
        elif (role, name) in by or role not in (LISTEN, POOL, INDEX):
            raise _PeerError(f"it handed over {role!r} {name!r} twice, or one a hand-over does not hold")
        else:
            by[(role, name)] = fd
    want = {(LISTEN, "")} | {(role, name) for name in names for role in (POOL, INDEX)}
    if set(by) != want:
        raise _PeerError(f"it handed over {sorted(by)}, not {sorted(want)}")
    for fd in (by[(LISTEN, "")], *tenant_listen):
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
                raise _PeerError("it handed over an fd that is not a listening Unix stream socket")
    listens = [socket.socket(fileno=fd) for fd in (by[(LISTEN, "")], *tenant_listen)]
    return Handed(
        sock,
        listens[0],
        pid,
        int(msg.get("pages", 0)),
        int(msg.get("owed", 0)),
        [(name, by[(POOL, name)], by[(INDEX, name)]) for name in names],
        tenant_listen=listens[1:],
    )


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
        mine = describe(d.pool.size, d.cfg.pool.slab_size, [(a.name, a.size) for a in d.pool.arenas])
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
        await self._hand_over(conn, pid, named=bool(hello.get("named")))

    async def _hand_over(self, conn: socket.socket, pid: int, named: bool) -> None:
        d = self.daemon
        log.info("pid %d takes over: no longer accepting; answering the requests in flight", pid)
        self.close()
        snaps: list[tuple[keep.Snapshot, int]] = []
        try:
            lsocks = await d.quiesce(DRAIN_S)
            # Each arena's snapshot: a tenant's pool is handed over on its own.
            for a in d.pool.arenas:
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
        arenas = d.pool.arenas
        entries: Entries = [(LISTEN, "", lsocks[0].fileno())]
        for a, (_, snap_fd) in zip(arenas, snaps, strict=True):
            entries += [(POOL, a.name, a.fd), (INDEX, a.name, snap_fd)]
        entries += [(TENANT_LISTEN, "", s.fileno()) for s in lsocks[1:]]
        # What the old instance serves again from if the new one does not take over: as systemd's fd store
        # would hand it to a start (each arena's pool and index under its names).
        kept = [
            (keep.arena_fdname(n, a.name, len(arenas)), fd)
            for a, (_, snap_fd) in zip(arenas, snaps, strict=True)
            for n, fd in ((keep.POOL_FDNAME, a.fd), (keep.INDEX_FDNAME, snap_fd))
        ]
        said = _said_arenas([(a.name, a.size) for a in arenas])
        messages = _named_messages(entries) if named else _positional(entries, said)
        messages[0][0].update(pages=pages, owed=owed)
        try:
            for msg, fds in messages:
                await _send(conn, msg, fds)
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
            f"; {len(snaps)} tenants' pools" if said is not None else "",
        )
        d.should_exit.set()


def _named_messages(entries: Entries) -> list[tuple[dict[str, Any], list[int]]]:
    """A hand-over whose fds are named: the handover message, and one `fds` message for each SCM_MAX_FD
    past the first."""
    out: list[tuple[dict[str, Any], list[int]]] = []
    for at in range(0, len(entries), SCM_MAX_FD):
        part = entries[at : at + SCM_MAX_FD]
        msg = {"op": "fds" if at else "handover", "fds": [[role, name] for role, name, _ in part]}
        msg["more"] = at + SCM_MAX_FD < len(entries)
        out.append((msg, [fd for _, _, fd in part]))
    return out


def _positional(entries: Entries, said: list[list[Any]] | None) -> list[tuple[dict[str, Any], list[int]]]:
    """The hand-over as a release before named fds reads it (its hello lacks `named`): the listening socket,
    the first arena's pool and index snapshot, the tenants' sockets; then each other arena's two, one message
    each. `said`: the arenas as hello and offer said them (None for the default tenant's arena alone)."""
    listen = [fd for role, _, fd in entries if role == LISTEN]
    tenant = [fd for role, _, fd in entries if role == TENANT_LISTEN]
    pools = [(name, fd) for role, name, fd in entries if role == POOL]
    index = {name: fd for role, name, fd in entries if role == INDEX}
    msg: dict[str, Any] = {"op": "handover", "tenant_sockets": len(tenant)}
    if said is not None:
        msg["arenas"] = [name for name, _ in said]
    (first, pool), rest = pools[0], pools[1:]
    out = [(msg, [*listen, pool, index[first], *tenant])]
    out += [({"op": "arena", "name": name}, [fd, index[name]]) for name, fd in rest]
    return out


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
