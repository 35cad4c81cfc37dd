"""What an operation yields to the client that drives it: requests sent now, held, or answered by nobody,
and the waits on their answers; also the check that the daemon closed the connection."""

from __future__ import annotations

import select
from collections.abc import Callable, Generator
from typing import Any

Op = Generator[dict[str, Any], dict[str, Any] | None, Any]


def peer_closed_check(fd: int) -> Callable[[], bool]:
    """A check, one poll(2) that does not wait, that the daemon has closed or reset the connection on `fd`
    (the peer's FIN shows as POLLRDHUP before anything has read it). Thread-safe: a poll object each call
    (one object cannot be polled from two threads at once)."""

    def closed() -> bool:
        p = select.poll()
        p.register(fd, select.POLLRDHUP)
        return bool(p.poll(0))

    return closed


class _NoReply(dict):
    """A request whose answer nobody waits for (a lease release): it saves a round trip."""


class _Send(dict):
    """A request sent now whose answer is collected later with `_Await(ticket)`: the driver answers the
    yield with a ticket at once. Lets an operation keep the daemon busy while it copies."""


class _SendNow(_Send):
    """A _Send written at once (with whatever the driver held), not at the next wait."""


def _held(req: Any) -> bool:
    """Whether a driver keeps `req`'s frame until the operation next waits or sends something else (a
    plain _Send): the frames then go in one write, e.g. a store's allocations."""
    return isinstance(req, _Send) and not isinstance(req, _SendNow)


class _Await:
    __slots__ = ("ticket",)

    def __init__(self, ticket: Any) -> None:
        self.ticket = ticket
