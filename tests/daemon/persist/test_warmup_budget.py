"""warmup.max_fraction applies within each tenant's pool: the warm list's Budget bounds the pages of each
arena by its own share, so one tenant's many pages never crowd another's out of the list."""

from __future__ import annotations

from hicached.daemon.persist.warmup import Budget, WarmPage, merge

PAGE = 4096


def pages(ns: str, n: int, pinned: bool = False) -> list[WarmPage]:
    return [WarmPage(ns, f"{i:064x}", PAGE, pinned) for i in range(n)]


def test_one_bound_cuts_the_list_where_it_is_passed():
    b = Budget(3 * PAGE)
    assert [b.take("x", PAGE) for _ in range(5)] == [True, True, True, False, False]
    assert b.full


def test_each_arena_is_bounded_by_its_own_share():
    arena = {"a.m": 0, "b.m": 1}.__getitem__
    b = Budget([2 * PAGE, 3 * PAGE], arena)
    got = [(ns, b.take(ns, PAGE)) for ns in ["a.m"] * 4 + ["b.m"] * 4]
    assert [ns for ns, ok in got if ok] == ["a.m"] * 2 + ["b.m"] * 3  # a's full pool does not stop b
    assert b.full


def test_merge_keeps_each_tenants_share():
    arena = lambda ns: 0 if ns.startswith("a.") else 1  # noqa: E731
    first = pages("a.m", 10) + pages("b.m", 2)  # a's pages come first and are many
    out = merge(first, pages("b.old", 5), Budget([4 * PAGE, 4 * PAGE], arena))
    assert sum(p.ns == "a.m" for p in out) == 4
    assert sum(p.ns.startswith("b.") for p in out) == 4  # b's 2 and 2 of its pending list


def test_a_namespace_no_arena_holds_takes_nothing():
    b = Budget([PAGE, PAGE], lambda ns: -1)
    assert not b.take("elsewhere", PAGE) and not b.full
