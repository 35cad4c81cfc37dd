"""The attached L3 backend: every call to it goes through here, which times it, counts it, tracks what is
in flight (so a swap can drain the old backend), and trips a circuit breaker after repeated failures.

Swap: the new connector is started and probed first; then new work goes to it at once, calls in flight
on the old one finish (bounded by storage.drain_timeout) and the old one is closed. Breaker: after
storage.breaker.failures consecutive failed calls, or as soon as it stalls (calls in flight, none finished
for storage.breaker.stall_timeout), the backend is detached, the daemon serves from L2, and the backend is
probed with backoff until it answers, then re-attached.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hicached.common.retry import Backoff
from hicached.config import Config
from hicached.connectors.base import BackendError, BackendUnavailable, BackendUnsupported, Connector

log = logging.getLogger("hicached.backend")

T = TypeVar("T")

# Upper bounds of the latency histogram buckets, in seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# How a kind of call's typical time is kept: an exponentially weighted mean of its successful calls, each new
# one weighing this much, used once there were this many.
_TYPICAL_WEIGHT = 0.1
_TYPICAL_SAMPLES = 8


class _Pending:
    """Stands in `Backend.tripped` while the configured backend has not started yet."""

    name = "pending"

    def __init__(self, error: BackendError) -> None:
        self.error = error

    async def close(self) -> None:
        """Nothing to release: no connector was built."""


class _Call:
    """A backend call in flight."""

    __slots__ = ("conn", "op", "start", "counted")

    def __init__(self, conn: Connector, op: str, start: float) -> None:
        self.conn = conn
        self.op = op
        self.start = start
        self.counted = False  # counted as a slow call already


class Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(LATENCY_BUCKETS) and seconds > LATENCY_BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.sum += seconds
        self.count += 1


class Backend:
    def __init__(
        self,
        cfg: Config,
        counters: collections.Counter[str],
        on_attach: Callable[[Connector], None] | None = None,
        on_detach: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.current: Connector | None = None
        self.tripped: Connector | None = None  # detached by the breaker, being probed
        self.latency: dict[tuple[str, str], Histogram] = collections.defaultdict(Histogram)
        self._inflight: collections.Counter[int] = collections.Counter()
        self._idle: dict[int, asyncio.Event] = {}
        self._failures = 0
        self._probe_task: asyncio.Task[None] | None = None
        # Bumped when a connector to another store (Connector.location) is attached: what the pages in L2
        # know of being in L3, and writes in flight to the old store, say nothing of the new one.
        self.epoch = 0
        self._location: tuple | None = None
        # Called with the connector after it is attached (by a swap or a re-attach): the tiers queue the
        # pages in L2 that are not in L3 yet.
        self.on_attach: Callable[[Connector], None] = on_attach or (lambda c: None)
        self.on_detach: Callable[[], None] = on_detach or (lambda: None)
        # The calls in flight on each connector (by task: a stall abandons them), with when and what they are.
        self._calls: dict[asyncio.Task, _Call] = {}
        self._abandoned: set[asyncio.Task] = set()  # cancelled by a stall; their call raises "stalled"
        # When a call to the current connector last finished or moved (Connector.progress), or it came.
        self._progress = time.monotonic()
        self._seen = 0  # the current connector's progress when last looked at
        self._typical: dict[str, tuple[float, int]] = {}  # op -> (typical seconds, calls it is made of)
        self._watch_task: asyncio.Task[None] | None = None
        # Why the backend is not attached, and since when (wall clock): for ctl status and the metrics.
        self.why = ""
        self.since = 0.0

    @property
    def name(self) -> str:
        return self.current.name if self.current else "none"

    @property
    def configured(self) -> str:
        """The backend's name whether attached or detached by the breaker (name says "none" then)."""
        return self.tripped.name if isinstance(self.tripped, Connector) else self.name

    @property
    def state(self) -> str:
        if self.current is not None:
            return "attached"
        if isinstance(self.tripped, _Pending):
            return "starting"
        if self.tripped is None:
            return "detached"
        return "stalled" if self.why.startswith("stalled") else "breaker_open"

    async def call(self, op: str, fn: Callable[[Connector], Awaitable[T]], timeout: float | None = None) -> T:
        """Runs `fn` on the current connector, bounded by `timeout` (default storage.operation_timeout)."""
        conn = self.current
        if conn is None:
            raise BackendUnavailable("none", "no L3 backend is attached", "detached")
        key = id(conn)
        self._inflight[key] += 1
        task = asyncio.current_task()
        start = time.perf_counter()
        if task is not None:
            self._calls[task] = _Call(conn, op, time.monotonic())
        try:
            async with asyncio.timeout(self.cfg.storage.operation_timeout if timeout is None else timeout):
                result = await fn(conn)
        except TimeoutError:
            self._failure(conn, "timeout")
            raise BackendUnavailable(conn.name, f"{op} did not finish in time", "timeout") from None
        except BackendUnsupported:
            raise  # the backend works; it just cannot do this
        except BackendError as e:
            self._failure(conn, e.reason)
            raise
        except asyncio.CancelledError:
            if task not in self._abandoned:
                raise
            self._abandoned.discard(task)
            if task.uncancel():  # cancelled by its caller too: that one stands
                raise
            # The stall cancelled it, not its caller: the caller hears of a failed call.
            self.counters[f"backend.failures.{conn.name}.stalled"] += 1
            raise BackendUnavailable(conn.name, f"{op} abandoned: the backend stalled", "stalled") from None
        else:
            # A clear epoch's read (a few bytes, hicached.daemon.sched.epochs) says nothing of whether page
            # calls get through: it neither ends a run of failures nor sets what a typical call takes.
            if conn is self.current and op != "epoch":
                self._failures = 0
                self._typical_add(op, time.perf_counter() - start)
            return result
        finally:
            seconds = time.perf_counter() - start
            self.latency[(conn.name, op)].observe(seconds)
            if task is not None:
                self._calls.pop(task, None)
                if task in self._abandoned:  # the connector made the stall's cancel an error of its own
                    self._abandoned.discard(task)
                    task.uncancel()
            if conn is self.current and op != "epoch":  # a mark's read is no sign that pages move
                self._progress = time.monotonic()
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]
                ev = self._idle.pop(key, None)
                if ev is not None:
                    ev.set()

    def _typical_add(self, op: str, seconds: float) -> None:
        mean, n = self._typical.get(op, (seconds, 0))
        self._typical[op] = (mean + _TYPICAL_WEIGHT * (seconds - mean) if n else seconds, n + 1)

    def start(self) -> None:
        """Starts watching the calls in flight for a stall (storage.breaker.stall_timeout) and for calls far
        slower than usual (storage.breaker.slow_factor)."""
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch(), name="backend-watch")

    async def _watch(self) -> None:
        while True:
            br = self.cfg.storage.breaker  # read each turn: a reload may change it
            tick = min(0.25, br.stall_timeout / 8) if br.stall_timeout > 0 else 0.25
            before = time.monotonic()
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - before > 2 * tick + 0.1:
                # The event loop itself was held up (a CPU-starved node, a long callback): the backend's
                # answers that came meanwhile wait in the loop's queue behind this look, so its silence says
                # nothing yet. The next look, after them, decides.
                continue
            try:
                self.check(now)
            except Exception:  # a bug here must not end the watch for the daemon's lifetime
                log.exception("the backend's stall watch failed a look; it goes on")

    def check(self, now: float) -> None:
        """One look at the current connector's calls in flight: a stall detaches it; each call past
        slow_factor times its kind's typical time counts once as a failure."""
        conn = self.current
        if conn is None:
            return
        if conn.progress != self._seen:  # a long call still moves: pieces of it ended
            self._seen, self._progress = conn.progress, now
        br = self.cfg.storage.breaker
        calls = [(t, c) for t, c in self._calls.items() if c.conn is conn]
        if not calls:
            return
        oldest = min(c.start for _, c in calls)
        quiet = now - max(self._progress, oldest)
        if br.stall_timeout > 0 and quiet >= br.stall_timeout:
            self._stalled(conn, len(calls), quiet)
            return
        if br.slow_factor <= 0:
            return
        for _, c in calls:
            mean, n = self._typical.get(c.op, (0.0, 0))
            if c.counted or n < _TYPICAL_SAMPLES:
                continue
            age = now - c.start
            if age >= max(br.stall_timeout, br.slow_factor * mean):
                c.counted = True
                why = f"slow: a {c.op} call ran {age:.1f}s, {age / mean:.0f}x its recent {mean * 1e3:.0f} ms"
                self._failure(conn, "slow", why)
                if self.current is not conn:
                    return

    def _stalled(self, conn: Connector, calls: int, quiet: float) -> None:
        """Detaches a backend that finished none of its calls in flight for stall_timeout, and abandons those
        calls: their callers get a failed call now (pages read are misses, pages written stay in L2) rather
        than at operation_timeout."""
        self.counters["backend.stalls"] += 1
        why = f"stalled: {calls} calls in flight, none finished or moved in {quiet:.1f}s"
        self._trip(conn, why)
        for task, c in list(self._calls.items()):
            if c.conn is conn and not task.done():
                self._abandoned.add(task)
                task.cancel()

    def note_location(self, conn: Connector) -> None:
        location = conn.location()
        if location != self._location:
            if self._location is not None:
                self.epoch += 1
            self._location = location

    def _failure(self, conn: Connector, reason: str, detail: str = "") -> None:
        self.counters[f"backend.failures.{conn.name}.{reason}"] += 1
        if conn is not self.current:
            return
        self._failures += 1
        if self._failures >= self.cfg.storage.breaker.failures:
            self._trip(conn, f"failed {self._failures} calls in a row (last: {detail or reason})")

    def _trip(self, conn: Connector, why: str) -> None:
        """The breaker opens: `conn` is detached, the daemon serves from L2, and `conn` is probed with backoff
        until it answers (then re-attached)."""
        self.counters["backend.breaker_trips"] += 1
        log.error("L3 backend %s %s; detached: serving from L2, probing it", conn.name, why)
        self._failures = 0
        self.current = None
        self.tripped = conn
        self.why, self.since = why, time.time()
        self.on_detach()
        self._probe_task = asyncio.get_running_loop().create_task(
            self._until_usable(conn, lambda: self._reprobe(conn))
        )

    async def _reprobe(self, conn: Connector) -> Connector:
        await conn.probe(timeout=self.cfg.storage.operation_timeout)
        return conn

    def attach_when_ready(self, factory: Callable[[], Connector], first_error: BackendError) -> None:
        """The configured backend could not start: serve from L2 and keep trying to build, start and
        probe a new connector with backoff; attach the first one that answers."""
        token = self.tripped = _Pending(first_error)
        self.why, self.since = f"not started: {first_error}", time.time()

        async def fresh() -> Connector:
            conn = factory()
            try:
                await conn.start()
                await conn.probe(timeout=self.cfg.storage.operation_timeout)
            except BaseException:
                await _close(conn)
                raise
            return conn

        self._probe_task = asyncio.get_running_loop().create_task(self._until_usable(token, fresh))

    async def _until_usable(self, token: object, attempt_fn: Callable[[], Awaitable[Connector]]) -> None:
        """Calls `attempt_fn` with backoff while `token` is what `tripped` holds; attaches what it returns."""
        br = self.cfg.storage.breaker
        backoff = Backoff(attempts=1 << 30, base=br.probe_interval, max=br.probe_max_interval, jitter=0.1)
        attempt = 1
        while self.tripped is token:
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1
            try:
                conn = await attempt_fn()
            except (BackendError, OSError) as e:
                self.counters["backend.probe_failures"] += 1
                log.debug("backend still not usable: %s", e)
                continue
            if self.tripped is not token or self.current is not None:
                if conn is not token:
                    await _close(conn)
                return
            log.info("L3 backend %s answers; attached", conn.name)
            self.tripped = None
            self._attaching(conn)
            self.counters["backend.reattached"] += 1
            self.on_attach(conn)
            return

    async def _stop_probing(self) -> None:
        self.tripped = None
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None

    async def attach(self, new: Connector | None, probe: bool = True) -> None:
        """Makes `new` (already started) the backend; the old one drains and is closed. With `probe`, the
        new one must first pass a write/read/delete probe, or it is closed and BackendError is raised."""
        if new is not None and probe:
            try:
                await new.probe(timeout=self.cfg.storage.operation_timeout)
            except BaseException:
                await _close(new)
                raise
        old = self.current or (self.tripped if isinstance(self.tripped, Connector) else None)
        await self._stop_probing()
        self._failures = 0
        if new is not None:
            self._attaching(new)
        else:
            self.current = None
            self.why, self.since = "detached by ctl", time.time()
            self.on_detach()
        if new is not None:
            self.on_attach(new)
        if old is not None and old is not new:
            await self._drain_and_close(old)

    def _attaching(self, conn: Connector) -> None:
        """`conn` becomes the current backend: its speed is learnt afresh, its silence counted from now."""
        self.note_location(conn)
        self.current = conn
        self.why, self.since = "", 0.0
        self._typical.clear()
        self._progress, self._seen = time.monotonic(), conn.progress

    async def _drain_and_close(self, old: Connector) -> None:
        key = id(old)
        if self._inflight.get(key):
            ev = self._idle.setdefault(key, asyncio.Event())
            try:
                async with asyncio.timeout(self.cfg.storage.drain_timeout):
                    await ev.wait()
            except TimeoutError:
                log.warning(
                    "backend %s still had %d calls in flight after %.0fs; closing it anyway",
                    old.name,
                    self._inflight.get(key, 0),
                    self.cfg.storage.drain_timeout,
                )
        await _close(old)

    async def stop(self) -> None:
        """Stops watching for stalls (start() undone)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None

    async def close(self) -> None:
        await self.stop()
        tripped = self.tripped if isinstance(self.tripped, Connector) else None
        await self._stop_probing()
        if tripped is not None:
            await _close(tripped)
        old, self.current = self.current, None
        if old is not None:
            await self._drain_and_close(old)

    def stats(self) -> dict:
        out = {
            "name": self.name,
            "state": self.state,
            "inflight": sum(self._inflight.values()),
            "counters": dict(self.current.counters) if self.current else {},
        }
        if self.current is None:
            out["why"] = self.why or "no backend configured"
            if self.since:
                out["since"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return out


async def _close(conn: Connector) -> None:
    """Closes a connector that is being let go: a failure to close it is logged, never raised over what the
    caller is doing (a swap, a detach, a shutdown)."""
    try:
        await conn.close()
    except Exception:
        log.warning("closing backend %s failed; it is dropped anyway", conn.name, exc_info=True)
