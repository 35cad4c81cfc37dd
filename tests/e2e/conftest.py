import pytest
from daemon_proc import DaemonProcess
from systemd_notify import NotifySocket
from systemd_unit import SystemdDaemon


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProcess] = []

    def make(overrides=None, start=True, name="d") -> DaemonProcess:
        d = DaemonProcess(str(tmp_path / name), overrides)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.alive:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


@pytest.fixture
def fd_store(tmp_path):
    """A stand-in for systemd's notify socket and file-descriptor store."""
    s = NotifySocket(str(tmp_path / "notify.sock"))
    yield s
    s.close()


@pytest.fixture
def systemd(tmp_path, fd_store):
    """make(overrides, fdstore=4): a daemon started as systemd starts a unit (SystemdDaemon) in tmp_path/d
    over `fd_store`; each one started is killed at the end if still running."""
    started: list[SystemdDaemon] = []

    def make(overrides: dict | None = None, fdstore: int = 4) -> SystemdDaemon:
        d = SystemdDaemon(str(tmp_path / "d"), overrides or {}, fd_store, fdstore)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        if d.alive:
            d.proc.kill()
            d.proc.wait()
