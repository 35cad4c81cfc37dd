import asyncio
import os
import signal
import socket

import msgpack
import pytest
from waits import wait_until

from hicached import config
from hicached.daemon.persist.warmup import WarmPage, load, save
from hicached.daemon.service.lifecycle import Daemon
from hicached.engine.client import AsyncClient


def test_save_and_load_round_trip(tmp_path):
    pages = [WarmPage("ns.a", "k1", 4096, True), WarmPage("ns.b", "k2", 8192, False)]
    path = str(tmp_path / "sub" / "warm.msgpack")
    save(path, pages)
    assert load(path) == pages


def test_bad_lists_are_ignored(tmp_path):
    path = tmp_path / "warm.msgpack"
    assert load(str(path)) == []
    path.write_bytes(b"not msgpack \xc1")
    assert load(str(path)) == []
    path.write_bytes(msgpack.packb({"format": 99, "pages": []}))
    assert load(str(path)) == []
    # Entries with names that are not safe are dropped, the rest kept.
    good, bad = ["ns", "k", 4096, False], ["../etc", "k", 4096, False]
    path.write_bytes(
        msgpack.packb({"format": 1, "pages": [bad, good, ["ns", "a/b", 1, 0], ["ns", "k2", -1, 0]]})
    )
    assert load(str(path)) == [WarmPage("ns", "k", 4096, False)]
    assert load(str(path), max_bytes=4) == []


# The warm list across restarts of an in-process daemon (file backend).


def write_config(tmp_path, slab_size="1MiB", snapshot_interval="0", enabled="true", root="data") -> str:
    path = tmp_path / "hicached.toml"
    path.write_text(
        "\n".join(
            [
                "[server]",
                'socket = "run/d.sock"',
                "[pool]",
                'capacity = "16MiB"',
                f'slab_size = "{slab_size}"',
                "prefault = false",
                "[storage]",
                'backend = "file"',
                "[storage.file]",
                f'root = "{root}"',
                "[storage.breaker]",
                'probe_interval = "100ms"',
                "[warmup]",
                f"enabled = {enabled}",
                'state_file = "state/warm.msgpack"',
                f'snapshot_interval = "{snapshot_interval}"',
            ]
        )
        + "\n"
    )
    return str(path)


async def start(path: str) -> Daemon:
    d = Daemon(config.load(path), config_path=path)
    await d.startup()
    return d


async def stop(d: Daemon) -> None:
    d.handle_signal(signal.SIGTERM)
    await d.shutdown()


async def until(cond, timeout: float = 5.0) -> None:
    await wait_until(cond, timeout)


async def fill(d: Daemon, ns: str, keys: list[str], page_bytes: int = 4096) -> None:
    async with AsyncClient(d.server.path, ns, page_bytes) as c:
        assert await c.store(keys, [bytes(page_bytes)] * len(keys)) == [True] * len(keys)
    await until(lambda: d.tiers.backup.pending == 0 and not d.tiers.index.dirty_pages)


KEYS = [f"{i:064x}" for i in range(40)]


async def test_a_stop_before_the_warmup_is_done_keeps_the_warm_list(tmp_path):
    # Regression: the list was written from L2 as it stood, so a stop right after a start (a second
    # restart, a crash loop) wrote an empty list over it; so did a start-up that failed after listening.
    path = write_config(tmp_path)
    d = await start(path)
    await fill(d, "ns", KEYS)
    await stop(d)
    warm_list = str(tmp_path / "state" / "warm.msgpack")
    assert len(load(warm_list)) == len(KEYS)
    d = await start(path)
    await stop(d)  # the warmup has barely begun
    assert {p.key for p in load(warm_list)} == set(KEYS)
    d = Daemon(config.load(path), config_path=path)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    d.cfg.metrics.listen = f"127.0.0.1:{blocker.getsockname()[1]}"
    try:
        with pytest.raises(OSError):
            await d.startup()
        await d.shutdown()
    finally:
        blocker.close()
    assert {p.key for p in load(warm_list)} == set(KEYS)


async def test_warmup_waits_for_a_backend_that_is_late_at_start(tmp_path):
    # Regression: with the backend down at start the list was not replayed, and the next snapshot wrote
    # over it with an empty L2.
    os.makedirs(tmp_path / "pages")
    os.symlink("pages", tmp_path / "store")
    path = write_config(tmp_path, root="store", snapshot_interval="100ms")
    d = await start(path)
    await fill(d, "ns", KEYS)
    await stop(d)
    os.unlink(tmp_path / "store")
    (tmp_path / "store").write_text("")  # not a directory: the backend cannot start
    d = await start(path)
    try:
        assert d.tiers.backend.state == "starting"
        listed = tmp_path / "state" / "warm.msgpack"
        mtime = listed.stat().st_mtime_ns
        await until(lambda: listed.stat().st_mtime_ns != mtime)  # a snapshot (100 ms) wrote the list again
        assert {p.key for p in load(str(tmp_path / "state" / "warm.msgpack"))} == set(KEYS)
        os.unlink(tmp_path / "store")
        os.symlink("pages", tmp_path / "store")
        await until(lambda: d.tiers.counters["warmup.pages"] == len(KEYS))
    finally:
        await stop(d)


async def test_warmup_files_pages_back_in_their_lru_order(tmp_path):
    # Regression: the list (most recently used first) was replayed in its order, so the hottest page came
    # in first and was the first evicted after a restart.
    path = write_config(tmp_path)
    d = await start(path)
    await fill(d, "ns", KEYS)
    async with AsyncClient(d.server.path, "ns", 4096) as c:
        for k in reversed(KEYS):  # KEYS[0] used last
            assert await c.load([k], [bytearray(4096)]) == 1
    await until(lambda: sum(len(lru) for lru in d.tiers.index.lru_lists()) == len(KEYS))
    before = [e.key for lru in d.tiers.index.lru_lists() for e in lru]
    await stop(d)
    d = await start(path)
    try:
        await until(lambda: d.tiers.counters["warmup.pages"] == len(KEYS))
        assert [e.key for lru in d.tiers.index.lru_lists() for e in lru] == before
    finally:
        await stop(d)


async def test_warm_list_pages_larger_than_a_slab_are_skipped(tmp_path):
    # Regression: after pool.slab_size was lowered, a listed page that no slot can hold raised in the
    # warmup task: no page was warmed, and the periodic snapshots (same task) stopped for good.
    d = await start(write_config(tmp_path, slab_size="4MiB"))
    await fill(d, "big", ["a" * 64], page_bytes=2 << 20)
    await fill(d, "small", KEYS[:10])
    await stop(d)
    d = await start(write_config(tmp_path, slab_size="1MiB", snapshot_interval="100ms"))
    warm_list = tmp_path / "state" / "warm.msgpack"
    try:
        await until(lambda: d.tiers.counters["warmup.pages"] == 10)
        mtime = warm_list.stat().st_mtime_ns
        await until(lambda: warm_list.stat().st_mtime_ns != mtime)
    finally:
        await stop(d)


async def test_reload_starts_and_stops_the_warm_list_snapshots(tmp_path):
    # Regression: warmup.enabled and a snapshot_interval of 0 turned on by a reload were reported applied,
    # but nothing wrote the list until a restart.
    path = write_config(tmp_path, enabled="false", snapshot_interval="100ms")
    d = await start(path)
    warm_list = tmp_path / "state" / "warm.msgpack"
    try:
        await fill(d, "ns", KEYS[:4])
        write_config(tmp_path, enabled="true", snapshot_interval="100ms")
        assert (await d.reload())["applied"] == ["warmup.enabled"]
        await until(warm_list.exists)
        write_config(tmp_path, enabled="true", snapshot_interval="0")
        assert (await d.reload())["applied"] == ["warmup.snapshot_interval"]
        # A snapshot that was writing the list when the reload stopped them ends its write (warmup.save: a
        # temporary file renamed over the list); no other may start.
        await until(lambda: not any(warm_list.parent.glob(".warm.*")))
        mtime = warm_list.stat().st_mtime_ns
        await asyncio.sleep(0.3)  # three snapshot intervals: none writes the list
        assert warm_list.stat().st_mtime_ns == mtime
    finally:
        await stop(d)


async def test_a_warm_list_cut_keeps_each_page_size_its_share(tmp_path):
    # Regression: the classes' LRU lists were joined one after the other, so a full pool's list (cut at
    # warmup.max_fraction) dropped the pages of the last class, however recently they were used.
    path = write_config(tmp_path)
    with open(path, "a") as f:
        f.write("max_fraction = 0.4\n")  # [warmup] is the last section
    d = await start(path)
    a = [f"a{i:063x}" for i in range(150)]  # 64 KiB pages
    b = [f"b{i:063x}" for i in range(256)]  # 4 KiB pages
    await fill(d, "model-a", a, page_bytes=64 << 10)
    await fill(d, "model-b", b)
    await stop(d)
    listed = load(str(tmp_path / "state" / "warm.msgpack"))
    kept = {ns: sum(p.ns == ns for p in listed) / n for ns, n in (("model-a", 150), ("model-b", 256))}
    assert 0.3 < kept["model-a"] < 1 and 0.3 < kept["model-b"] < 1  # the list was cut, in both
    assert abs(kept["model-a"] - kept["model-b"]) < 0.1
