"""A datagram socket standing in for systemd's $NOTIFY_SOCKET that keeps every notification in the order it
came, so that tests can check what follows what (READY=1 after each RELOADING=1)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


class NotifySocket:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[dict[str, str]] = []  # every notification so far, oldest first
        self._seen = 0  # messages[:_seen] were handed out by next()

    def _receive(self, timeout: float) -> None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(65536).decode()
        except TimeoutError:
            return
        self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))

    def next(self, match: Callable[[dict[str, str]], bool], timeout: float = 30.0) -> dict[str, str]:
        """The first notification after the last one returned that `match` accepts (those it skips stay in
        `messages`)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(self._seen, len(self.messages)):
                if match(self.messages[i]):
                    self._seen = i + 1
                    return self.messages[i]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no such notification in {timeout}s; got {self.messages[self._seen :]}")
            self._receive(remaining)

    def drain(self, quiet: float = 0.3) -> list[dict[str, str]]:
        """Every notification, once none has come for `quiet` seconds."""
        n = -1
        while n != len(self.messages):
            n = len(self.messages)
            self._receive(quiet)
        return self.messages

    def close(self) -> None:
        self.sock.close()
