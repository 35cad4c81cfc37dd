"""Reloads of a damaged configuration file, with the daemon as a subprocess on a real Redis backend: an empty
or white-space file, bytes that are not UTF-8, a file that cannot be read, a TOML error, a schema error. Each
is refused with its reason, by SIGHUP and by `hicached ctl reload` (exit 1, never an internal error); the
daemon keeps the backend it had and serves on; `ctl status` and systemd's STATUS= say `rejected: <reason>`
until the next good reload, and READY=1 follows every RELOADING=1.

Regression: SIGHUP after hicached.toml was emptied swapped the running Redis backend for the default file
backend and reported ok; a byte that is not UTF-8 made `ctl reload` answer `[internal] UnicodeDecodeError`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from daemon_proc import DaemonProcess, merge, to_toml, without_file_capabilities
from servers import RedisServer
from systemd_notify import NotifySocket

from hicached.engine.client import Client

PAGE = 16 * 1024
NS = "reload.ns"


def _unreadable(d: DaemonProcess) -> None:
    """A file no one can read, root included: a directory in its place (mode 000: see the test of its own)."""
    os.unlink(d.config_path)
    os.mkdir(d.config_path)


def _write(data: bytes) -> Callable[[DaemonProcess], None]:
    def damage(d: DaemonProcess) -> None:
        with open(d.config_path, "wb") as f:
            f.write(data)

    return damage


def _schema_error(d: DaemonProcess) -> None:
    d.write_config(to_toml(merge(d.config, {"storage": {"backup_concurrency": 0}})))


def _not_utf8(d: DaemonProcess) -> None:
    # The whole good file, with one Latin-1 byte in a comment: only the encoding is wrong.
    _write(b"# caf\xe9\n" + to_toml(d.config).encode())(d)


# name -> (how the file is damaged, words the reason must hold)
DAMAGES: dict[str, tuple[Callable[[DaemonProcess], None], str]] = {
    "empty": (_write(b""), "is empty: refusing to run on the built-in defaults"),
    "white space": (_write(b" \n\t\n  \n"), "is empty: refusing to run on the built-in defaults"),
    "not utf-8": (_not_utf8, "is not UTF-8 text: byte 0xe9 at line 1, column 6"),
    "unreadable": (_unreadable, "is a directory"),
    "toml error": (_write(b"[pool\ncapacity = \n"), "is not valid TOML"),
    "schema error": (_schema_error, "storage.backup_concurrency: must be greater than 0"),
}


def restore(d: DaemonProcess) -> None:
    if os.path.isdir(d.config_path):
        shutil.rmtree(d.config_path)
    d.write_config()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def on_redis(server: RedisServer, prefix: str) -> dict:
    return {"storage": {"backend": "redis", "redis": {"url": server.url, "prefix": prefix}}}


def ctl(d: DaemonProcess, *args: str, how: str = "--socket") -> subprocess.CompletedProcess:
    where = ["--socket", d.socket] if how == "--socket" else ["--config", d.config_path]
    return subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", *where, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_rejected(d: DaemonProcess, count: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = d.ctl("status")
        if status["reloads"]["rejected"] >= count or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def serves_on_redis(d: DaemonProcess, server: RedisServer, prefix: str, key: str) -> None:
    """A page stored now reaches Redis under the daemon's prefix: the backend is still the one it had."""
    page = os.urandom(PAGE)
    with Client(d.socket, NS, PAGE) as c:
        assert c.store([key], [page]) == [True]
    assert d.ctl("flush")["flushed"] is True
    with contextlib.closing(redis.Redis.from_url(server.url)) as rc:
        assert rc.get(f"{prefix}:{NS}:{key}").endswith(page)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_is_refused_and_the_running_configuration_stays(
    daemon_factory, redis_server, damage: str
) -> None:
    prefix = damage.replace(" ", "_")
    d = daemon_factory(on_redis(redis_server, prefix))
    spoil, words = DAMAGES[damage]

    # By SIGHUP (systemctl reload).
    spoil(d)
    d.proc.send_signal(signal.SIGHUP)
    status = wait_rejected(d, 1)
    assert status["reloads"] == {"ok": 0, "rejected": 1}, status
    assert status["last_reload"].startswith("rejected: ") and words in status["last_reload"], status
    assert status["backend"] == "redis" and status["backend_state"] == "attached"
    serves_on_redis(d, redis_server, prefix, "k1")

    # By `hicached ctl reload`: exit 1 and the reason, on stderr and in the answer.
    r = ctl(d, "reload")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "reload rejected" in r.stderr and words in r.stderr
    assert "internal" not in r.stdout + r.stderr
    assert "ok: False" in r.stdout and words in r.stdout
    status = d.ctl("status")
    assert status["reloads"] == {"ok": 0, "rejected": 2} and words in status["last_reload"]
    assert status["backend"] == "redis"
    assert "write_policy" in status and status["write_policy"] == "write_through"
    serves_on_redis(d, redis_server, prefix, "k2")

    # `ctl status` still says rejected; a good file clears it.
    assert words in ctl(d, "status").stdout
    restore(d)
    r = ctl(d, "reload")
    assert r.returncode == 0, r.stderr
    status = d.ctl("status")
    assert status["last_reload"] == "ok" and status["reloads"] == {"ok": 1, "rejected": 2}
    assert status["backend"] == "redis"
    assert words in d.log()  # the log said why, too
    assert "Traceback" not in d.log() and "internal error" not in d.log()
    assert d.stop() == 0


def test_a_file_of_mode_000_is_refused(tmp_path: Path) -> None:
    """The unreadable file as a daemon of another uid meets it: a daemon run as root gives up the powers
    that let root read a file of mode 000 (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so this runs in CI too."""
    d = DaemonProcess(str(tmp_path / "d"), preexec=without_file_capabilities if os.geteuid() == 0 else None)
    try:
        d.start()
        os.chmod(d.config_path, 0)
        d.proc.send_signal(signal.SIGHUP)
        status = wait_rejected(d, 1)
        assert "cannot read configuration file" in status["last_reload"], status
        assert "Permission denied" in status["last_reload"] and status["backend"] == "file"
        r = ctl(d, "reload")
        assert r.returncode == 1 and "Permission denied" in r.stderr, r.stderr
        os.chmod(d.config_path, 0o600)
        assert ctl(d, "reload").returncode == 0 and d.ctl("status")["last_reload"] == "ok"
        assert d.stop() == 0
    finally:
        if d.alive:
            d.proc.kill()
            d.proc.wait()


def test_ctl_reload_with_config_reaches_the_daemon_of_a_file_it_refuses(daemon_factory) -> None:
    """`ctl --config FILE reload` reads only server.socket from FILE: with a schema error elsewhere in it, it
    reaches the daemon and prints the daemon's reason. A file that does not even parse names no socket: ctl
    says so and asks for --socket (exit 2) without touching the daemon."""
    d = daemon_factory()
    _schema_error(d)
    r = ctl(d, "reload", how="--config")
    assert r.returncode == 1 and "storage.backup_concurrency: must be greater than 0" in r.stderr
    _write(b"[server\n")(d)
    r = ctl(d, "reload", how="--config")
    assert r.returncode == 2 and "not valid TOML" in r.stderr and "--socket" in r.stderr
    assert d.ctl("status")["reloads"] == {"ok": 0, "rejected": 1}
    assert d.stop() == 0


def test_systemd_hears_ready_after_every_reloading_and_the_rejection_in_status(
    daemon_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = NotifySocket(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", listener.path)
    try:
        d = daemon_factory()
        listener.next(lambda m: m.get("READY") == "1")
        for name, (spoil, words) in DAMAGES.items():
            for trigger in ("SIGHUP", "ctl"):
                spoil(d)
                if trigger == "SIGHUP":
                    d.proc.send_signal(signal.SIGHUP)
                else:
                    assert ctl(d, "reload").returncode == 1
                listener.next(lambda m: m.get("RELOADING") == "1")
                ready = listener.next(lambda m: m.get("READY") == "1")
                assert "last reload: rejected: " in ready["STATUS"], (name, trigger, ready)
                assert words in ready["STATUS"], (name, trigger, ready)
                assert "backend file (attached)" in ready["STATUS"]
                restore(d)
        # A reason quoting a key with a line break in it stays one STATUS= line: no STOPPING=1 of its own.
        d.write_config('"a\\nSTOPPING=1" = 1\n')
        assert ctl(d, "reload").returncode == 1
        listener.next(lambda m: m.get("RELOADING") == "1")
        ready = listener.next(lambda m: m.get("READY") == "1")
        assert "STOPPING" not in ready and "unknown key in the top level" in ready["STATUS"], ready
        d.write_config(to_toml(merge(d.config, {"storage": {"backend": "none"}})))
        assert ctl(d, "reload").returncode == 0
        listener.next(lambda m: m.get("RELOADING") == "1")
        ready = listener.next(lambda m: m.get("READY") == "1")
        assert ready["STATUS"].endswith("last reload: ok") and "backend none" in ready["STATUS"]
        assert d.stop() == 0
        listener.next(lambda m: m.get("STOPPING") == "1")
        # READY=1 after every RELOADING=1, none missing, none out of order.
        states = [m for m in listener.drain() if "RELOADING" in m or "READY" in m]
        assert [("RELOADING" in m) for m in states] == [False] + [True, False] * (2 * len(DAMAGES) + 2)
    finally:
        listener.close()
