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


def test_a_service_manager_that_stops_reading_holds_a_send_for_the_time_out_only(tmp_path) -> None:
    """The event loop sends the notifications: with systemd's queue full (a stalled PID 1), a send gives up
    after the time-out and says so (False, logged), where a blocking one hung the daemon for good."""
    import os
    import time

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sd:
        sd.bind(path)  # never read
        n = Notifier(path, timeout=0.2)
        try:
            sent = 0
            start = time.monotonic()
            while n.send("STATUS=" + "x" * 1000) and time.monotonic() - start < 30:
                sent += 1
            took = time.monotonic() - start
            assert sent > 0 and took < 30  # the queue filled, and the send that found it full gave up
            fd = os.memfd_create("stored")
            try:
                t0 = time.monotonic()
                assert n.store_fd("hicached-l2", fd) is False  # not taken for stored
                assert time.monotonic() - t0 < 5
            finally:
                os.close(fd)
        finally:
            n.close()
