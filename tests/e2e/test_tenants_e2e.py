"""Tenants (issue #23, point 2) with real processes of other uids against the daemon as a subprocess: a
peer belongs to the first tenant it matches (its socket, then its uid, then its gid, else the default tenant
if admitted at all), opens only its tenant's namespaces, sees only its tenant in `stats`, and a reload that
takes a namespace from a tenant closes the connection that used it."""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from other_uid import OPERATOR_USER, other_user, run_as, shared_workdir

from hicached.common.errors import HicachedError
from hicached.engine.client import Client, control

PAGE = 16 * 1024
GID_B = 54350  # tenant b's gid: a uid of no tenant with this primary gid is in b
UID_ALLOWED = 54351  # in server.allowed_uids, in no tenant: the default tenant
UID_NOBODY = 54352  # neither: refused


def whoami(path: str) -> dict[str, Any]:
    """The tenant `status` names for this process through `path`, or the error it got."""
    try:
        return {"tenant": control(path, "status", timeout=30.0)["tenant"]}
    except HicachedError as e:
        return {"code": e.code, "message": e.message}


def open_namespace(path: str, namespace: str) -> dict[str, Any]:
    try:
        with Client(path, namespace, PAGE, timeout=30, reconnect=0) as c:
            stored = c.store(["k0"], [b"\7" * PAGE])
            return {"stored": stored, "namespaces": sorted(c.stats()["namespaces"])}
    except HicachedError as e:
        return {"code": e.code, "message": e.message}


def held_until_closed(path: str, namespace: str) -> dict[str, Any]:
    """Opens `namespace`, then calls until the daemon closes the connection."""
    with Client(path, namespace, PAGE, timeout=30, reconnect=0) as c:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                c.exists(["k0"])
            except HicachedError as e:
                return {"code": e.code}
            time.sleep(0.05)
    return {"code": "still open"}


@pytest.fixture
def engine_user():
    return other_user()


@pytest.fixture
def tenants_daemon(engine_user):
    """Tenants a (the engine user's uid, and a socket of its own), b (a gid) and c (a socket, and the
    operator user's uid), beside server.allowed_uids = [UID_ALLOWED]."""
    operator = other_user(OPERATOR_USER)
    workdir = shared_workdir("hicached-tenants-")
    d = DaemonProcess(
        workdir,
        {
            "server": {"socket_mode": "0666", "allowed_uids": [UID_ALLOWED]},
            "tenants": {
                "a": {"uids": [engine_user.pw_uid], "namespaces": ["a.*"], "capacity": "32MiB"},
                "b": {"gids": [GID_B], "namespaces": ["b.*"], "capacity": "32MiB"},
                "c": {
                    "uids": [operator.pw_uid],
                    "socket": "run/c.sock",
                    "namespaces": ["c.*"],
                    "capacity": "32MiB",
                },
            },
            "shutdown": {"flush_timeout": "5s"},
        },
    )
    d.start()
    d.operator = operator
    d.c_socket = f"{workdir}/run/c.sock"
    try:
        yield d
    finally:
        if d.alive:
            d.proc.kill()
            d.proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_membership_is_the_socket_then_the_uid_then_the_gid_then_the_default_tenant(
    tenants_daemon, engine_user
):
    d, u = tenants_daemon, engine_user
    assert run_as(u.pw_uid, u.pw_gid, whoami, d.socket) == {"tenant": "a"}
    assert run_as(u.pw_uid, GID_B, whoami, d.socket) == {"tenant": "a"}  # the uid before the gid
    assert run_as(u.pw_uid, u.pw_gid, whoami, d.c_socket) == {"tenant": "c"}  # the socket before the uid
    assert run_as(54353, GID_B, whoami, d.socket) == {"tenant": "b"}
    assert run_as(d.operator.pw_uid, d.operator.pw_gid, whoami, d.socket) == {"tenant": "c"}
    assert run_as(UID_ALLOWED, UID_ALLOWED, whoami, d.socket) == {"tenant": "default"}
    assert run_as(UID_ALLOWED, GID_B, whoami, d.socket) == {"tenant": "b"}  # a tenant's gid over allowed_uids
    refused = run_as(UID_NOBODY, UID_NOBODY, whoami, d.socket)
    assert refused["code"] == "unauthorized" and f"uid {UID_NOBODY}" in refused["message"], refused
    assert d.alive


def test_an_engine_opens_and_sees_only_its_tenants_namespaces(tenants_daemon, engine_user):
    d, u = tenants_daemon, engine_user
    assert run_as(54353, GID_B, open_namespace, d.socket, "b.model")["stored"] == [True]
    assert open_namespace(d.socket, "d.model")["stored"] == [True]  # root: the default tenant
    mine = run_as(u.pw_uid, u.pw_gid, open_namespace, d.socket, "a.model")
    assert mine == {"stored": [True], "namespaces": ["a.model"]}, mine
    for ns in ("b.model", "d.model", "c.model"):
        refused = run_as(u.pw_uid, u.pw_gid, open_namespace, d.socket, ns)
        assert refused["code"] == "unauthorized" and "not tenant 'a''s" in refused["message"], refused
    assert run_as(UID_ALLOWED, UID_ALLOWED, open_namespace, d.socket, "a.model")["code"] == "unauthorized"
    everything = control(d.socket, "stats", timeout=30.0)
    assert {"a.model", "b.model", "d.model"} <= set(everything["namespaces"])
    assert sorted(everything["tenants"]) == ["a", "b", "c", "default"]


def test_a_reload_that_takes_a_namespace_from_a_tenant_closes_its_connection(tenants_daemon, engine_user):
    d, u = tenants_daemon, engine_user
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.update(run_as(u.pw_uid, u.pw_gid, held_until_closed, d.socket, "a.old"))
    )
    t.start()
    deadline = time.monotonic() + 30
    while control(d.socket, "status", timeout=30.0)["tenants"]["a"] < 1:  # connected
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    d.config["tenants"]["a"]["namespaces"] = ["a.new"]
    d.write_config()
    answer = control(d.socket, "reload", timeout=30.0)
    assert answer["ok"] and answer["applied"] == ["tenants.a.namespaces"], answer
    t.join(60)
    assert out.get("code") == "connection", out
    assert "namespace 'a.old' is no longer tenant 'a''s" in d.log()
    assert run_as(u.pw_uid, u.pw_gid, open_namespace, d.socket, "a.old")["code"] == "unauthorized"
    assert run_as(u.pw_uid, u.pw_gid, open_namespace, d.socket, "a.new")["stored"] == [True]


def test_a_default_tenant_left_no_capacity_refuses_its_engines(engine_user):
    workdir = shared_workdir("hicached-tenants-full-")
    d = DaemonProcess(
        workdir,
        {
            "server": {"socket_mode": "0666", "allowed_uids": [UID_ALLOWED]},
            "pool": {"capacity": "64MiB"},
            "tenants": {"a": {"uids": [engine_user.pw_uid], "namespaces": ["a.*"], "capacity": "64MiB"}},
        },
    )
    try:
        d.start()
        refused = run_as(UID_ALLOWED, UID_ALLOWED, whoami, d.socket)
        assert refused["code"] == "unauthorized" and "the default tenant has no L2" in refused["message"]
        assert run_as(engine_user.pw_uid, engine_user.pw_gid, whoami, d.socket) == {"tenant": "a"}
        assert d.ctl("status")["tenants"] == {"a": 0, "default": 1}  # root, an operator: this very ctl
        assert open_namespace(d.socket, "d.model")["code"] == "unauthorized"  # root: no pool to store in
    finally:
        if d.alive:
            d.proc.kill()
            d.proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
