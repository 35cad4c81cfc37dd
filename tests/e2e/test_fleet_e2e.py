"""Nodes of a fleet (DESIGN.md): each runs its own daemon with its own L2, and they share one L3. Real daemons
(subprocesses) on each real store: the file backend's root, a redis-server, a Redis Cluster, moto's S3
(tests/support/page_life.py). What one node stores and flushes, another finds and loads with its exact bytes;
a miss is never remembered past a store of another node; nodes storing and loading the same keys at once
never hand out a wrong byte; and pages acknowledged on any node survive restarts of every node, one after
the other under load or all at once."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from daemon_proc import DaemonProcess
from page_life import L3, loadable, open_l3, wait_for

from hicached import Client, HicachedError
from hicached.common.errors import CONNECTION, DRAINING

PAGE = 16 << 10
BATCH = 8
# A client that finds its daemon restarting waits this long for the next one (a restart takes about a second).
RECONNECT_S = 30.0


def page_of(key: str) -> bytes:
    """The bytes of every page stored under `key`, on any node: a wrong byte anywhere (another key's page,
    a shifted or torn copy) differs from them."""
    return random.Random(key).randbytes(PAGE)


def keys_of(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def wrong_in(keys: list[str], got: list[bytes | bytearray]) -> int:
    """How many of the pages loaded for the leading `keys` hold other bytes than their key's."""
    return sum(bytes(g) != page_of(k) for k, g in zip(keys, got, strict=False))


@pytest.fixture(scope="module", params=["file", "redis", "cluster", "s3"])
def l3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[L3]:
    """One store for every test of the module on it (each test in a namespace of its own): starting a
    cluster or moto for each would take most of the module's time."""
    with pytest.MonkeyPatch.context() as mp:
        tmp = tmp_path_factory.mktemp(f"l3-{request.param}")
        with open_l3(request.param, tmp, mp, holdable=False) as store:
            yield store


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return "fleet." + request.node.originalname.removeprefix("test_")[:40]


@pytest.fixture
def node(daemon_factory, l3: L3) -> Callable[..., DaemonProcess]:
    """node(name, write_policy="write_through"): a daemon of the fleet, started in tmp_path/name with an
    empty L2, on the shared L3."""

    def make(name: str, write_policy: str = "write_through") -> DaemonProcess:
        return daemon_factory(
            {"storage": {**l3.storage(direct=True), "write_policy": write_policy}}, name=name
        )

    return make


def store_all(d: DaemonProcess, ns: str, keys: list[str]) -> None:
    with Client(d.socket, ns, PAGE) as c:
        for i in range(0, len(keys), BATCH):
            batch = keys[i : i + BATCH]
            assert c.store(batch, [page_of(k) for k in batch]) == [True] * len(batch)
    assert d.ctl("flush")["flushed"]


def load_exact(c: Client, keys: list[str]) -> int:
    """How many leading `keys` the node loads; each of them checked to hold exactly its key's bytes."""
    buffers = [bytearray(PAGE) for _ in keys]
    n = c.load(keys, buffers)
    assert wrong_in(keys[:n], buffers[:n]) == 0
    return n


def test_pages_one_node_stores_load_on_another_with_their_bytes(node, ns: str, l3: L3) -> None:
    a, b = node("a"), node("b")
    ours, theirs = keys_of("from-a", 32), keys_of("from-b", 16)
    store_all(a, ns, ours)
    assert l3.keys(ns) == set(ours)
    with Client(b.socket, ns, PAGE) as c:
        assert c.stats()["pool"]["pages"] == 0  # nothing of A's in B's L2: what B finds, it finds in L3
        assert c.exists(ours) == len(ours)
        assert c.present(ours) == [True] * len(ours)
        assert load_exact(c, ours) == len(ours)
        assert c.stats()["pool"]["pages"] == len(ours)
    store_all(b, ns, theirs)  # and the other way
    with Client(a.socket, ns, PAGE) as c:
        assert c.exists(theirs) == len(theirs)
        got = c.get(theirs)
        assert len(got) == len(theirs) and wrong_in(theirs, got) == 0


def test_a_miss_is_not_remembered_past_another_nodes_store(node, ns: str) -> None:
    a, b = node("a"), node("b")
    keys = keys_of("later", 32)
    half = len(keys) // 2
    with Client(b.socket, ns, PAGE) as c:
        assert c.exists(keys) == 0
        assert c.present(keys) == [False] * len(keys)
        assert load_exact(c, keys) == 0
        assert c.get(keys) == []
        assert c.wait(c.prefetch(keys), timeout=30) == 0

        store_all(a, ns, keys[:half])
        assert c.exists(keys) == half
        assert c.present(keys) == [True] * half + [False] * (len(keys) - half)
        assert load_exact(c, keys) == half  # the first half now in B's L2; the rest missed a second time

        store_all(a, ns, keys[half:])
        assert c.exists(keys) == len(keys)
        assert c.wait(c.prefetch(keys), timeout=30) == len(keys)
        assert load_exact(c, keys) == len(keys)


class Traffic(threading.Thread):
    """One engine's traffic on a node: stores batches drawn from `keys` (the other engines draw from the
    same ones: the same key is stored on several nodes at once) and loads or gets random batches of
    `loads()`, checking every byte that comes back. Runs `rounds` rounds, or until `stop` is set; with
    `pace`, a round starts at most every `pace` seconds (a steady load, whatever the machine's speed)."""

    def __init__(
        self,
        socket: str,
        ns: str,
        seed: int,
        keys: Callable[[random.Random, int], list[str]],
        loads: Callable[[random.Random], list[str]],
        stop: threading.Event,
        rounds: int = 0,
        pace: float = 0.0,
    ) -> None:
        super().__init__(daemon=True)
        self.socket, self.ns, self.rng = socket, ns, random.Random(seed)
        self.keys, self.loads, self.stop, self.rounds, self.pace = keys, loads, stop, rounds, pace
        self.acked: set[str] = set()
        self.stored = self.loaded = self.wrong = self.reconnects = 0
        self.errors: dict[str, int] = {}
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.socket, self.ns, PAGE, timeout=30, reconnect=RECONNECT_S) as c:
                n = 0
                while not self.stop.is_set() and (not self.rounds or n < self.rounds):
                    start = time.monotonic()
                    self._round(c, n)
                    n += 1
                    self.stop.wait(self.pace - (time.monotonic() - start))
                self.reconnects = c.reconnects
        except BaseException as e:  # noqa: BLE001 - the test fails with it after join()
            self.failure = e

    def _round(self, c: Client, n: int) -> None:
        batch = self.keys(self.rng, n)
        try:
            ok = c.store(batch, [page_of(k) for k in batch])
            self.acked.update(k for k, good in zip(batch, ok, strict=True) if good)
            self.stored += sum(ok)
        except HicachedError as e:
            self.errors[e.code] = self.errors.get(e.code, 0) + 1
        wanted = self.loads(self.rng)
        try:
            if n % 2:
                got = c.get(wanted)
            else:
                got = [bytearray(PAGE) for _ in wanted]
                got = got[: c.load(wanted, got)]
        except HicachedError as e:
            self.errors[e.code] = self.errors.get(e.code, 0) + 1
            return
        self.wrong += wrong_in(wanted, got)
        self.loaded += len(got)


def run_all(traffic: list[Traffic]) -> None:
    for t in traffic:
        t.join(120)
        assert not t.is_alive(), "an engine's traffic did not end in 120 s"
        if t.failure is not None:
            raise t.failure


def test_nodes_storing_and_loading_the_same_keys_at_once(node, ns: str) -> None:
    a, b = node("a"), node("b")
    universe = keys_of("shared", 64)
    stop = threading.Event()

    def some(rng: random.Random, _n: int = 0) -> list[str]:
        return rng.sample(universe, BATCH)

    traffic = [
        Traffic(d.socket, ns, seed, some, some, stop, rounds=10) for seed, d in enumerate((a, b, a, b))
    ]
    for t in traffic:
        t.start()
    run_all(traffic)
    assert sum(t.wrong for t in traffic) == 0
    assert [t.errors for t in traffic] == [{}] * len(traffic)
    assert all(t.loaded for t in traffic)  # the checks saw bytes
    acked = {k: page_of(k) for t in traffic for k in t.acked}
    assert len(acked) >= len(universe) // 2

    assert a.ctl("flush")["flushed"] and b.ctl("flush")["flushed"]
    for d in (a, b):
        assert loadable(d.socket, ns, PAGE, acked) == (len(acked), 0)
    for d in (a, b):
        assert d.stop() == 0
    for d in (node("a2"), node("b2")):  # the whole fleet again, every L2 empty: L3 alone
        with Client(d.socket, ns, PAGE) as c:
            assert c.stats()["pool"]["pages"] == 0
        assert loadable(d.socket, ns, PAGE, acked) == (len(acked), 0)


def test_a_rolling_restart_under_load(node, ns: str, l3: L3) -> None:
    # A writes back: what it acknowledges reaches L3 only through the flush of its clean stop (B reads
    # A's pages after A's restart, from L3). B writes through: it stops with backups in flight.
    a, b = node("a", "write_back"), node("b")
    # Each round (one every 100 ms) stores 2 keys of the node's own, never stored again (what a node
    # acknowledged before its stop must have reached L3: nothing stores it anew afterwards), and 4 keys both
    # nodes store again and again (stored anew into an L2 that a restart emptied, while the other node
    # reads them from L3).
    shared = keys_of("shared", 32)
    acked: list[str] = []  # what any engine has had acknowledged: the loads draw from it
    lock = threading.Lock()
    stop = threading.Event()

    def stores(tag: str) -> Callable[[random.Random, int], list[str]]:
        def batch(rng: random.Random, n: int) -> list[str]:
            return keys_of(f"{tag}-{n}", 2) + rng.sample(shared, 4)

        return batch

    def loads(rng: random.Random) -> list[str]:
        with lock:
            return rng.sample(acked, min(BATCH, len(acked)))

    traffic = [
        Traffic(d.socket, ns, i, stores(d.workdir), loads, stop, pace=0.1) for i, d in enumerate((a, b))
    ]

    def progress() -> list[int]:
        with lock:
            acked[:] = sorted(set().union(*(t.acked for t in traffic)))
        return [t.stored for t in traffic]

    def storing_past(before: list[int], what: str) -> None:
        wait_for(lambda: all(now >= was + 24 for now, was in zip(progress(), before, strict=True)), what)

    for t in traffic:
        t.start()
    try:
        storing_past([0, 0], "both nodes' engines storing")
        for d in (a, b):
            before = progress()
            d.restart()  # a clean stop: it flushes what it acknowledged; then an empty L2
            storing_past(before, f"both nodes' engines storing again after {d.workdir} restarted")
    finally:
        stop.set()
        run_all(traffic)
    assert sum(t.wrong for t in traffic) == 0
    # A call in flight as a node stops may be refused (draining) or cut; none fails otherwise.
    assert set().union(*(t.errors for t in traffic)) <= {DRAINING, CONNECTION}, [t.errors for t in traffic]
    assert [t.reconnects for t in traffic] == [1, 1]  # each engine saw its node go and come back
    assert all(t.loaded for t in traffic)

    acked_pages = {k: page_of(k) for t in traffic for k in t.acked}
    assert a.ctl("flush")["flushed"] and b.ctl("flush")["flushed"]
    missing = acked_pages.keys() - l3.keys(ns)
    assert not missing, f"{len(missing)} of {len(acked_pages)} acknowledged pages are not in L3"
    for d in (a, b):  # what each node stored before its restart, it can only load from L3
        assert loadable(d.socket, ns, PAGE, acked_pages) == (len(acked_pages), 0)
