"""One suite for every L3 backend (file, redis, redis-cluster, s3) on real stores: what the daemon relies
on, whichever backend is configured."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest
from hicached.connectors import BackendUnavailable, Connector, header
from hicached.connectors.base import FLEET_NAMESPACE

from hicached.common.keys import valid_namespace

NS = "llama-3.1-8b.bf16.p64.tp0of1"
KiB, MiB = 1024, 1024 * 1024
# Only a guard against a hang: the calls themselves are bounded by storage.operation_timeout.
GUARD_S = 60


def key(i: int) -> str:
    return f"{i:064x}"


def page(i: int, size: int) -> memoryview:
    return memoryview(((i.to_bytes(4, "little") + bytes(range(251))) * (size // 255 + 1))[:size])


def buffers(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


def errors(conn: Connector) -> int:
    return sum(v for k, v in conn.counters.items() if k.startswith("errors."))


@pytest.mark.parametrize("size", [4 * KiB, 256 * KiB, 8 * MiB], ids=["4KiB", "256KiB", "8MiB"])
async def test_round_trip(backend, size: int) -> None:
    keys, pages = [key(i) for i in range(3)], [page(i, size) for i in range(3)]
    async with backend.connector() as conn:
        assert await conn.put(NS, keys, pages) == [True] * 3
        assert await conn.exists(NS, keys) == 3
        bufs = buffers(3, size)
        assert await conn.get_into(NS, keys, bufs) == [True] * 3
        assert bufs == pages
        assert await conn.delete(NS, keys) == 3
        assert await conn.exists(NS, keys) == 0
        assert await conn.get_into(NS, keys, buffers(3, size)) == [False] * 3
        assert await conn.delete(NS, keys) == 0
        c = conn.counters
        assert (c["puts"], c["gets"], c["hits"], c["misses"]) == (3, 6, 3, 3)
        assert c["bytes_written"] == c["bytes_read"] == 3 * size
        assert errors(conn) == 0


async def test_stored_object_is_header_and_payload(backend) -> None:
    async with backend.connector() as conn:
        assert await conn.put(NS, [key(1)], [page(1, 4 * KiB)]) == [True]
    stored = await asyncio.to_thread(backend.raw, NS, key(1))
    assert stored is not None and len(stored) == header.HEADER_SIZE + 4 * KiB
    header.verify(stored[: header.HEADER_SIZE], NS, key(1), stored[header.HEADER_SIZE :])


async def test_a_page_is_published_only_if_its_bytes_hash_to_its_checksum(backend) -> None:
    """The backup hands over each page's checksum as the page entered L2: it goes into the header, and a
    page whose bytes, as written, do not hash to it is not stored under its key (False, counted), so that
    L3 never holds under a key bytes other than those acknowledged; None is computed by the connector."""
    size = 256 * KiB
    keys, pages = [key(i) for i in range(3)], [page(i, size) for i in range(3)]
    sums = [header.checksum(pages[0]), header.checksum(pages[1]) ^ 1, None]
    async with backend.connector() as conn:
        assert await conn.put(NS, keys, pages, sums) == [True, False, True]
        assert conn.counters["errors.changed"] == 1
        assert await asyncio.to_thread(backend.raw, NS, keys[1]) is None
        for k, want in zip([keys[0], keys[2]], [sums[0], header.checksum(pages[2])], strict=True):
            stored = await asyncio.to_thread(backend.raw, NS, k)
            assert header.parse(stored[: header.HEADER_SIZE], NS, k, size) == want
        bufs = buffers(3, size)
        assert await conn.get_into(NS, keys, bufs) == [True, False, True]
        assert bufs[0] == pages[0] and bufs[2] == pages[2]
        assert not conn.counters["corrupt.checksum"]


async def test_present_answers_each_key(backend) -> None:
    keys = [key(i) for i in range(10)]
    here = [1, 2, 5, 9]
    async with backend.connector() as conn:
        assert all(await conn.put(NS, [keys[i] for i in here], [page(i, 4 * KiB) for i in here]))
        assert await conn.present(NS, keys) == [i in here for i in range(10)]
        assert await conn.present(NS, []) == []
        assert await conn.present("another-namespace", keys[:3]) == [False] * 3


async def test_exists_counts_the_leading_prefix(backend) -> None:
    n, hole = 270, 260  # past the width of one batch of checks in every backend
    present = [key(i) for i in range(n) if i != hole]
    async with backend.connector() as conn:
        assert all(await conn.put(NS, present, [page(i, 4 * KiB) for i in range(len(present))]))
        keys = [key(i) for i in range(n)]
        assert await conn.exists(NS, keys) == hole
        assert await conn.exists(NS, keys[:hole]) == hole
        assert await conn.exists(NS, keys[hole:]) == 0
        assert await conn.exists(NS, keys[hole + 1 :]) == n - hole - 1
        assert await conn.exists(NS, []) == 0
        assert await conn.exists("another-namespace", keys) == 0


async def test_get_reports_each_page(backend) -> None:
    async with backend.connector() as conn:
        await conn.put(NS, [key(0), key(2)], [page(0, 4 * KiB), page(2, 4 * KiB)])
        bufs = buffers(3, 4 * KiB)
        assert await conn.get_into(NS, [key(0), key(1), key(2)], bufs) == [True, False, True]
        assert (bufs[0], bufs[2]) == (page(0, 4 * KiB), page(2, 4 * KiB))
        assert (conn.counters["hits"], conn.counters["misses"]) == (2, 1)
        assert await conn.get_into(NS, [], []) == []


async def test_overwrite_replaces_the_page(backend) -> None:
    async with backend.connector() as conn:
        await conn.put(NS, [key(7)], [page(1, 64 * KiB)])
        await conn.put(NS, [key(7)], [page(2, 64 * KiB)])
        (buf,) = buffers(1, 64 * KiB)
        assert await conn.get_into(NS, [key(7)], [buf]) == [True]
        assert buf == page(2, 64 * KiB)


async def test_many_concurrent_operations(backend) -> None:
    n, size = 200, 16 * KiB
    # 200 calls at once on one moto server: on a loaded 2-CPU machine the last answer can take past the
    # default 10 s; what this checks is that they all come right, not how fast.
    async with backend.connector(operation_timeout=60) as conn:
        puts = await asyncio.gather(*(conn.put(NS, [key(i)], [page(i, size)]) for i in range(n)))
        assert puts == [[True]] * n
        bufs = buffers(n, size)
        gets = await asyncio.gather(*(conn.get_into(NS, [key(i)], [bufs[i]]) for i in range(n)))
        assert gets == [[True]] * n
        assert all(bufs[i] == page(i, size) for i in range(n))
        counts = await asyncio.gather(*(conn.exists(NS, [key(i), key(i + 1)]) for i in range(n)))
        assert counts == [2] * (n - 1) + [1]
        assert sum(await asyncio.gather(*(conn.delete(NS, [key(i)]) for i in range(n)))) == n


def _flip_payload_byte(data: bytes, _other: bytes) -> bytes:
    i = header.HEADER_SIZE + 1000
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


# How an object is damaged behind the connector's back, and the reason it is then counted under.
DAMAGE = {
    "checksum": _flip_payload_byte,
    "length": lambda data, _other: data[:-1],
    "short": lambda data, _other: data[:10],
    "magic": lambda data, _other: b"XXXX" + data[4:],
    "key": lambda _data, other: other,  # another page's object copied under this key
}


@pytest.mark.parametrize("reason", list(DAMAGE))
async def test_corrupt_object_is_a_counted_miss_and_removed(backend, reason: str) -> None:
    size = 8 * KiB
    async with backend.connector() as conn:
        await conn.put(NS, [key(1), key(2)], [page(1, size), page(2, size)])
        one, two = [await asyncio.to_thread(backend.raw, NS, k) for k in (key(1), key(2))]
        await asyncio.to_thread(backend.replace, NS, key(1), DAMAGE[reason](one, two))

        bufs = buffers(2, size)
        assert await conn.get_into(NS, [key(1), key(2)], bufs) == [False, True]
        assert bufs[1] == page(2, size)
        assert conn.counters[f"corrupt.{reason}"] == 1
        assert (conn.counters["hits"], conn.counters["misses"]) == (1, 1)
        assert await asyncio.to_thread(backend.raw, NS, key(1)) is None
        assert await conn.exists(NS, [key(1), key(2)]) == 0


async def test_a_page_of_another_size_or_format_is_a_miss_left_for_its_readers(backend) -> None:
    """Regression (#29): a node whose engines use another page size for the same namespace (or a daemon of
    another page format) read the others' pages as corrupt and removed them: 0 of 48 survived. Now a miss,
    counted apart (misfit.*), and the page stays for the nodes it fits."""
    async with backend.connector() as conn:
        await conn.put(NS, [key(3), key(4)], [page(3, 8 * KiB), page(4, 8 * KiB)])
        four = await asyncio.to_thread(backend.raw, NS, key(4))
        newer = bytearray(four)
        struct.pack_into("<H", newer, 4, header.VERSION + 1)  # a format this daemon does not read
        await asyncio.to_thread(backend.replace, NS, key(4), bytes(newer))
        assert await conn.get_into(NS, [key(3)], buffers(1, 4 * KiB)) == [False]
        assert await conn.get_into(NS, [key(4)], buffers(1, 8 * KiB)) == [False]
        assert (conn.counters["misfit.length"], conn.counters["misfit.version"]) == (1, 1)
        assert not any(k.startswith("corrupt.") for k in conn.counters)
        assert await asyncio.to_thread(backend.raw, NS, key(4)) == bytes(newer)
        bufs = buffers(1, 8 * KiB)
        assert await conn.get_into(NS, [key(3)], bufs) == [True]  # its readers still find it
        assert bufs[0] == page(3, 8 * KiB)


async def test_probe(backend) -> None:
    async with backend.connector() as conn:
        await conn.probe(timeout=GUARD_S)
        assert conn.counters["hits"] == 1


async def test_registry_builds_the_named_backend(backend) -> None:
    async with backend.connector() as conn:
        assert conn.name == backend.kind.removesuffix("-cluster")
        assert conn.capabilities.persistent
        assert conn.capabilities.shared == (backend.kind != "file")


async def _every_call_is_unavailable(conn: Connector) -> None:
    size = 4 * KiB
    calls = [
        lambda: conn.put(NS, [key(1), key(2)], [page(1, size), page(2, size)]),
        lambda: conn.get_into(NS, [key(0), key(1)], buffers(2, size)),
        lambda: conn.exists(NS, [key(0), key(1)]),
        lambda: conn.delete(NS, [key(0)]),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailable) as err:
            async with asyncio.timeout(GUARD_S):
                await call()
        assert err.value.code == "backend_unavailable"


async def _works(conn: Connector, i: int) -> None:
    size = 256 * KiB
    assert await conn.put(NS, [key(i)], [page(i, size)]) == [True]
    (buf,) = buffers(1, size)
    assert await conn.get_into(NS, [key(i)], [buf]) == [True]
    assert buf == page(i, size)


async def test_server_stopped_then_back(restartable) -> None:
    """While the store is down every call fails as a whole, counted, within the time-out; once the store
    is back, the same connector works again by itself."""
    async with restartable.connector(operation_timeout=1.0) as conn:
        await _works(conn, 0)
        await asyncio.to_thread(restartable.stop)
        try:
            await _every_call_is_unavailable(conn)
            if restartable.kind != "file":  # a missing directory is not an error the file backend counts
                assert errors(conn) >= 4
        finally:
            await asyncio.to_thread(restartable.restart)
        await _works(conn, 1)


async def test_stalled_server_times_out_then_recovers(stallable) -> None:
    """A store that accepts connections and then never answers: calls end at storage.operation_timeout
    as backend_unavailable; after the stall the same connector works again."""
    harness, proxy = stallable
    fast = {"socket_timeout": 0.2} if harness.kind == "redis" else {"read_timeout": 0.2, "max_attempts": 1}
    async with harness.connector(operation_timeout=0.5, **fast) as conn:
        await _works(conn, 0)
        proxy.stall()
        try:
            await _every_call_is_unavailable(conn)
            assert conn.counters["errors.timeout"] >= 4
        finally:
            proxy.resume()
        await _works(conn, 1)


async def test_probes_of_nodes_sharing_a_store_do_not_meet(backend) -> None:
    """Nodes that share a store probe it at once (started together, or after one outage): one node's
    whole probe, its delete included, between another's write and read fails neither."""
    async with backend.connector() as first, backend.connector() as second:
        read = first.get_into

        async def read_after_the_other_probe(*args):
            await second.probe(timeout=GUARD_S)
            return await read(*args)

        first.get_into = read_after_the_other_probe
        await first.probe(timeout=GUARD_S)


async def test_marks_are_kept_apart_from_pages(backend) -> None:
    """Marks (a namespace's clear epoch, shared by the nodes of a fleet): absent until written, replaced
    whole, seen by another connector on the same store, never a page, and under no time to live."""
    async with backend.connector(**({"ttl": "1s"} if backend.kind.startswith("redis") else {})) as a:
        async with backend.connector() as b:
            assert await a.read_marks([]) == []
            assert await a.read_marks(["epoch-x", "epoch-y"]) == [None, None]
            await a.write_mark("epoch-x", b"one")
            await a.write_mark("epoch-x", b"two")
            assert await b.read_marks(["epoch-x", "epoch-y"]) == [b"two", None]
            # No engine's page call reaches them: their namespace is none an engine can name.
            assert not valid_namespace(FLEET_NAMESPACE)
            if backend.kind.startswith("redis"):  # pages expire after storage.redis.ttl; marks do not
                with contextlib.closing(backend._client()) as c:
                    assert c.pttl(f"{backend.prefix}:{FLEET_NAMESPACE}:epoch-x") == -1
            assert a.counters["gets"] == a.counters["misses"] == 0
