"""`touch`: the pages an engine names become L2's most recently used, and eviction follows that use; nothing
is leased, read from L3 or copied."""

from __future__ import annotations

from tiers_rig import close_tiers, make_tiers, session, write


async def test_touched_pages_survive_the_eviction_that_takes_the_untouched(tmp_path):
    t = await make_tiers(tmp_path, connector=None, backend="none")  # 128 slots of 64 KiB, nothing dirty
    try:
        s = session(t)
        keys = [f"k{i}" for i in range(128)]
        assert all(write(t, s, keys))
        # The oldest ten are touched (with a key that is not there, and one asked twice).
        assert t.touch(s, [*keys[:10], "absent", keys[0]]) == 11
        assert all(write(t, s, [f"new{i}" for i in range(10)]))
        here = [t.index.get("ns1", k) is not None for k in keys]
        assert here[:10] == [True] * 10  # touched: now the most recently used
        assert here[10:20] == [False] * 10  # the least recently used after the touch: evicted
        assert all(here[20:])
        assert t.counters["touch.pages"] == 11
    finally:
        await close_tiers(t)


async def test_touch_counts_only_its_namespace_and_leases_nothing(tmp_path):
    t = await make_tiers(tmp_path, connector=None, backend="none")
    try:
        s, other = session(t), session(t, "ns2")
        write(t, s, ["a", "b"])
        assert t.touch(other, ["a", "b"]) == 0
        assert t.touch(s, ["a", "b"]) == 2
        assert all(t.index.get("ns1", k).leases == 0 and t.index.get("ns1", k).in_lru for k in "ab")
        assert not s.leases
    finally:
        await close_tiers(t)


async def test_touch_reads_nothing_from_l3(tmp_path):
    t = await make_tiers(tmp_path)
    try:
        s = session(t)
        write(t, s, ["x"])
        assert await t.flush(30)  # in L3 too
        t.index.remove(t.index.get("ns1", "x"))  # gone from L2: only L3 holds it
        assert t.touch(s, ["x"]) == 0
        assert t.index.get("ns1", "x") is None  # not fetched
        assert t.counters["lookup.l3_hits"] == 0 and t.counters["prefetch.pages"] == 0
    finally:
        await close_tiers(t)
