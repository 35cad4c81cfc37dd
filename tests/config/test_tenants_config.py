"""[tenants.NAME]: what the loader refuses, with the key it names, and what a reload may change."""

from __future__ import annotations

import copy
import pathlib
import tomllib

import pytest
from hicached.config import ConfigError, from_dict
from hicached.config.diff import plan
from hicached.config.tenants import NAMESPACE_MAX_LEN as PATTERN_MAX_LEN
from hicached.config.tenants import default_capacity, overlap, valid_pattern

from hicached.common.keys import NAMESPACE_MAX_LEN, valid_namespace

BASE = {"server": {"socket": "run/main.sock"}, "pool": {"capacity": "64MiB", "slab_size": "1MiB"}}
BASE["storage"] = {"backend": "none"}


def tenant(**over):
    return {"uids": [1001], "namespaces": ["a.*"], "capacity": "8MiB", **over}


def load(tenants: dict):
    return from_dict({**copy.deepcopy(BASE), "tenants": tenants}, "/etc/hicached")


def test_a_tenant_table_loads():
    cfg = load({"a": tenant(socket="run/a.sock", gids=[5]), "b": tenant(uids=[], gids=[7], namespaces=["b"])})
    assert cfg.tenants["a"].capacity == 8 << 20 and cfg.tenants["a"].socket == "run/a.sock"
    assert cfg.tenants["b"].gids == [7] and default_capacity(cfg) == 48 << 20
    assert load({}).tenants == {}


@pytest.mark.parametrize(
    ("tenants", "key", "words"),
    [
        (
            {"a": tenant(), "b": tenant(namespaces=["a.x"])},
            "tenants.b.namespaces[0]",
            "overlaps 'a.*' of tenant 'a'",
        ),
        (
            {"a": tenant(namespaces=["x"]), "b": tenant(namespaces=["x"])},
            "tenants.b.namespaces[0]",
            "overlaps",
        ),
        (
            {"a": tenant(namespaces=["ab*"]), "b": tenant(namespaces=["a*"])},
            "tenants.b.namespaces[0]",
            "overlaps",
        ),
        (
            {"a": tenant(namespaces=["a*"]), "b": tenant(namespaces=["ab.*"])},
            "tenants.b.namespaces[0]",
            "overlaps",
        ),
        (
            {"a": tenant(capacity="40MiB"), "b": tenant(namespaces=["b"], capacity="32MiB")},
            "tenants",
            "more than pool.capacity",
        ),
        ({"default": tenant()}, "tenants.default", "choose another name"),
        ({"a.b": tenant()}, "tenants.a.b", "1 to 64 characters"),
        ({"x" * 65: tenant()}, "tenants." + "x" * 65, "1 to 64 characters"),
        ({"a": tenant(capacity=None)}, "tenants.a.capacity", "is required"),
        ({"a": tenant(capacity="0")}, "tenants.a.capacity", "is required and positive"),
        ({"a": tenant(capacity="512KiB")}, "tenants.a.capacity", "at least one slab"),
        ({"a": tenant(capacity="1536KiB")}, "tenants.a.capacity", "not a whole number of slabs of 1MiB"),
        ({"a": tenant(namespaces=["a*b"])}, "tenants.a.namespaces[0]", "neither a namespace"),
        ({"a": tenant(namespaces=["a/b"])}, "tenants.a.namespaces[0]", "neither a namespace"),
        ({"a": tenant(namespaces=[".."])}, "tenants.a.namespaces[0]", "neither a namespace"),
        ({"a": tenant(namespaces=[])}, "tenants.a.namespaces", "must list"),
        ({"a": tenant(uids=[])}, "tenants.a", "has no members"),
        ({"a": tenant(uids=[-1])}, "tenants.a.uids[0]", "cannot be negative"),
        ({"a": tenant(socket="run/main.sock")}, "tenants.a.socket", "is server.socket"),
        ({"a": tenant(socket="/etc/hicached/run/main.sock")}, "tenants.a.socket", "is server.socket"),
        (
            {"a": tenant(socket="s"), "b": tenant(namespaces=["b"], socket="./s")},
            "tenants.b.socket",
            "also tenant 'a''s socket",
        ),
        ({"a": tenant(colour="red")}, "tenants.a.colour", "unknown key"),
        ({"a": 3}, "tenants.a", "expected a table"),
    ],
)
def test_refused(tenants, key, words):
    for t in tenants.values():
        if isinstance(t, dict) and t.get("capacity") is None:
            t.pop("capacity", None)
    with pytest.raises(ConfigError) as e:
        load(tenants)
    assert e.value.path == key and words in e.value.message, str(e.value)


def test_patterns():
    assert valid_pattern("team-a.*") and valid_pattern("*") and valid_pattern("x") and not valid_pattern("")
    assert not valid_pattern("a**") and not valid_pattern("*a") and not valid_pattern("a" * 129)
    assert overlap("a.*", "a.b") and overlap("a.b", "a.*") and overlap("*", "z") and overlap("a*", "ab*")
    assert not overlap("a.*", "a") and not overlap("a.b", "a.c") and not overlap("a.*", "b.*")


def test_the_pattern_charset_is_the_namespace_charset():
    assert PATTERN_MAX_LEN == NAMESPACE_MAX_LEN
    for ns in ("a", "A-z_0.9", "x" * 128, "x" * 129, "a b", "a/b", "é", ".", "..", "a*", ""):
        assert valid_pattern(ns) == valid_namespace(ns) or ns.endswith("*"), ns


def test_a_reload_applies_members_and_namespaces_and_keeps_sockets_capacities_and_the_set():
    old = load({"a": tenant(socket="run/a.sock"), "gone": tenant(namespaces=["g"])})
    new = load(
        {
            "a": tenant(uids=[1002], gids=[9], namespaces=["a.x"], socket="run/b.sock", capacity="16MiB"),
            "added": tenant(namespaces=["n"]),
        }
    )
    p = plan(old, new)
    assert p.live == ["tenants.a.gids", "tenants.a.namespaces", "tenants.a.uids"]
    assert p.restart == ["tenants.a.capacity", "tenants.a.socket", "tenants.added", "tenants.gone"]
    a = p.config.tenants["a"]
    assert (a.uids, a.gids, a.namespaces) == ([1002], [9], ["a.x"])
    assert (a.socket, a.capacity) == ("run/a.sock", 8 << 20)
    assert sorted(p.config.tenants) == ["a", "gone"]


def test_a_reload_whose_kept_tenant_overlaps_a_changed_one_is_refused():
    old = load({"a": tenant(), "b": tenant(namespaces=["b.*"])})
    new = load({"b": tenant(namespaces=["a.x"])})  # b takes a namespace of a, whose removal waits a restart
    with pytest.raises(ConfigError, match="overlaps"):
        plan(old, new)


def test_the_system_configurations_tenant_example_loads_once_uncommented():
    text = (pathlib.Path(__file__).parents[2] / "config" / "hicached.toml").read_text()
    start = text.index("# [tenants.team-a]")
    example = "\n".join(line.removeprefix("# ") for line in text[start:].splitlines())
    cfg = from_dict(tomllib.loads(text[:start] + example), "/etc/hicached")
    assert cfg.tenants["team-a"].namespaces == ["team-a.*"] and cfg.tenants["team-a"].capacity == 16 << 30
