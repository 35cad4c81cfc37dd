"""What the benchmarks share: a real daemon as a subprocess on a configuration of its own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hicached import HicachedError
from hicached.engine.client import control


class Daemon:
    """`python -m hicached serve` on `config_text`; ready on enter, stopped on exit whatever happened."""

    def __init__(self, work: Path, config_text: str, config_name: str = "hicached.toml") -> None:
        cfg = work / config_name
        cfg.write_text(config_text)
        self.sock = str(work / "run" / "hicached.sock")
        self.log_path = work / "daemon.log"
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "hicached", "serve", "--config", str(cfg)]
        # A session of its own: a Ctrl-C reaches only us, and we stop the daemon in order.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Daemon:
        try:
            deadline = time.monotonic() + 60
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    control(self.sock, "status", timeout=2.0)
                    return self
                except HicachedError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def flush(self) -> None:
        """Returns when nothing is left to back up (the daemon's `flush` control request)."""
        ans = control(self.sock, "flush", timeout=120.0)
        if not ans.get("flushed"):
            raise RuntimeError(f"flush did not complete: {ans}")

    def stop(self) -> None:
        try:
            self.proc.terminate()
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass  # killed below
        finally:  # also when a second Ctrl-C lands here: never leave the daemon behind
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
