"""The daemon started as systemd starts a unit with FileDescriptorStoreMax=: NOTIFY_SOCKET set to a stand-in
(systemd_notify.NotifySocket), and whatever its store holds passed in LISTEN_FDS / LISTEN_FDNAMES /
LISTEN_PID, activated sockets first (tests/e2e/conftest.py's `systemd` fixture starts them)."""

from __future__ import annotations

import os
import subprocess
import sys

from daemon_proc import DaemonProcess
from systemd_notify import NotifySocket


class SystemdDaemon(DaemonProcess):
    def __init__(self, workdir: str, overrides: dict, store: NotifySocket, fdstore: int = 4) -> None:
        super().__init__(workdir, overrides)
        self.store = store
        self.fdstore = fdstore  # the unit's FileDescriptorStoreMax=
        self.sockets: list[tuple[str, int]] = []  # activated sockets, passed before the stored fds

    def start(self, timeout: float = 60.0) -> SystemdDaemon:
        self.store.drain(0.2)  # what the previous instance sent (FDSTORE=1, FDSTOREREMOVE=1) comes first
        with open(self.log_path, "ab") as log:
            self.proc = self.store.launch(
                [sys.executable, "-m", "hicached", "serve", "--config", self.config_path],
                self.sockets + self.store.stored,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, "NOTIFY_SOCKET": self.store.path, "FDSTORE": str(self.fdstore)},
            )
        return self.wait_up(timeout)

    def crash(self) -> None:
        """SIGKILL, then what it sent before dying taken in."""
        self.stop(sig=9)
        self.store.drain(0.2)
