"""The counters declared in hicached.common.counters are the ones the code counts: every key written where a
counter is bumped or read (`counters["x"] += n`, `counters[f"x.{reason}"]`, `counters.get("x")`, an
EveryMinute's key) is declared, and every declaration is counted somewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hicached.common.counters import (
    BACKEND,
    COUNTERS,
    DAEMON,
    EVENTS,
    METRICS,
    POOL,
    REGIONS,
    WHERE,
    Counted,
    declared,
)

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("hicached", "connectors", "config")
HOLE = "\x00"  # a part of a key the code fills in at run time (an f-string's {...})

# Where a key written in these modules is counted, unless the expression before `.counters` says otherwise.
MODULE_WHERE = (
    ("connectors/", BACKEND),
    ("hicached/daemon/l2/index.py", POOL),
    ("hicached/daemon/regions/", REGIONS),
)
RECEIVER_WHERE = (("connector", BACKEND), ("index", POOL), ("idx", POOL), ("regions", REGIONS))
# Modules that subscript a counter with a key they were handed: the key is checked where it is handed
# (EveryMinute(counters, "backup.lost", ...)).
INDIRECT = {"hicached/daemon/sched/reports.py"}


def _is_counters(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "counters") or (
        isinstance(node, ast.Attribute) and node.attr == "counters"
    )


def _where(rel: str, receiver: ast.expr) -> str:
    text = ast.unparse(receiver)
    for word, where in RECEIVER_WHERE:
        if word in text.removesuffix("counters"):
            return where
    return next((where for prefix, where in MODULE_WHERE if rel.startswith(prefix)), DAEMON)


def _loop_values(tree: ast.AST) -> dict[str, list[str]]:
    """Names bound by `for name in ("a", "b", ...)`: the keys they take."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, ast.Tuple | ast.List)
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)
        ):
            out.setdefault(node.target.id, []).extend(e.value for e in node.iter.elts)
    return out


def _keys(node: ast.expr, loops: dict[str, list[str]]) -> list[str] | None:
    """The keys an expression can be, HOLE for a part filled in at run time; None when it cannot tell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [
            "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)  # type: ignore[misc]
        ]
    if isinstance(node, ast.IfExp):
        body, orelse = _keys(node.body, loops), _keys(node.orelse, loops)
        return None if body is None or orelse is None else body + orelse
    if isinstance(node, ast.Name) and node.id in loops:
        return loops[node.id]
    return None


def scan(root: Path = REPO) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(where, key, file:line) of every key counted in the sources, and the places it could not tell."""
    found, unknown = [], []
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), rel)
            loops = _loop_values(tree)
            for node in ast.walk(tree):
                receiver, key = None, None
                if isinstance(node, ast.Subscript) and _is_counters(node.value):
                    receiver, key = node.value, node.slice
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and _is_counters(node.func.value)
                    and node.args
                ):
                    receiver, key = node.func.value, node.args[0]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "EveryMinute"
                    and len(node.args) >= 2
                ):
                    receiver, key = node.args[0], node.args[1]
                if receiver is None:
                    continue
                place = f"{rel}:{node.lineno}"
                keys = _keys(key, loops)
                if keys is None:
                    if rel not in INDIRECT:
                        unknown.append(f"{place}: {ast.unparse(node)}")
                    continue
                found += [(_where(rel, receiver), k, place) for k in keys]
    return found, unknown


def _loose(c: Counted) -> re.Pattern[str]:
    """`c`'s keys as a use with holes may write them: any part any word, or a hole."""
    return re.compile("[^.]+".join(map(re.escape, re.split(r"\{\w+\}", c.name))))


def matches(where: str, key: str) -> list[Counted]:
    """The declarations a key written in the code stands for."""
    if HOLE not in key:
        c = declared(where, key)
        return [] if c is None else [c]
    return [c for c in COUNTERS if c.where == where and c.parts and _loose(c).fullmatch(key)]


@pytest.fixture(scope="module")
def uses() -> list[tuple[str, str, str]]:
    found, unknown = scan()
    assert not unknown, (
        "counter keys the scan cannot read (write them as literals or f-strings):\n  " + "\n  ".join(unknown)
    )
    return found


def test_the_scan_finds_the_counters_it_should(uses: list[tuple[str, str, str]]) -> None:
    seen = {(where, key) for where, key, _ in uses}
    assert (DAEMON, "backup.lost") in seen  # an EveryMinute's key
    assert (DAEMON, f"backup.errors.{HOLE}") in seen  # an f-string
    assert (DAEMON, "store.no_space") in seen  # one side of a conditional expression
    assert (BACKEND, "deletes") in seen  # a loop over literals (the file backend's probe)
    assert (POOL, "evictions") in seen and (BACKEND, "evictions") in seen
    assert (REGIONS, f"attached.{HOLE}") in seen


def test_every_counter_counted_is_declared(uses: list[tuple[str, str, str]]) -> None:
    undeclared = [
        f"{place}: {where} {key.replace(HOLE, '{…}')}"
        for where, key, place in uses
        if not matches(where, key)
    ]
    assert not undeclared, "counted but not declared in hicached/common/counters.py:\n  " + "\n  ".join(
        undeclared
    )


def test_every_declared_counter_is_counted(uses: list[tuple[str, str, str]]) -> None:
    used = {id(c) for where, key, _ in uses for c in matches(where, key)}
    unused = [f"{c.where} {c.name}" for c in COUNTERS if id(c) not in used]
    assert not unused, "declared in hicached/common/counters.py but counted nowhere:\n  " + "\n  ".join(
        unused
    )


def test_declarations_are_whole() -> None:
    names = [(c.where, c.name) for c in COUNTERS]
    assert len(names) == len(set(names)), "a counter declared twice"
    for c in COUNTERS:
        assert c.where in WHERE and c.help and not c.help.endswith("."), c
        assert set(c.values) <= set(c.parts), c
        assert c.metric != EVENTS, c  # a daemon counter without a family of its own is in it already
        if c.metric is None:
            assert not c.labels, c
            continue
        m = METRICS[c.metric]
        assert m.kind == c.kind == "counter" and set(c.labels) == set(m.labels), c
        for value in c.labels.values():
            assert not value.startswith("{") or value[1:-1] in c.parts, c
    metrics = {c.metric for c in COUNTERS if c.metric} | {EVENTS}
    assert {m.name for m in METRICS.values() if m.kind == "counter"} - metrics <= {"hicached_reloads"}


def test_a_key_finds_its_declaration() -> None:
    assert declared(DAEMON, "backup.errors.ENOSPC").name == "backup.errors.{reason}"
    assert declared(BACKEND, "misfit.length").name == "misfit.{reason}"
    assert declared(BACKEND, "misfit.other") is None  # reasons of a fixed set
    assert declared(REGIONS, "attached.fence").name == "attached.fence"
    assert declared(DAEMON, "backend.failures.redis.stalled").labels == {
        "backend": "{backend}",
        "reason": "{reason}",
    }
    assert (
        declared(DAEMON, "evictions") is None and declared(POOL, "evictions").metric == "hicached_evictions"
    )


def test_an_undeclared_counter_fails_the_scan(tmp_path: Path) -> None:
    (tmp_path / "connectors").mkdir()
    (tmp_path / "connectors" / "x.py").write_text(
        'self.counters["puts"] += 1\nself.counters["invented"] += 1\nself.counters[f"misfit.{r}"] += 1\n'
        'self.counters["misfit.other"] += 1\nself.counters[key] += 1\n'
    )
    found, unknown = scan(tmp_path)
    assert [k for w, k, _ in found if not matches(w, k)] == ["invented", "misfit.other"]
    assert [k for w, k, _ in found if matches(w, k)] == ["puts", f"misfit.{HOLE}"]
    assert unknown == ["connectors/x.py:5: self.counters[key]"]
