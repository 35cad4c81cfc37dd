"""Running as a service: the systemd notify protocol (checked with a real NOTIFY_SOCKET listener),
SIGHUP reloads good and broken, ctl backend/drain, metrics, the unit file."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from daemon_proc import to_toml
from ports import free_port

from hicached.common.errors import HicachedError
from hicached.engine.client import Client, control

PAGE = 64 * 1024


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[dict[str, str]] = []

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            for m in self.messages:
                if key in m and (value is None or m[key] == value):
                    self.messages.remove(m)
                    return m
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {key}={value} notification; got {self.messages}")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536).decode()
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notified(daemon_factory, tmp_path, monkeypatch):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", listener.path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    d = daemon_factory(start=False)
    d.start()
    # WATCHDOG_PID cannot name a pid before the process exists; without it the daemon takes
    # WATCHDOG_USEC as its own, as sd_watchdog_enabled does.
    yield d, listener
    listener.close()


def test_notify_ready_reload_stopping_and_watchdog(notified):
    d, listener = notified
    ready = listener.wait_for("READY", "1")
    assert "backend file (attached)" in ready["STATUS"]
    listener.wait_for("WATCHDOG", "1")
    listener.wait_for("WATCHDOG", "1")  # pings keep coming while the loop runs
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    d.proc.send_signal(signal.SIGHUP)
    reloading = listener.wait_for("RELOADING", "1")
    assert int(reloading["MONOTONIC_USEC"]) >= before
    after = listener.wait_for("READY", "1")
    assert "last reload: ok" in after["STATUS"]
    # A broken file: still READY=1 afterwards (or systemctl reload would hang), and the status says why.
    d.write_config("[pool\ncapacity = ")
    d.proc.send_signal(signal.SIGHUP)
    listener.wait_for("RELOADING", "1")
    after = listener.wait_for("READY", "1")
    assert "last reload: rejected" in after["STATUS"]
    assert d.stop() == 0
    listener.wait_for("STOPPING", "1")


def test_broken_toml_on_sighup_keeps_the_old_config(daemon):
    keys = [f"k{i}" for i in range(10)]
    with Client(daemon.socket, "reload.ns", PAGE) as c:
        assert all(c.store(keys, [os.urandom(PAGE) for _ in keys]))
        good = open(daemon.config_path).read()
        for broken, why in [
            ("[storage]\nbackend = 'tape'\n", "storage.backend"),
            ("[pool]\ncapacity = 'lots'\n", "pool.capacity"),
            ("[server]\nsocket = 'x'\nbogus = 1\n", "server.bogus"),
            ("this is not toml", "not valid TOML"),
        ]:
            daemon.write_config(broken)
            daemon.proc.send_signal(signal.SIGHUP)
            for _ in range(1500):
                status = daemon.ctl("status")
                if why in status["last_reload"]:
                    break
                time.sleep(0.02)
            assert status["last_reload"].startswith("rejected") and why in status["last_reload"], status
            assert status["backend"] == "file"
            assert c.exists(keys) == 10  # still serving
        assert why in daemon.log()
        daemon.write_config(good)
        answer = daemon.ctl("reload")
        assert answer["ok"] is True


def test_reload_applies_live_changes_and_reports_restart_ones(daemon):
    cfg = dict(daemon.config)
    cfg["pool"] = dict(cfg["pool"], capacity="256MiB")
    cfg["storage"] = dict(cfg["storage"], backup_concurrency=2, write_policy="write_back")
    cfg["logging"] = {"level": "debug"}
    daemon.write_config(to_toml(cfg))
    answer = daemon.ctl("reload")
    assert answer["ok"] is True
    assert answer["restart_required"] == ["pool.capacity"]
    assert "storage.backup_concurrency" in answer["applied"] and "storage.write_policy" in answer["applied"]
    status = daemon.ctl("status")
    assert status["write_policy"] == "write_back"
    assert status["capacity_bytes"] == 128 << 20  # unchanged: needs a restart
    with Client(daemon.socket, "live.ns", PAGE) as c:
        c.store(["a"], [os.urandom(PAGE)])
        assert c.stats()["pool"]["dirty"] == 1  # write-back now


def test_ctl_backend_detach_attach_and_drain(daemon):
    keys = [f"d{i}" for i in range(20)]
    pages = [os.urandom(PAGE) for _ in keys]

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hicached", "ctl", "--socket", daemon.socket, "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    with Client(daemon.socket, "swap.ns", PAGE) as c:
        assert '"state": "detached"' in ctl("backend", "detach").stdout
        # L2 only: stores and loads still work.
        assert all(c.store(keys, pages)) and c.get(keys) == pages
        assert c.stats()["pool"]["dirty"] == 0
        out = ctl("backend", "attach", "file")
        assert out.returncode == 0 and '"state": "attached"' in out.stdout
        # Pages stored while detached are backed up once a backend is attached again.
        assert daemon.ctl("flush")["flushed"]
        assert c.stats()["counters"]["backup.pages"] == 20
        bad = ctl("backend", "attach", "tape")
        assert bad.returncode == 1 and "cannot attach" in bad.stderr
        assert ctl("backend", "show").returncode == 0
        assert ctl("drain").returncode == 0
        with pytest.raises(HicachedError) as e:
            c.exists(keys)
        assert e.value.code == "draining"
        assert ctl("drain", "cancel").returncode == 0
        assert c.exists(keys) == 20


def test_metrics_endpoint(daemon_factory):
    port = free_port()
    d = daemon_factory({"metrics": {"listen": f"127.0.0.1:{port}"}})
    with Client(d.socket, "m.ns", PAGE) as c:
        c.store(["a", "b"], [os.urandom(PAGE), os.urandom(PAGE)])
        c.get(["a", "b", "c"])
        d.ctl("flush")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        held = re.search(r"^hicached_pool_reserved_bytes (\S+)$", body, re.M)
        assert held and float(held.group(1)) > 0  # the client holds slots ahead for its next stores
    for _ in range(1500):  # given back once the daemon has seen the connection close
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        if re.search(r"^hicached_pool_reserved_bytes 0\.0$", body, re.M):
            break
        time.sleep(0.02)
    assert re.search(r"^hicached_pool_reserved_bytes 0\.0$", body, re.M)
    assert re.search(r"^hicached_stored_pages_total 2\.0$", body, re.M)
    assert re.search(r"^hicached_backed_up_pages_total 2\.0$", body, re.M)
    assert re.search(r'^hicached_backend_attached\{backend="file",state="attached"\} 1\.0$', body, re.M)
    assert 'hicached_backend_latency_seconds_bucket{backend="file",le="+Inf",op="put"}' in body
    assert "hicached_pool_capacity_bytes" in body
    # A fleet's figures (docs/fleet.md): a node alone has read no other node's page and seen no clear.
    assert re.search(r"^hicached_l3_other_nodes_pages_total", body, re.M) is None or re.search(
        r"^hicached_l3_other_nodes_pages_total 0\.0$", body, re.M
    )
    assert re.search(r"^hicached_l3_janitor_removed_pages_total 0\.0$", body, re.M)
    on_disk = re.search(r"^hicached_l3_file_bytes (\S+)$", body, re.M)
    assert on_disk and float(on_disk.group(1)) >= 2 * PAGE
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)


def test_unit_file_verifies():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    unit = open(os.path.join(os.path.dirname(__file__), "..", "..", "config", "hicached.service")).read()
    hicached = shutil.which("hicached") or "/bin/true"
    unit = unit.replace("/usr/local/bin/hicached", hicached)
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hicached-{os.getpid()}.service")
    with open(tmp, "w") as f:
        f.write(unit)
    try:
        out = subprocess.run([analyze, "verify", tmp], capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(tmp)
    version = int(
        re.search(
            r"systemd (\d+)", subprocess.run([analyze, "--version"], capture_output=True, text=True).stdout
        ).group(1)
    )
    problems = [line for line in out.stderr.splitlines() if "hicached" in line]
    if version < 253:
        # Type=notify-reload and ReloadSignal= arrived in systemd 253; older versions warn about them only.
        problems = [p for p in problems if "notify-reload" not in p and "ReloadSignal" not in p]
    assert not problems, out.stderr


def test_unit_stop_timeout_covers_the_shipped_configs_longest_stop():
    """systemd kills a daemon still stopping at TimeoutStopSec: with config/hicached.toml, a stop may
    answer requests in flight for up to server.request_timeout, then flush for shutdown.flush_timeout."""
    from hicached import config

    here = os.path.join(os.path.dirname(__file__), "..", "..", "config")
    unit = open(os.path.join(here, "hicached.service")).read()
    stop = re.search(r"^TimeoutStopSec=(\d+)s$", unit, re.M)
    assert stop is not None, "the unit sets TimeoutStopSec in seconds"
    cfg = config.load(os.path.join(here, "hicached.toml"))
    longest = min(cfg.server.request_timeout, cfg.shutdown.flush_timeout) + cfg.shutdown.flush_timeout
    assert int(stop.group(1)) > longest


def test_socket_activation(tmp_path):
    """A listening socket handed over as systemd does (fd 3, LISTEN_FDS, LISTEN_PID) is served, and left
    in place at exit: it belongs to the service manager."""
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    cfg = tmp_path / "hicached.toml"
    cfg.write_text(
        to_toml(
            {
                "server": {"socket": "unused/never.sock"},
                "pool": {"capacity": "64MiB", "slab_size": "4MiB", "prefault": False},
                "storage": {"backend": "none"},
                "warmup": {"enabled": False},
            }
        )
    )
    # LISTEN_PID must be the daemon's own pid: set it in a wrapper that then execs the daemon (same pid).
    wrapper = (
        "import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ['LISTEN_FDS'] = '1';"
        "os.environ['LISTEN_PID'] = str(os.getpid());"
        "os.execv(sys.executable, [sys.executable, '-m', 'hicached', 'serve', '--config', sys.argv[2]])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, str(listener.fileno()), str(cfg)],
        pass_fds=[listener.fileno()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    listener.close()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status = control(path, "status", timeout=2)
                break
            except HicachedError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
                time.sleep(0.05)
        assert status["socket"] == path
        assert not os.path.exists(tmp_path / "unused")
        with Client(path, "act.ns", PAGE) as c:
            assert c.store(["a"], [b"\1" * PAGE]) == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert os.path.exists(path), "the activated socket is the service manager's: not unlinked"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
