"""Requests for the protocol fuzz test, without I/O: for every op a well-formed request whose fields are wrong
in many ways (wrong types, out of range, missing, someone else's offsets, leases, handles and regions)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgpack

FUZZ_PB = 8192  # page size of the fuzz connections' namespaces (twice that for the second connection)
NAN, INF = float("nan"), float("inf")

BAD_SCALARS: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, -0.0, NAN, INF, -INF,
    "", "x", "a" * 300, "é", b"", b"\x00" * 8, [], [1], [None], [[]], {}, {"a": 1},
    msgpack.ExtType(5, b"xy"), msgpack.Timestamp(0, 0),
]  # fmt: skip

OPS = [
    "hello", "exists", "present", "alloc", "commit", "abort", "reserve", "put", "acquire", "release",
    "prefetch", "wait", "pin", "unpin", "stats", "status", "region_attach", "region_detach", "store_pages",
    "load_pages", "backend", "flush", "touch", "bogus_op",
] + ["region_attach", "store_pages", "load_pages"] * 2  # fmt: skip


def past_int64_geometries() -> list[dict]:
    """Region geometries (8 pages of FUZZ_PB in 64 KiB, but for one number) whose strides, offsets, page
    counts or sizes pass int64 in the overlap test: each must be refused as a bad request."""
    half = FUZZ_PB // 2
    base = {"nbytes": FUZZ_PB * 8, "page_bytes": FUZZ_PB, "num_pages": 8}
    out = []
    for big in (2**40, 2**62, 2**63, 2**64 - 1):
        out.append({**base, "segments": [[0, half, big], [half, half, big - 1]]})
        out.append({**base, "segments": [[big, half, FUZZ_PB], [0, half, FUZZ_PB * 2]]})
        out.append({**base, "num_pages": big, "segments": [[0, half, FUZZ_PB], [half, half, FUZZ_PB * 2]]})
        out.append({**base, "nbytes": big, "segments": [[0, half, big // 16], [half, half, big // 8]]})
    return out


def hexkey(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


@dataclass
class Targets:
    """What one connection really holds, for requests that name it as their own or as someone else's."""

    page_bytes: int
    reserved: list[int] = field(default_factory=list)
    writing_keys: list[str] = field(default_factory=list)
    writing_offsets: list[int] = field(default_factory=list)
    lease: Any = None
    lease_offsets: list[int] = field(default_factory=list)
    handle: Any = None
    region: Any = None


class Requests:
    """Request generator for the connection whose targets are `mine`; `other` is another connection's."""

    def __init__(self, rng: random.Random, stored_keys: list[str], pool_bytes: int) -> None:
        self.rng = rng
        self.stored_keys = stored_keys  # keys the fuzz connections store for real, so lookups find pages
        self.pool_bytes = pool_bytes
        self.mine = Targets(FUZZ_PB)
        self.other = Targets(2 * FUZZ_PB)

    def any(self) -> dict:
        """A request for a random op, its fields mutated more often than not."""
        r = self.template(self.rng.choice(OPS))
        return self.mutate(r) if self.rng.random() < 0.6 else r

    def bad(self) -> Any:
        return self.rng.choice(BAD_SCALARS)

    def offset(self) -> Any:
        rng, mine, other = self.rng, self.mine, self.other
        choices = [
            lambda: rng.choice(mine.reserved or [0]),
            lambda: rng.choice(other.reserved or [0]),
            lambda: rng.choice(other.writing_offsets or [0]),
            lambda: rng.choice(other.lease_offsets or [0]),
            lambda: rng.choice(mine.reserved or [0]) + rng.choice([1, -1, 4096, FUZZ_PB // 2]),
            lambda: self.pool_bytes,
            lambda: self.pool_bytes + FUZZ_PB,
            lambda: -FUZZ_PB,
            lambda: 2**64 - 1,
            lambda: rng.randrange(0, self.pool_bytes),
            lambda: float(rng.choice(mine.reserved or [0])),
            lambda: True,
            lambda: str(rng.choice(mine.reserved or [0])),
            lambda: None,
        ]
        return rng.choice(choices)()

    def key(self) -> Any:
        rng = self.rng
        return rng.choice(
            [
                lambda: hexkey(rng),
                lambda: rng.choice(self.stored_keys),
                lambda: hexkey(rng).upper(),
                lambda: "g" * 64,
                lambda: "",
                lambda: "a" * 128,
                lambda: "a" * 129,
                lambda: "../" + "a" * 10,
                lambda: "ab/cd",
                lambda: "a b",
                lambda: "é" * 10,
                lambda: "\x00" * 5,
                lambda: hexkey(rng).encode(),
                self.bad,
            ]
        )()

    def keys(self) -> Any:
        rng = self.rng
        n = rng.choice([0, 1, 2, 3, 8, 65])
        kind = rng.random()
        if kind < 0.35:
            return [hexkey(rng) for _ in range(n)]
        if kind < 0.5:
            return rng.sample(self.stored_keys, min(n, len(self.stored_keys)))
        if kind < 0.6:
            return [rng.choice(self.stored_keys)] * max(2, n)  # the same key twice
        if kind < 0.62:
            return [hexkey(rng)] * 65537  # over max_keys_per_request
        if kind < 0.64:
            return [rng.choice(self.stored_keys)] * 2000
        if kind < 0.85:
            ks = [rng.choice(self.stored_keys) for _ in range(max(1, n))]
            ks[rng.randrange(len(ks))] = self.key()
            return ks
        return self.bad()

    def sums(self, n: int) -> Any:
        rng = self.rng
        return rng.choice(
            [
                lambda: [rng.getrandbits(64) for _ in range(n)],
                lambda: [0] * (n + 1),
                lambda: [0] * max(0, n - 1),
                lambda: [-1] * n,
                lambda: [2**64 - 1] * n,
                lambda: [1.0] * n,
                lambda: [True] * n,
                lambda: [None] * n,
                lambda: [[1]] * n,
                self.bad,
                lambda: None,
            ]
        )()

    def int_field(self, valid: Any) -> Any:
        return self.rng.choice([valid, self.bad(), -1, 0, 2**64 - 1, -(2**63), 2**63, 10**6, NAN, INF])

    def template(self, op: str) -> dict:
        """A request for `op` with plausible field names and values that are often wrong."""
        rng, mine, other = self.rng, self.mine, self.other
        keys = self.keys()
        n = len(keys) if isinstance(keys, list) else 1
        if op == "hello":
            namespace = rng.choice(["fz", "fz2", "good", "x" * 129, ".", "..", "a/b", "", 5])
            page_bytes = rng.choice(
                [FUZZ_PB, FUZZ_PB * 2, 16384, 1, 0, -1, 2**64 - 1, 4 << 20, (4 << 20) + 1, 1.0, True]
            )
            return {"op": op, "namespace": namespace, "page_bytes": page_bytes}
        if op in ("exists", "present", "alloc", "abort", "pin", "unpin", "touch"):
            return {"op": op, "keys": keys}
        if op == "commit":
            r = {"op": op, "keys": rng.choice([keys, mine.writing_keys, other.writing_keys])}
            if rng.random() < 0.5:
                r["sums"] = self.sums(len(r["keys"]) if isinstance(r["keys"], list) else 1)
            return r
        if op == "reserve":
            return {"op": op, "n": self.int_field(rng.choice([1, 4, 65536, 65537]))}
        if op == "put":
            offsets = rng.choice(
                [
                    lambda: [self.offset() for _ in range(min(n, 70))],
                    lambda: list(mine.reserved[:n]),
                    lambda: [rng.choice(mine.reserved or [0])] * max(n, 2),  # one slot for two keys
                    self.bad,
                ]
            )()
            r = {"op": op, "keys": keys, "offsets": offsets}
            if rng.random() < 0.4:
                r["sums"] = self.sums(n)
            return r
        if op == "acquire":
            r = {"op": op, "keys": keys}
            if rng.random() < 0.5:
                r["fetch"] = rng.choice([True, False, self.bad()])
            return r
        if op == "release":
            return {"op": op, "lease": rng.choice([other.lease, mine.lease, 0, -1, 2**64 - 1, self.bad()])}
        if op == "prefetch":
            r = {"op": op, "keys": keys}
            if rng.random() < 0.7:
                r["priority"] = rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1 << 30, self.bad()])
            return r
        if op == "wait":
            r = {"op": op, "handle": rng.choice([other.handle, mine.handle, 0, -5, 2**64 - 1, self.bad()])}
            if rng.random() < 0.7:
                r["timeout"] = rng.choice([0, 0.001, -1, -0.0, NAN, INF, -INF, 2**64 - 1, 1e308, self.bad()])
            return r
        if op in ("stats", "status", "flush"):
            return {"op": op}
        if op == "backend":
            action = rng.choice(["show", "bogus", self.bad()])
            return {"op": op, "action": action, "name": rng.choice(["file", "nope", self.bad()])}
        if op == "region_attach":
            return self.region_fields({"op": op, "kind": rng.choice(["cuda", "host", "gpu", self.bad()])})
        if op == "region_detach":
            return {"op": op, "handle": rng.choice([other.region, mine.region, 0, 2**64 - 1, self.bad()])}
        if op in ("store_pages", "load_pages"):
            pages = rng.choice(
                [
                    lambda: [rng.randrange(8) for _ in range(min(n, 70))],
                    lambda: list(range(min(n, 8))),
                    lambda: [rng.choice([-1, 8, 2**64 - 1, 1.0, True, None, "0"]) for _ in range(n)],
                    lambda: [0] * n,
                    self.bad,
                ]
            )()
            handle = rng.choice([mine.region] * 3 + [other.region, self.bad()])
            r = {"op": op, "handle": handle, "page_indices": pages, "keys": keys}
            if op == "load_pages" and rng.random() < 0.5:
                r["fetch"] = rng.choice([True, False, self.bad()])
            return r
        return {"op": op}

    def region_fields(self, r: dict) -> dict:
        """Geometry of a region (8 pages of FUZZ_PB when right): sizes, offsets and segments often wrong,
        huge strides among them (past int64 in the overlap test), and a CUDA description now and then."""
        rng = self.rng
        r["nbytes"] = rng.choice([FUZZ_PB * 8, 0, -1, 2**64 - 1, 2**63, 1, self.bad()])
        r["offset"] = rng.choice([0, 1, -1, 4096, 2**64 - 1, self.bad()])
        r["page_bytes"] = rng.choice([FUZZ_PB, FUZZ_PB * 2, 0, -1, 2**64 - 1, self.bad()])
        r["num_pages"] = rng.choice([8, 1, 0, -1, 9, 2**64 - 1, 2**40, self.bad()])
        if rng.random() < 0.6:
            big = rng.choice([2**63, 2**64 - 1, 2**62, 2**40])
            half = FUZZ_PB // 2
            r["segments"] = rng.choice(
                [
                    lambda: [[0, FUZZ_PB, FUZZ_PB]],
                    lambda: [[0, half, big], [half, half, big - 1]],
                    lambda: [[big, half, FUZZ_PB], [0, half, FUZZ_PB * 2]],
                    lambda: [[0, half, FUZZ_PB], [FUZZ_PB // 4, half, FUZZ_PB]],
                    lambda: [[0, 1, 1]] * 4097,
                    lambda: [[0, FUZZ_PB]],
                    lambda: [[-1, FUZZ_PB, FUZZ_PB]],
                    lambda: [[0, FUZZ_PB, 0]],
                    lambda: [[0.0, FUZZ_PB, FUZZ_PB]],
                    lambda: [],
                    lambda: [self.bad(), self.bad(), self.bad()],
                    lambda: [[self.bad(), FUZZ_PB, FUZZ_PB]],
                    self.bad,
                ]
            )()
        if rng.random() < 0.5:
            ipc = {"version": 1, "device_uuid": "x", "ipc_handle": b"\x00" * 64, "storage_bytes": 1}
            r["cuda"] = rng.choice([self.bad(), ipc, {"version": self.bad()}])
        return r

    def mutate(self, r: dict) -> dict:
        """A copy of `r` with a field missing, of the wrong type, one added, or a wrong op name."""
        rng = self.rng
        r = dict(r)
        x = rng.random()
        fields = [k for k in r if k != "op"]
        if x < 0.15 and fields:
            del r[rng.choice(fields)]
        elif x < 0.3 and fields:
            r[rng.choice(fields)] = self.bad()
        elif x < 0.4:
            extra = rng.choice(
                ["extra", "keys", "n", "lease", "handle", "offsets", "sums", "timeout", "priority", "fetch"]
                + ["namespace", "page_bytes", "cuda", "segments"]
            )
            r[extra] = self.bad()
        elif x < 0.45:
            r["op"] = rng.choice([self.bad(), "HELLO", "hello ", "_dispatch", "__class__"])
        return r
