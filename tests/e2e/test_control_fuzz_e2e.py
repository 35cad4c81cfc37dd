"""Protocol-level fuzzing of the operator's commands on a real daemon (a subprocess): reload, backend with
every action, drain, flush, status and stats, their fields missing, of the wrong type or huge, unknown
actions and names that are not strings, pipelined on two raw connections while an engine stores pages and
the configuration file changes under the reloads (damaged, live changes, a backend swap, a Redis that is
down). Every request gets exactly one answer, never `internal`; afterwards the daemon is not draining,
serves, answers a good reload, exits 0 and logged no traceback. Raw connections and the log checks come
from protocol_fuzz.py; the requests from control_requests.py."""

from __future__ import annotations

import collections
import os
import random
import shutil
import threading
import traceback

import pytest
from control_requests import ControlRequests, config_variants
from daemon_proc import DaemonProcess
from protocol_fuzz import RawConnection, log_problems, short

from hicached.common.errors import CODES, CONNECTION, DRAINING, INTERNAL, HicachedError
from hicached.engine.client import Client

PAGE = 16 * 1024
# flush and drain wait up to shutdown.flush_timeout: kept short so that a burst of them ends soon. The Redis
# section names a port where nothing listens: attaching it fails at once, as a refusal.
FUZZ_CONFIG = {
    "server": {"request_timeout": "5s"},
    "shutdown": {"flush_timeout": "1s"},
    "storage": {
        "operation_timeout": "2s",
        "drain_timeout": "2s",
        "redis": {"url": "redis://127.0.0.1:1/0", "connect_timeout": "200ms", "socket_timeout": "200ms"},
    },
}


class Engine:
    """An engine storing pages all along; `draining` is the only error it may see."""

    def __init__(self, path: str) -> None:
        self.client = Client(path, "ctlfuzz.ns", PAGE, timeout=30)
        self.errors: list[str] = []
        self.stored = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(5)
        while not self._stop.is_set():
            keys = [f"{rng.getrandbits(64):016x}" for _ in range(4)]
            try:
                self.stored += sum(self.client.store(keys, [os.urandom(PAGE) for _ in keys]))
            except HicachedError as e:
                if e.code != DRAINING:
                    self.errors.append(f"store: {e}")
            except Exception:
                self.errors.append(traceback.format_exc())
                return
            self._stop.wait(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def write_variant(d: DaemonProcess, data: bytes | None) -> None:
    if os.path.isdir(d.config_path):
        shutil.rmtree(d.config_path)
    elif data is None:
        os.unlink(d.config_path)
    if data is None:
        os.mkdir(d.config_path)  # unreadable, for root too
        return
    with open(d.config_path, "wb") as f:
        f.write(data)


def check_answers(
    c: RawConnection, rids: list[int], reqs: list[dict], findings: list[str], seen: collections.Counter
) -> None:
    """Each request got exactly one answer, and an error a known code other than internal; `seen` counts
    the outcomes by op (the error code, or for a reload whether it was applied)."""
    missing = c.wait_for(rids)
    for rid, req in zip(rids, reqs, strict=True):
        got = c.answers.get(rid, [])
        if rid in missing:
            why = "the connection closed" if c.closed else "no answer in time"
            findings.append(f"{c.name}: {why} to {short(req, 300)}")
            continue
        if len(got) != 1:
            findings.append(f"{c.name}: {len(got)} answers to {short(req, 300)}")
        err = got[0].get("error")
        op = req["op"] if isinstance(req["op"], str) and len(req["op"]) < 20 else "other"
        if err is not None:
            code = err.get("code") if isinstance(err, dict) else None
            seen[op, code] += 1
            if code not in CODES or code in (INTERNAL, CONNECTION):
                findings.append(f"{c.name}: {code!r} for {short(req, 300)}: {short(err, 400)}")
        else:
            seen[op, f"ok={got[0].get('ok')}" if op == "reload" else "answered"] += 1


def unexpected_log_records(text: str) -> list[str]:
    """The log's errors, less the refusals the fuzz asks for (a reload of a damaged file) when they come
    without a traceback: a bug in a reload is logged with one."""
    return [
        r
        for r in log_problems(text, limit=1000)
        if "Traceback" in r or "reload rejected, keeping the running configuration" not in r
    ][:10]


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzzed_control_commands_are_never_answered_internal(daemon_factory, seed: int) -> None:
    d = daemon_factory(FUZZ_CONFIG)
    rng = random.Random(seed)
    gen = ControlRequests(rng)
    variants = config_variants(d.config)
    findings: list[str] = []
    seen: collections.Counter = collections.Counter()
    engine = Engine(d.socket)
    conns = [RawConnection(d.socket, "A"), RawConnection(d.socket, "B")]
    order = rng.sample(list(variants), len(variants))  # every file meets a burst of reloads
    try:
        for rnd, name in enumerate(order):
            write_variant(d, variants[name])
            sent = [(c, reqs, c.send(*reqs)) for c in conns for reqs in [[gen.any() for _ in range(30)]]]
            for c, reqs, rids in sent:
                check_answers(c, rids, reqs, findings, seen)
            # Every op once more, as the template has it, after the file changed again.
            write_variant(d, variants[rng.choice(list(variants))])
            reqs = [gen.template(op) for op in ("reload", "backend", "drain", "flush", "status", "stats")]
            check_answers(conns[0], conns[0].send(*reqs), reqs, findings, seen)
            # A drain left on would answer engines `draining` from now on.
            cancel = conns[1].call({"op": "drain", "cancel": True})
            if cancel.get("draining") is not False:
                findings.append(f"round {rnd}: drain cancel answered {short(cancel)}")
            if not d.alive:
                findings.append("the daemon died")
                break
    except Exception:
        findings.append("the fuzz run stopped: " + traceback.format_exc())
    finally:
        for c in conns:
            c.close()
        engine.close()
    findings += [f"engine: {e}" for e in engine.errors[:5]]
    if d.alive:
        write_variant(d, variants["good"])
        answer = d.ctl("reload")
        if answer.get("ok") is not True or d.ctl("status")["last_reload"] != "ok":
            findings.append(f"a good reload after the fuzz answered {short(answer)}")
        status = d.ctl("status")
        if status["draining"]:
            findings.append(f"still draining after the fuzz: {short(status)}")
        with Client(d.socket, "ctlfuzz.after", PAGE) as c:
            if c.store(["after"], [b"\1" * PAGE]) != [True] or c.get(["after"]) != [b"\1" * PAGE]:
                findings.append("a store after the fuzz did not read back")
    if engine.stored == 0:
        findings.append("the engine stored nothing meanwhile")
    # The fuzz reached what it is for: reloads applied and refused, backend commands refused and answered.
    for outcome in [
        ("reload", "ok=True"),
        ("reload", "ok=False"),
        ("backend", "bad_request"),
        ("backend", "answered"),
    ]:
        if not seen[outcome]:
            findings.append(f"no {outcome} among the answers: {dict(seen)}")
    code = d.stop(timeout=60) if d.alive else -1
    if code != 0:
        findings.append(f"the daemon exited with {code}")
    findings += [f"daemon log:\n{r}" for r in unexpected_log_records(d.log())]
    shown = "\n".join(f"- {f}" for f in findings[:20])
    assert not findings, f"seed {seed}: {len(findings)} findings:\n{shown}"
