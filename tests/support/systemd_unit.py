"""The daemon started as systemd starts a unit with FileDescriptorStoreMax=: NOTIFY_SOCKET set to a stand-in
(systemd_notify.NotifySocket), and whatever its store holds passed in LISTEN_FDS / LISTEN_FDNAMES /
LISTEN_PID, activated sockets first (tests/e2e/conftest.py's `systemd` fixture starts them)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

from daemon_proc import DaemonProcess
from systemd_notify import NotifySocket


@contextlib.contextmanager
def reading(store: NotifySocket) -> Iterator[None]:
    """The stand-in reads its socket meanwhile, as systemd does: a start that takes back several tenants'
    pools sends more notifications than a datagram socket queues (net.unix.max_dgram_qlen, 10 by default),
    and would block on a reader that waits for it to be up."""
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            store.drain(0.05)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


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

    def wait_up(self, timeout: float) -> SystemdDaemon:
        with reading(self.store):
            super().wait_up(timeout)
        return self

    def crash(self) -> None:
        """SIGKILL, then what it sent before dying taken in."""
        self.stop(sig=9)
        self.store.drain(0.2)
