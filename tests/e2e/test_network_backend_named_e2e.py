"""A redis or s3 backend is used only when the file names its server: without [storage.redis] /
[storage.s3] (and its url / bucket) it is refused, naming the section, by `hicached ctl backend attach`
(exit 1), at start-up and on reload, instead of falling back on redis://127.0.0.1:6379 (where an
application's own Redis may listen). With the section, each works, on real servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess, merge, to_toml
from servers import MotoServer, RedisServer, aws_env

BUCKET = "hicached-named"


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for k, v in aws_env(tmp_path).items():
        monkeypatch.setenv(k, v)  # the daemon subprocess inherits them: the standard AWS chain
    r = RedisServer(tmp_path / "redis")
    m = MotoServer(tmp_path / "moto")
    try:
        r.start()
        m.start()
        m.create_bucket(BUCKET)
        yield r, m
    finally:
        r.stop()
        m.stop()


def sections(r: RedisServer, m: MotoServer) -> dict:
    return {
        "redis": {"url": r.url, "prefix": "named"},
        "s3": {"bucket": BUCKET, "endpoint_url": m.endpoint_url, "addressing_style": "path"},
    }


def ctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicached", "ctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_start_up_refuses_a_network_backend_without_its_section(daemon_factory, backend: str) -> None:
    d = daemon_factory({"storage": {"backend": backend}}, start=False)
    with pytest.raises(RuntimeError, match=r"exited with 2"):
        d.start()
    assert f"[storage.{backend}]" in d.log() and "invalid configuration" in d.log()
    assert "Traceback" not in d.log()


def test_attach_refuses_a_backend_the_file_does_not_name(daemon_factory) -> None:
    d = daemon_factory()  # file backend; no [storage.redis] nor [storage.s3]
    for name in ("redis", "s3"):
        r = ctl(d, "backend", "attach", name)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"[storage.{name}]" in r.stderr and "bad_request" in r.stderr
        assert "internal" not in r.stderr
    status = d.ctl("status")
    assert status["backend"] == "file" and status["backend_state"] == "attached"
    assert d.ctl("stats")["counters"].get("backend.swap_failures", 0) == 0  # refused before building
    assert ctl(d, "backend", "attach", "file").returncode == 0  # the file backend has its default root
    assert d.stop() == 0


def test_reload_refuses_a_network_backend_without_its_section(daemon_factory) -> None:
    d = daemon_factory()
    for backend in ("redis", "s3"):
        d.write_config(to_toml(merge(d.config, {"storage": {"backend": backend}})))
        r = ctl(d, "reload")
        assert r.returncode == 1 and f"[storage.{backend}]" in r.stderr, r.stderr
        status = d.ctl("status")
        assert status["backend"] == "file" and f"[storage.{backend}]" in status["last_reload"]
    assert d.stop() == 0


def test_named_sections_work_at_start_up_by_attach_and_on_reload(daemon_factory, stores) -> None:
    r, m = stores
    d = daemon_factory({"storage": {"backend": "redis", **sections(r, m)}})
    assert d.ctl("status")["backend"] == "redis"
    for name in ("s3", "file", "redis"):
        out = ctl(d, "backend", "attach", name)
        assert out.returncode == 0, out.stderr
        assert d.ctl("status")["backend"] == name
    # Reloaded to s3: the backend swaps. Then a file that drops [storage.redis] while the backend is the
    # file one: the reload is fine, and from then on an attach of redis is refused.
    d.config = merge(d.config, {"storage": {"backend": "s3"}})
    d.write_config()
    assert ctl(d, "reload").returncode == 0 and d.ctl("status")["backend"] == "s3"
    d.config["storage"] = {k: v for k, v in d.config["storage"].items() if k != "redis"} | {"backend": "file"}
    d.write_config()
    assert ctl(d, "reload").returncode == 0 and d.ctl("status")["backend"] == "file"
    out = ctl(d, "backend", "attach", "redis")
    assert out.returncode == 1 and "[storage.redis]" in out.stderr
    assert ctl(d, "backend", "attach", "s3").returncode == 0
    assert d.stop() == 0
