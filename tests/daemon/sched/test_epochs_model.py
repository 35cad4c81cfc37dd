"""clear() across a fleet as a state machine (hypothesis): three Tiers in one process, each with its own pool
and its own real file connector on one root, driven through random stores, loads, clears and epoch reads
on random nodes.

A namespace's content changes only at a clear (a weight update under the same model name): the bytes of a
key stored by a node that knows g clears are page(key, g). The invariants:

- What a node serves, and every ready page in its L2, is of the generation it knows: once it has read an
  epoch (or cleared), no page of an earlier generation is served by it, from L2 or from L3.
- Once every node has read the latest epoch, every page stored under that generation by a node that knew it
  is loadable from every node with its exact bytes (flushed first: written through, nothing lost).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tiers_rig import PAGE, close_tiers, make_tiers

from hicached.common.protocol import ALLOC_WRITE
from hicached.daemon.l2.index import READY
from hicached.daemon.sched.tiers import Session, Tiers

NODES = 3
KEYS = [f"k{i}" for i in range(6)]
NS = "model"


def page(key: str, generation: int) -> bytes:
    unit = f"{key}:{generation}:".encode()
    return (unit * (PAGE // len(unit) + 1))[:PAGE]


class FleetClears(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="hicached-epochs-model-"))
        # The epochs are read when a rule says so (refresh), not by the timer.
        self.nodes: list[Tiers] = [self.run(make_tiers(self.dir, epoch_interval="1h")) for _ in range(NODES)]
        self.sessions: list[Session] = []
        for t in self.nodes:
            s = Session(peer="model")
            t.hello(s, NS, PAGE)
            self.sessions.append(s)
            self.run(t.epochs.stored(NS))  # the first read: no clear yet
        self.clears = 0  # clears made so far: the newest generation
        self.known = [0] * NODES  # the generation each node knows
        self.stored: set[str] = set()  # keys stored under the newest generation by a node that knew it

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            for t in self.nodes:
                self.run(close_tiers(t))
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _settled(self, t: Tiers) -> None:
        """The work a step started on `t`: its backups, and the forgetting of a clear it has just seen."""
        assert await t.backup.drain(10)
        tasks = [task for task in t.clears._tasks if task.get_name().startswith("hicached-cleared")]
        await asyncio.gather(*tasks)

    @rule(
        node=st.integers(0, NODES - 1),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    )
    def store(self, node: int, keys: list[str]) -> None:
        t, s, g = self.nodes[node], self.sessions[node], self.known[node]
        status, offsets = t.alloc(s, keys)
        written = [k for k, st_, off in zip(keys, status, offsets, strict=True) if st_ == ALLOC_WRITE]
        for k, st_, off in zip(keys, status, offsets, strict=True):
            if st_ == ALLOC_WRITE:
                t.pool.view[off : off + PAGE] = page(k, g)
        assert t.commit(s, written) == [True] * len(written)
        self.run(self._settled(t))
        if g == self.clears:
            self.stored.update(keys)

    @rule(
        node=st.integers(0, NODES - 1),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
    )
    def load(self, node: int, keys: list[str]) -> None:
        t, s = self.nodes[node], self.sessions[node]
        lease, offsets = self.run(t.acquire(s, keys, fetch=True))
        if not offsets:
            return
        try:
            for k, off in zip(keys, offsets, strict=False):
                assert bytes(t.pool.view[off : off + PAGE]) == page(k, self.known[node]), (node, k)
        finally:
            t.release(s, lease)

    @rule(node=st.integers(0, NODES - 1))
    def clear(self, node: int) -> None:
        t = self.nodes[node]
        out = self.run(t.clear(self.sessions[node]))
        assert out.get("error") is None and out["busy"] == 0, out
        self.clears += 1
        self.known[node] = self.clears
        self.stored.clear()

    @rule(node=st.integers(0, NODES - 1))
    def read_epochs(self, node: int) -> None:
        t = self.nodes[node]
        self.run(t.epochs.refresh())
        self.run(self._settled(t))
        self.known[node] = self.clears

    @rule()
    def every_node_reads_then_loads_all(self) -> None:
        for node in range(NODES):
            self.read_epochs(node)
        for node, t in enumerate(self.nodes):
            s = self.sessions[node]
            for k in sorted(self.stored):
                lease, offsets = self.run(t.acquire(s, [k], fetch=True))
                assert offsets, (node, k, "an acknowledged page of the current generation is not loadable")
                try:
                    assert bytes(t.pool.view[offsets[0] : offsets[0] + PAGE]) == page(k, self.clears)
                finally:
                    t.release(s, lease)

    @invariant()
    def l2_holds_only_the_generation_each_node_knows(self) -> None:
        for node, t in enumerate(self.nodes):
            for k, e in t.index.ns_entries(NS).items():
                if e.state == READY:
                    got = bytes(t.pool.view[e.offset : e.offset + PAGE])
                    assert got == page(k, self.known[node]), (node, k, got[:16])


TestFleetClears = FleetClears.TestCase
TestFleetClears.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
