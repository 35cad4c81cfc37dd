"""Lookups of the vLLM tier without waiting under vLLM's lock: a step's new keys go to the daemon in one batch
at the step's end, on a thread of their own, and are answered from what came back; touches are queued and
sent in batches the same way (hicached.engine.vllm)."""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_TOUCHES = 65536  # keys waiting to be sent; past it the least recently touched are dropped
# While the daemon is down, lookups ask for a connection at most this often (the connection's own backoff
# then decides whether one is tried).
CONNECT_EVERY_S = 0.05


class Phase(enum.Enum):
    PENDING = 1  # asked this step; goes to the daemon when the step ends
    IN_FLIGHT = 2  # posted; its answer has not been drained yet
    RESOLVED = 3


class Answer(enum.Enum):
    HIT = 1
    MISS = 2
    RETRY = 3


@dataclass(slots=True)
class _Probe:
    generation: int
    deadline: float  # RETRY until then (the clock's seconds), MISS after while no answer came
    phase: Phase = Phase.PENDING
    found: bool | None = None
    requests: set[str] = field(default_factory=set)


Batch = list[tuple[bytes, int]]


class Lookups:
    """Per-key probes, as vLLM's AsyncLookupManager keeps them (per-request references, a generation so a
    late answer never lands on a newer probe, mark_miss after a failed load), except that one batch a step
    carries every request's keys to `resolve`, and that the wait is bounded. A key is answered RETRY while
    the daemon's answer is on its way, for `wait_s` from the first time it was asked; after that it is a
    MISS (counted in `late`) until the answer lands. A new key is a MISS at once, asked of no one, while
    `up()` is false (the daemon is down: an empty batch lets `resolve` try to connect again, off the lock),
    or while a batch posted more than `wait_s` ago is still unanswered (counted in `late`: a key asked now
    would queue behind it).

    All methods but the worker run under vLLM's manager lock; the worker only calls `resolve`."""

    def __init__(
        self,
        resolve: Callable[[Sequence[bytes]], Sequence[bool]],
        up: Callable[[], bool],
        name: str,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._up = up
        self._wait_s = wait_s
        self._clock = clock
        self._probes: dict[bytes, _Probe] = {}
        self._req_keys: dict[str, set[bytes]] = {}
        self._batch: Batch = []
        self._generation = 0
        self._posted: collections.deque[float] = collections.deque()  # when each batch out was posted
        self._connect_at = 0.0  # the daemon down: when a lookup may next ask for a connection
        self._todo: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[list[tuple[bytes, int, bool]]] = queue.SimpleQueue()
        self.late = 0  # lookups answered MISS because the daemon's answer had not come within wait_s
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def lookup(self, key: bytes, req_id: str) -> Answer:
        if self._posted:
            self._drain()
        probe = self._probes.get(key)
        if probe is None:
            now = self._clock()
            if not self._up():
                if not self._posted and now >= self._connect_at:
                    self._connect_at = now + CONNECT_EVERY_S
                    self._post([])
                return Answer.MISS
            if self._posted and now - self._posted[0] > self._wait_s:
                self.late += 1
                return Answer.MISS
            probe = self._probes[key] = _Probe(self._generation, now + self._wait_s)
            self._generation += 1
            self._batch.append((key, probe.generation))
        probe.requests.add(req_id)
        keys = self._req_keys.get(req_id)
        if keys is None:
            keys = self._req_keys[req_id] = set()
        keys.add(key)
        if probe.found is not None:
            return Answer.HIT if probe.found else Answer.MISS
        if self._clock() < probe.deadline:
            return Answer.RETRY
        self.late += 1
        return Answer.MISS

    def flush(self) -> None:
        """The step ended: its new keys go to the daemon in one batch."""
        self._drain()
        batch, self._batch = self._batch, []
        posted = []
        for key, generation in batch:
            probe = self._probes.get(key)
            if probe is None or probe.generation != generation:
                continue  # its requests finished within the step
            probe.phase = Phase.IN_FLIGHT
            posted.append((key, generation))
        if posted:
            self._post(posted)

    def _post(self, batch: Batch) -> None:
        self._posted.append(self._clock())
        self._todo.put(batch)

    def pending(self) -> bool:
        """Keys wait for the step's end, or for the daemon's answer."""
        self._drain()
        return bool(self._batch) or bool(self._posted)

    def mark_miss(self, keys: Collection[bytes]) -> None:
        """A load of these keys failed: answer MISS from now on (vLLM would otherwise promote them again
        and again, vLLM #49176). A newer probe still on its way keeps its own answer."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and probe.phase is Phase.RESOLVED:
                probe.found = False

    def cleanup(self, req_id: str) -> None:
        for key in self._req_keys.pop(req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.requests.discard(req_id)
            if not probe.requests and probe.phase is not Phase.IN_FLIGHT:
                del self._probes[key]

    def shutdown(self) -> None:
        self._todo.put(None)
        self._thread.join()
        self._drain()

    def _drain(self) -> None:
        while not self._done.empty():  # one reader (the lock's holder): not empty stays not empty
            answers = self._done.get_nowait()
            self._posted.popleft()  # batches come back in the order they were posted (one worker)
            for key, generation, found in answers:
                probe = self._probes.get(key)
                if probe is None or probe.generation != generation:
                    continue
                if not probe.requests:
                    del self._probes[key]
                    continue
                probe.found = found
                probe.phase = Phase.RESOLVED

    def _work(self) -> None:
        # An empty batch asks for nothing: `resolve` connects if it can (the daemon was down).
        while (batch := self._todo.get()) is not None:
            keys = [key for key, _ in batch]
            try:
                found = list(self._resolve(keys))
                if len(found) != len(keys):
                    raise ValueError(f"{len(found)} answers for {len(keys)} keys")
            except Exception:  # resolve answers misses itself; this is a bug, and must not stop lookups
                logger.exception("hicached: a lookup batch failed; its %d keys are misses", len(keys))
                found = [False] * len(keys)
            self._done.put([(key, gen, bool(f)) for (key, gen), f in zip(batch, found, strict=True)])


class Touches:
    """vLLM's touch() without waiting under its lock: `add` queues the keys (a key touched again moves to
    the back) and wakes a thread of its own, which sends all that queued meanwhile in one batch, least
    recently touched first, so that the daemon ends with the same order. Bounded: past `bound` keys the
    oldest are dropped. While the daemon is down (`up` false) touches are dropped, not kept for later; so is
    a batch the daemon could not be asked (`send` answered None)."""

    def __init__(
        self,
        send: Callable[[Sequence[bytes]], int | None],
        up: Callable[[], bool],
        name: str,
        bound: int = MAX_TOUCHES,
    ) -> None:
        self._send = send
        self._up = up
        self._bound = bound
        self._keys: dict[bytes, None] = {}  # insertion order: least recently touched first
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.sent = 0  # keys the daemon was asked to touch
        self.dropped = 0  # keys touched and never sent
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def add(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if not keys:
            return
        with self._lock:
            if self._stop or not self._up():
                self.dropped += len(keys)
                return
            pending = self._keys
            for key in keys:
                pending.pop(key, None)
                pending[key] = None
            over = len(pending) - self._bound
            if over > 0:
                for key in list(itertools.islice(pending, over)):
                    del pending[key]
                self.dropped += over
        self._wake.set()

    def shutdown(self) -> None:
        """Stops the thread once a batch on its way has been answered; what is still queued is dropped."""
        with self._lock:
            self._stop = True
            self.dropped += len(self._keys)
            self._keys = {}
        self._wake.set()
        self._thread.join()

    def _work(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()  # under the lock: a key added after this wakes the next round
                if self._stop:
                    return
                keys, self._keys = list(self._keys), {}
            if not keys:
                continue
            try:
                found = self._send(keys)
            except Exception:  # send answers None itself; this is a bug, and must not stop the thread
                logger.exception("hicached: a touch batch failed; its %d keys are dropped", len(keys))
                found = None
            with self._lock:
                if found is None:
                    self.dropped += len(keys)
                else:
                    self.sent += len(keys)
