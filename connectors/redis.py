"""L3 on Redis, one node or a Redis Cluster: one key per page, header and payload in one value.

Header and payload live in one value so Redis can never evict one without the other. Batches go out as
non-transactional pipelines (a cluster pipeline splits them by slot itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions as rexc
from hicached.config import Config, resolve_path
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff

from hicached.common.keys import valid_key, valid_stored_namespace
from hicached.common.retry import Backoff

from . import header
from .base import (
    FLEET_NAMESPACE,
    BackendMisconfigured,
    BackendUnavailable,
    Capabilities,
    Connector,
    Hold,
    log,
    put_checksums,
)

T = TypeVar("T")

_STORE_FAILURES = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterError, rexc.TryAgainError)

# Keys per pipeline in exists(): small enough that a miss early in a long list stops the work early.
_EXISTS_CHUNK = 256
# SCAN's COUNT in clear_namespace(): slots of the keyspace a round looks at, about the most keys it returns
# (and so UNLINKs in its pipeline); a round of this size takes a node milliseconds.
_SCAN_COUNT = 1000
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")  # what MATCH patterns treat specially: escaped with a backslash


class _Page:
    """A SET value made of two buffers, header then payload, sent without joining them."""

    __slots__ = ("header", "payload")

    def __init__(self, head: bytes, payload: memoryview) -> None:
        self.header = head
        self.payload = payload


class _PagePacking:
    """Packs a _Page argument as one RESP bulk string written in pieces, so the payload goes from the
    pool's memory to the socket with no copy. Joining header and payload into one bytes object instead
    allocates a fresh, not yet faulted buffer for every page: measured here that makes pipelined SETs of
    2 MiB pages about 3x slower (1.1 vs 3.7 GB/s) and costs 3x the client CPU."""

    def pack_command(self, *args: Any) -> list[Any]:
        if not any(isinstance(a, _Page) for a in args):
            return super().pack_command(*args)  # type: ignore[misc]
        encode = self.encoder.encode  # type: ignore[attr-defined]
        out: list[Any] = []
        buf = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, _Page):
                out.append(buf + b"$%d\r\n" % (len(arg.header) + len(arg.payload)) + arg.header)
                out.append(arg.payload)  # a memoryview: pack_commands keeps it a chunk of its own
                buf = b"\r\n"
            else:
                value = encode(arg)
                buf += b"$%d\r\n%s\r\n" % (len(value), value)
        out.append(buf)
        return out

    @property
    def is_connected(self) -> bool:
        """Connected, and the socket not closed under us meanwhile: a pooled connection the peer reset or
        closed while it sat idle is dialled again when it is next used, inside the call, instead of failing
        it (a cluster node's pool lends connections without checking them)."""
        writer = getattr(self, "_writer", None)
        return super().is_connected and not writer.transport.is_closing()  # type: ignore[misc]

    async def disconnect(self, nowait: bool = False, **kwargs: Any) -> None:
        """redis-py disconnects with nowait after an error or a cancellation (a time-out) in the middle of
        a command. A graceful close would still send what the transport holds: the rest of a page, read
        from a pool slot that may hold another page by then. Aborting drops it: a SET given up on is
        never completed."""
        writer = getattr(self, "_writer", None)
        if nowait and writer is not None:
            writer.transport.abort()
        await super().disconnect(nowait, **kwargs)  # type: ignore[misc]


class _PageConnection(_PagePacking, Connection):
    pass


class _PageSSLConnection(_PagePacking, SSLConnection):
    pass


class _PageUnixConnection(_PagePacking, UnixDomainSocketConnection):
    pass


_PAGE_CONNECTIONS: dict[type, type] = {
    Connection: _PageConnection,
    SSLConnection: _PageSSLConnection,
    UnixDomainSocketConnection: _PageUnixConnection,
}


class _BackoffAdapter(AbstractBackoff):
    """The daemon's Backoff (storage.retry) as a redis-py backoff: redis-py does the retrying, so a
    stale pooled connection is re-dialled inside the call and nothing retries twice."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff

    def compute(self, failures: int) -> float:
        return self._backoff.delay(max(1, failures))


class RedisConnector(Connector):
    name = "redis"
    capabilities = Capabilities(shared=True, persistent=True, ttl=True)

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self._cfg = cfg
        self._rcfg = cfg.storage.redis
        self._timeout = cfg.storage.operation_timeout
        self._ttl_ms = int(self._rcfg.ttl * 1000)
        self._sem = asyncio.Semaphore(self._rcfg.max_connections)
        self._client: aioredis.Redis | RedisCluster | None = None
        # Checks and copies of large GET batches into the pool's slots, off the event loop.
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hicached-redis-copy")

    def _key(self, namespace: str, key: str) -> str:
        return f"{self._rcfg.prefix}:{namespace}:{key}"

    def location(self) -> tuple:
        r = self._rcfg
        return ("redis", r.url, r.cluster, r.username, r.prefix)

    def _client_options(self) -> dict[str, Any]:
        r = self._rcfg
        opts: dict[str, Any] = {
            "socket_timeout": r.socket_timeout,
            "socket_connect_timeout": r.connect_timeout,
            "retry": Retry(
                _BackoffAdapter(Backoff.from_config(self._cfg.storage.retry)),
                self._cfg.storage.retry.attempts - 1,
            ),
        }
        if r.username:
            opts["username"] = r.username
        password = r.password
        if r.password_env:
            password = os.environ.get(r.password_env, "")
            if not password:
                raise BackendMisconfigured(
                    self.name,
                    f"environment variable {r.password_env} (storage.redis.password_env) is not set",
                    "config",
                )
        if password:
            opts["password"] = password
        if r.url.startswith("rediss://"):
            opts["ssl_cert_reqs"] = r.ssl_cert_reqs
            for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if getattr(r, name):
                    opts[name] = resolve_path(self._cfg, getattr(r, name))
        return opts

    def _make_client(self) -> aioredis.Redis | RedisCluster:
        r = self._rcfg
        opts = self._client_options()
        if r.cluster:
            client = RedisCluster.from_url(r.url, max_connections=r.max_connections, **opts)
            # RedisCluster has no connection_class option: nodes are built from connection_kwargs (one
            # dict shared with its NodesManager), and the startup nodes already exist.
            cls = _PAGE_CONNECTIONS[client.connection_kwargs["connection_class"]]
            client.connection_kwargs["connection_class"] = cls
            for node in client.startup_nodes:
                node.connection_class = cls
            return client
        url_opts = parse_url(r.url)
        url_opts["connection_class"] = _PAGE_CONNECTIONS[url_opts.get("connection_class", Connection)]
        pool = aioredis.ConnectionPool(max_connections=r.max_connections, **{**url_opts, **opts})
        return aioredis.Redis(connection_pool=pool)

    async def start(self) -> None:
        try:
            self._client = self._make_client()
        except (ValueError, rexc.RedisClusterException) as e:
            raise BackendMisconfigured(
                self.name, f"storage.redis.url {self._where()!r} cannot be used: {e}", "config"
            ) from None
        try:
            await self._call(lambda c: c.ping())
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            if isinstance(client, RedisCluster):
                await client.aclose()
            else:  # the pool is ours (built in _make_client): the client closes it only when told to
                await client.aclose(close_connection_pool=True)
        self._copier.shutdown(wait=False)

    def _where(self) -> str:
        # The URL without its credentials, for messages and logs.
        scheme, sep, rest = self._rcfg.url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}"

    def _unavailable(self, reason: str, message: str) -> BackendUnavailable:
        self.counters[f"errors.{reason}"] += 1
        return BackendUnavailable(self.name, f"{self._where()}: {message}", reason)

    async def _call(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Runs one whole call: bounded by the semaphore (the pool raises when exhausted) and by
        storage.operation_timeout; failures of the store become BackendError for the whole call."""
        if self._client is None:
            raise BackendUnavailable(self.name, "not started, or closed", "closed")
        try:
            async with self._sem, asyncio.timeout(self._timeout):
                return await fn(self._client)
        except TimeoutError:
            msg = f"no answer within {self._timeout}s (storage.operation_timeout)"
            raise self._unavailable("timeout", msg) from None
        except (rexc.AuthenticationError, rexc.AuthorizationError, rexc.NoPermissionError) as e:
            self.counters["errors.auth"] += 1
            raise BackendMisconfigured(self.name, f"{self._where()} refused us: {e}", "auth") from None
        except rexc.TimeoutError as e:
            raise self._unavailable("timeout", _describe(e)) from None
        except (*_STORE_FAILURES, rexc.RedisClusterException, OSError) as e:
            if isinstance(e.__cause__ or e.__context__, ssl.SSLCertVerificationError):
                self.counters["errors.tls"] += 1
                msg = f"{self._where()}: {_describe(e)}; check storage.redis.ssl_ca_certs"
                raise BackendMisconfigured(self.name, msg, "tls") from None
            raise self._unavailable("connection", _describe(e)) from None

    def _count_refusals(self, results: list[Any], what: str) -> None:
        """Commands Redis answered with an error (out of memory, wrong type): counted per page, logged
        once per call, since a full server refuses a whole batch alike."""
        refused = [r for r in results if isinstance(r, Exception)]
        if not refused:
            return
        oom = sum(isinstance(r, rexc.OutOfMemoryError) for r in refused)
        self.counters["errors.oom"] += oom
        self.counters["errors.response"] += len(refused) - oom
        hint = "; run Redis with maxmemory-policy allkeys-lru when it is a cache" if oom else ""
        log.warning(
            "%s: %d of %d %s refused: %s%s", self.name, len(refused), len(results), what, refused[0], hint
        )

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        return await self._call(lambda client: _execute(client, commands))

    async def put(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        checksums: Sequence[int | None] | None = None,
        hold: Hold | None = None,
    ) -> list[bool]:
        sums = put_checksums(keys, payloads, checksums) or [None] * len(keys)
        self.counters["puts"] += len(keys)
        if not keys:
            return []
        ttl = ("PX", self._ttl_ms) if self._ttl_ms > 0 else ()
        commands = []
        views = [_byte_view(p) for p in payloads]
        for key, view, digest in zip(keys, views, sums, strict=True):
            page = _Page(header.encode(namespace, key, view, digest), view)
            commands.append(("SET", self._key(namespace, key), page, *ttl))

        async def run(client: Any) -> list[bool]:
            results = await _execute(client, commands)
            self._count_refusals(results, "SET")
            ok = [not isinstance(res, Exception) for res in results]
            # The payloads went from the slots to the socket as they were while being sent: a page whose
            # bytes no longer hash to its checksum may have gone out changed. Its header says the checksum
            # it was acknowledged with, so no reader takes it; it is removed now, and not counted written.
            check = [i for i, digest in enumerate(sums) if ok[i] and digest is not None]
            if sum(views[i].nbytes for i in check) > _THREAD_BYTES:  # xxh3 drops the GIL: off the loop
                hashes = await asyncio.get_running_loop().run_in_executor(
                    self._copier, lambda: [header.checksum(views[i]) for i in check]
                )
            else:
                hashes = [header.checksum(views[i]) for i in check]
            changed = [i for i, h in zip(check, hashes, strict=True) if h != sums[i]]
            if changed:
                self.counters["errors.changed"] += len(changed)
                log.warning("%s: %d pages changed while being sent; removed", self.name, len(changed))
                await _execute(client, [("UNLINK", self._key(namespace, keys[i])) for i in changed])
                for i in changed:
                    ok[i] = False
            return ok

        ok = await self._call(run)
        self.counters["bytes_written"] += sum(v.nbytes for v, done in zip(views, ok, strict=True) if done)
        return ok

    async def get_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], hold: Hold | None = None
    ) -> list[bool]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        self.counters["gets"] += len(keys)
        if not keys:
            return []

        async def run(client: Any) -> list[bool]:
            results = await _execute(client, [("GET", self._key(namespace, k)) for k in keys])
            self._count_refusals(results, "GET")
            outcomes = _check_and_copy(namespace, keys, buffers, results)
            if isinstance(outcomes, _Deferred):
                # Checksums and copies of a large batch run on a thread (both release the GIL), so
                # the event loop goes on parsing replies meanwhile. A call given up meanwhile leaves the
                # buffers in `hold` until the copy ended: it cannot be stopped in the middle of a page.
                loop = asyncio.get_running_loop()
                job = self._copier.submit(outcomes.run)
                try:
                    outcomes = await asyncio.wrap_future(job, loop=loop)
                finally:
                    if not job.done():
                        if hold is not None:
                            hold.track_thread(job, loop)
                        else:
                            job.cancel()
            found = [
                self._account(namespace, k, b, o) for k, b, o in zip(keys, buffers, outcomes, strict=True)
            ]
            corrupt = [
                k for k, hit, o in zip(keys, found, outcomes, strict=True) if hit is None and not _misfit(o)
            ]
            if corrupt:
                # A writer that replaced the object since our GET loses its page here: a later miss,
                # never a corrupt hit. Failing to remove it fails nothing: the next read finds it again.
                with contextlib.suppress(rexc.RedisError):
                    await _execute(client, [("UNLINK", self._key(namespace, k)) for k in corrupt])
            return [bool(hit) for hit in found]

        return await self._call(run)

    def _account(self, namespace: str, key: str, buf: memoryview, outcome: Any) -> bool | None:
        """Counts one GET's outcome (True: filled, False: absent, CorruptPage); None for a corrupt one."""
        if isinstance(outcome, header.MisfitPage):
            self.misfit(namespace, key, outcome.reason, str(outcome))
            hit = None
        elif isinstance(outcome, header.CorruptPage):
            self.corrupt(namespace, key, outcome.reason, str(outcome))
            hit = None
        else:
            hit = outcome
            if hit:
                self.counters["bytes_read"] += buf.nbytes
        self.counters["hits" if hit else "misses"] += 1
        return hit

    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        async def run(client: Any) -> int:
            count = 0
            for start in range(0, len(keys), _EXISTS_CHUNK):
                chunk = keys[start : start + _EXISTS_CHUNK]
                for res in await _execute(client, [("EXISTS", self._key(namespace, k)) for k in chunk]):
                    if isinstance(res, Exception) or not res:
                        return count
                    count += 1
            return count

        return await self._call(run)

    async def present(self, namespace: str, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        results = await self._pipeline([("EXISTS", self._key(namespace, k)) for k in keys])
        return [not isinstance(r, Exception) and bool(r) for r in results]

    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        # UNLINK frees large values off Redis's main thread; one command per key keeps every command
        # in one slot for a cluster.
        results = await self._pipeline([("UNLINK", self._key(namespace, k)) for k in keys])
        self._count_refusals(results, "UNLINK")
        removed = sum(int(r) for r in results if not isinstance(r, Exception))
        self.counters["deletes"] += removed
        return removed

    async def read_marks(self, names: Sequence[str]) -> list[bytes | None]:
        """Each mark a plain key `{prefix}:.fleet~:{name}`, with no time to live: under a
        `volatile-*` maxmemory-policy, only pages (which have one) are evicted (docs/fleet.md)."""
        if not names:
            return []
        results = await self._pipeline([("GET", self._key(FLEET_NAMESPACE, name)) for name in names])
        self._count_refusals(results, "GET")
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise self._unavailable("response", f"reading marks: {failed}")
        return [None if r is None else bytes(r) for r in results]

    async def write_mark(self, name: str, value: bytes) -> None:
        results = await self._pipeline([("SET", self._key(FLEET_NAMESPACE, name), bytes(value))])
        self._count_refusals(results, "SET")
        if isinstance(results[0], Exception):
            raise self._unavailable("response", f"writing mark {name}: {results[0]}")

    async def clear_namespace(self, namespace: str) -> int:
        """One SCAN pass over each primary (every node of a cluster, each holding its own slots) for keys
        that MATCH `{prefix}:{namespace}:*` (the prefix's glob characters escaped), each round's pages
        UNLINKed in one pipeline; only keys whose rest is a page key (no further `:`) are pages of this
        namespace. Every round trip is bounded by storage.operation_timeout, and one pass ends however many
        pages come in meanwhile: SCAN returns every key there throughout the pass, and a key written during
        it may or may not be. A cluster that moves slots or fails over during the pass fails the call, or
        leaves the pages of the moved slots. Pages removed before a failure are counted in `deletes`."""
        if not valid_stored_namespace(namespace):
            return 0
        head = self._key(namespace, "")
        match, prefix = _GLOB_SPECIAL.sub(r"\\\1", head) + "*", head.encode()
        nodes = await self._call(self._primaries)
        removed = 0
        try:
            for node in nodes:
                cursor = 0
                while True:
                    cursor, names = await self._call(functools.partial(self._scan, node, cursor, match))
                    pages = [name for name in names if _page_of(name, prefix)]
                    if pages:
                        results = await self._pipeline([("UNLINK", name) for name in pages])
                        self._count_refusals(results, "UNLINK")
                        removed += sum(int(r) for r in results if not isinstance(r, Exception))
                    if not cursor:
                        break
        finally:
            self.counters["deletes"] += removed
        return removed

    async def _primaries(self, client: Any) -> list[str | None]:
        """The names of the nodes whose keys make the whole keyspace: a cluster's primaries, or None for the
        one server."""
        if isinstance(client, RedisCluster):
            await client.initialize()  # a no-op, unless a failure made the client forget the layout
            primaries = [node.name for node in client.get_primaries()]
            if not primaries:
                raise rexc.ClusterError("the cluster names no primary node")
            return primaries
        return [None]

    async def _scan(self, node: str | None, cursor: int, match: str, client: Any) -> tuple[int, list[bytes]]:
        """One SCAN round on `node` (None: the one server)."""
        if node is None:
            return await client.scan(cursor, match=match, count=_SCAN_COUNT)
        target = client.get_node(node_name=node)
        if target is None:
            raise rexc.ClusterError(f"node {node} left the cluster during the scan")
        cursors, names = await client.scan(cursor, match=match, count=_SCAN_COUNT, target_nodes=target)
        return cursors[node], names


async def _execute(client: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One pipeline, not a transaction; commands Redis refuses come back as exception objects."""
    pipe = client.pipeline(transaction=False)
    for cmd in commands:
        pipe.execute_command(*cmd)
    results = await pipe.execute(raise_on_error=False)
    # A cluster pipeline returns a node's connection failure in place of its commands' answers rather
    # than raising it: that is the store failing, not Redis refusing a command.
    failed = next((r for r in results if isinstance(r, _STORE_FAILURES)), None)
    if failed is not None:
        raise failed
    return results


def _page_of(name: bytes, prefix: bytes) -> bool:
    """Whether key `name` is a page under `prefix` (`{prefix}:{namespace}:`)."""
    return name.startswith(prefix) and valid_key(name[len(prefix) :].decode("latin-1"))


def _describe(e: BaseException) -> str:
    # redis-py 8 words some errors only as "network:ConnectionError"; the cause says what happened.
    cause = e.__cause__ or e.__context__
    return f"{e} ({cause})" if cause is not None else str(e) or type(e).__name__


def _byte_view(buf: memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_THREAD_BYTES = 1 << 20  # batches larger than this are checked and copied off the event loop


class _Deferred:
    def __init__(self, fn: Callable[[], list[Any]]) -> None:
        self.run = fn


def _check_and_copy(
    namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], results: list[Any]
) -> list[Any] | _Deferred:
    def work() -> list[Any]:
        out: list[Any] = []
        for key, buf, value in zip(keys, buffers, results, strict=True):
            if value is None or isinstance(value, Exception):
                out.append(False)
                continue
            dest = _byte_view(buf)
            try:
                payload = _verified_payload(value, namespace, key, dest.nbytes)
            except header.CorruptPage as e:
                out.append(e)
                continue
            # numpy's copy releases the GIL; a memoryview slice assignment would hold it.
            np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
            out.append(True)
        return out

    size = sum(len(v) for v in results if isinstance(v, bytes | bytearray))
    return _Deferred(work) if size > _THREAD_BYTES else work()


def _misfit(outcome: Any) -> bool:
    """A page of another page size or format (header.MisfitPage): not ours to remove."""
    return isinstance(outcome, header.MisfitPage)


def _verified_payload(value: bytes, namespace: str, key: str, length: int) -> memoryview:
    mv = memoryview(value)
    expected = header.HEADER_SIZE + length
    if len(mv) < header.HEADER_SIZE:
        raise header.CorruptPage("short", f"object of {len(mv)} bytes holds no header")
    # The header first: a page of another size (a node configured otherwise) is a misfit, not corrupt.
    digest = header.parse(mv[: header.HEADER_SIZE], namespace, key, length, len(mv))
    if len(mv) != expected:
        raise header.CorruptPage("length", f"object of {len(mv)} bytes, expected {expected}")
    payload = mv[header.HEADER_SIZE :]
    if header.checksum(payload) != digest:
        raise header.CorruptPage("checksum", "payload checksum does not match the header")
    return payload
