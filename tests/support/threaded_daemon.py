"""The real daemon on its own uvloop in a thread of the test's process, that a test stops and starts again
(tests/engine: the clients' reconnect, the adapters' link)."""

from __future__ import annotations

import asyncio
import signal
import threading

import uvloop

from hicached import config
from hicached.daemon.service.lifecycle import Daemon


def cfg(tmp_path):
    return config.from_dict(
        {
            "server": {"socket": "run/d.sock"},
            "pool": {"capacity": "16MiB", "slab_size": "1MiB", "prefault": False},
            "storage": {"backend": "none"},  # a restart empties L2: pages from before are misses
        },
        base_dir=str(tmp_path),
    )


class ThreadedDaemon:
    """A daemon on its own uvloop in a thread, that a test stops and starts again."""

    def __init__(self, tmp_path) -> None:
        self.cfg = cfg(tmp_path)
        self.thread: threading.Thread | None = None
        self.daemon: Daemon | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> ThreadedDaemon:
        ready = threading.Event()

        async def main() -> None:
            d = Daemon(self.cfg)
            self.daemon, self.loop = d, asyncio.get_running_loop()
            await d.startup()
            ready.set()
            await d.main_loop()
            await d.shutdown()

        self.thread = threading.Thread(target=uvloop.run, args=(main(),), daemon=True)
        self.thread.start()
        assert ready.wait(30)
        return self

    def stop(self) -> None:
        if self.thread is None:
            return
        self.loop.call_soon_threadsafe(self.daemon.handle_signal, signal.SIGTERM)
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.thread = None
