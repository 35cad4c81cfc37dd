"""The Unix-socket server: admits operators and engines by uid/gid, hands them the pool's fd, and answers
requests, within a bound on the bytes held for unfinished requests and unread answers (PendingBudget).

Each accepted socket is checked with SO_PEERCRED, sent a welcome frame carrying the pool's memfd
(SCM_RIGHTS, before the socket is wrapped in a transport, which cannot pass fds), then served by a
Connection protocol. Requests that need no waiting are answered inline; the others run as tasks, several
per connection. A frame that cannot be read closes its connection only. The first bytes a peer sends are
read on the raw socket: if an fd came with them, the connection registers a host memory region (see
hicached.common.protocol and .attach) and is closed after its answer. The requests' handlers are in .handlers,
what `status` and `stats` show each asker in .views.

Roles: operators (root, the daemon's uid, server.operator_uids/gids) may use every control on server.socket;
engines (server.allowed_uids/gids, the members of tenants) get `unauthorized` for the controls that change the
daemon. Tenants (hicached.daemon.server.tenants): every peer belongs to one; it is handed its tenant's pool
memory with the welcome (Tiers.arena), may open only its tenant's namespaces, and sees only its tenant in
`status` and `stats`. Each tenant socket is listened on beside server.socket: whoever connects through it
is an engine of that tenant, root included (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
from typing import Any

from hicached.common import protocol
from hicached.common.errors import (
    BUSY,
    DRAINING,
    TIMEOUT,
    UNAUTHORIZED,
    HicachedError,
)
from hicached.config import Config, resolve_path
from hicached.config.tenants import DEFAULT
from hicached.daemon.regions.service import RegionService
from hicached.daemon.sched.tiers import Session, Tiers
from hicached.daemon.server import views
from hicached.daemon.server.attach import attach_connection
from hicached.daemon.server.budget import PendingBudget
from hicached.daemon.server.connection import Connection
from hicached.daemon.server.handlers import Handler, Unanswered, engine_handlers
from hicached.daemon.server.tenants import TenantTable

log = logging.getLogger("hicached.server")

MAX_FDS = 4  # fds read with a connection's first bytes; region_attach takes exactly one

OPERATOR = "operator"
ENGINE = "engine"
NO_ARENA_BYTES = 4096
# Controls an engine may use: they change nothing (`backend` only with action "show").
READ_ONLY_CONTROLS = frozenset({"status", "stats"})


class Server:
    def __init__(self, cfg: Config, tiers: Tiers, control: dict[str, Handler] | None = None) -> None:
        self._cfg = cfg
        self.tenants = TenantTable(cfg)
        self.tiers = tiers
        self.path = resolve_path(cfg, cfg.server.socket)
        self.connections: set[Connection] = set()
        self.draining = False  # engine requests are answered `draining` (ctl drain, shutdown)
        self.stopping = False  # no new connections either
        self.refused = 0
        self._refused_by_uid: dict[int, int] = {}
        # Listening sockets by path: server.socket's first, then the tenants' (path -> tenant in tenant_of).
        self._listeners: dict[str, socket.socket] = {}
        self.tenant_of: dict[str, str] = {}
        self._unlink: set[str] = set()  # paths this server removes at its stop (not systemd's socket)
        self._accept_tasks: list[asyncio.Task[None]] = []
        self._empty_fd = -1  # _no_arena's memfd
        self._admitting: set[asyncio.Task[Any]] = set()
        self._engines_admitting = 0  # engine connections past their first bytes, not yet in `connections`
        self.regions = RegionService(lambda: self.cfg, tiers)
        self.by_token: dict[str, Connection] = {}  # welcome token -> connection, for region_attach
        self.handlers: dict[str, Handler] = engine_handlers(self, tiers)
        self.handlers.update(self.regions.handlers())
        self.handlers.update(control or {})
        self.control_ops = frozenset(control or {}) | READ_ONLY_CONTROLS
        self.budget = PendingBudget(lambda: self.cfg.server)
        self.unauthorized = 0  # controls refused to engines
        self.handshake_timeouts = 0  # connections closed without a hello or a control request in time
        try:  # sent with a fence board's answer (see attach.attach_connection)
            self.pidfd = os.pidfd_open(os.getpid())
        except (OSError, AttributeError):
            self.pidfd = -1

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    @property
    def cfg(self) -> Config:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:
        """A reload sets the configuration (controls.apply): the tenant table follows it, and connections that
        no longer qualify for what they hold are closed (their engines reconnect and are judged afresh)."""
        self._cfg = cfg
        self.tenants = TenantTable(cfg)
        self._judge_connections()

    # Lifecycle.

    async def start(
        self,
        sock: socket.socket | None = None,
        owns_path: bool | None = None,
        handed: list[socket.socket] | None = None,
    ) -> None:
        """Listen on the configured path, or on `sock` when one was handed over (socket activation, or a
        takeover: `owns_path` then, as the path is the daemon's to remove at its stop), and on each tenant's
        socket: one of `handed` (a takeover's) listening on its path, or bound here."""
        # A socket from systemd stays systemd's: never unlinked.
        owns = sock is None if owns_path is None else owns_path
        lsock = sock if sock is not None else self._bind(self.path)
        if sock is not None and isinstance(sock.getsockname(), str) and sock.getsockname():
            self.path = sock.getsockname()
        if owns:
            self._unlink.add(self.path)
        self._listen(self.path, lsock, "")
        by_path = {s.getsockname(): s for s in handed or ()}
        try:
            for path, tenant in self.tenants.by_socket.items():
                lsock = by_path.pop(path, None) or self._bind(path)
                self._unlink.add(path)
                self._listen(path, lsock, tenant)
        except BaseException:
            self.stop_accepting()
            raise
        finally:
            for path, s in by_path.items():  # a tenant socket the previous instance had and this one has not
                s.close()
                self._remove_socket(path)
        self.budget.start()
        log.info("listening on %s", ", ".join(self._listeners))

    def _listen(self, path: str, lsock: socket.socket, tenant: str) -> None:
        lsock.setblocking(False)
        self._listeners[path] = lsock
        if tenant:
            self.tenant_of[path] = tenant
        self._accept_tasks.append(asyncio.create_task(self._accept_loop(lsock, path), name=f"accept {path}"))

    def stop_accepting(self) -> None:
        self.budget.stop()
        for t in self._accept_tasks:
            t.cancel()
        for path, lsock in self._listeners.items():
            lsock.close()
            if path in self._unlink:
                self._remove_socket(path)
        self._listeners.clear()

    @staticmethod
    def _remove_socket(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)

    async def stop(self, timeout: float) -> None:
        """Stop accepting, answer what is in flight (bounded by `timeout`), then close every connection."""
        self.draining = self.stopping = True
        self.stop_accepting()
        await asyncio.gather(*self._accept_tasks, return_exceptions=True)
        for t in list(self._admitting):
            t.cancel()
        await asyncio.gather(*self._admitting, return_exceptions=True)
        pending = [t for c in self.connections for t in c.tasks]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for c in list(self.connections):
            c.close()
        await asyncio.sleep(0)
        await self.regions.close(timeout)
        self._close_pidfd()
        if self._empty_fd >= 0:
            os.close(self._empty_fd)
            self._empty_fd = -1

    async def hand_over(self, timeout: float) -> list[socket.socket]:
        """Takeover, old side: stop accepting but keep the listening sockets open (engines that connect
        meanwhile wait in their backlogs for the next instance), answer the requests already read (bounded
        by `timeout`) while reading no new one, close every connection, and return the listening sockets,
        server.socket's first, then the tenants' (the next instance matches them by path), no longer this
        server's: never closed nor unlinked by it."""
        self.stopping = True
        self.budget.stop()
        socks = list(self._listeners.values())
        if not socks:
            raise RuntimeError("the server is not listening: nothing to hand over")
        self._listeners.clear()
        self._unlink.clear()
        for t in self._accept_tasks:
            t.cancel()
        await asyncio.gather(*self._accept_tasks, return_exceptions=True)
        for t in list(self._admitting):
            t.cancel()  # their engines see the connection close and connect again, to the next instance
        await asyncio.gather(*self._admitting, return_exceptions=True)
        # Not `draining`: that answers requests with an error. A request read from now on gets no answer:
        # its engine sees the connection close and sends it again, to the next instance.
        self.handlers = Unanswered()
        pending = [t for c in self.connections for t in c.tasks]
        for c in self.connections:
            if c.transport is not None:
                with contextlib.suppress(RuntimeError):
                    c.transport.pause_reading()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for c in list(self.connections):
            c.close()
        # connection_lost releases each session's slots and leases: polled, as nothing signals the last one.
        for _ in range(int(timeout / 0.01)):
            if not self.connections:
                break
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()  # a peer that does not read its answers
        await asyncio.sleep(0)
        await self.regions.close(timeout)
        self._close_pidfd()
        return socks

    def _bind(self, path: str) -> socket.socket:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        self._remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The umask around bind gives the socket its mode from the start; a chmod afterwards would leave
        # a window in which it has the default mode.
        old = os.umask(0o777 & ~self.cfg.server.socket_mode)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(min(self.cfg.server.max_connections, socket.SOMAXCONN))
        return sock

    @staticmethod
    def _remove_stale(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # a socket nobody listens on: left by a daemon that died
            log.info("removed stale socket %s", path)
            return
        finally:
            probe.close()
        raise RuntimeError(f"another daemon is listening on {path}")

    # Admission.

    async def _accept_loop(self, lsock: socket.socket, path: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as e:
                log.warning("accept on %s failed: %s", path, e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._admit(sock, "" if path == self.path else path))
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    def role(self, uid: int, gid: int) -> str | None:
        """OPERATOR, ENGINE, or None for a peer this daemon does not admit. Root and the daemon's own uid
        are operators whatever the configuration says: they can ptrace the daemon anyway."""
        s = self.cfg.server
        if uid in (0, os.getuid()) or uid in s.operator_uids or gid in s.operator_gids:
            return OPERATOR
        if uid in s.allowed_uids or gid in s.allowed_gids:
            return ENGINE
        return None

    def place(self, uid: int, gid: int, via: str = "") -> tuple[str | None, str]:
        """(role, tenant) of a peer that came through socket `via` ("": server.socket); role None for a peer
        this daemon does not admit. Through a tenant's socket anyone is an engine of that tenant; through
        server.socket a peer belongs to the first tenant its uid, then its gid, matches, and the operators and
        server.allowed_uids/gids that match none are in the default tenant."""
        if via:
            tenant = self.tenant_of.get(via)
            return (ENGINE, tenant) if tenant is not None else (None, DEFAULT)
        role = self.role(uid, gid)
        tenant = self.tenants.member(uid, gid)
        if tenant is not None:
            return role or ENGINE, tenant
        return role, DEFAULT

    def _no_arena(self) -> int:
        """A page of memory that belongs to no tenant, handed to a peer whose tenant has no L2 (an operator
        of the default tenant when [tenants] take all of pool.capacity): its client maps something, and its
        hello is refused (handlers.check_tenant_namespace)."""
        if self._empty_fd < 0:
            self._empty_fd = os.memfd_create("hicached-no-arena", os.MFD_CLOEXEC)
            os.ftruncate(self._empty_fd, NO_ARENA_BYTES)
        return self._empty_fd

    def _no_room(self, role: str | None, tenant: str) -> bool:
        """An engine of the default tenant when [tenants] leave it no capacity: nothing it could store."""
        return (
            role == ENGINE
            and tenant == DEFAULT
            and self.tenants.configured
            and self.tenants.tenants[DEFAULT].capacity <= 0
        )

    def _judge_connections(self) -> None:
        """After a reload: closes the connections whose peer now places in another tenant (or nowhere), or
        whose namespace its tenant no longer allows; an operator that is one no more loses the role."""
        for c in list(self.connections):
            if c.transport is None or c.transport.is_closing():
                continue
            role, tenant = self.place(c.uid, c.gid, c.via)
            ns = c.session.ns
            if role is None or self._no_room(role, tenant):
                why = "no longer admitted"
            elif tenant != c.session.tenant:
                why = f"now in tenant {tenant!r}, not {c.session.tenant!r}"
            elif ns and not self.tenants.allows(tenant, ns):
                why = f"namespace {ns!r} is no longer tenant {tenant!r}'s"
            else:
                c.operator = role == OPERATOR and not c.via
                continue
            log.warning("reload: closing connection from %s: %s (it may connect again)", c.session.peer, why)
            c.close()

    def needs_operator(self, op: str, req: dict[str, Any]) -> bool:
        """Whether `op` changes the daemon: every control but the read-only ones. A control added to the
        daemon's handlers later is operator-only unless it is named here."""
        if op not in self.control_ops or op in READ_ONLY_CONTROLS:
            return False
        return not (op == "backend" and req.get("action", "show") == "show")

    async def _admit(self, sock: socket.socket, via: str = "") -> None:
        """`via`: the tenant socket the peer came through; "" for server.socket."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.server.handshake_timeout
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, gid = struct.unpack("3i", creds)
            role, tenant = self.place(uid, gid, via)
            peer = f"pid={pid} uid={uid} gid={gid} tenant={tenant}"
            if role is None:
                self.refused += 1
                if len(self._refused_by_uid) > 4096:
                    self._refused_by_uid.clear()
                n = self._refused_by_uid[uid] = self._refused_by_uid.get(uid, 0) + 1
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... refusal: a retry loop does not flood logs
                    log.warning(
                        "refused connection from %s: neither an operator nor in server.allowed_uids/"
                        "allowed_gids (%d times)",
                        peer,
                        n,
                    )
                self._refuse(sock, UNAUTHORIZED, f"uid {uid} / gid {gid} may not use this daemon")
                return
            if self._no_room(role, tenant):
                self.refused += 1
                log.warning(
                    "refused connection from %s: in no tenant, and the default tenant has no L2", peer
                )
                self._refuse(
                    sock,
                    UNAUTHORIZED,
                    f"uid {uid} / gid {gid} is in no tenant, and the default tenant has no L2 (the tenants' "
                    "capacities take all of pool.capacity): add it to a tenant's uids or gids",
                )
                return
            if self.stopping:
                self._refuse(sock, DRAINING, "the daemon is shutting down")
                return
            # Those still in their handshake count too (this one is among them): a burst of connections
            # would all pass a check of the admitted ones alone. Twice the limit: until its first bytes, a
            # connection may be an engine's short side connection that registers a host region, which
            # belongs to a connection already counted; engines are held to the limit below.
            limit = self.cfg.server.max_connections
            if len(self.connections) + len(self._admitting) - 1 >= 2 * limit:
                self._refuse(sock, BUSY, "too many connections (server.max_connections)")
                return
            token = secrets.token_hex(16)
            try:
                arena_fd, arena_bytes = self.tiers.arena(tenant)
            except HicachedError:  # a tenant without L2: an operator's ctl still needs a welcome
                arena_fd, arena_bytes = self._no_arena(), NO_ARENA_BYTES
            welcome = protocol.encode(
                {
                    "id": 0,
                    "version": protocol.VERSION,
                    "pool_bytes": arena_bytes,
                    "max_frame": self.cfg.server.max_frame,
                    "max_keys": self.cfg.server.max_keys_per_request,
                    "pid": os.getpid(),
                    "token": token,
                }
            )
            sock.setblocking(False)
            socket.send_fds(sock, [welcome], [arena_fd])
            first, fds = await self._first_bytes(sock, deadline)
            if fds:
                await attach_connection(self, sock, first, fds, uid, deadline, via)
                return
            if not first:
                self.handshake_timeouts += 1
                self._refuse(sock, TIMEOUT, "nothing sent within server.handshake_timeout: closed")
                return
            if len(self.connections) + self._engines_admitting >= limit:
                self._refuse_first(sock, first, BUSY, "too many connections (server.max_connections)")
                return
            self._engines_admitting += 1
            try:
                await loop.connect_accepted_socket(
                    lambda: Connection(
                        self,
                        Session(peer=peer, tenant=tenant),
                        token,
                        uid,
                        first,
                        operator=role == OPERATOR,
                        deadline=deadline,
                        gid=gid,
                        via=via,
                    ),
                    sock=sock,
                )
            finally:
                self._engines_admitting -= 1
        except asyncio.CancelledError:
            sock.close()
            raise
        except Exception as e:
            log.warning("could not admit a connection: %s", e)
            sock.close()

    async def _first_bytes(self, sock: socket.socket, deadline: float) -> tuple[bytes, list[int]]:
        """The first bytes the peer sends and any fds that came with them, read on the raw socket (a
        transport cannot receive fds). An engine sends hello at once, so this costs it no round trip; one
        that sends nothing by `deadline` (accept + server.handshake_timeout) gets b"" and is closed."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
        except TimeoutError:
            return b"", []
        finally:
            loop.remove_reader(sock.fileno())
        try:
            data, fds, flags, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return b"", []
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise OSError(f"peer sent more than {MAX_FDS} fds")
        return data, fds

    def _refuse_first(self, sock: socket.socket, first: bytes, code: str, message: str) -> None:
        """Refuses a connection that has had its welcome: the answer goes to its first request (its
        hello), so that the client sees `code` rather than a connection closed in silence."""
        rid = 0
        with contextlib.suppress(protocol.FrameError):
            msgs = protocol.FrameDecoder(self.cfg.server.max_frame).feed(first)
            if msgs and isinstance(msgs[0], dict) and type(msgs[0].get("id")) is int:
                rid = msgs[0]["id"]
        self._refuse(sock, code, message, rid)

    @staticmethod
    def _refuse(sock: socket.socket, code: str, message: str, rid: int = 0) -> None:
        """A few bytes into a socket that holds none (never blocks), then closed."""
        with contextlib.suppress(OSError):
            sock.send(protocol.encode(protocol.error_answer(rid, code, message)))
        sock.close()

    # What status and stats say (hicached.daemon.server.views).

    def view(self, op: str, answer: Any, tenant: str | None) -> Any:
        return views.view(self, op, answer, tenant)

    def status(self) -> dict:
        return views.status(self)

    async def stats_sliced(self) -> dict:
        return await views.stats_sliced(self)

    def stats(self, pool: dict | None = None) -> dict:
        return views.stats(self, pool)
