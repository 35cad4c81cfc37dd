"""Nodes of a fleet share one L3 (DESIGN.md): a node whose engines use another page size for a namespace the
others use reads their pages as misses, and leaves them there. Regression (#29): it read them as corrupt and
deleted them, 0 of 48 surviving. Real daemons (subprocesses) on each real store: the file backend's root, a
redis-server, a Redis Cluster, moto's S3 (tests/support/page_life.py)."""

from __future__ import annotations

import random

import pytest
from page_life import loadable, open_l3

from hicached import Client, page_keys

NS = "fleet.shared"
PAGE = 16 << 10
OTHER_PAGE = 8 << 10  # the misconfigured node's engines
TOKENS = 16
N = 48


@pytest.fixture(params=["file", "redis", "cluster", "s3"])
def l3(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch):
    with open_l3(request.param, tmp_path, monkeypatch, holdable=False) as store:
        yield store


def test_a_node_with_another_page_size_leaves_the_others_pages_alone(daemon_factory, l3) -> None:
    rng = random.Random(29)
    keys = page_keys([rng.randrange(1 << 17) for _ in range(N * TOKENS)], TOKENS)
    pages = {k: rng.randbytes(PAGE) for k in keys}
    a = daemon_factory({"storage": l3.storage(direct=True)}, name="a")
    with Client(a.socket, NS, PAGE) as c:
        assert c.store(keys, list(pages.values())) == [True] * N
    assert a.ctl("flush")["flushed"]
    assert l3.keys(NS) == set(keys)

    b = daemon_factory({"storage": l3.storage(direct=True)}, name="b")
    with Client(b.socket, NS, OTHER_PAGE) as c:
        assert c.get(keys) == []  # not its pages: misses
        assert c.load(keys, [bytearray(OTHER_PAGE) for _ in keys]) == 0
    counters = b.ctl("stats")["backend_counters"]
    assert counters.get("misfit.length", 0) >= 1
    assert not any(k.startswith("corrupt.") for k in counters), counters
    assert l3.keys(NS) == set(keys)  # every page still there

    c_node = daemon_factory({"storage": l3.storage(direct=True)}, name="c")  # an empty L2: from L3 alone
    assert loadable(c_node.socket, NS, PAGE, pages) == (N, 0)
