"""Runs the real daemon as a subprocess on a temporary configuration, for end-to-end tests."""

from __future__ import annotations

import copy
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from hicached.common.errors import HicachedError
from hicached.engine.client import control


def to_toml(d: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for test configurations: tables of strings, numbers, booleans and lists."""
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {_value(v)}")
    out = ""
    if lines:
        out += (f"[{prefix}]\n" if prefix else "") + "\n".join(lines) + "\n\n"
    for k, v in tables:
        out += to_toml(v, f"{prefix}.{k}" if prefix else k)
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new dict: `over` laid on `base`, table by table. Nothing of `base` is shared with it, so a test that
    changes its daemon's config (d.config["pool"][...] = ...) never changes BASE_CONFIG for the next one."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


BASE_CONFIG: dict[str, Any] = {
    "server": {"socket": "run/hicached.sock", "request_timeout": "20s"},
    "pool": {"capacity": "128MiB", "slab_size": "4MiB", "prefault": False},
    "storage": {"backend": "file", "file": {"root": "data"}, "retry": {"base": "10ms", "attempts": 3}},
    "logging": {"level": "info"},
    "shutdown": {"flush_timeout": "30s"},
    # Off unless a test is about it: tests of the L3 read path want an empty L2 after a restart.
    "warmup": {"enabled": False},
}


def without_file_capabilities() -> None:
    """A Popen preexec_fn: the daemon runs as root but without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (out
    of its bounding set, so exec does not give them back): file modes apply to it as to any user. How a
    test running as root (CI) plays a daemon of another uid against unreadable files, where a process of
    another uid could not run this Python (under /root) at all."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


class DaemonProcess:
    def __init__(
        self,
        workdir: str,
        overrides: dict[str, Any] | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.workdir = workdir
        self.preexec = preexec
        os.makedirs(workdir, exist_ok=True)
        self.config = merge(BASE_CONFIG, overrides or {})
        self.config_path = os.path.join(workdir, "hicached.toml")
        self.write_config()
        self.socket = os.path.join(workdir, self.config["server"]["socket"])
        self.log_path = os.path.join(workdir, "daemon.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, text: str | None = None) -> None:
        with open(self.config_path, "w") as f:
            f.write(text if text is not None else to_toml(self.config))

    def launch(self) -> subprocess.Popen[bytes]:
        """Starts the daemon without waiting for it to answer (a takeover: it waits on another instance)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hicached", "serve", "--config", self.config_path],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                preexec_fn=self.preexec,
            )
        return self.proc

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        self.launch()
        return self.wait_up(timeout)

    def wait_up(self, timeout: float) -> DaemonProcess:
        """Returns once the started daemon answers `status` (or refuses us, as configured)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                control(self.socket, "status", timeout=2.0)
                return self
            except HicachedError as e:
                if e.code == "unauthorized":
                    return self  # up, and refusing us as configured
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not come up in {timeout}s:\n{self.log()}") from None
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"daemon did not stop within {timeout}s:\n{self.log()}") from None
        code = self.proc.returncode
        self.proc = None
        return code

    def restart(self) -> DaemonProcess:
        code = self.stop()
        assert code == 0, f"daemon exited with {code}:\n{self.log()}"
        return self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ctl(self, op: str) -> dict[str, Any]:
        return control(self.socket, op, timeout=30.0)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


def wait_pid(path: str, pid: int, timeout: float = 60.0) -> None:
    """Returns once the daemon answering on `path` is process `pid` (a takeover handed it over)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if control(path, "status", timeout=5.0)["pid"] == pid:
                return
        except HicachedError:
            pass
        assert time.monotonic() < deadline, f"pid {pid} did not come to serve {path}"
        time.sleep(0.05)


def refused_line(d: DaemonProcess) -> tuple[str, str]:
    """Runs `d` to its end as a new instance that must refuse to take over: it exits 1 with one ERROR line.
    That line, and all it wrote on stderr."""
    r = subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--config", d.config_path],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=d.workdir,
    )
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, r.stderr
    return errors[0], r.stderr
