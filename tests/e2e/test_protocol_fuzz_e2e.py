"""Protocol fuzzing of the real daemon (a subprocess), and regression tests for what it found: store_pages
keeps its slots out of the engine's reach while the daemon copies into them (an abort or commit meanwhile let
another connection's pages be overwritten); huge region strides and sizes are refused, not answered with an
internal error. Machinery in protocol_fuzz.py and fuzz_requests.py; each finding names the request and the
answer at fault, or quotes the daemon log's error with its traceback."""

from __future__ import annotations

import os

import pytest
from fuzz_requests import FUZZ_PB, past_int64_geometries
from protocol_fuzz import (
    RACE_DELAYS,
    Fuzzer,
    RawConnection,
    check_stop,
    fuzz_run,
    held_after_close,
    sealed_memfd,
    short,
    side_attach,
)

from hicached.common.errors import BAD_REQUEST

RACES = 32  # a race hits its window about one time in three without the fix; 32 make a miss unlikely
FUZZ_CONFIG = {
    "server": {"request_timeout": "5s", "handshake_timeout": "2s"},
    "pool": {"capacity": "128MiB"},
}


def report(findings: list[str], what: str) -> str:
    shown = "\n".join(f"- {f}" for f in findings[:20])
    more = f"\n(and {len(findings) - 20} more)" if len(findings) > 20 else ""
    return f"{what}: {len(findings)} findings:\n{shown}{more}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzzed_requests_get_one_coded_answer_each_and_leave_nothing_held(daemon_factory, seed):
    """Fixed-seed fuzzing, file backend: malformed requests for every op (before and after hello, naming
    another connection's slots, leases, handles and regions), region_attach with nonsense geometry on side
    connections, and an engine racing the daemon's copies of its store_pages/load_pages with abort, commit,
    release and hello, while a well-behaved client checks the bytes it reads back. Each request gets
    exactly one answer, an error has a known code other than internal; at the end nothing is left held
    (leases, slots, pins, regions, connections), the daemon exits 0 and logged no error."""
    d = daemon_factory(FUZZ_CONFIG)
    findings = fuzz_run(d, seed, rounds=8, races=1)
    assert not findings, report(findings, f"seed {seed} (file backend)")


@pytest.mark.parametrize("then", ["abort", "commit"])
def test_store_pages_slots_stay_held_while_the_daemon_copies(daemon_factory, then):
    """An engine aborts or commits the keys of its store_pages while the daemon still copies their pages from
    its region into the pool; another connection's pages, stored meanwhile, must keep their bytes."""
    # A pool that holds the racer's pages and the victim's leased ones and no more, so the victim's alloc
    # takes the racer's slots as soon as they are free or evictable; no L3, whose write-through would refuse
    # the victim's slots while its backup queue is full.
    d = daemon_factory({**FUZZ_CONFIG, "pool": {"capacity": "64MiB"}, "storage": {"backend": "none"}})
    f = Fuzzer(d, seed=7)
    try:
        for i in range(RACES):
            f.race("store_pages", then, RACE_DELAYS[i % len(RACE_DELAYS)])
        f.close_all()
        if held := held_after_close(d):
            f.finding(f"held after every connection closed: {held}")
    finally:
        findings = f.findings + check_stop(d)
    assert not findings, report(findings, f"store_pages, then {then}")


def test_region_geometry_past_int64_is_refused(daemon_factory):
    """Strides, offsets, page counts and sizes past int64 are refused as bad requests: region_attach on the
    engine connection (host and CUDA) and on a side connection with the region's fd, which got no answer at
    all when the overlap test overflowed."""
    d = daemon_factory(FUZZ_CONFIG)
    findings = []
    c = RawConnection(d.socket, "engine")
    try:
        c.call({"op": "hello", "namespace": "fz", "page_bytes": FUZZ_PB})
        for geometry in past_int64_geometries():
            for kind in ("host", "cuda"):
                req = {"op": "region_attach", "kind": kind, **geometry}
                ans = c.call(req)
                if ans.get("error", {}).get("code") != BAD_REQUEST:
                    findings.append(f"engine connection: {short(req)} answered {short(ans)}")
            req = {"id": 7, "op": "region_attach", "kind": "host", "token": c.token, **geometry}
            fd = sealed_memfd(FUZZ_PB * 8)
            try:
                how, ans = side_attach(d.socket, req, fd)
            finally:
                os.close(fd)
            if how != "answer" or ans.get("error", {}).get("code") != BAD_REQUEST:
                findings.append(f"side connection: {short(req)} answered {how} {short(ans)}")
    finally:
        c.close()
        findings += check_stop(d)
    assert not findings, report(findings, "region geometry past int64")
