"""What `Client` and `AsyncClient` share to outlive a daemon restart: their settings and state, the checks
before a call, the redial schedule, and prefetch handles that tell the connection they were made on."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Protocol

from hicached.common.errors import CONNECTION, TIMEOUT, HicachedError
from hicached.common.retry import Backoff
from hicached.engine.ops import Op, _Ops
from hicached.engine.regions import RegionBook

# Both clients log under the name engines configure for them.
log = logging.getLogger("hicached.engine.client")

# A call that finds its connection gone dials again for up to `reconnect` seconds (the daemon restarting:
# stopping, then starting and verifying a kept pool, takes a second or two here), waiting between tries as
# this backoff says; once a whole wait has failed, later calls try one dial each until the daemon is back.
DEFAULT_RECONNECT_S = 3.0
_REDIAL = Backoff(attempts=0, base=0.05, max=0.5, jitter=0.2)
# The errors that say the daemon is away (not up yet, gone, or not answering), as against one that answered
# and refused: a redial goes on after them, and an adapter's link (hicached.engine.link) drops its
# connection on them and connects again later.
AWAY = (CONNECTION, TIMEOUT)
# A prefetch handle carries the number of the connection it was made on above these bits (none on the
# first), so that a handle from before a reconnect is told from the new connection's handles.
_GEN_SHIFT = 40


def _tagged(op: Op, gen: int) -> Op:
    return (yield from op) + (gen << _GEN_SHIFT)


def _answer(value: Any) -> Op:
    """An operation that needs no request."""
    return value
    yield  # a generator like every op


def _wait_op(ops: _Ops, gen: int, handle: int, timeout: float | None) -> Op:
    made_on = handle >> _GEN_SHIFT if isinstance(handle, int) and handle >= 0 else gen
    if made_on < gen:
        # Its prefetch went with the connection it was made on (the daemon restarted): nothing to wait
        # for. 0 says "no page is known to have arrived"; a load still finds every page L2 or L3 has.
        return _answer(0)
    return ops.op_wait(handle - (gen << _GEN_SHIFT) if made_on == gen else handle, timeout)


def _gone_message(path: str, why: str | None, waited: float, last: HicachedError) -> str:
    if not waited:  # an earlier call waited the whole `reconnect` already
        return f"the daemon at {path} is still not back ({last.message}); the next call tries again"
    return (
        f"the connection to the daemon at {path} broke ({why}) and no daemon answered again within "
        f"{waited:g}s (last try: {last.message}); the next call tries again"
    )


class _Connection(Protocol):
    """A client's connection as the checks before a call see it."""

    @property
    def broken(self) -> str | None: ...

    def gone(self) -> bool: ...


class _Reconnecting:
    """The part of both clients that does not depend on how they wait: the settings, the regions to register
    again, and the checks and bookkeeping of a reconnect. Each client dials, redials (in the calling thread,
    or in a task) and runs its operations its own way."""

    def __init__(self, namespace: str, page_bytes: int, timeout: float, reconnect: float) -> None:
        first = _Ops(namespace, page_bytes)  # checks both before anything is dialled
        self._namespace, self._page_bytes = first.namespace, first.page_bytes
        self.timeout = timeout
        self.reconnect = reconnect
        self._local = first.local  # local regions: this process's memory, the same on every connection
        self._regions = RegionBook()
        self._gens = itertools.count()
        self._closed = False
        self._down = False  # a whole reconnect wait failed: the next calls try one dial each
        self.reconnects = 0

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def _new_ops(self) -> _Ops:
        """The operations' state for a new connection: this client's namespace, page size, local regions."""
        ops = _Ops(self._namespace, self._page_bytes)
        ops.local = self._local
        return ops

    def _usable(self, wire: _Connection | None) -> bool:
        """Whether a new call runs on `wire` as it is; False: the daemon went away, and a reconnect is to
        replace it. Raises where neither: the client is closed or not connected, or never reconnects."""
        if self._closed:
            raise HicachedError(CONNECTION, "the client is closed")
        if wire is None:
            raise HicachedError(CONNECTION, "the client is not connected")
        if not wire.gone():
            return True
        if self.reconnect <= 0:
            raise HicachedError(CONNECTION, wire.broken or "the connection broke")
        return False

    def _may_retry(self, wire: _Connection, retry: bool) -> bool:
        """Whether a call that failed on `wire` runs once more on a new connection: the operation is safe to
        run twice (`retry`), and the daemon went away during it."""
        return retry and self.reconnect > 0 and not self._closed and wire.gone()


class _Redial:
    """One reconnect's tries: for up to `reconnect` seconds (one try once a whole wait has failed), with the
    backoff's pauses between them."""

    def __init__(self, client: _Reconnecting, path: str, why: str | None) -> None:
        self.client = client
        self.path = path
        self.why = why
        self.wait = 0.0 if client._down else client.reconnect
        self.deadline = time.monotonic() + self.wait
        self.attempt = 0

    def pause(self, e: HicachedError) -> float:
        """Seconds to wait before the next try, the last one having failed with `e`; raises when there is no
        next one (then the client is down: the next call tries one dial)."""
        # A daemon that answers and refuses (unauthorized, a bad hello) will not change its mind: say so
        # now. connection / timeout: not up (again) yet.
        if e.code not in AWAY:
            raise e
        self.attempt += 1
        delay = _REDIAL.delay(self.attempt)
        if time.monotonic() + delay > self.deadline:
            self.client._down = True
            raise HicachedError(CONNECTION, _gone_message(self.path, self.why, self.wait, e)) from None
        return delay

    def done(self) -> None:
        """The new connection is the client's."""
        self.client._down = False
        self.client.reconnects += 1
        log.info("hicached: connected again to %s (%s)", self.path, self.why)
