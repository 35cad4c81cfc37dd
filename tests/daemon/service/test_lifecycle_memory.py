"""Start-up against the memory left for the pool: waits for it (a previous daemon's pool still mapped by
engines), starts once it is there, gives up after pool.memory_wait, and stops when asked meanwhile."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest

import hicached.daemon.service.lifecycle as daemon_mod
from hicached import config
from hicached.daemon.service.lifecycle import Daemon

GiB = 1 << 30


def cfg(tmp_path, wait: str):
    return config.from_dict(
        {
            "server": {"socket": "run/d.sock"},
            "pool": {"capacity": "16MiB", "slab_size": "1MiB", "prefault": True, "memory_wait": wait},
            "storage": {"file": {"root": "data"}},
        },
        base_dir=str(tmp_path),
    )


def fake_memory(monkeypatch, left: list[int]) -> list[int]:
    """available_memory answers the figures in `left` in turn (the last one from then on)."""
    asked = []

    def available():
        asked.append(1)
        return (left[min(len(asked), len(left)) - 1], "MemAvailable in /proc/meminfo")

    monkeypatch.setattr(daemon_mod, "available_memory", available)
    return asked


async def test_start_waits_for_memory_then_goes_on(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hicached")
    asked = fake_memory(monkeypatch, [1 << 20, 1 << 20, GiB])  # short twice, then enough
    d = Daemon(cfg(tmp_path, "30s"))
    try:
        await d.startup()
        assert d.pool is not None and d.pool.size == 16 << 20
        assert len(asked) == 3
        assert "waiting up to 30s for memory" in caplog.text and "memory for the pool is free" in caplog.text
    finally:
        d.handle_signal(signal.SIGTERM)
        await d.shutdown()


async def test_start_gives_up_after_memory_wait(tmp_path, monkeypatch):
    fake_memory(monkeypatch, [1 << 20])
    d = Daemon(cfg(tmp_path, "1500ms"))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(RuntimeError, match=r"pool.capacity is 16.0MiB but only 1.0MiB .*waited 2s"):
        await d.startup()
    assert 1.4 < loop.time() - t0 < 30  # it waited, and not for ever
    assert d.pool is None
    await d.shutdown()


async def test_a_stop_while_waiting_for_memory_ends_the_wait(tmp_path, monkeypatch):
    fake_memory(monkeypatch, [1 << 20])
    d = Daemon(cfg(tmp_path, "1h"))
    start = asyncio.ensure_future(d.startup())
    await asyncio.sleep(0.3)
    assert not start.done()
    d.handle_signal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="stopped while waiting for memory"):
        await asyncio.wait_for(start, 10)
    await d.shutdown()
