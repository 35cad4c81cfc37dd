"""Through the real daemon (a subprocess): `touch` keeps the pages an engine uses out of the eviction that
takes the others, bounded like every key list; `store_pages_copied` tells the pages copied from those the
daemon held already."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hicached.common.errors import HicachedError
from hicached.common.keys import page_keys
from hicached.engine.client import AsyncClient, Client, shared_buffer

PAGE = 64 * 1024
SMALL = {"pool": {"capacity": "8MiB", "slab_size": "1MiB"}, "storage": {"backend": "none"}}  # 128 pages


def keys_for(seed: int, n: int) -> list[str]:
    return page_keys([seed] * 16 + list(range(n * 16)), 16)[1:]


def test_touched_pages_survive_an_eviction_that_takes_the_untouched(daemon_factory):
    d = daemon_factory(SMALL)
    old, new = keys_for(1, 128), keys_for(2, 16)
    with Client(d.socket, "ns", PAGE) as c:
        assert all(c.store(old, [bytes([i % 256]) * PAGE for i in range(128)]))
        assert c.touch(old[:16] + keys_for(3, 2)) == 16  # the oldest 16, and two keys it does not hold
        assert all(c.store(new, [b"n" * PAGE] * 16))
        here = c.present(old)
        assert here[:16] == [True] * 16
        assert here[16:32] == [False] * 16  # the least recently used once the oldest were touched
        assert c.get(old[:1]) == [bytes([0]) * PAGE]  # touched, not changed
        assert c.touch([]) == 0


def test_touch_is_bounded_by_max_keys_per_request_and_answers_async(daemon_factory):
    d = daemon_factory({**SMALL, "server": {"max_keys_per_request": 64}})
    keys = keys_for(4, 65)
    with Client(d.socket, "ns", PAGE) as c:
        c.store(keys[:4], [b"k" * PAGE] * 4)
        with pytest.raises(HicachedError) as e:
            c.touch(keys)
        assert e.value.code == "bad_request"

    async def touch_async() -> int:
        async with AsyncClient(d.socket, "ns", PAGE) as ac:
            return await ac.touch(keys[:64])

    assert asyncio.run(touch_async()) == 4


def test_store_pages_copied_counts_only_pages_copied(daemon):
    src = shared_buffer(8 * PAGE, name="touch-e2e")
    src.copy_(torch.arange(8 * PAGE, dtype=torch.int64).to(torch.uint8))
    keys = keys_for(5, 8)
    with Client(daemon.socket, "ns", PAGE) as c:
        h = c.register_region(src, PAGE)
        assert c.store_pages_copied(h, range(4), keys[:4]) == ([True] * 4, 4)
        assert c.store_pages_copied(h, range(8), keys) == ([True] * 8, 4)  # the first four were held
        assert c.store_pages_copied(h, range(8), keys) == ([True] * 8, 0)
        assert c.store_pages(h, range(8), keys) == [True] * 8  # unchanged: a list of bool
        assert c.store_pages_copied(h, [], []) == ([], 0)
        c.unregister_region(h)
