"""Requests for the control-command fuzz test, without I/O: reload, backend (every action), drain, flush,
status and stats, with fields missing, of the wrong type, huge, unknown actions and names that are not
strings; and the damaged or changed configuration files that reloads meet meanwhile."""

from __future__ import annotations

import random
from typing import Any

from daemon_proc import merge, to_toml
from fuzz_requests import BAD_SCALARS

CONTROL_OPS = ["reload", "backend", "backend", "backend", "drain", "flush", "status", "stats"]
ACTIONS = ["show", "attach", "detach"]
NAMES = ["file", "redis", "s3", "none", "tape", "FILE", "file ", ""]


def _nested(depth: int) -> Any:
    out: Any = "deep"
    for i in range(depth):
        out = [out] if i % 2 else {"k": out}
    return out


# Values far past anything a field takes: a 1 MiB string (under server.max_frame), long lists and tables.
HUGE: list[Any] = [
    "x" * (1 << 20),
    "attach" * 50_000,
    list(range(100_000)),
    {f"k{i}": i for i in range(20_000)},
    b"\xff" * (1 << 20),
    _nested(60),
]


class ControlRequests:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def bad(self) -> Any:
        rng = self.rng
        return rng.choice(HUGE) if rng.random() < 0.15 else rng.choice(BAD_SCALARS)

    def template(self, op: str) -> dict:
        rng = self.rng
        r: dict[str, Any] = {"op": op}
        if op == "backend":
            if rng.random() < 0.9:
                r["action"] = rng.choice(ACTIONS + ["bogus", "ATTACH", "attach "])
            if rng.random() < 0.7:
                r["name"] = rng.choice(NAMES)
        elif op == "drain" and rng.random() < 0.7:
            r["cancel"] = rng.choice([True, False])
        return r

    def mutate(self, r: dict) -> dict:
        """A copy of `r` with a field missing, of the wrong type or huge, one added, or a wrong op name."""
        rng = self.rng
        r = dict(r)
        x = rng.random()
        fields = [k for k in r if k != "op"]
        if x < 0.2 and fields:
            del r[rng.choice(fields)]
        elif x < 0.55 and fields:
            r[rng.choice(fields)] = self.bad()
        elif x < 0.85:
            r[rng.choice(["action", "name", "cancel", "timeout", "path", "config", "extra"])] = self.bad()
        else:
            r["op"] = rng.choice([self.bad(), "RELOAD", "reload ", "backend\x00", "drain_", "__init__"])
        return r

    def any(self) -> dict:
        r = self.template(self.rng.choice(CONTROL_OPS))
        return self.mutate(r) if self.rng.random() < 0.6 else r


def config_variants(good: dict[str, Any]) -> dict[str, bytes | None]:
    """What a reload may find in the file: the good configuration, live changes to it, and damaged files
    (None: a directory in the file's place)."""
    storage = good["storage"]
    no_redis = {k: v for k, v in storage.items() if k != "redis"}
    return {
        "good": to_toml(good).encode(),
        "live change": to_toml(merge(good, {"storage": {"backup_concurrency": 2}})).encode(),
        "no backend": to_toml(merge(good, {"storage": {"backend": "none"}})).encode(),
        "redis without its section": to_toml({**good, "storage": {**no_redis, "backend": "redis"}}).encode(),
        "redis down": to_toml(merge(good, {"storage": {"backend": "redis"}})).encode(),
        "empty": b"",
        "white space": b"\n \t \n",
        "not utf-8": b"\xff\xfe" + to_toml(good).encode(),
        "toml error": b"[pool\n",
        "schema error": to_toml(merge(good, {"pool": {"capacity": "lots"}})).encode(),
        "directory": None,
    }
