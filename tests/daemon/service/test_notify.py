"""The systemd notifier: a STATUS= text is one bounded line, whatever a rejected reload's reason quotes (a
TOML key may hold a line break: `"a\\nREADY=1" = 1`)."""

from __future__ import annotations

import socket

from hicached.daemon.service.notify import STATUS_MAX_CHARS, Notifier


def test_status_is_one_line_and_bounded(tmp_path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sd:
        sd.bind(path)
        sd.settimeout(5)
        n = Notifier(path)
        try:
            n.ready("last reload: rejected: a\nREADY=1\r\nSTOPPING=1: unknown key")
            assert sd.recv(65536).decode().splitlines() == [
                "READY=1",
                "STATUS=last reload: rejected: a READY=1 STOPPING=1: unknown key",
            ]
            n.status("x" * 5000)
            (line,) = sd.recv(65536).decode().splitlines()
            assert len(line) == len("STATUS=") + STATUS_MAX_CHARS and line.endswith("...")
        finally:
            n.close()
