"""The adapters' link to the daemon (hicached.engine.link), over real clients of an in-process daemon that
stops and starts again: misses while the daemon is away, connects again only as the backoff allows (a clock
the tests move), at once after a drop, failures logged once a kind until the daemon answers again, the
client's own reconnect under it, and no connection after close."""

from __future__ import annotations

import logging
import threading

import pytest
from threaded_daemon import ThreadedDaemon

from hicached.common.errors import BAD_REQUEST, CONNECTION, TIMEOUT, HicachedError
from hicached.engine.client import Client
from hicached.engine.link import RECONNECT_MAX_S, Link, LogOnce, connect_backoff

PAGE = 32 * 1024
FIRST_S = 1.0
log = logging.getLogger("tests.engine.link")


class Clock:
    """The link's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A link whose connections are real clients of the daemon at `socket`; it records each dial, each
    connection it was told of (with `again`), and each connection closed."""

    def __init__(self, socket: str, reconnect: float = 0.0, **kw) -> None:
        self.socket = socket
        self.reconnect = reconnect
        self.clock = Clock()
        self.dials = 0
        self.connected: list[tuple[Client, bool]] = []
        self.closed: list[Client] = []
        self.link: Link[Client] = Link(
            socket,
            self.dial,
            self.disconnect,
            backoff=connect_backoff(FIRST_S),
            log_once=LogOnce(log),
            connected=lambda c, again: self.connected.append((c, again)),
            clock=self.clock,
            **kw,
        )

    def dial(self) -> Client:
        self.dials += 1
        return Client(self.socket, "link.test", PAGE, timeout=5, reconnect=self.reconnect)

    def disconnect(self, c: Client) -> None:
        self.closed.append(c)
        c.close()

    def exists(self, keys: list[str]) -> int:
        return self.link.call("exists", lambda c: c.exists(keys), -1)


@pytest.fixture
def daemon(tmp_path):
    d = ThreadedDaemon(tmp_path)
    yield d
    d.stop()


def socket_of(tmp_path) -> str:
    return str(tmp_path / "run" / "d.sock")


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name and r.levelno == logging.WARNING]


def test_the_backoff_doubles_from_the_first_wait_up_to_the_cap():
    b = connect_backoff(1.5)
    assert [b.delay(n) for n in range(1, 7)] == [1.5, 3.0, 6.0, 12.0, 24.0, RECONNECT_MAX_S]
    assert b.delay(100) == RECONNECT_MAX_S


def test_a_daemon_away_answers_misses_and_is_dialled_again_as_the_backoff_allows(daemon, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    r = Rig(socket_of(tmp_path))
    assert r.exists(["a"]) == -1 and r.dials == 1 and not r.link.reachable
    assert r.exists(["a"]) == -1 and r.dials == 1  # within the first wait: not dialled
    r.clock.now += FIRST_S
    assert r.exists(["a"]) == -1 and r.dials == 2
    r.clock.now += 2 * FIRST_S - 0.01  # the second wait is twice the first
    assert r.exists(["a"]) == -1 and r.dials == 2
    r.clock.now += 0.01
    assert r.exists(["a"]) == -1 and r.dials == 3
    [said] = warnings(caplog)  # three failed connects, one line
    assert said.startswith(f"hicached: cannot connect to {r.socket} (") and "logged once" in said

    daemon.start()
    r.clock.now += 4 * FIRST_S
    assert r.exists(["a"]) == 0 and r.dials == 4 and r.link.reachable and r.link.connects == 1
    assert [again for _, again in r.connected] == [True]  # a failure had been logged: "connected again"
    assert r.exists(["a"]) == 0 and r.dials == 4  # the connection is kept

    # The daemon answered: the next failure is logged again, and the backoff starts over from the first wait.
    daemon.stop()
    assert r.exists(["a"]) == -1 and not r.link.reachable
    assert r.exists(["a"]) == -1 and r.dials == 5  # dropped: dialled again at once, and that failed
    assert r.exists(["a"]) == -1 and r.dials == 5
    r.clock.now += FIRST_S
    assert r.exists(["a"]) == -1 and r.dials == 6
    assert len(warnings(caplog)) == 3  # the call's failure and the connect's, once each, after the first


def test_a_connection_the_daemon_closed_is_dropped_and_made_again_at_the_next_use(daemon, tmp_path):
    daemon.start()
    r = Rig(socket_of(tmp_path))
    assert r.link.call("store", lambda c: c.store(["k"], [bytes(PAGE)]), None) == [True]
    first = r.link.get()
    daemon.stop()
    assert r.link.call("store", lambda c: c.store(["k2"], [bytes(PAGE)]), None) is None
    assert r.closed == [first] and not r.link.reachable
    daemon.start()
    assert r.exists(["k"]) == 0 and r.dials == 2 and r.link.connects == 2  # at once: no wait after a drop
    assert r.link.get() is not first
    assert [again for _, again in r.connected] == [False, True]


def test_the_clients_own_reconnect_covers_a_quick_restart(daemon, tmp_path):
    daemon.start()
    r = Rig(socket_of(tmp_path), reconnect=10.0)
    assert r.exists(["a"]) == 0
    c = r.link.get()
    daemon.stop()
    daemon.start()
    # The client dials again by itself, within its wait: the link keeps it, and never connected anew.
    assert r.exists(["a"]) == 0 and r.link.get() is c and c.reconnects == 1
    assert r.dials == 1 and r.link.connects == 1 and not r.closed


def test_a_failure_that_says_nothing_of_the_daemon_keeps_the_connection(daemon, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    daemon.start()
    r = Rig(socket_of(tmp_path))
    c = r.link.get()

    def refused(_: Client) -> int:
        raise HicachedError(BAD_REQUEST, "no")

    assert [r.link.call("exists", refused, -1) for _ in range(3)] == [-1] * 3
    assert r.link.get() is c and not r.closed
    [said] = warnings(caplog)  # three failures of one kind, one line
    assert said.startswith("hicached: exists failed ([bad_request] no); answering a miss")


@pytest.mark.parametrize("drop_on_timeout", [True, False])
def test_a_timeout_drops_the_connection_unless_the_call_holds_nothing(daemon, tmp_path, drop_on_timeout):
    daemon.start()
    r = Rig(socket_of(tmp_path))
    c = r.link.get()

    def late(_: Client) -> int:
        raise HicachedError(TIMEOUT, "no answer within 5s")

    assert r.link.call("lookup", late, -1, drop_on_timeout=drop_on_timeout) == -1
    assert r.link.reachable is not drop_on_timeout and r.closed == ([c] if drop_on_timeout else [])


def test_the_errors_that_drop_are_the_adapters_choice(daemon, tmp_path):
    daemon.start()
    r = Rig(socket_of(tmp_path), drop=(CONNECTION, BAD_REQUEST))

    def refused(_: Client) -> int:
        raise HicachedError(BAD_REQUEST, "the region was dropped")

    assert r.link.call("load", refused, -1) == -1 and not r.link.reachable
    assert r.exists(["a"]) == 0 and r.link.connects == 2


def test_a_failed_connect_after_the_client_was_made_answers_a_miss(daemon, tmp_path):
    daemon.start()
    made: list[Client] = []

    def dial() -> Client:
        c = Client(socket_of(tmp_path), "link.test", PAGE, timeout=5, reconnect=0)
        made.append(c)
        c.close()  # what an adapter's connect does when registering its memory fails
        raise HicachedError(CONNECTION, "the daemon went away while the region was registered")

    link: Link[Client] = Link(
        socket_of(tmp_path),
        dial,
        Client.close,
        backoff=connect_backoff(FIRST_S),
        log_once=LogOnce(log),
        connected=lambda c, again: None,
    )
    assert link.call("exists", lambda c: c.exists(["a"]), -1) == -1 and link.get() is None
    assert len(made) == 1 and link.connects == 0


def test_threads_asking_at_once_share_one_connection(daemon, tmp_path):
    daemon.start()
    r = Rig(socket_of(tmp_path))
    start = threading.Barrier(8)
    got: list[Client | None] = []

    def ask() -> None:
        start.wait()
        got.append(r.link.get())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.dials == 1 and len(got) == 8 and got[0] is not None and all(c is got[0] for c in got)


def test_close_says_goodbye_and_no_connection_is_made_after(daemon, tmp_path):
    daemon.start()
    r = Rig(socket_of(tmp_path))
    c = r.link.get()
    bye: list[Client] = []
    r.link.close(bye=bye.append)
    assert bye == [c] and r.closed == [c] and not r.link.reachable
    r.clock.now += 1000
    assert r.link.get() is None and r.exists(["a"]) == -1 and r.dials == 1
    r.link.close()  # again: nothing to close
    assert r.closed == [c]
