"""A store's pages into the pool: the allocations pipelined in chunks, the commits and puts that follow the
copies, and the slots the daemon holds ahead for this connection's next stores (its `reserve`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any

from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.engine.requests import Op, _Await, _NoReply, _Send, _SendNow

# A store of at least this many pages is cut into chunks whose allocations are all sent first (in one
# write): the daemon works on the later ones while the client copies the first.
_PIPELINE_MIN_PAGES = 16
_PIPELINE_CHUNKS = 4


class StoreOps:
    """The store of checked pages and the slots held ahead, for `_Ops` (hicached.engine.ops): its `_copy`
    puts the pages into the pool; its `__init__` sets up the reserve."""

    _reserve_lock: threading.Lock
    _reserved: list[int]
    _reserve_limit: int | None
    peer_closed: Callable[[], bool]
    _copy: Callable[[list[int], list[Any], bool], list[int] | None]

    def _store(self, keys: list[str], srcs: list[Any]) -> Op:
        """The store of checked pages (bytes-like, or RegionPage of one local region)."""
        n = len(keys)
        # The first pages go into slots this connection holds ahead (copied at once, bound to their keys by
        # `put`); the rest into slots allocated now, in chunks whose allocations go out in one write so that
        # the daemon answers them while the client copies the pages before.
        spare = self._take_reserved(n)
        r = len(spare)
        m = n - r
        chunks = 0 if not m else _PIPELINE_CHUNKS if m >= _PIPELINE_MIN_PAGES else 1
        bounds = [(r + m * c // chunks, r + m * (c + 1) // chunks) for c in range(chunks)]
        if r:
            # All from the reserve: the last quarter is a segment of its own, so that the pages before it
            # are put while it is copied.
            cut = r - r // _PIPELINE_CHUNKS if not chunks and r >= _PIPELINE_MIN_PAGES else r
            bounds = [(0, cut), *([(cut, r)] if cut < r else []), *bounds]
        want = self._refill_wanted(n)
        reqs: list[dict[str, Any]] = [{"op": "alloc", "keys": keys[lo:hi]} for lo, hi in bounds if lo >= r]
        # The refill of the slots held ahead goes out with the allocations (one write), or, for a store
        # with none, right after its first put: then the daemon answers that put first, and the store wakes
        # it twice, not three times. Either way it is answered before the call ends.
        late = None
        if want and reqs:
            reqs.append({"op": "reserve", "n": want})
        elif want:
            late = {"op": "reserve", "n": want}
        tickets = []
        for i, req in enumerate(reqs):
            tickets.append((yield (_SendNow if i == len(reqs) - 1 else _Send)(req)))  # one write
        refill = tickets.pop() if want and late is None else None
        allocs = iter(tickets)
        segs = [(lo, hi, None if hi <= r else next(allocs)) for lo, hi in bounds]
        result = [False] * n
        slot: dict[int, int] = dict(enumerate(spare))  # index into keys -> the slot its page goes to
        sums: dict[int, int] = {}  # index into keys -> its page's checksum, where the copy took it
        taken: list[int] = []  # indices given slots by alloc: WRITING on the daemon until committed
        sent = 0  # the pages before this index are committed or put (the requests are sent)
        acks: list[tuple[list[int], Any, bool]] = []  # (indices, ticket, is a put) of requests sent
        done = 0  # segments whose allocation has been collected
        try:
            for si, (lo, hi, ticket) in enumerate(segs):
                done = si + 1
                if ticket is None:
                    mine = range(lo, hi)
                else:
                    ans = yield _Await(ticket)
                    mine = []
                    for j, st in enumerate(ans["status"]):
                        result[lo + j] = st == protocol.ALLOC_PRESENT
                        if st == protocol.ALLOC_WRITE:
                            mine.append(lo + j)
                            slot[lo + j] = ans["offsets"][j]
                    taken += mine  # before any copy: a failed copy gives them all back
                if si == len(segs) - 1 and lo > sent:
                    # Before the last segment is copied: the pages so far are committed meanwhile, and only
                    # the last segment's commit is left for the client to wait on.
                    acks += yield from self._store_acks(
                        keys, spare, range(sent, lo), slot, sums, now=late is None
                    )
                    sent = lo
                    if late is not None:
                        refill, late = (yield _SendNow(late)), None
                if mine:
                    got = self._copy([slot[i] for i in mine], [srcs[i] for i in mine], True)
                    if got is not None:
                        sums.update(zip(mine, got, strict=True))
            acks += yield from self._store_acks(keys, spare, range(sent, n), slot, sums, now=False)
            sent = n
            if late is not None:
                refill, late = (yield _Send(late)), None
        except BaseException:
            if taken:
                yield _NoReply(op="abort", keys=[keys[i] for i in taken])
            self._give_back(spare[sent:])  # reserved slots never put are still this connection's
            # Allocations answered after the failure still hold slots: give them back.
            for lo, _, ticket in segs[done:]:
                if ticket is None:
                    continue
                try:
                    ans = yield _Await(ticket)
                except HicachedError:
                    continue
                held = [keys[lo + i] for i, st in enumerate(ans["status"]) if st == protocol.ALLOC_WRITE]
                if held:
                    yield _NoReply(op="abort", keys=held)
            yield from self._collect_acks(acks, spare, result)
            yield from self._collect_refill(refill)
            raise
        # At most two commits (and two puts) a call: the pages before the last segment (sent above, before
        # its copy) and the last segment's. A page is reported stored only once the daemon has it, so any
        # connection that asks next sees it.
        error = yield from self._collect_acks(acks, spare, result)
        yield from self._collect_refill(refill)
        if error is not None:
            raise error
        return result

    def _collect_acks(
        self, acks: list[tuple[list[int], Any, bool]], spare: list[int], result: list[bool]
    ) -> Generator[Any, Any, HicachedError | None]:
        """Every answer to the commits and puts sent (none is left behind); the first error, if any. A
        put refused as a whole (draining) left its slots reserved: they come back to this client."""
        error = None
        for indices, ticket, is_put in acks:
            try:
                ans = yield _Await(ticket)
            except HicachedError as e:
                error = error or e
                if is_put:
                    self._give_back([spare[i] for i in indices])
                continue
            if is_put:
                self._put_done(ans, indices, spare, result)
            else:
                for i, good in zip(indices, ans["ok"], strict=True):
                    result[i] = bool(good)
        return error

    def _store_acks(
        self,
        keys: list[str],
        spare: list[int],
        indices: range,
        slot: dict[int, int],
        sums: dict[int, int],
        now: bool,
    ) -> Generator[Any, Any, list[tuple[list[int], Any, bool]]]:
        """Sends the commit (slots from alloc) and the put (reserved slots) of the pages at `indices` that
        were copied, with their checksums where the copy took them; with `now`, written at once. Returns
        (indices, ticket, is a put) for each."""
        r = len(spare)
        put = [i for i in indices if i < r]
        com = [i for i in indices if i >= r and i in slot]
        reqs = []
        if com:
            commit = {"op": "commit", "keys": [keys[i] for i in com]}
            if sums:
                commit["sums"] = [sums[i] for i in com]
            reqs.append((com, False, commit))
        if put:
            puts = {"op": "put", "keys": [keys[i] for i in put], "offsets": [spare[i] for i in put]}
            if sums:
                puts["sums"] = [sums[i] for i in put]
            reqs.append((put, True, puts))
        out = []
        for j, (idx, is_put, req) in enumerate(reqs):
            kind = _SendNow if now and j == len(reqs) - 1 else _Send
            out.append((idx, (yield kind(req)), is_put))
        return out

    def _put_done(
        self, ans: dict[str, Any], indices: list[int], spare: list[int], result: list[bool]
    ) -> None:
        back = []
        for i, st in zip(indices, ans["status"], strict=True):
            result[i] = st in (protocol.PUT_STORED, protocol.PUT_PRESENT)
            if st != protocol.PUT_STORED:
                back.append(spare[i])  # the daemon kept it reserved for us
        self._give_back(back)

    def _collect_refill(self, refill: Any) -> Generator[Any, Any, None]:
        if refill is None:
            return
        try:
            ans = yield _Await(refill)
        except HicachedError:
            return  # draining, say: the next store allocates instead
        with self._reserve_lock:
            self._reserve_limit = ans.get("limit", 0)
            self._reserved += ans["offsets"]

    def _take_reserved(self, n: int) -> list[int]:
        """Up to half of what the daemon lets this connection hold: the slots a store fills come back
        while it runs (its refill goes out first), and the daemon counts those still being filled. None
        once the daemon has closed the connection (a store may copy into these before it sends anything)."""
        if not self._reserved:
            return []
        if self.peer_closed():
            self._drop_reserved()
            return []
        with self._reserve_lock:
            k = min(n, (self._reserve_limit or 0) // 2)
            out = self._reserved[:k]
            del self._reserved[:k]
        return out

    def _drop_reserved(self) -> None:
        """The connection is gone: the daemon freed the slots it held for it."""
        with self._reserve_lock:
            self._reserved.clear()
            self._reserve_limit = 0

    def _give_back(self, offsets: list[int]) -> None:
        if offsets:
            with self._reserve_lock:
                self._reserved += offsets

    def _refill_wanted(self, n: int) -> int:
        """How many slots to ask the daemon to set aside for the next stores (it may grant fewer)."""
        with self._reserve_lock:
            limit = self._reserve_limit
            target = n if limit is None else limit // 2
            return max(0, target - len(self._reserved))
