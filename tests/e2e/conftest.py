import pytest
from daemon_proc import DaemonProcess


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
