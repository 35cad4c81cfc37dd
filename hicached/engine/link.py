"""An engine adapter's connection to the daemon (hicached.engine.sglang, hicached.engine.vllm): made on first
use and again after it broke, with backoff; while there is none, calls answer a miss and never raise, and
each kind of failure is logged once until the daemon answers again."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Generic, TypeVar

from hicached.common.errors import TIMEOUT, HicachedError
from hicached.common.retry import Backoff
from hicached.engine.reconnect import AWAY

C = TypeVar("C")
T = TypeVar("T")

RECONNECT_MAX_S = 30.0  # the longest wait between two connects while the daemon stays away


def connect_backoff(first_s: float) -> Backoff:
    """The waits after failed connects: `first_s`, doubling up to RECONNECT_MAX_S."""
    return Backoff(attempts=0, base=first_s, max=RECONNECT_MAX_S, jitter=0.0)


class LogOnce:
    """Warnings said once a kind until the daemon answers again, not on every retry. Callable as
    `log_once(kind, message, *args)`."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._kinds: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, *args: Any) -> None:
        with self._lock:
            if kind in self._kinds:
                return
            self._kinds.add(kind)
        self._logger.warning("hicached: " + message + " (logged once until the daemon answers again)", *args)

    def reset(self) -> bool:
        """The daemon answered: every kind may be logged again. Whether any had been (a reconnect)."""
        with self._lock:
            again = bool(self._kinds)
            self._kinds.clear()
        return again


class Link(Generic[C]):
    """One connection `C` to the daemon (a `Client` and what was registered on it), as an adapter holds it.

    Built on the client's reconnect: a `Client` dials again by itself for its `reconnect` seconds
    (hicached.engine.reconnect), and raises `connection` once the daemon stayed away longer; a `Client` made
    with `reconnect=0` raises at once. This is what comes after: the call answers `default`, the connection
    is dropped (on the errors in `drop`: by default those that say the daemon is away), and the next use
    makes a new one with `connect` (which may register memory again, or pick another namespace). The first
    connect after a drop is tried at once; a connect that fails waits `backoff` before the next
    (`connect_backoff`), in whichever thread asks then (a caller never waits for the backoff, only for a
    connect under way in another thread). Nothing here raises."""

    def __init__(
        self,
        path: str,
        connect: Callable[[], C],
        disconnect: Callable[[C], None],
        *,
        backoff: Backoff,
        log_once: LogOnce,
        connected: Callable[[C, bool], None],
        down: str = "cannot connect to %s (%s); answering misses, retrying",
        failed: str = "%s failed (%s); answering a miss",
        drop: Collection[str] = AWAY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`connect()` makes a connection (raising if it cannot: closing what it made first), and
        `disconnect(conn)` closes one. `connected(conn, again)` is told of each new connection (`again`:
        a failure had been logged since the last). `down` is logged (with the path and the error) when a
        connect fails, `failed` (with the call's name and the error) when a call does."""
        self.path = path
        self.connects = 0  # connections made
        self._connect = connect
        self._disconnect = disconnect
        self._backoff = backoff
        self._log_once = log_once
        self._connected = connected
        self._down = down
        self._failed = failed
        self._drop = frozenset(drop)
        self._clock = clock
        self._conn: C | None = None
        self._lock = threading.Lock()  # one connect at a time; held while it runs
        self._closed = False
        self._failures = 0  # connects failed in a row
        self._retry_at = 0.0

    @property
    def reachable(self) -> bool:
        return self._conn is not None

    def get(self) -> C | None:
        """The connection: the one held, or a new one if the backoff allows a try now; None while there is
        none (the daemon is away, or the link closed)."""
        with self._lock:
            if self._conn is not None or self._closed:
                return self._conn
            now = self._clock()
            if now < self._retry_at:
                return None
            try:
                conn = self._connect()
            except Exception as e:
                self._failures += 1
                self._retry_at = now + self._backoff.delay(self._failures)
                self._log_once("connect", self._down, self.path, e)
                return None
            self._conn, self._failures = conn, 0
            self.connects += 1
        self._connected(conn, self._log_once.reset())
        return conn

    def call(self, what: str, fn: Callable[[C], T], default: T, drop_on_timeout: bool = True) -> T:
        """fn(conn), or `default` when there is no connection or the call failed (logged once a kind).
        `drop_on_timeout=False` keeps a connection whose answer timed out, for a call that holds nothing
        that only closing it gives back (a lookup)."""
        conn = self.get()
        if conn is None:
            return default
        try:
            return fn(conn)
        except Exception as e:
            code = e.code if isinstance(e, HicachedError) else type(e).__name__
            if (code in self._drop and (drop_on_timeout or code != TIMEOUT)) or isinstance(e, OSError):
                self.drop(conn)
            self._log_once(f"{what}:{code}", self._failed, what, e)
            return default

    def drop(self, conn: C) -> None:
        """Closes `conn`; the next use connects again, at once the first time."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._retry_at = 0.0
        with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
            self._disconnect(conn)

    def close(self, bye: Callable[[C], None] | None = None) -> None:
        """Closes the connection, after `bye(conn)` (errors ignored); no connection is made after this. Once
        it returns, no connect is under way."""
        with self._lock:
            conn, self._conn, self._closed = self._conn, None, True
        if conn is None:
            return
        if bye is not None:
            with contextlib.suppress(Exception):
                bye(conn)
        with contextlib.suppress(Exception):
            self._disconnect(conn)
