"""The clients against an in-process daemon on the test's own event loop (AsyncClient), and against a
daemon thread (Client shared by many threads), plus the client-side checks of pages and buffers."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
import uvloop

from hicached import config
from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient, Client, _Wire
from hicached.engine.ops import _as_bytes_array
from hicached.engine.ops import _copy_pages as client_ops_native

PAGE = 32 * 1024

# The client's page copies: hicached.common._pageio.copy_pages, and the numpy path used where it is not built.
COPY_PATHS = [
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(
            client_ops_native is None,
            reason="hicached.common._pageio is not built (no C compiler at install)",
        ),
    ),
    pytest.param(False, id="numpy"),
]


def daemon_cfg(tmp_path, **storage):
    return config.from_dict(
        {
            "server": {"socket": "run/d.sock"},
            "pool": {"capacity": "16MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {"file": {"root": "data"}, **storage},
        },
        base_dir=str(tmp_path),
    )


async def test_async_client_round_trip_and_clean_shutdown(tmp_path):
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        sock = d.server.path
        pages = [os.urandom(PAGE) for _ in range(12)]
        keys = [f"key{i}" for i in range(12)]
        async with AsyncClient(sock, "async.ns", PAGE) as c:
            assert await c.store(keys, pages) == [True] * 12
            assert await c.exists(keys) == 12
            assert await c.get(keys) == pages
            bufs = [bytearray(PAGE) for _ in keys]
            assert await c.load(keys, bufs) == 12 and [bytes(b) for b in bufs] == pages
            h = await c.prefetch(keys)
            assert await c.wait(h) == 12
            # Many requests in flight on one connection at once.
            results = await asyncio.gather(*(c.exists(keys[: i + 1]) for i in range(12)))
            assert results == list(range(1, 13))
            with pytest.raises(HicachedError) as e:
                await c.store(keys[:1], [b"x"])
            assert e.value.code == "bad_request"
            assert (await c.stats())["counters"]["store.pages"] == 12
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    assert (tmp_path / "data" / "async.ns").is_dir()
    assert not os.path.exists(d.server.path)


async def test_shutdown_writes_dirty_pages(tmp_path):
    d = Daemon(daemon_cfg(tmp_path, write_policy="write_back"))
    await d.startup()
    async with AsyncClient(d.server.path, "wb.ns", PAGE) as c:
        await c.store(["a", "b", "c"], [os.urandom(PAGE) for _ in range(3)])
        assert (await c.stats())["pool"]["dirty"] == 3
    await d.shutdown()
    assert len(list((tmp_path / "data" / "wb.ns").rglob("*"))) >= 3


@pytest.fixture
def threaded_daemon(tmp_path):
    """A daemon on its own uvloop in a thread, for the blocking client."""
    cfg = daemon_cfg(tmp_path)
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        d = Daemon(cfg)
        box["daemon"], box["loop"] = d, asyncio.get_running_loop()
        await d.startup()
        ready.set()
        await d.main_loop()
        await d.shutdown()

    t = threading.Thread(target=uvloop.run, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(30)
    yield box["daemon"]
    box["loop"].call_soon_threadsafe(box["daemon"].handle_signal, signal.SIGTERM)
    t.join(30)


def test_one_client_shared_by_many_threads(threaded_daemon):
    sock = threaded_daemon.server.path
    errors: list[BaseException] = []
    with Client(sock, "threads.ns", PAGE) as c:

        def worker(i: int) -> None:
            try:
                rng = np.random.default_rng(i)
                for j in range(10):
                    keys = [f"t{i}-{j}-{k}" for k in range(4)]
                    pages = [rng.bytes(PAGE) for _ in keys]
                    assert c.store(keys, pages) == [True] * 4
                    assert c.get(keys) == pages
                    assert c.exists(keys) == 4
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = c.stats()
        assert stats["counters"]["store.pages"] == 8 * 10 * 4
        assert stats["pool"]["reserved"] == len(c._ops._reserved) > 0  # no slot set aside was lost


def test_stores_copy_into_slots_held_ahead(threaded_daemon, monkeypatch):
    # The first store allocates and asks for slots ahead; the next ones copy into those at once and only
    # bind them to keys (put), with no allocation to wait for.
    sock = threaded_daemon.server.path
    ops: list[str] = []
    real_send = _Wire._send

    def send(self, req, held):
        ops.append(req["op"])
        return real_send(self, req, held)

    monkeypatch.setattr(_Wire, "_send", send)
    writes: list[int] = []
    real_write = _Wire._write

    def write(self, held):
        writes.append(len(held))
        return real_write(self, held)

    monkeypatch.setattr(_Wire, "_write", write)
    keys = [f"ahead{i}" for i in range(100)]
    pages = [os.urandom(PAGE) for _ in keys]
    with Client(sock, "ahead.ns", PAGE) as c:
        assert c.store(keys[:16], pages[:16]) == [True] * 16
        assert "alloc" in ops and "reserve" in ops
        held = len(c._ops._reserved)
        assert c.stats()["pool"]["reserved"] == held == 16
        ops.clear()
        writes.clear()
        assert c.store(keys[16:32], pages[16:32]) == [True] * 16
        assert ops == ["put", "reserve", "put"]  # two puts, no alloc
        assert writes == [2, 1]  # the refill goes out right after the first put: two writes in all
        # More pages than the slots held ahead: the first go there, the others are allocated.
        n = c._ops._reserve_limit // 2 + 8
        assert 32 + n <= len(keys)
        ops.clear()
        assert c.store(keys[32 : 32 + n], pages[32 : 32 + n]) == [True] * n
        assert "alloc" in ops and "put" in ops
        assert c.get(keys[: 32 + n]) == pages[: 32 + n]
        # Pages there already: their reserved slots come back to the client, nothing is overwritten.
        assert c.store(keys[:16], [bytes(PAGE)] * 16) == [True] * 16
        assert c.get(keys[: 32 + n]) == pages[: 32 + n]
        held = len(c._ops._reserved)
        assert c.stats()["pool"]["reserved"] == held > 0
    with Client(sock, "ahead.ns", PAGE) as c:
        for _ in range(3000):  # the closed connection's slots are freed once the daemon sees it close
            if c.stats()["pool"]["reserved"] == 0:
                break
            threading.Event().wait(0.01)
        assert c.stats()["pool"]["reserved"] == 0


@pytest.mark.parametrize("reconnect", [0, 5.0])
def test_slots_held_ahead_are_never_written_once_the_daemon_closed_the_connection(threaded_daemon, reconnect):
    # The daemon frees a closed connection's reserved slots and hands them to other pages at once. A store
    # that needs no refill copies into slots held ahead before it sends anything: it must see the close.
    # Without reconnects it fails; with them it runs on a new connection, with slots of its own.
    sock = threaded_daemon.server.path
    keys_a, keys_b = [f"a{i}" for i in range(72)], [f"b{i}" for i in range(64)]
    pages_a, pages_b = [os.urandom(PAGE) for _ in keys_a], [os.urandom(PAGE) for _ in keys_b]
    ns = f"gone{reconnect:g}.ns"
    with Client(sock, ns, PAGE, reconnect=reconnect) as a, Client(sock, ns, PAGE) as b:
        assert a.store(keys_a[:64], pages_a[:64]) == [True] * 64
        held = len(a._ops._reserved)
        assert held == a._ops._reserve_limit == 64  # a store of 8 will ask for nothing first
        a._sock.sendall(protocol.encode({"op": "exists"}))  # no id: the daemon drops the connection
        for _ in range(3000):
            if b.stats()["pool"]["reserved"] == 0:
                break
            threading.Event().wait(0.01)
        assert b.stats()["pool"]["reserved"] == 0
        assert b.store(keys_b, pages_b) == [True] * 64  # into the slots a held: freed slots go first
        if reconnect:
            assert a.store(keys_a[64:], pages_a[64:]) == [True] * 8
            assert a.reconnects == 1 and a.get(keys_a) == pages_a
        else:
            with pytest.raises(HicachedError) as e:
                a.store(keys_a[64:], pages_a[64:])
            assert e.value.code == "connection"
        assert b.get(keys_b) == pages_b


def test_store_refused_while_draining_collects_each_answer_once(threaded_daemon, monkeypatch):
    # Regression: an allocation answered with an error was waited for a second time on the way out (an
    # answer that never comes: the call hung for the client's whole time-out).
    sock = threaded_daemon.server.path
    keys = [f"drain{i}" for i in range(48)]
    pages = [os.urandom(PAGE) for _ in keys]
    collected: list[int] = []
    real_collect = _Wire._collect

    def collect(self, rid):
        collected.append(rid)
        return real_collect(self, rid)

    monkeypatch.setattr(_Wire, "_collect", collect)
    with Client(sock, "drain.ns", PAGE, timeout=60) as c:
        assert c.store(keys[:8], pages[:8]) == [True] * 8  # and slots held ahead for the next stores
        held = len(c._ops._reserved)
        threaded_daemon.server.draining = True
        try:
            for some in (keys[8:12], keys[8:]):
                with pytest.raises(HicachedError) as e:
                    c.store(some, pages[8 : 8 + len(some)])
                assert e.value.code == "draining"
        finally:
            threaded_daemon.server.draining = False
        assert len(collected) == len(set(collected))
        stats = c.stats()
        assert stats["pool"]["pages"] == 8 and stats["pool"]["writing"] == 0
        assert stats["pool"]["reserved"] == len(c._ops._reserved) == held  # refused puts kept their slots
        assert c.store(keys, pages) == [True] * 48
        assert c.get(keys) == pages


@pytest.mark.parametrize("native", COPY_PATHS)
def test_tensors_and_arrays_as_pages_and_buffers(threaded_daemon, monkeypatch, native):
    import hicached.engine.ops as client_ops

    if not native:
        monkeypatch.setattr(client_ops, "_copy_pages", None)
    sock = threaded_daemon.server.path
    with Client(sock, f"tensor.{native}", PAGE) as c:
        t = torch.randn(PAGE // 2, dtype=torch.bfloat16)
        a = np.arange(PAGE // 4, dtype=np.int32)
        b = os.urandom(PAGE)
        assert c.store(["t", "a", "b"], [t, a, b]) == [True, True, True]
        out_t = torch.empty(PAGE // 2, dtype=torch.bfloat16)
        out_a = np.empty(PAGE // 4, dtype=np.int32)
        out_b = bytearray(PAGE)
        assert c.load(["t", "a", "b", "missing"], [out_t, out_a, out_b, bytearray(PAGE)]) == 3
        assert torch.equal(out_t, t) and np.array_equal(out_a, a) and out_b == b


def test_client_side_checks():
    assert _as_bytes_array(bytearray(8), 8, True, "b").nbytes == 8
    with pytest.raises(HicachedError, match="read-only"):
        _as_bytes_array(b"12345678", 8, True, "b")
    with pytest.raises(HicachedError, match="bytes"):
        _as_bytes_array(bytearray(4), 8, False, "b")
    with pytest.raises(HicachedError, match="contiguous"):
        _as_bytes_array(np.zeros((4, 4), dtype=np.uint8)[:, :2], 8, False, "b")
    with pytest.raises(HicachedError, match="contiguous"):
        _as_bytes_array(torch.zeros(4, 4, dtype=torch.uint8)[:, :2], 8, False, "b")
    with pytest.raises(HicachedError, match="bytes-like"):
        _as_bytes_array(12, 8, False, "b")
    with pytest.raises(HicachedError, match="namespace"):
        Client("/nonexistent.sock", "bad/ns", PAGE)
    with pytest.raises(HicachedError) as e:
        Client("/nonexistent.sock", "ok.ns", PAGE)
    assert e.value.code == "connection"


class _FailingCopies:
    """numpy as hicached.engine.ops sees it, with np.copyto failing from the `fail_at`-th call on."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __getattr__(self, name: str):
        return getattr(np, name)

    def copyto(self, dst, src) -> None:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise MemoryError("injected failure in the middle of a store")
        np.copyto(dst, src)


def _fail_copies(monkeypatch, fail_at: int, native: bool) -> None:
    """Makes the client's page copies fail from the `fail_at`-th page on: in hicached.common._pageio's
    copy_pages (one call a segment; the pages before the failing one are copied) or, without it, in numpy."""
    import hicached.engine.ops as client_ops

    if not native:
        monkeypatch.setattr(client_ops, "_copy_pages", None)
        monkeypatch.setattr(client_ops, "np", _FailingCopies(fail_at))
        return
    real, copied = client_ops._copy_pages, [0]

    def copy_pages(pool, offsets, size, pages, into_pool, sums=None):
        keep = max(0, min(len(pages), fail_at - 1 - copied[0]))
        real(pool, offsets[:keep], size, pages[:keep], into_pool, None if sums is None else sums[:keep])
        copied[0] += keep
        if keep < len(pages):
            raise MemoryError("injected failure in the middle of a store")

    monkeypatch.setattr(client_ops, "_copy_pages", copy_pages)


@pytest.mark.parametrize("native", COPY_PATHS)
def test_store_failing_half_way_leaves_no_slot_taken(threaded_daemon, monkeypatch, native):
    # 40 pages go in 4 chunks whose allocations are sent together; the copy fails in the third chunk.
    # Nothing is committed: every slot allocated to the call is given back, whichever chunk it is in.
    keys = [f"half{i}" for i in range(40)]
    pages = [os.urandom(PAGE) for _ in keys]
    with Client(threaded_daemon.server.path, "half.ns", PAGE) as c:
        assert c.store(keys[:5], pages[:5]) == [True] * 5  # already there: never copied again
        _fail_copies(monkeypatch, 20, native)
        with pytest.raises(MemoryError):
            c.store(keys, pages)
        monkeypatch.undo()
        stats = c.stats()
        assert stats["pool"]["writing"] == 0 and stats["pool"]["pages"] == 5
        assert stats["pool"]["reserved"] == len(c._ops._reserved)  # slots held ahead: none lost
        assert c.exists(keys) == 5
        assert c.store(keys, pages) == [True] * 40
        assert c.get(keys) == pages


@pytest.mark.parametrize("native", COPY_PATHS)
async def test_async_store_failing_half_way_leaves_no_slot_taken(tmp_path, monkeypatch, native):
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        keys = [f"half{i}" for i in range(40)]
        pages = [os.urandom(PAGE) for _ in keys]
        async with AsyncClient(d.server.path, "half.ns", PAGE) as c:
            _fail_copies(monkeypatch, 25, native)
            with pytest.raises(MemoryError):
                await c.store(keys, pages)
            monkeypatch.undo()
            stats = await c.stats()
            assert stats["pool"]["writing"] == 0 and stats["pool"]["pages"] == 0
            assert stats["pool"]["reserved"] == len(c._ops._reserved)
            assert await c.store(keys, pages) == [True] * 40
            assert await c.store(keys, pages) == [True] * 40  # from the slots held ahead, all present
            stats = await c.stats()
            assert stats["pool"]["reserved"] == len(c._ops._reserved) > 0
            assert await c.get(keys) == pages
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


def _page_files(root, ns: str) -> dict[str, bytes]:
    """Every page file under root/ns by key (the file name), header included."""
    return {
        p.name: p.read_bytes() for p in (root / ns).rglob("*") if p.is_file() and not p.name.startswith(".")
    }


@pytest.mark.parametrize("native", COPY_PATHS)
async def test_the_checksums_a_store_takes_go_to_l3_as_they_are(tmp_path, monkeypatch, native):
    """The client takes each page's xxh3 as it copies it (in the same pass with the C module; from the
    source, still in the cache, without it): put and commit carry them, the backup hands them to L3, and
    every header holds the checksum of its page."""
    import hicached.connectors.file as file_mod
    import xxhash

    import hicached.engine.ops as client_ops

    if not native:
        monkeypatch.setattr(client_ops, "_copy_pages", None)
    given: dict = {}  # key -> the checksum the backup handed to the connector
    real_put = file_mod.FileConnector.put

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        if namespace == "sums.ns":  # not the backend's probe
            given.update(zip(keys, checksums or [None] * len(keys), strict=True))
        return await real_put(self, namespace, keys, payloads, checksums, hold)

    monkeypatch.setattr(file_mod.FileConnector, "put", put)
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    keys = [f"sum{i}" for i in range(48)]
    pages = [os.urandom(PAGE) for _ in keys]
    try:
        async with AsyncClient(d.server.path, "sums.ns", PAGE) as c:
            assert await c.store(keys[:24], pages[:24]) == [True] * 24  # slots from alloc: commit
            assert await c.store(keys[24:], pages[24:]) == [True] * 24  # slots held ahead: put
            assert await d.tiers.backup.drain(30)
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    want = {k: xxhash.xxh3_64_intdigest(p) for k, p in zip(keys, pages, strict=True)}
    files = _page_files(tmp_path / "data", "sums.ns")
    assert {k: int.from_bytes(files[k][16:24], "little") for k in keys} == want
    assert given == want


@pytest.mark.skipif(client_ops_native is None, reason="hicached.common._pageio is not built (no C compiler)")
async def test_a_wrong_checksum_from_a_client_keeps_the_page_out_of_l3(tmp_path, monkeypatch):
    # The checksum a page enters L2 with is what L3 holds it to: a page whose bytes do not hash to it is
    # never published there (never wrong bytes under a key), counted, and a miss after a restart.
    import hicached.engine.ops as client_ops

    real = client_ops._copy_pages

    def copy_pages(pool, offsets, size, pages, into_pool, sums=None):
        real(pool, offsets, size, pages, into_pool, sums)
        if sums is not None and len(sums) > 3:
            sums[3] ^= 1  # the fourth page of the store: a checksum that is not its page's

    keys = [f"bad{i}" for i in range(6)]
    pages = [os.urandom(PAGE) for _ in keys]
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "bad.ns", PAGE) as c:
            monkeypatch.setattr(client_ops, "_copy_pages", copy_pages)
            assert await c.store(keys, pages) == [True] * 6
            monkeypatch.undo()
            assert await c.get(keys) == pages  # L2 holds the engine's bytes
            assert await d.tiers.backup.drain(30)
            stats = await c.stats()
            assert stats["backend_counters"]["errors.changed"] == 1
            # Found changed once refused: not retried, not owed to L3, not counted lost.
            assert stats["counters"]["backup.changed"] == 1 and stats["counters"]["backup.lost"] == 0
            assert "backup.failed" not in stats["counters"]
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    d = Daemon(daemon_cfg(tmp_path))  # a restart: L2 empty, the pages only in L3
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "bad.ns", PAGE) as c:
            bufs = [bytearray(PAGE) for _ in keys]
            assert await c.load(keys, bufs) == 3  # the page with the wrong checksum ends the prefix
            assert [bytes(b) for b in bufs[:3]] == pages[:3] and not any(bufs[3])
            assert "corrupt.checksum" not in (await c.stats())["backend_counters"]  # never written at all
            assert await c.exists(keys) == 3
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_put_and_commit_refuse_checksums_that_are_not_one_uint64_a_key(tmp_path):
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()

    def raw(req):
        return (yield req)

    try:
        async with AsyncClient(d.server.path, "raw.ns", PAGE) as c:
            for sums in ("x", [1], [1, 2, 3], [-1, 0], [1.5, 0], [True, 0], [None, 0]):
                with pytest.raises(HicachedError) as e:
                    await c._run(raw({"op": "commit", "keys": ["a", "b"], "sums": sums}))
                assert e.value.code == "bad_request" and "sums must be" in e.value.message
            assert (await c._run(raw({"op": "commit", "keys": ["a"], "sums": [0]})))["ok"] == [False]
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


@pytest.mark.skipif(client_ops_native is None, reason="hicached.common._pageio is not built (no C compiler)")
def test_copy_pages_checks_every_page_before_moving_a_byte():
    import mmap

    from hicached.common._pageio import copy_pages

    mm = mmap.mmap(-1, 1 << 16)
    pages = [bytes([i + 1]) * 4096 for i in range(3)]
    copy_pages(mm, [8192, 0, 61440], 4096, pages, True)
    assert mm[0:4096] == pages[1] and mm[8192:12288] == pages[0] and mm[61440:] == pages[2]
    out = [bytearray(4096), np.empty(1024, dtype=np.int32)]
    copy_pages(mm, [61440, 8192], 4096, out, False)
    assert out[0] == pages[2] and out[1].tobytes() == pages[0]
    before = mm[:]
    bad = [
        ([0, 1 << 16], [pages[0], pages[1]], ValueError),  # past the end: the first page is not copied
        ([0, -4096], [pages[0], pages[1]], ValueError),
        ([0, 4096], [pages[0], b"short"], ValueError),
        ([0], [pages[0], pages[1]], ValueError),
        ([0, "x"], [pages[0], pages[1]], TypeError),
        ([0], [object()], TypeError),
    ]
    for offsets, srcs, err in bad:
        with pytest.raises(err):
            copy_pages(mm, offsets, 4096, srcs, True)
    assert mm[:] == before
    with pytest.raises(BufferError):
        copy_pages(mm, [0], 4096, [bytes(4096)], False)  # a read-only destination
    with pytest.raises(TypeError):
        copy_pages(bytes(1 << 16), [0], 4096, [pages[0]], True)  # a read-only pool


def _stream_impls() -> list[str]:
    """The streaming stores this CPU and build can run ('' is a plain memcpy)."""
    if client_ops_native is None:
        return []
    from hicached.common import _pageio

    return [""] + [name for name in ("sse2", "avx2") if _stream_impl_works(_pageio, name)]


def _stream_impl_works(_pageio, name: str) -> bool:
    try:
        _pageio.stream_impl(_pageio.stream_impl(name))
        return True
    except ValueError:
        return False


@pytest.mark.skipif(client_ops_native is None, reason="hicached.common._pageio is not built (no C compiler)")
@pytest.mark.parametrize("impl", _stream_impls())
@pytest.mark.parametrize("size", [100, 241, 4096, 4096 + 77, 65536 + 128 + 5, 256 << 10])
def test_copy_pages_into_the_pool_with_streaming_stores(impl, size):
    """Every byte lands where it belongs and none beside it, whatever the alignment of the slot (a head
    copied up to a 64-byte boundary, a tail under 128 bytes) and the page's length; loads are memcpy. The
    checksums taken on the way are xxh3-64 (xxh3 hashes up to 240 bytes another way)."""
    import mmap

    import xxhash

    from hicached.common import _pageio

    before = _pageio.stream_impl(impl)
    try:
        assert _pageio.stream_impl() == impl
        rng = np.random.default_rng(size)
        pool_bytes = 4 * size + 4096
        mm = mmap.mmap(-1, pool_bytes)
        mm[:] = b"\xee" * pool_bytes
        offsets = [1, size + 64 + 63, 2 * size + 200, 3 * size + 4095 - 63]
        srcs = [rng.bytes(size + 3)[3:] for _ in offsets]  # buffers that start anywhere
        srcs[1] = memoryview(bytearray(b"\x00" + srcs[1]))[1:]  # a source off any alignment
        sums = np.zeros(len(offsets), dtype=np.uint64)
        _pageio.copy_pages(mm, offsets, size, srcs, True, sums)
        expect = bytearray(b"\xee" * pool_bytes)
        for off, src in zip(offsets, srcs, strict=True):
            expect[off : off + size] = src
        assert mm[:] == expect
        assert sums.tolist() == [xxhash.xxh3_64_intdigest(bytes(src)) for src in srcs]
        mm[:] = b"\xee" * pool_bytes
        _pageio.copy_pages(mm, offsets, size, srcs, True)  # without checksums
        assert mm[:] == expect
        out = [bytearray(size) for _ in offsets]
        _pageio.copy_pages(mm, offsets, size, out, False)
        assert [bytes(o) for o in out] == [bytes(s) for s in srcs]
    finally:
        _pageio.stream_impl(before)


@pytest.mark.skipif(client_ops_native is None, reason="hicached.common._pageio is not built (no C compiler)")
def test_stream_impl_refuses_what_it_does_not_have():
    from hicached.common import _pageio

    before = _pageio.stream_impl()
    with pytest.raises(ValueError, match="no streaming stores named 'avx9'"):
        _pageio.stream_impl("avx9")
    assert _pageio.stream_impl() == before  # unchanged by the refusal


@pytest.mark.skipif(client_ops_native is None, reason="hicached.common._pageio is not built (no C compiler)")
def test_copy_pages_takes_checksums_into_a_buffer_of_the_right_size_only():
    import mmap

    from hicached.common._pageio import copy_pages

    mm, pages = mmap.mmap(-1, 1 << 16), [bytes(4096)] * 2
    with pytest.raises(ValueError, match="room for 2 uint64"):
        copy_pages(mm, [0, 4096], 4096, pages, True, np.zeros(1, dtype=np.uint64))
    with pytest.raises(ValueError, match="into the pool only"):
        copy_pages(mm, [0, 4096], 4096, [bytearray(4096)] * 2, False, np.zeros(2, dtype=np.uint64))
    with pytest.raises(BufferError):
        copy_pages(mm, [0, 4096], 4096, pages, True, b"x" * 16)  # read-only


def _slow_acquire(monkeypatch, tiers, delay: float) -> None:
    """Tiers.acquire answers `delay` seconds late (an L3 read that takes its time). Loads of keys that are
    not all in L2 go through it."""
    acquire = tiers.acquire

    async def slow(*args, **kwargs):
        await asyncio.sleep(delay)
        return await acquire(*args, **kwargs)

    monkeypatch.setattr(tiers, "acquire", slow)


async def test_cancelled_async_store_gives_its_slots_back(tmp_path):
    """A store cancelled while it waits on its allocations (asyncio.wait_for around it) used to leave
    every slot WRITING until the connection closed: later stores of its keys were told they were there,
    and no read ever found them."""
    d = Daemon(daemon_cfg(tmp_path, backend="none"))
    await d.startup()
    try:
        keys = [f"cancel{i}" for i in range(32)]
        pages = [os.urandom(PAGE) for _ in keys]
        async with AsyncClient(d.server.path, "cancel.ns", PAGE) as c:
            task = asyncio.create_task(c.store(keys, pages))
            await asyncio.sleep(0)  # its allocations are sent; it waits for their answers
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(50):
                if (await c.stats())["pool"]["writing"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await c.stats())["pool"]["writing"] == 0
            assert await c.store(keys, pages) == [True] * 32
            assert await c.get(keys) == pages
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_async_load_given_up_releases_the_lease_that_comes_later(tmp_path, monkeypatch):
    d = Daemon(daemon_cfg(tmp_path, backend="none"))
    await d.startup()
    try:
        keys = [f"late{i}" for i in range(4)]
        pages = [os.urandom(PAGE) for _ in keys]
        async with AsyncClient(d.server.path, "late.ns", PAGE, timeout=0.1) as c:
            assert await c.store(keys, pages) == [True] * 4
            _slow_acquire(monkeypatch, d.tiers, 0.3)
            with pytest.raises(HicachedError, match="timeout"):
                await c.load([*keys, "late-miss"], [bytearray(PAGE) for _ in range(5)])
            with pytest.raises(TimeoutError):  # cancelled by the caller
                await asyncio.wait_for(
                    c.load([*keys, "late-miss"], [bytearray(PAGE) for _ in range(5)]), 0.05
                )
            await asyncio.sleep(0.6)
            assert (await c.stats())["pool"]["leased"] == 0
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


def test_load_timed_out_releases_the_lease_that_comes_later(threaded_daemon, monkeypatch):
    keys = [f"tlate{i}" for i in range(4)]
    pages = [os.urandom(PAGE) for _ in keys]
    with Client(threaded_daemon.server.path, "tlate.ns", PAGE, timeout=0.2) as c:
        assert c.store(keys, pages) == [True] * 4
        _slow_acquire(monkeypatch, threaded_daemon.tiers, 0.5)
        with pytest.raises(HicachedError, match="timeout"):
            c.load([*keys, "tlate-miss"], [bytearray(PAGE) for _ in range(5)])
        monkeypatch.undo()
        time.sleep(0.6)
        assert c.exists(keys) == 4  # its answer, read by this call's reader, gives the late lease back
        time.sleep(0.1)
        assert c.stats()["pool"]["leased"] == 0


async def test_present_answers_each_key_holes_and_all_from_l2_then_l3(tmp_path):
    keys = [f"pres{i}" for i in range(8)]
    stored = [0, 2, 3, 6]
    d = Daemon(daemon_cfg(tmp_path))
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "present.ns", PAGE) as c:
            assert await c.store([keys[i] for i in stored], [os.urandom(PAGE) for _ in stored]) == [True] * 4
            want = [i in stored for i in range(8)]
            assert await c.present(keys) == want
            assert await c.exists(keys) == 1  # the leading run only
            assert await c.present([]) == []
            assert await d.tiers.backup.drain(30)
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()
    d = Daemon(daemon_cfg(tmp_path))  # L2 empty: the answer comes from L3
    await d.startup()
    try:
        async with AsyncClient(d.server.path, "present.ns", PAGE) as c:
            assert await c.present(keys) == want
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


def test_a_handshake_reset_by_the_daemon_is_a_connection_error(tmp_path):
    # A daemon killed with connections still in its listen backlog resets them: the client's wait for the
    # welcome ends in ECONNRESET. Regression: that escaped the client as a bare ConnectionResetError, which
    # ended a reconnect (and the engine's process) instead of being waited out as a daemon not up yet.
    import socket

    path = str(tmp_path / "dying.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)  # never accepts: the client's connection waits in the backlog
    closer = threading.Timer(0.3, server.close)
    closer.start()
    try:
        with pytest.raises(HicachedError) as e:
            Client(path, "reset.ns", 4096, timeout=5, reconnect=0)
        assert e.value.code == "connection"
    finally:
        closer.join(10)
        server.close()
