"""Daemon.reload and `ctl backend attach` in-process, for the failures no damaged file brings about: an
unexpected exception (a connector's constructor raising ValueError, a bug while applying) is a refusal that
says what happened, is logged with its traceback, leaves nothing of the new file applied, and is followed by
READY=1; the daemon goes on serving."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

import hicached.daemon.service.lifecycle as daemon_mod
from hicached import config
from hicached.common.errors import BACKEND_UNAVAILABLE, BAD_REQUEST, HicachedError
from hicached.daemon.service.lifecycle import Daemon
from hicached.daemon.service.notify import Notifier

GOOD = """
[server]
socket = "run/d.sock"
[pool]
capacity = "16MiB"
slab_size = "1MiB"
prefault = false
[storage]
backup_concurrency = {concurrency}
[storage.file]
root = "{root}"
[warmup]
enabled = false
"""


class RecordingNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__(address="")
        self.sent: list[tuple[str, ...]] = []

    def send(self, *fields: str) -> None:
        self.sent.append(fields)


def write(path: Path, concurrency: int = 4, root: str = "data") -> None:
    path.write_text(GOOD.format(concurrency=concurrency, root=root))


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "hicached.toml"
    write(p)
    return p


async def started(path: Path) -> Daemon:
    d = Daemon(config.load(path), config_path=str(path), notifier=RecordingNotifier())
    await d.startup()
    return d


async def stop(d: Daemon) -> None:
    d.handle_signal(signal.SIGTERM)
    await d.shutdown()


def states(n: RecordingNotifier) -> list[str]:
    return [f[0] for f in n.sent if f[0] in ("READY=1", "RELOADING=1")]


async def test_a_connector_constructor_raising_is_a_refusal(path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="hicached")
    d = await started(path)
    try:
        before, connector = d.cfg, d.tiers.connector

        def broken(cfg, name=None):
            raise ValueError("the library refuses this option")

        monkeypatch.setattr(daemon_mod, "build", broken)
        write(path, root="elsewhere")  # another root: the backend is rebuilt
        answer = await d.reload()
        assert answer == {"ok": False, "reason": "unexpected ValueError: the library refuses this option"}
        assert d.last_reload == "rejected: unexpected ValueError: the library refuses this option"
        assert d.reloads == {"ok": 0, "rejected": 1}
        assert d.cfg is before and d.tiers.cfg is before and d.tiers.connector is connector
        assert d.tiers.counters["backend.swap_failures"] == 1
        assert states(d.notifier) == ["READY=1", "RELOADING=1", "READY=1"]
        assert "last reload: rejected: unexpected ValueError" in d.notifier.sent[-1][1]
        (record,) = [r for r in caplog.records if "reload rejected" in r.getMessage()]
        assert record.exc_info is not None  # a bug's traceback reaches the log

        monkeypatch.undo()
        answer = await d.reload()
        assert answer["ok"] is True and d.last_reload == "ok"
        assert d.cfg.storage.file.root == "elsewhere"
    finally:
        await stop(d)


async def test_a_failure_while_applying_leaves_nothing_applied(path: Path, monkeypatch) -> None:
    d = await started(path)
    try:
        real = d.tiers.set_policy
        calls = []

        def fails_once(was_write_back: bool) -> None:
            calls.append(was_write_back)
            if len(calls) == 1:
                raise RuntimeError("a bug in applying")
            real(was_write_back)

        monkeypatch.setattr(d.tiers, "set_policy", fails_once)
        write(path, concurrency=2)
        answer = await d.reload()
        assert answer["ok"] is False and "RuntimeError: a bug in applying" in answer["reason"]
        assert d.cfg.storage.backup_concurrency == 4 and d.tiers.backup.concurrency == 4
        assert d.server.cfg is d.cfg and d.tiers.backend.cfg is d.cfg
        assert len(calls) == 2  # the old configuration was applied again
        answer = await d.reload()
        assert answer["ok"] is True and d.tiers.backup.concurrency == 2
    finally:
        await stop(d)


async def test_attach_answers_an_unexpected_connector_error_as_a_refusal(
    path: Path, monkeypatch, caplog
) -> None:
    d = await started(path)
    handler = d._control_handlers()["backend"]
    try:

        def broken(cfg, name=None):
            raise ValueError("no such option")

        monkeypatch.setattr(daemon_mod, "build", broken)
        with pytest.raises(HicachedError) as e:
            await handler(None, {"action": "attach", "name": "file"})
        assert e.value.code == BACKEND_UNAVAILABLE
        assert e.value.message == "backend file was not attached: unexpected ValueError: no such option"
        assert any(r.exc_info for r in caplog.records if "was not attached" in r.getMessage())
        assert d.tiers.backend.name == "file" and d.tiers.counters["backend.swap_failures"] == 1
        for req, words in [
            ({"action": "attach", "name": ["file"]}, "cannot attach backend ['file']"),
            ({"action": "attach", "name": "x" * 10_000}, "(10002 characters)"),
            ({"action": "attach", "name": "redis"}, "[storage.redis]"),
            ({"action": {"attach": 1}}, "unknown backend action {'attach': 1}"),
        ]:
            with pytest.raises(HicachedError) as e:
                await handler(None, req)
            assert e.value.code == BAD_REQUEST and words in e.value.message, e.value.message
            assert len(e.value.message) < 400
    finally:
        await stop(d)


async def test_a_daemon_without_a_file_refuses_reloads_and_says_ready(tmp_path: Path) -> None:
    p = tmp_path / "hicached.toml"
    write(p)
    d = Daemon(config.load(p), notifier=RecordingNotifier())
    await d.startup()
    try:
        answer = await d.reload()
        assert answer["ok"] is False and "not started from a configuration file" in answer["reason"]
        assert states(d.notifier)[-2:] == ["RELOADING=1", "READY=1"]
    finally:
        await stop(d)
