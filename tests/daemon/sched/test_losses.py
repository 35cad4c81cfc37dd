"""Pages lost (issue #21, point 5): acknowledged, owed to L3, gone from L2 before reaching it. Counted once
(backup.lost), logged at most once a minute, and answered by a flush (`lost` since the previous answer).
Tiers in-process over a real pool and the real file connector, with refusals injected in front of it."""

from __future__ import annotations

import logging

import pytest
import tiers_rig as rig
from hicached.connectors.file import FileConnector
from tiers_rig import PAGE, close_tiers, session

from hicached.common.protocol import ALLOC_PRESENT, ALLOC_WRITE, PUT_PRESENT
from hicached.daemon.sched import reports as reports_mod
from hicached.daemon.sched.tiers import Session, Tiers

BAD = "lost.ns"  # the namespace whose pages the connector refuses


def cfg_for(tmp_path, **storage):
    return rig.cfg_for(tmp_path, "4MiB", 2, **storage)


class RefusingFile(FileConnector):
    """The real file connector on a disk that is full for one namespace: while `full`, every page of BAD is
    refused (as ENOSPC is), without the call failing (so the breaker stays closed)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.full = True

    async def put(self, namespace, keys, payloads, checksums=None, hold=None):
        if self.full and namespace == BAD:
            return [False] * len(keys)
        return await super().put(namespace, keys, payloads, checksums, hold)


async def make_tiers(tmp_path, connector=None, **storage) -> Tiers:
    return await rig.make_tiers(tmp_path, connector, "4MiB", 2, **storage)


def write(t: Tiers, s: Session, keys: list[str]) -> list[int]:
    """alloc, copy, commit: the client's store. Returns the alloc statuses."""
    status, offsets = t.alloc(s, keys)
    done = []
    for k, st, off in zip(keys, status, offsets, strict=True):
        if st == ALLOC_WRITE:
            t.pool.view[off : off + PAGE] = bytes([len(k)]) * PAGE
            done.append(k)
    assert t.commit(s, done) == [True] * len(done)
    return status


async def push_out(t: Tiers, ns: str, n: int) -> None:
    """Stores `n` new pages of `ns` (written to L3 as they go), a few at a time: a full pool evicts the
    least recently used pages to take them in."""
    s = session(t, ns)
    for start in range(0, n, 8):
        keys = [f"k{i}" for i in range(start, min(n, start + 8))]
        assert ALLOC_WRITE in write(t, s, keys)
        t.backup.submit_many(list(t.index.dirty.values()))  # at once under write-back too
        assert await t.backup.drain(10)  # written: evictable from now on


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_pages_given_up_then_evicted_are_lost_once_and_flush_reports_them_once(tmp_path, policy):
    refusing = RefusingFile(cfg_for(tmp_path))
    t = await make_tiers(tmp_path, refusing, write_policy=policy)
    try:
        write(t, session(t, BAD), ["a", "b", "c"])
        assert not await t.flush_dirty(10)  # the disk refuses them: given up
        assert t.counters["backup.failed"] == 3 and t.counters["backup.lost"] == 0
        answer = await t.flush(10)
        assert answer == {
            "flushed": False,
            "backup_pending": 0,
            "not_in_l3": 3,
            "lost": 0,
            "dropped": 0,
        }  # at risk
        await push_out(t, "ok.ns", 80)  # a pool of 64 pages: the given-up ones go first
        assert all(t.index.get(BAD, k) is None for k in "abc")
        assert t.counters["backup.lost"] == 3 and not t.life.given_up
        answer = await t.flush(10)
        assert answer == {"flushed": False, "backup_pending": 0, "not_in_l3": 0, "lost": 3, "dropped": 0}
        # Reported once: the next flush answers what was lost since.
        assert await t.flush(10) == {
            "flushed": True,
            "backup_pending": 0,
            "not_in_l3": 0,
            "lost": 0,
            "dropped": 0,
        }
        assert t.counters["backup.lost"] == 3
    finally:
        await close_tiers(t)


async def test_a_page_stored_again_before_it_left_is_written_and_not_lost(tmp_path):
    refusing = RefusingFile(cfg_for(tmp_path))
    t = await make_tiers(tmp_path, refusing)
    try:
        s = session(t, BAD)
        write(t, s, ["a", "b"])
        assert not await t.flush_dirty(10)
        assert t.counters["backup.failed"] == 2 and t.not_in_l3() == 2
        refusing.full = False  # space freed; the engines store the same pages again
        assert write(t, s, ["a"]) == [ALLOC_PRESENT]
        [offset], _ = t.reserve(s, 1)
        assert t.put(s, ["b"], [offset]) == [PUT_PRESENT]
        assert await t.backup.drain(10)
        assert t.counters["backup.pages"] == 2 and t.not_in_l3() == 0
        assert all(t.index.get(BAD, k).in_l3 for k in "ab")
        await push_out(t, "ok.ns", 80)
        assert all(t.index.get(BAD, k) is None for k in "ab")
        assert t.counters["backup.lost"] == 0
        assert (await t.flush(10))["flushed"]
    finally:
        await close_tiers(t)


async def test_dirty_pages_of_a_detached_backend_are_lost_only_if_evicted_before_it_returns(tmp_path):
    t = await make_tiers(tmp_path, FileConnector(cfg_for(tmp_path)), write_policy="write_back")
    try:
        s = session(t, "ns1")
        write(t, s, ["a", "b", "c", "d"])  # write-back: held in L2, not written yet
        await t.backend.attach(None)  # detached (as by ctl, or an open breaker)
        assert t.index.stats()["dirty"] == 0 and t.stranded and t.not_in_l3() == 4
        # At risk, not lost yet: no backend to write them to, and flushed must not be claimed for them.
        assert await t.flush(10) == {
            "flushed": False,
            "backup_pending": 0,
            "not_in_l3": 4,
            "lost": 0,
            "dropped": 0,
        }
        write(t, s, ["e"])  # stored while none is attached: owed to the configured backend too
        assert t.not_in_l3() == 5
        await push_out(t, "ns2", 80)  # evicts the oldest: a..e first
        assert all(t.index.get("ns1", k) is None for k in "abcde")
        evicted = t.index.counters["evictions"]
        assert t.counters["backup.lost"] == evicted >= 5  # every page evicted was owed to L3
        answer = await t.flush(10)
        assert answer["lost"] == evicted and not answer["flushed"]
        # The backend returns: the pages still in L2 are written, and are not lost when they leave.
        await t.backend.attach(FileConnector(cfg_for(tmp_path)), probe=False)
        assert await t.flush(10) == {
            "flushed": True,
            "backup_pending": 0,
            "not_in_l3": 0,
            "lost": 0,
            "dropped": 0,
        }
        await push_out(t, "ns3", 80)
        assert t.counters["backup.lost"] == evicted
    finally:
        await close_tiers(t)


async def test_flush_with_no_backend_attached(tmp_path):
    refusing = RefusingFile(cfg_for(tmp_path))
    t = await make_tiers(tmp_path, refusing)
    try:
        write(t, session(t, BAD), ["a", "b"])
        assert not await t.flush_dirty(10)  # given up
        await t.backend.attach(None)
        # Given up, then detached: still at risk, and a flush with no backend says so (it used to answer
        # flushed: true whenever nothing was dirty, which a detach makes so).
        assert await t.flush(10) == {
            "flushed": False,
            "backup_pending": 0,
            "not_in_l3": 2,
            "lost": 0,
            "dropped": 0,
        }
    finally:
        await close_tiers(t)


async def test_l2_only_by_configuration_owes_nothing_to_l3(tmp_path):
    t = await make_tiers(tmp_path, None, backend="none")
    try:
        write(t, session(t, "ns1"), ["a", "b"])
        await push_out(t, "ns2", 80)
        assert t.index.counters["evictions"] > 0 and t.counters["backup.lost"] == 0
        assert await t.flush(10) == {
            "flushed": True,
            "backup_pending": 0,
            "not_in_l3": 0,
            "lost": 0,
            "dropped": 0,
        }
    finally:
        await close_tiers(t)


async def test_losses_are_logged_at_most_once_a_minute_with_the_figure(tmp_path, monkeypatch, caplog):
    clock = [1000.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    monkeypatch.setattr(reports_mod, "time", Time)
    t = await make_tiers(tmp_path, None)  # storage.backend = "file", none attached: stores are owed to it
    try:
        s = session(t, "ns1")
        write(t, s, ["a", "b", "c"])
        caplog.set_level(logging.ERROR, logger="hicached.tiers")

        def evict(key: str) -> None:
            t.index.remove(t.index.get("ns1", key))

        evict("a")
        clock[0] += 30
        evict("b")  # within the minute: counted, not logged
        clock[0] += 31
        evict("c")
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2, lines
        assert lines[0].startswith("lost 1 acknowledged pages since start") and "1 in all" in lines[0]
        assert (
            lines[1].startswith("lost 2 acknowledged pages since the last report") and "3 in all" in lines[1]
        )
        assert t.counters["backup.lost"] == 3
    finally:
        await close_tiers(t)
