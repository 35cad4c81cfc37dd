"""Operators apart from engines (issue #23, point 1), with real processes of other uids against the daemon as
a subprocess: an engine's controls that change the daemon are refused `unauthorized` and change nothing,
while root, the daemon's own uid and server.operator_uids/operator_gids members steer it, even with
allowed_uids naming the engine alone; and the protocol fuzzer, run as the engine."""

from __future__ import annotations

import io
import os
import shutil
import signal
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest
from daemon_proc import DaemonProcess, to_toml
from other_uid import OPERATOR_USER, become, other_user, run_as, shared_workdir
from protocol_fuzz import Fuzzer, check_stop, held_after_close

import hicached.cli
import hicached.daemon.service.lifecycle  # noqa: F401  (imported for the forked daemon of another uid)
import hicached.daemon.service.notify  # noqa: F401
from hicached.common.errors import UNAUTHORIZED, HicachedError
from hicached.engine.client import Client, control

PAGE = 16 * 1024
# What an engine may not do: (op, fields) as `hicached ctl` sends them.
CHANGING = [
    ("reload", {}),
    ("drain", {"cancel": False}),
    ("drain", {"cancel": True}),
    ("backend", {"action": "detach"}),
    ("backend", {"action": "attach", "name": "file"}),
    ("flush", {}),
]
READ_ONLY = [("status", {}), ("stats", {}), ("backend", {"action": "show"})]


def ask(path: str, requests: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    """Each request on a connection of its own: the answer, or {"code", "message"} of its error."""
    out = []
    for op, fields in requests:
        try:
            out.append(control(path, op, timeout=30.0, **fields))
        except HicachedError as e:
            out.append({"code": e.code, "message": e.message})
    return out


def ctl(path: str, *words: str) -> tuple[int, str]:
    """`hicached ctl` in this process: exit status and what it printed on stderr."""
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = hicached.cli.main(["ctl", "--socket", path, *words])
    return code, err.getvalue()


def engine_session(path: str) -> dict[str, Any]:
    """What an engine does besides controls: stores, loads and clears its own namespace."""
    keys = [f"{i:064x}" for i in range(4)]
    with Client(path, "roles.engine", PAGE, timeout=30) as c:
        stored = c.store(keys, [bytes([i]) * PAGE for i in range(4)])
        bufs = [bytearray(PAGE) for _ in keys]
        loaded = c.load(keys, bufs)
        same = all(b == bytes([i]) * PAGE for i, b in enumerate(bufs))
        cleared = "error" not in c.clear()
    return {"stored": stored, "loaded": loaded, "same": same, "cleared": cleared}


@pytest.fixture
def engine_user():
    return other_user()


@pytest.fixture
def roles_daemon(engine_user):
    """A daemon (root) whose allowed_uids name the engine user alone, and a second user as an operator."""
    operator = other_user(OPERATOR_USER)
    workdir = shared_workdir("hicached-roles-")
    d = DaemonProcess(
        workdir,
        {
            "server": {
                "socket_mode": "0666",
                "allowed_uids": [engine_user.pw_uid],
                "operator_uids": [operator.pw_uid],
                "operator_gids": [54321],
            },
            "shutdown": {"flush_timeout": "5s"},
        },
    )
    d.start()
    d.operator = operator
    try:
        yield d
    finally:
        if d.alive:
            d.proc.kill()
            d.proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_engine_cannot_change_the_daemon(roles_daemon, engine_user):
    """Every control that changes the daemon, from the engine's uid: `unauthorized`, a message naming the
    operator role, and nothing changed (the backend still attached after `backend detach`, the daemon still
    draining after `drain cancel`, no reload). Status, stats, backend show and its own namespace work."""
    d = roles_daemon
    before = d.ctl("status")
    d.ctl("drain")  # as root: so that the engine's `drain cancel` has something to cancel
    u = engine_user
    answers = run_as(u.pw_uid, u.pw_gid, ask, d.socket, CHANGING)
    for (op, fields), ans in zip(CHANGING, answers, strict=True):
        assert ans.get("code") == UNAUTHORIZED, (op, fields, ans)
        assert "operator role" in ans["message"] and f"uid {u.pw_uid}" in ans["message"], ans
    after = d.ctl("status")
    assert after["draining"] is True, "the engine's drain cancel took effect"
    assert (
        after["backend"] == before["backend"] == "file" and after["backend_state"] == before["backend_state"]
    )
    assert after["reloads"] == before["reloads"] and after["last_reload"] == before["last_reload"]
    assert d.ctl("stats")["server"]["unauthorized"] == len(CHANGING)
    control(d.socket, "drain", cancel=True)

    read = run_as(u.pw_uid, u.pw_gid, ask, d.socket, READ_ONLY)
    assert [("code" in a) for a in read] == [False] * 3, read
    assert (
        read[0]["backend"] == "file" and "server" in read[1] and read[2]["state"] == before["backend_state"]
    )
    done = run_as(u.pw_uid, u.pw_gid, engine_session, d.socket)
    assert done == {"stored": [True] * 4, "loaded": 4, "same": True, "cleared": True}, done
    code, err = run_as(u.pw_uid, u.pw_gid, ctl, d.socket, "backend", "detach")
    assert code == 1 and "[unauthorized] backend detach changes the daemon" in err, err
    assert d.ctl("status")["backend"] == "file"


@pytest.mark.parametrize("who", ["root", "operator_uids", "operator_gids"])
def test_operators_steer_the_daemon_when_allowed_uids_names_only_the_engine(roles_daemon, who):
    """root, a member of operator_uids and one of operator_gids (a uid in no list): each control works,
    though allowed_uids names only the engine's uid."""
    d = roles_daemon
    steps = [
        ("backend", {"action": "detach"}),
        ("status", {}),
        ("backend", {"action": "attach", "name": "file"}),
        ("drain", {"cancel": False}),
        ("drain", {"cancel": True}),
        ("flush", {}),
        ("reload", {}),
        ("stats", {}),
    ]
    if who == "root":
        answers = ask(d.socket, steps)
    elif who == "operator_uids":
        answers = run_as(d.operator.pw_uid, d.operator.pw_gid, ask, d.socket, steps)
    else:
        answers = run_as(54320, 54321, ask, d.socket, steps)  # no user: its gid alone makes it an operator
    errors = [(s, a) for s, a in zip(steps, answers, strict=True) if "code" in a]
    assert not errors, errors
    assert answers[1]["backend"] == "none", "backend detach did not detach"
    assert answers[2]["state"] != "detached" and answers[3]["draining"] is True
    assert answers[4]["draining"] is False and answers[6]["ok"] is True
    assert d.ctl("status")["backend"] == "file"


def test_a_peer_in_no_list_is_refused(roles_daemon):
    """A uid that is neither an operator nor an engine is refused at connect, and the daemon serves on."""
    d = roles_daemon
    answers = run_as(54330, 54330, ask, d.socket, [("status", {})])
    assert answers[0].get("code") == UNAUTHORIZED, answers
    assert "refused connection from" in d.log() and "uid=54330" in d.log()
    assert d.alive and d.ctl("stats")["server"]["refused"] == 1


def _serve_as(uid: int, gid: int, config_path: str, log_path: str) -> int:
    """Forks a daemon that becomes uid/gid before it starts (its modules imported here already)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            become(uid, gid)
            code = hicached.cli.main(["serve", "--config", config_path])
        finally:
            os._exit(code)
    return pid


def test_the_daemons_own_uid_is_an_operator(engine_user):
    """A daemon running as a non-root uid, with allowed_uids naming another engine: a process of its own
    uid steers it (it could ptrace it anyway), the engine cannot, and root can."""
    daemon_user = other_user(OPERATOR_USER)
    workdir = shared_workdir("hicached-own-uid-")
    os.chown(workdir, daemon_user.pw_uid, daemon_user.pw_gid)
    cfg = {
        "server": {"socket": "run/d.sock", "socket_mode": "0666", "allowed_uids": [engine_user.pw_uid]},
        "pool": {"capacity": "32MiB", "slab_size": "4MiB", "prefault": False},
        "storage": {"backend": "none"},
        "warmup": {"enabled": False},
        "shutdown": {"flush_timeout": "2s"},
    }
    config_path = os.path.join(workdir, "hicached.toml")
    with open(config_path, "w") as f:
        f.write(to_toml(cfg))
    sock = os.path.join(workdir, "run/d.sock")
    log_path = os.path.join(workdir, "daemon.log")
    pid = _serve_as(daemon_user.pw_uid, daemon_user.pw_gid, config_path, log_path)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert time.monotonic() < deadline, open(log_path).read()
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), open(log_path).read()
            time.sleep(0.05)
        steps = [("drain", {"cancel": False}), ("drain", {"cancel": True}), ("flush", {}), ("reload", {})]
        own = run_as(daemon_user.pw_uid, daemon_user.pw_gid, ask, sock, steps)
        assert [a.get("code") for a in own] == [None] * 4, own
        engine = run_as(engine_user.pw_uid, engine_user.pw_gid, ask, sock, steps)
        assert [a.get("code") for a in engine] == [UNAUTHORIZED] * 4, engine
        assert [a.get("code") for a in ask(sock, steps)] == [None] * 4
    finally:
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        log = open(log_path).read()
        shutil.rmtree(workdir, ignore_errors=True)
    assert os.waitstatus_to_exitcode(status) == 0, log
    assert "Traceback" not in log, log


def _fuzz_as_engine(d: DaemonProcess, seed: int) -> list[str]:
    """A shortened fuzz_run (protocol_fuzz.py) in the engine's process: bursts of malformed requests of every
    op, controls among them, requests before hello and side region attaches."""
    f = Fuzzer(d, seed)
    f.open_pair()
    for rnd in range(6):
        f.burst(f.a)
        if rnd % 2 == 0:
            f.burst(f.b)
        if rnd % 3 == 0:
            f.side_attach_burst()
            f.before_hello()
    f.close_all()
    return f.findings


@pytest.mark.parametrize("seed", [11, 12])
def test_protocol_fuzzer_as_an_engine(roles_daemon, engine_user, seed):
    """The protocol fuzzer from the engine's uid: every request gets one answer with a known code (never
    internal), controls that change the daemon `unauthorized`; nothing is left held, the backend stays
    attached, the daemon is not draining and exits 0 without an error in its log."""
    d = roles_daemon
    u = engine_user
    findings = run_as(u.pw_uid, u.pw_gid, _fuzz_as_engine, d, seed, timeout=300)
    if held := held_after_close(d):
        findings.append(f"held after every connection closed: {held}")
    st = d.ctl("status")
    if st["backend"] != "file" or st["draining"]:
        findings.append(f"the engine changed the daemon: backend {st['backend']}, draining {st['draining']}")
    if not d.ctl("stats")["server"]["unauthorized"]:
        findings.append("no control was refused: the fuzzer sent none that changes the daemon?")
    findings += check_stop(d)
    assert not findings, "\n".join(findings[:20])
