"""L3 on S3 or an S3-compatible store (aioboto3): one object per page, `{prefix}/{namespace}/{key}`.

One long-lived client per started connector: creating one costs hundreds of milliseconds. Credentials come
from the standard AWS chain (environment, profile, instance role), never from hicached's TOML.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aioboto3
import aiohttp
import botocore.exceptions as bexc
from aiobotocore.config import AioConfig
from hicached.config import Config

from hicached.common.keys import valid_key, valid_stored_namespace

from . import header
from .base import (
    FLEET_NAMESPACE,
    MAX_MARK,
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    Capabilities,
    Connector,
    Hold,
    log,
    put_checksums,
)

T = TypeVar("T")

_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
# The store answered and refuses us: retrying will not help, an operator has to act.
_REFUSED = frozenset(
    {
        "403",
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "InvalidBucketName",
        "PermanentRedirect",
        "301",
        "AuthorizationHeaderMalformed",
    }
)
_NO_CREDENTIALS = (bexc.NoCredentialsError, bexc.PartialCredentialsError, bexc.CredentialRetrievalError)
# Transport failures: botocore wraps most aiohttp errors, but a body read can surface aiohttp's own.
_TRANSPORT = (bexc.ConnectionError, bexc.HTTPClientError, aiohttp.ClientError, OSError)
# Objects a DeleteObjects request may name: S3's limit, and as many as one ListObjectsV2 page returns.
_DELETE_BATCH = 1000


def _code(e: bexc.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Connector(Connector):
    name = "s3"
    capabilities = Capabilities(shared=True, persistent=True, ttl=False)

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self._s3cfg = cfg.storage.s3
        self._timeout = cfg.storage.operation_timeout
        self._bucket = self._s3cfg.bucket
        self._sem = asyncio.Semaphore(self._s3cfg.max_connections)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None

    def location(self) -> tuple:
        c = self._s3cfg
        return ("s3", c.endpoint_url, c.region, c.bucket, c.prefix)

    def _object(self, namespace: str, key: str) -> str:
        prefix = self._s3cfg.prefix.strip("/")
        return f"{prefix}/{namespace}/{key}" if prefix else f"{namespace}/{key}"

    async def start(self) -> None:
        c = self._s3cfg
        botocfg = AioConfig(
            max_pool_connections=c.max_connections,
            connect_timeout=c.connect_timeout,
            read_timeout=c.read_timeout,
            retries={"max_attempts": c.max_attempts, "mode": "standard"},
            s3={"addressing_style": c.addressing_style},
            # "when_required": no CRC on every PutObject, which some S3-compatible stores reject; our
            # header carries a checksum that is verified on every read anyway.
            request_checksum_calculation=c.checksum,
            response_checksum_validation=c.checksum,
        )
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                aioboto3.Session().client(
                    "s3",
                    endpoint_url=c.endpoint_url or None,
                    region_name=c.region or "us-east-1",
                    config=botocfg,
                )
            )
        except (ValueError, bexc.BotoCoreError) as e:
            await stack.aclose()
            raise BackendMisconfigured(self.name, f"cannot create an S3 client: {e}", "config") from None
        self._stack = stack
        try:
            await self._call(lambda: self._client.head_bucket(Bucket=self._bucket), check_bucket=True)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    def _where(self) -> str:
        return f"bucket {self._bucket!r} at {self._s3cfg.endpoint_url or 'AWS'}"

    def _error(self, e: BaseException, check_bucket: bool = False) -> BackendError:
        """The whole-call error for a failure of the store, counted by reason."""
        if isinstance(e, bexc.ClientError):
            code = _code(e)
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if check_bucket and (code in _MISSING or code == "NoSuchBucket"):
                self.counters["errors.no_bucket"] += 1
                return BackendMisconfigured(
                    self.name, f"{self._where()} does not exist (storage.s3.bucket)", "no_bucket"
                )
            if code in _REFUSED or status in (301, 403):
                self.counters["errors.refused"] += 1
                return BackendMisconfigured(
                    self.name,
                    f"{self._where()} refused us ({code or status}): check the credentials and the policy"
                    " (without s3:ListBucket, a missing object is a 403)",
                    "refused",
                )
            self.counters["errors.server"] += 1
            return BackendUnavailable(self.name, f"{self._where()} answered {code or status}: {e}", "server")
        if isinstance(e, bexc.ParamValidationError):
            self.counters["errors.config"] += 1
            return BackendMisconfigured(self.name, f"{self._where()}: {e}", "config")
        if isinstance(e, _NO_CREDENTIALS):
            self.counters["errors.credentials"] += 1
            return BackendMisconfigured(
                self.name,
                f"no usable AWS credentials in the standard chain (environment, profile): {e}",
                "credentials",
            )
        if isinstance(e, TimeoutError | bexc.ReadTimeoutError | bexc.ConnectTimeoutError):
            self.counters["errors.timeout"] += 1
            return BackendUnavailable(self.name, f"{self._where()} did not answer in time: {e}", "timeout")
        self.counters["errors.connection"] += 1
        return BackendUnavailable(self.name, f"{self._where()} unreachable: {e}", "connection")

    async def _call(self, fn: Callable[[], Awaitable[T]], check_bucket: bool = False) -> T:
        """One whole call, bounded by storage.operation_timeout."""
        if self._client is None:
            raise BackendUnavailable(self.name, "not started, or closed", "closed")
        try:
            async with asyncio.timeout(self._timeout):
                return await fn()
        except TimeoutError:
            self.counters["errors.timeout"] += 1
            raise BackendUnavailable(
                self.name, f"no answer within {self._timeout}s (storage.operation_timeout)", "timeout"
            ) from None
        except (bexc.ClientError, bexc.ParamValidationError, *_NO_CREDENTIALS, *_TRANSPORT) as e:
            raise self._error(e, check_bucket) from None

    async def _gather(
        self, fn: Callable[[str, Any], Awaitable[T]], keys: Sequence[str], args: Sequence[Any]
    ) -> list[T]:
        """Runs fn per key concurrently, at most max_connections at once. The first failure fails them
        all: requests not yet sent are skipped, those in flight are waited for. Runs inside _call."""
        errors: list[Exception] = []

        async def one(key: str, arg: Any) -> T | None:
            async with self._sem:
                if errors:
                    return None
                try:
                    result = await fn(key, arg)
                    self.progress += 1
                    return result
                except Exception as e:  # kept apart from results that are exceptions themselves
                    errors.append(e)
                    return None

        results = await asyncio.gather(*(one(k, a) for k, a in zip(keys, args, strict=True)))
        if errors:
            # A refusal says more than the timeouts that may come with it.
            raise next((e for e in errors if isinstance(e, bexc.ClientError)), errors[0])
        return results  # type: ignore[return-value]

    async def _each(
        self, fn: Callable[[str, Any], Awaitable[T]], keys: Sequence[str], args: Sequence[Any]
    ) -> list[T]:
        """_gather as one whole call."""
        return await self._call(lambda: self._gather(fn, keys, args))

    async def put(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        checksums: Sequence[int | None] | None = None,
        hold: Hold | None = None,
    ) -> list[bool]:
        async def put_one(key: str, item: tuple[memoryview, int | None]) -> bool:
            payload, digest = item
            # botocore takes bytes, bytearray or a file-like Body, not a memoryview, so a put costs this
            # one copy. A file-like body is worse: aiohttp reads it in chunks (copies) on executor threads.
            # Reusing preallocated buffers instead of a fresh bytes saved ~0.4 of ~5.5 ms client CPU per
            # 2 MiB PUT against moto: not worth holding max_connections x page size of memory.
            view = _byte_view(payload)
            body = b"".join((header.encode(namespace, key, view, digest), view))
            # The copy is what goes out: it is published only if it hashes to the checksum the page was
            # acknowledged with (a slot changed since is never stored under the key).
            if digest is not None and header.checksum(memoryview(body)[header.HEADER_SIZE :]) != digest:
                self.counters["errors.changed"] += 1
                log.warning(
                    "%s: page %s/%s changed since it was stored; not written", self.name, namespace, key
                )
                return False
            await self._client.put_object(Bucket=self._bucket, Key=self._object(namespace, key), Body=body)
            return True

        sums = put_checksums(keys, payloads, checksums) or [None] * len(keys)
        self.counters["puts"] += len(keys)
        done = await self._each(put_one, keys, list(zip(payloads, sums, strict=True)))
        self.counters["bytes_written"] += sum(p.nbytes for p, ok in zip(payloads, done, strict=True) if ok)
        return done

    async def get_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], hold: Hold | None = None
    ) -> list[bool]:
        async def get_one(key: str, buf: memoryview) -> bool | header.CorruptPage:
            dest = _byte_view(buf)
            try:
                resp = await self._client.get_object(Bucket=self._bucket, Key=self._object(namespace, key))
            except bexc.ClientError as e:
                if _code(e) in _MISSING:
                    return False
                raise
            try:
                return await _read_page(resp, namespace, key, dest)
            except header.CorruptPage as e:
                return e

        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        self.counters["gets"] += len(keys)

        async def run() -> list[bool | header.CorruptPage]:
            results = await self._gather(get_one, keys, buffers)
            corrupt = [
                k
                for k, res in zip(keys, results, strict=True)
                if isinstance(res, header.CorruptPage) and not isinstance(res, header.MisfitPage)
            ]
            if corrupt:
                # Failing to remove it fails nothing: the next read finds it corrupt again.
                with contextlib.suppress(bexc.ClientError, bexc.BotoCoreError, *_TRANSPORT):
                    await self._gather(lambda k, _: self._delete_one(namespace, k), corrupt, corrupt)
            return results

        found = []
        for key, buf, res in zip(keys, buffers, await self._call(run), strict=True):
            if isinstance(res, header.MisfitPage):
                self.misfit(namespace, key, res.reason, str(res))
                res = False
            elif isinstance(res, header.CorruptPage):
                self.corrupt(namespace, key, res.reason, str(res))
                res = False
            self.counters["hits" if res else "misses"] += 1
            if res:
                self.counters["bytes_read"] += buf.nbytes
            found.append(res)
        return found

    async def _head(self, namespace: str, key: str) -> bool:
        try:
            await self._client.head_object(Bucket=self._bucket, Key=self._object(namespace, key))
        except bexc.ClientError as e:
            if _code(e) in _MISSING:
                return False
            raise
        return True

    async def _delete_one(self, namespace: str, key: str) -> None:
        await self._client.delete_object(Bucket=self._bucket, Key=self._object(namespace, key))

    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        # HEADs in windows as wide as the connection pool: a miss early in a long list stops the work.
        async def run() -> int:
            count = 0
            window = self._s3cfg.max_connections
            for start in range(0, len(keys), window):
                chunk = keys[start : start + window]
                for hit in await self._gather(lambda k, _: self._head(namespace, k), chunk, chunk):
                    if not hit:
                        return count
                    count += 1
            return count

        return await self._call(run)

    async def present(self, namespace: str, keys: Sequence[str]) -> list[bool]:
        return await self._each(lambda k, _: self._head(namespace, k), keys, keys)

    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        # S3 answers a DELETE alike whether the object existed or not; a HEAD first tells which did.
        # DeleteObjects would save requests but requires a checksum header some compatible stores reject.
        async def delete_one(key: str, _: Any) -> bool:
            if not await self._head(namespace, key):
                return False
            await self._delete_one(namespace, key)
            return True

        removed = sum(await self._each(delete_one, keys, keys))
        self.counters["deletes"] += removed
        return removed

    async def read_marks(self, names: Sequence[str]) -> list[bytes | None]:
        """Each mark an object `{prefix}/.fleet~/{name}` (a lifecycle rule that expires pages must
        leave that prefix alone: docs/fleet.md)."""

        async def read_one(name: str, _: Any) -> bytes | None:
            try:
                resp = await self._client.get_object(
                    Bucket=self._bucket, Key=self._object(FLEET_NAMESPACE, name)
                )
            except bexc.ClientError as e:
                if _code(e) in _MISSING:
                    return None
                raise
            async with resp["Body"] as body:
                return (await body.read())[: MAX_MARK + 1]

        return await self._each(read_one, list(names), list(names)) if names else []

    async def write_mark(self, name: str, value: bytes) -> None:
        async def run() -> None:
            await self._client.put_object(
                Bucket=self._bucket, Key=self._object(FLEET_NAMESPACE, name), Body=bytes(value)
            )

        await self._call(run)

    async def clear_namespace(self, namespace: str) -> int:
        """One ListObjectsV2 pass over `{prefix}/{namespace}/` (the slash keeps `ns2/` and `ns.x/` out), each
        page of the listing removed by one DeleteObjects; only objects named by a page key are pages (what
        lies in deeper "folders" is not ours). Every round trip is bounded by storage.operation_timeout.
        The pass ends however many pages come in meanwhile: a page written during it may or may not be
        listed. An object DeleteObjects reports as not deleted fails the call (BackendMisconfigured where
        the store refuses us, else BackendUnavailable). Pages removed before a failure are counted in
        `deletes`. DeleteObjects carries a checksum header; a store that rejects it fails the call."""
        if not valid_stored_namespace(namespace):
            return 0
        folder = self._object(namespace, "")
        removed = 0
        token: dict[str, str] = {}
        try:
            while True:
                listing = await self._call(
                    functools.partial(
                        self._client.list_objects_v2,
                        Bucket=self._bucket,
                        Prefix=folder,
                        Delimiter="/",
                        MaxKeys=_DELETE_BATCH,
                        **token,
                    )
                )
                names = [o["Key"] for o in listing.get("Contents", ()) if valid_key(o["Key"][len(folder) :])]
                if names:
                    removed += await self._delete_batch(names)
                if not listing.get("IsTruncated"):
                    break
                token = {"ContinuationToken": listing["NextContinuationToken"]}
        finally:
            self.counters["deletes"] += removed
        return removed

    async def _delete_batch(self, names: list[str]) -> int:
        """One DeleteObjects for up to _DELETE_BATCH objects; how many it removed. Raises for objects the
        store reports it could not delete."""
        objects = {"Objects": [{"Key": name} for name in names], "Quiet": True}
        answer = await self._call(
            functools.partial(self._client.delete_objects, Bucket=self._bucket, Delete=objects)
        )
        failed = answer.get("Errors", ())
        if not failed:
            return len(names)
        self.counters["deletes"] += len(names) - len(failed)
        first = failed[0]
        code = str(first.get("Code", ""))
        detail = f"{first.get('Key')}: {code} {first.get('Message', '')}".rstrip()
        what = f"{len(failed)} of {len(names)} objects not deleted ({detail})"
        if code in _REFUSED:
            self.counters["errors.refused"] += 1
            raise BackendMisconfigured(self.name, f"{self._where()} refused us: {what}", "refused")
        self.counters["errors.server"] += 1
        raise BackendUnavailable(self.name, f"{self._where()}: {what}", "server")


def _byte_view(buf: memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


async def _read_page(resp: dict[str, Any], namespace: str, key: str, dest: memoryview) -> bool:
    """Reads one object straight into `dest` and verifies it. `dest` holds garbage if the page turns out
    corrupt; the caller reports a miss for it. Raises CorruptPage."""
    length = int(resp["ContentLength"])
    expected = header.HEADER_SIZE + dest.nbytes
    stream = resp["Body"]
    async with stream:  # releases the connection, or closes it when the body was not read to the end
        if length < header.HEADER_SIZE:
            raise header.CorruptPage("short", f"object of {length} bytes holds no header")
        head = memoryview(bytearray(header.HEADER_SIZE))
        await _read_exactly(stream, head)
        # The header first: a page of another size (a node configured otherwise) is a misfit, not corrupt.
        digest = header.parse(head, namespace, key, dest.nbytes, length)
        if length != expected:
            raise header.CorruptPage("length", f"object of {length} bytes, expected {expected}")
        await _read_exactly(stream, dest)
    if header.checksum(dest) != digest:
        raise header.CorruptPage("checksum", "payload checksum does not match the header")
    return True


async def _read_exactly(body: Any, dest: memoryview) -> None:
    filled = 0
    while filled < len(dest):
        n = await body.readinto(dest[filled:])
        if n == 0:
            raise bexc.ResponseStreamingError(error=f"body ended after {filled} of {len(dest)} bytes")
        filled += n
