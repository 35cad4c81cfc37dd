"""Drives the protocol fuzz test against a real daemon: raw engine connections that send the requests of
fuzz_requests.py, races of an engine against the daemon's copies into its slots, a well-behaved client that
checks the bytes it reads back, and the checks that nothing is left held and nothing went wrong in the log."""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import re
import socket
import threading
import time
import traceback
from typing import Any

import numpy as np
from daemon_proc import DaemonProcess
from fuzz_requests import FUZZ_PB, OPS, Requests, Targets, hexkey

from hicached.common import protocol
from hicached.common.errors import CODES, CONNECTION, INTERNAL
from hicached.engine.client import Client, shared_buffer

GOOD_PB = 16384
RACE_PB, RACE_PAGES = 256 << 10, 128  # 32 MiB a copy: long enough for another connection to act meanwhile
ANSWER_TIMEOUT = 40.0  # seconds; far above what an answer takes, only there so a lost one fails the test
RACE_THEN = ["abort", "commit", "release", "hello elsewhere", "hello again"]
RACE_DELAYS = [0, 0.0005, 0.001, 0.002, 0.004]  # seconds: the copy of 32 MiB takes a few milliseconds
FUZZ_NAMESPACES = {"fz": FUZZ_PB, "fz2": FUZZ_PB * 2, "good": GOOD_PB, "fz3": FUZZ_PB * 4}


class _More:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"...{self.n} more"


def _abridged(x: Any) -> Any:
    if isinstance(x, list):
        head = [_abridged(v) for v in x[:8]]
        return head + [_More(len(x) - 8)] if len(x) > 8 else head
    if isinstance(x, dict):
        return {k: _abridged(v) for k, v in x.items()}
    return x


def short(x: Any, n: int = 600) -> str:
    """repr of a request or answer for a finding: long lists cut after 8 items, the whole after n chars."""
    s = repr(_abridged(x))
    return s if len(s) <= n else s[:n] + f"...<{len(s)} chars>"


def sealed_memfd(nbytes: int, seal: bool = True) -> int:
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


class RawConnection:
    """An engine connection without the client library: frames out, every answer kept by id (all of them,
    to see a request answered twice) by a reader thread."""

    def __init__(self, path: str, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.decoder = protocol.FrameDecoder(1 << 24)
        msgs: list[Any] = []
        fds: list[int] = []
        while not msgs:
            data, got, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            fds += got
            if not data:
                raise RuntimeError(f"{name}: the daemon closed the connection before its welcome")
            msgs = self.decoder.feed(data)
        self.token = msgs[0]["token"]
        self.pool_bytes = msgs[0]["pool_bytes"]
        self.pool = mmap.mmap(fds[0], self.pool_bytes)
        for fd in fds:
            os.close(fd)
        self.answers: dict[int, list[dict]] = {}
        self.unknown: list[Any] = []  # answers without an integer id
        self.closed = False
        self.cv = threading.Condition()
        self.ids = iter(range(1, 1 << 40))
        self.sock.settimeout(None)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while data := self.sock.recv(1 << 16):
                for m in self.decoder.feed(data):
                    with self.cv:
                        if isinstance(m, dict) and isinstance(m.get("id"), int):
                            self.answers.setdefault(m["id"], []).append(m)
                        else:
                            self.unknown.append(m)
                        self.cv.notify_all()
        except OSError:
            pass
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def send(self, *reqs: dict) -> list[int]:
        """Sends the requests in one write (pipelined) and returns their ids."""
        rids, buf = [], bytearray()
        for r in reqs:
            rids.append(next(self.ids))
            buf += protocol.encode({**r, "id": rids[-1]})
        self.sock.sendall(buf)
        return rids

    def wait_for(self, rids: list[int], timeout: float = ANSWER_TIMEOUT) -> list[int]:
        """The ids still unanswered after `timeout` seconds (or once the connection closed)."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                missing = [r for r in rids if r not in self.answers]
                if not missing or self.closed or time.monotonic() > deadline:
                    return missing
                self.cv.wait(0.05)

    def call(self, req: dict) -> dict:
        (rid,) = self.send(req)
        if self.wait_for([rid]):
            raise AssertionError(f"{self.name}: no answer to {short(req)}")
        return self.answers[rid][0]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread; close alone would not
        except OSError:
            pass
        self.reader.join(5)
        self.sock.close()
        self.pool.close()


def side_attach(path: str, req: dict, fd: int) -> tuple[str, Any]:
    """region_attach on a connection of its own, with the region's fd: ("answer", msg), or ("closed" or
    "timeout", detail) when no answer came."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        dec = protocol.FrameDecoder(1 << 24)
        msgs: list[Any] = []
        while not msgs:
            data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
            for f in fds:
                os.close(f)
            msgs = dec.feed(data)
        data = protocol.encode(req)
        n = socket.send_fds(s, [data], [fd])
        if n < len(data):  # only then: the daemon may have answered and closed already (EPIPE)
            s.sendall(data[n:])
        while chunk := s.recv(1 << 16):
            if msgs := dec.feed(chunk):
                return "answer", msgs[0]
        return "closed", None
    except TimeoutError:
        return "timeout", None
    except OSError as e:
        return "closed", str(e)
    finally:
        s.close()


def attach_host_region(path: str, token: str, page_bytes: int, num_pages: int, fill: int = 0) -> int:
    fd = sealed_memfd(page_bytes * num_pages)
    try:
        if fill:
            with mmap.mmap(fd, page_bytes * num_pages) as mm:
                mm[:] = bytes([fill]) * len(mm)
        req = {"id": 1, "op": "region_attach", "token": token, "kind": "host"}
        req |= {"nbytes": page_bytes * num_pages, "page_bytes": page_bytes, "num_pages": num_pages}
        kind, ans = side_attach(path, req, fd)
    finally:
        os.close(fd)
    assert kind == "answer" and "handle" in ans, f"region_attach {short(req)}: {kind} {short(ans)}"
    return ans["handle"]


class GoodClient:
    """The well-behaved engine, through the client library: stores and loads pages through the pool and
    through a host region, and checks that every page it reads back holds the bytes it stored."""

    def __init__(self, path: str, rng: random.Random) -> None:
        self.rng = rng
        self.c = Client(path, "good", GOOD_PB, timeout=30)
        self.kept: dict[str, bytes] = {}
        self.region = shared_buffer(GOOD_PB * 16)
        self.handle = self.c.register_region(self.region, GOOD_PB)
        self.errors: list[str] = []

    def page(self) -> bytes:
        return self.rng.randbytes(GOOD_PB)

    def round(self) -> None:
        # A refusal (the pool full of pages not in L3 yet) is an answer, not a defect: only what was stored
        # is checked.
        keys = [hexkey(self.rng) for _ in range(8)]
        pages = [self.page() for _ in keys]
        ok = self.c.store(keys, pages)
        got = self.c.get(keys)
        if any(bytes(g) != p for g, p in zip(got, pages, strict=False)):
            self.errors.append("get: a page reads back different bytes than were stored")
        if all(ok) and len(got) != len(keys):
            self.errors.append(f"get: {len(got)} of {len(keys)} stored pages back")
        self.kept.update((k, p) for k, p, good in zip(keys, pages, ok, strict=True) if good)

        arr = self.region.numpy()
        rkeys = [hexkey(self.rng) for _ in range(4)]
        rpages = [self.page() for _ in rkeys]
        for i, p in enumerate(rpages):
            arr[i * GOOD_PB : (i + 1) * GOOD_PB] = np.frombuffer(p, dtype=np.uint8)
        ok = self.c.store_pages(self.handle, [0, 1, 2, 3], rkeys)
        arr[:] = 0
        n = self.c.load_pages(self.handle, [7, 6, 5, 4], rkeys)
        if all(ok) and n != 4:
            self.errors.append(f"load_pages: {n} of 4 stored pages back")
        for j, p in enumerate(rpages[:n]):
            i = 7 - j
            if bytes(arr[i * GOOD_PB : (i + 1) * GOOD_PB]) != p:
                self.errors.append(f"load_pages: page {j} reads back different bytes than were stored")
        self.kept.update((k, p) for k, p, good in zip(rkeys, rpages, ok, strict=True) if good)

        for k in self.rng.sample(list(self.kept), min(16, len(self.kept))):
            got = self.c.get([k])
            if got and bytes(got[0]) != self.kept[k]:
                self.errors.append(f"old key {k[:8]} reads back different bytes than were stored")

    def safe_round(self) -> None:
        try:
            self.round()
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.c.unregister_region(self.handle)
        self.c.close()


class Fuzzer:
    """Sends the fuzz requests and records a finding (the request and its answer) for each defect seen."""

    def __init__(self, d: DaemonProcess, seed: int) -> None:
        self.d = d
        self.rng = random.Random(seed)
        self.findings: list[str] = []
        self.sent = 0
        self.pinned: set[str] = set()
        self.stored_keys = [hexkey(self.rng) for _ in range(64)]
        self.a: RawConnection | None = None
        self.b: RawConnection | None = None
        self.racer: RawConnection | None = None
        self.victim: RawConnection | None = None
        self.victim_lease: int | None = None
        self.requests: Requests | None = None

    def finding(self, msg: str) -> None:
        if msg not in self.findings:
            self.findings.append(msg)

    def open_pair(self) -> None:
        """Two fresh fuzz connections (the old ones close with whatever they held), each holding real
        reserved slots, writing slots, a lease, a prefetch handle and a region for the requests to name."""
        for c in (self.a, self.b):
            if c is not None:
                c.close()
        self.a = RawConnection(self.d.socket, "A")
        self.b = RawConnection(self.d.socket, "B")
        self.requests = Requests(self.rng, self.stored_keys, self.a.pool_bytes)
        self.a.call({"op": "hello", "namespace": "fz", "page_bytes": FUZZ_PB})
        self.b.call({"op": "hello", "namespace": "fz2", "page_bytes": FUZZ_PB * 2})
        self.requests.mine = self.harvest(self.a, FUZZ_PB)
        self.requests.other = self.harvest(self.b, FUZZ_PB * 2)

    def harvest(self, c: RawConnection, page_bytes: int) -> Targets:
        rng = self.rng
        t = Targets(page_bytes)
        t.reserved = c.call({"op": "reserve", "n": 4}).get("offsets", [])
        t.writing_keys = [hexkey(rng) for _ in range(3)]
        offsets = c.call({"op": "alloc", "keys": t.writing_keys}).get("offsets", [])
        t.writing_offsets = [o for o in offsets if o >= 0]
        real = rng.sample(self.stored_keys, 4)  # stored, so that acquire and prefetch find pages
        status = c.call({"op": "alloc", "keys": real}).get("status", [])
        if done := [k for k, st in zip(real, status, strict=False) if st == 0]:
            c.call({"op": "commit", "keys": done})
        lease = c.call({"op": "acquire", "keys": real})
        t.lease, t.lease_offsets = lease.get("lease"), lease.get("offsets", [])
        t.handle = c.call({"op": "prefetch", "keys": real + [hexkey(rng)]}).get("handle")
        t.region = attach_host_region(self.d.socket, c.token, page_bytes, 8)
        return t

    def check_answers(self, c: RawConnection, rids: list[int], reqs: list[dict]) -> None:
        """Each request got exactly one answer, and an error carries a known code other than internal."""
        missing = c.wait_for(rids)
        for rid, req in zip(rids, reqs, strict=True):
            got = c.answers.get(rid, [])
            if rid in missing:
                why = "connection closed" if c.closed else f"no answer within {ANSWER_TIMEOUT}s"
                self.finding(f"{c.name}: {why} to {short(req)}")
                continue
            if len(got) != 1:
                self.finding(f"{c.name}: {len(got)} answers to {short(req)}: {short(got)}")
            err = got[0].get("error")
            if err is None:
                if req.get("op") == "pin" and isinstance(req.get("keys"), list):
                    self.pinned.update(k for k in req["keys"] if isinstance(k, str))
                continue
            code = err.get("code") if isinstance(err, dict) else None
            if code not in CODES or code in (INTERNAL, CONNECTION):
                self.finding(f"{c.name}: error code {code!r} for {short(req)}: {short(err)}")
        with c.cv:
            if c.unknown:
                self.finding(f"{c.name}: answers without an id: {short(c.unknown)}")
                c.unknown.clear()

    def burst(self, c: RawConnection, n: int = 60) -> None:
        """`n` fuzz requests pipelined on `c`."""
        reqs = [self.requests.any() for _ in range(n)]
        self.sent += n
        self.check_answers(c, c.send(*reqs), reqs)

    def side_attach_burst(self, n: int = 6) -> None:
        """region_attach with nonsense fields on connections of their own, an fd that could shrink now and
        then: each gets an answer, never an internal error nor a closed connection."""
        rng = self.rng
        for _ in range(n):
            r = self.requests.region_fields(
                {"op": "region_attach", "kind": rng.choice(["host"] * 4 + ["cuda", 5])}
            )
            r["token"] = rng.choice([self.a.token] * 4 + [self.b.token, "nope", self.requests.bad()])
            r = self.requests.mutate(r) if rng.random() < 0.3 else r
            r["id"] = rng.choice([1, 2**64 - 1, -1])
            fd = sealed_memfd(FUZZ_PB * 8, seal=rng.random() < 0.85)
            try:
                kind, ans = side_attach(self.d.socket, r, fd)
            finally:
                os.close(fd)
            self.sent += 1
            if kind != "answer":
                self.finding(f"side region_attach: {kind} ({ans}) without an answer to {short(r)}")
                continue
            err = ans.get("error") if isinstance(ans, dict) else None
            if err is not None and (err.get("code") not in CODES or err.get("code") == INTERNAL):
                self.finding(
                    f"side region_attach: error code {err.get('code')!r} for {short(r)}: {short(err)}"
                )

    def before_hello(self) -> None:
        """Every op on a fresh connection before its hello, then hellos that must be refused (another page
        size for a namespace) or accepted."""
        c = RawConnection(self.d.socket, "fresh")
        try:
            reqs = [self.requests.template(op) for op in dict.fromkeys(OPS) if op != "hello"]
            reqs = [self.requests.mutate(r) if self.rng.random() < 0.3 else r for r in reqs]
            reqs += [
                {"op": "hello", "namespace": "fz", "page_bytes": FUZZ_PB},
                {"op": "hello", "namespace": "fz", "page_bytes": FUZZ_PB * 4},
                {"op": "hello", "namespace": "fz3", "page_bytes": FUZZ_PB * 4},
                {"op": "reserve", "n": 3},
                {"op": "hello", "namespace": "fz", "page_bytes": FUZZ_PB},
            ]
            self.sent += len(reqs)
            self.check_answers(c, c.send(*reqs), reqs)
        finally:
            c.close()

    def race(
        self, op: str, then: str, delay: float, good: GoodClient | None = None, n: int = RACE_PAGES
    ) -> None:
        """An engine sends `op` (store_pages or load_pages of `n` pages, at most RACE_PAGES) and, `delay`
        seconds later while the daemon may still copy, `then` about the same pages (one of RACE_THEN). A
        victim connection meanwhile stores pages of the same size through fresh slots: once the copy is over
        they must still hold the victim's bytes (the copy's slots were handed to no one), and every answer
        is one the engine could expect. `good` runs a round meanwhile, for more traffic."""
        rng = self.rng
        if self.racer is None:
            self.racer = RawConnection(self.d.socket, "racer")
            self.racer.call({"op": "hello", "namespace": "fzr", "page_bytes": RACE_PB})
            self.racer_region = attach_host_region(self.d.socket, self.racer.token, RACE_PB, RACE_PAGES, 0xAA)
            self.victim = RawConnection(self.d.socket, "victim")
            self.victim.call({"op": "hello", "namespace": "fzv", "page_bytes": RACE_PB})
        c, v = self.racer, self.victim
        keys = [hexkey(rng) for _ in range(n)]
        first = {"op": op, "handle": self.racer_region, "page_indices": list(range(n)), "keys": keys}
        if op == "load_pages":
            c.call({**first, "op": "store_pages"})
        (rid,) = c.send(first)
        time.sleep(delay)
        second = {
            "abort": {"op": "abort", "keys": keys},
            "commit": {"op": "commit", "keys": keys},
            "release": {"op": "release", "lease": rid},  # lease ids count per connection: a guess
            "hello elsewhere": {"op": "hello", "namespace": "fzr2", "page_bytes": RACE_PB},
            "hello again": {"op": "hello", "namespace": "fzr", "page_bytes": RACE_PB},
        }[then]
        reqs = [first, second]
        rids = [rid, *c.send(second)]
        t = threading.Thread(target=good.safe_round) if good is not None else None
        if t is not None:
            t.start()
        c.wait_for(rids[1:])
        # The victim's pages of the last race stay leased until now: in a small pool its alloc must then
        # take the slots of the racer's pages, which it may only do once the copy into them is over.
        vkeys = [hexkey(rng) for _ in range(n)]
        offsets = [o for o in v.call({"op": "alloc", "keys": vkeys}).get("offsets", []) if o >= 0]
        for o in offsets:
            v.pool[o : o + RACE_PB] = b"\x55" * RACE_PB
        v.call({"op": "commit", "keys": vkeys})
        lease = v.call({"op": "acquire", "keys": vkeys}).get("lease")
        if self.victim_lease is not None:
            v.call({"op": "release", "lease": self.victim_lease})
        self.victim_lease = lease
        c.wait_for(rids[:1])
        torn = sum(1 for o in offsets if bytes(v.pool[o : o + RACE_PB]) != b"\x55" * RACE_PB)
        if torn:
            self.finding(
                f"race: {torn} of {len(offsets)} pages another connection committed were overwritten by the "
                f"daemon's copy for {op} of {n} pages, after {then} (request {second['op']}) sent "
                f"{delay}s later; {op} answered {short(c.answers.get(rids[0]))}, {second['op']} "
                f"answered {short(c.answers.get(rids[1]))}"
            )
        for _ in range(3):
            release = {"op": "release", "lease": rng.randrange(1, rid + 4)}
            reqs.append(release)
            rids += c.send(release)
        if t is not None:
            t.join()
        missing = c.wait_for(rids)
        for r, q in zip(rids, reqs, strict=True):
            answers = c.answers.get(r, [])
            if r in missing or len(answers) != 1:
                self.finding(f"race: {len(answers)} answers to {short(q)}: {short(answers)}")
            for a in answers:
                e = a.get("error")
                if e and e.get("code") not in ("not_found", "bad_request"):
                    self.finding(f"race: error {short(e)} for {short(q)}")
        c.call({"op": "hello", "namespace": "fzr", "page_bytes": RACE_PB})

    def close_all(self) -> None:
        """Closes every fuzz connection, then unpins what they pinned, from each namespace they used."""
        for c in (self.a, self.b, self.racer, self.victim):
            if c is not None:
                c.close()
        self.a = self.b = self.racer = self.victim = None
        keys = sorted(self.pinned)
        for ns, pb in FUZZ_NAMESPACES.items():
            c = RawConnection(self.d.socket, "unpin")
            try:
                if "error" not in c.call({"op": "hello", "namespace": ns, "page_bytes": pb}):
                    for i in range(0, len(keys), 1000):
                        c.call({"op": "unpin", "keys": keys[i : i + 1000]})
            finally:
                c.close()


def held_after_close(d: DaemonProcess, timeout: float = 10.0) -> dict[str, Any]:
    """What the daemon still holds (leases, writing/filling/reserved slots, pins, regions, connections) once
    every engine connection closed; waits up to `timeout` seconds for it to let go, returns {} when it did."""
    deadline = time.monotonic() + timeout
    while True:
        st = d.ctl("stats")
        pool = st["pool"]
        held = {k: pool[k] for k in ("leased", "writing", "filling", "reserved", "reserved_bytes", "pinned")}
        held |= {"pinned_bytes": st["pinned_bytes"], "connections": st["server"]["connections"] - 1}
        held |= {"regions": st["regions"]["count"], "regions_inflight": st["regions"]["inflight"]}
        held = {k: v for k, v in held.items() if v}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.M)
LOG_PROBLEMS = (
    "Traceback",
    "never retrieved",
    "internal error",
    "Exception",
    "could not admit",
    "ERROR",
    "Error:",
)


def log_problems(text: str, limit: int = 10) -> list[str]:
    """The daemon log's records (each with its traceback) that report an error, a bug or a lost task."""
    starts = [m.start() for m in LOG_RECORD.finditer(text)] + [len(text)]
    records = [text[a:b].rstrip() for a, b in zip(starts, starts[1:], strict=False)]
    if starts[0] > 0:
        records.insert(0, text[: starts[0]].rstrip())  # printed before logging was set up
    return [r for r in records if any(p in r for p in LOG_PROBLEMS)][:limit]


def fuzz_run(d: DaemonProcess, seed: int, rounds: int, races: int) -> list[str]:
    """`rounds` rounds of fuzz bursts, region_attach bursts, requests before hello, `races` races against
    the daemon's copies and a round of the good client; then every connection closed and the daemon stopped.
    Returns the findings, each naming the request and answer at fault (empty when all went well)."""
    f = Fuzzer(d, seed)
    good: GoodClient | None = None
    try:
        good = GoodClient(d.socket, f.rng)
        f.open_pair()
        for rnd in range(rounds):
            f.burst(f.a)
            if rnd % 3 == 0:
                f.burst(f.b)
            if rnd % 4 == 0:
                f.side_attach_burst()
            if rnd % 5 == 0:
                f.before_hello()
            for _ in range(races):
                op, then = f.rng.choice(["store_pages", "load_pages"]), f.rng.choice(RACE_THEN)
                # A quarter of the pages: what each race writes goes to L3 too.
                f.race(op, then, f.rng.choice(RACE_DELAYS), good, RACE_PAGES // 4)
            if not d.alive:
                f.finding("the daemon died")
                break
            good.safe_round()
            for e in good.errors:
                f.finding(f"good client: {e}")
            good.errors.clear()
            if rnd % 4 == 3:  # the old connections close with what they hold
                f.open_pair()
        good.close()
        good = None
        f.close_all()
        if held := held_after_close(d):
            f.finding(f"held after every connection closed: {held}")
    except Exception:
        f.finding("the fuzz run stopped: " + traceback.format_exc())
    finally:
        if good is not None:
            good.c.close()
        f.findings += check_stop(d)
    return f.findings


def check_stop(d: DaemonProcess) -> list[str]:
    """Stops the daemon: it must be alive, exit 0, and have logged no error or traceback."""
    out = [] if d.alive else ["the daemon was dead at the end"]
    code = d.stop(timeout=60)
    if code != 0 and not out:
        out.append(f"the daemon exited with {code}")
    out += [f"daemon log:\n{r}" for r in log_problems(d.log())]
    return out
