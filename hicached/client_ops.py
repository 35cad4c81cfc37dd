"""What each client operation does, written once as generators that yield requests and receive answers
(no I/O): `Client` and `AsyncClient` in hicached.client only carry the requests. Also the checks that turn
pages and buffers into byte views, and the mapping of the shared pool on the client's side."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from . import protocol
from .client_regions import RegionOps
from .errors import BAD_REQUEST, CONNECTION, HicachedError
from .keys import check_namespace

Op = Generator[dict[str, Any], dict[str, Any] | None, Any]

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _populate(mm: mmap.mmap, size: int) -> None:
    step = 256 << 20
    # An older kernel, or a client closed meanwhile: then pages fault in on first use instead.
    with contextlib.suppress(OSError, ValueError):
        for start in range(0, size, step):
            mm.madvise(_MADV_POPULATE_WRITE, start, min(step, size - start))


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


# A store of at least this many pages is cut into chunks whose allocations are all sent first (in one
# write): the daemon works on the later ones while the client copies the first.
_PIPELINE_MIN_PAGES = 16
_PIPELINE_CHUNKS = 4


def _as_bytes_array(obj: Any, nbytes: int, writable: bool, what: str) -> np.ndarray:
    """A flat uint8 numpy view of a page or a buffer (bytes-like object or CPU tensor), without a copy."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda"):  # torch.Tensor
        if obj.is_cuda:
            raise HicachedError(BAD_REQUEST, f"{what} is a CUDA tensor: register it as a region instead")
        if not obj.is_contiguous():
            raise HicachedError(BAD_REQUEST, f"{what} tensor is not contiguous")
        import torch

        arr = obj.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise HicachedError(BAD_REQUEST, f"{what} must be a bytes-like object or a tensor") from None
        if not mv.c_contiguous:
            raise HicachedError(BAD_REQUEST, f"{what} is not contiguous")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    if arr.nbytes != nbytes:
        raise HicachedError(
            BAD_REQUEST, f"{what} has {arr.nbytes} bytes; this client's page_bytes is {nbytes}"
        )
    if writable and not arr.flags.writeable:
        raise HicachedError(BAD_REQUEST, f"{what} is read-only")
    return arr


class _Ops(RegionOps):
    """What each client method does, as generators of requests; no I/O."""

    def __init__(self, namespace: str, page_bytes: int) -> None:
        try:
            self.namespace = check_namespace(namespace)
        except ValueError as e:
            raise HicachedError(BAD_REQUEST, str(e)) from None
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise HicachedError(BAD_REQUEST, f"page_bytes must be a positive integer, got {page_bytes!r}")
        self.page_bytes = page_bytes
        self._mm: mmap.mmap | None = None
        self._pool: np.ndarray | None = None
        self.token = ""
        self.regions: dict[int, Any] = {}

    def _attach(self, welcome: dict[str, Any], fd: int) -> None:
        self.token = welcome.get("token", "")
        try:
            size = welcome["pool_bytes"]
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._pool = np.frombuffer(self._mm, dtype=np.uint8)
        # A fresh mapping faults on the first touch of every page, which makes first copies 3-4x slower.
        # Map the page tables in the background instead of at connect (that costs ~0.1 s per GiB).
        threading.Thread(
            target=_populate, args=(self._mm, size), name="hicached-populate", daemon=True
        ).start()

    def _detach(self) -> None:
        self.regions.clear()  # the daemon unregisters a closed connection's regions itself
        self._pool = None
        if self._mm is not None:
            # A view handed out by get() may still be alive: then the mapping goes with the process.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def _slot(self, offset: int) -> np.ndarray:
        if self._pool is None:
            raise HicachedError(CONNECTION, "the client is closed")
        return self._pool[offset : offset + self.page_bytes]

    def op_hello(self) -> Op:
        return (yield {"op": "hello", "namespace": self.namespace, "page_bytes": self.page_bytes})

    def op_exists(self, keys: Sequence[str]) -> Op:
        return (yield {"op": "exists", "keys": list(keys)})["n"]

    def op_store(self, keys: Sequence[str], pages: Sequence[Any]) -> Op:
        keys = list(keys)
        if len(keys) != len(pages):
            raise HicachedError(BAD_REQUEST, f"{len(keys)} keys but {len(pages)} pages")
        if not keys:
            return []
        # Every page is checked before anything is sent (a bad one must not cost L2 any page). Pages that
        # are bytes of the right length need no more than that check here: their numpy views (~1 us
        # each) are made while the daemon answers the allocations.
        nbytes = self.page_bytes
        srcs: list[Any] = [
            p if type(p) is bytes and len(p) == nbytes else _as_bytes_array(p, nbytes, False, f"page {i}")
            for i, p in enumerate(pages)
        ]
        n = len(keys)
        chunks = _PIPELINE_CHUNKS if n >= _PIPELINE_MIN_PAGES else 1
        bounds = [(n * c // chunks, n * (c + 1) // chunks) for c in range(chunks)]
        allocs = []
        for c, (lo, hi) in enumerate(bounds):
            kind = _SendNow if c == chunks - 1 else _Send  # all in one write, sent before the views
            allocs.append((yield kind(op="alloc", keys=keys[lo:hi])))
        srcs = [np.frombuffer(p, dtype=np.uint8) if type(p) is bytes else p for p in srcs]
        result = [False] * n
        taken: list[int] = []  # indices into keys of the slots allocated to us, in WRITING on the daemon
        commits: list[tuple[list[int], Any]] = []  # (indices into keys, ticket) of commits sent
        done = 0
        try:
            for (lo, _), ticket in zip(bounds, allocs, strict=True):
                ans = yield _Await(ticket)
                done += 1
                status = ans["status"]
                mine = []
                for i, st in enumerate(status):
                    result[lo + i] = st == protocol.ALLOC_PRESENT
                    if st == protocol.ALLOC_WRITE:
                        mine.append(i)
                taken += [lo + i for i in mine]  # before any copy: a failed copy gives them all back
                if done == chunks and len(taken) > len(mine):
                    # Before the last chunk is copied: the pages so far are committed meanwhile, and
                    # only the last chunk's commit is left for the client to wait on.
                    early = taken[: -len(mine) or None]
                    commits.append((early, (yield _SendNow(op="commit", keys=[keys[i] for i in early]))))
                for i in mine:
                    np.copyto(self._slot(ans["offsets"][i]), srcs[lo + i])
        except BaseException:
            if taken:
                yield _NoReply(op="abort", keys=[keys[i] for i in taken])
            # Allocations answered after the failure still hold slots: give them back.
            for (lo, _), ticket in zip(bounds[done:], allocs[done:], strict=True):
                try:
                    ans = yield _Await(ticket)
                except HicachedError:
                    continue
                held = [keys[lo + i] for i, st in enumerate(ans["status"]) if st == protocol.ALLOC_WRITE]
                if held:
                    yield _NoReply(op="abort", keys=held)
            for _, ticket in commits:
                with contextlib.suppress(HicachedError):
                    yield _Await(ticket)
            raise
        # At most two commits a call: the pages before the last chunk (sent above, before its copy) and the
        # last chunk's. A commit per chunk cost a message and a wake-up on each side. A page is reported
        # stored only once the daemon has it, so any connection that asks next sees it.
        rest = taken[sum(len(indices) for indices, _ in commits) :]
        if rest:
            commits.append((rest, (yield _Send(op="commit", keys=[keys[i] for i in rest]))))
        for indices, ticket in commits:
            ok = (yield _Await(ticket))["ok"]
            for i, good in zip(indices, ok, strict=True):
                result[i] = bool(good)
        return result

    def op_load(self, keys: Sequence[str], buffers: Sequence[Any]) -> Op:
        if len(keys) != len(buffers):
            raise HicachedError(BAD_REQUEST, f"{len(keys)} keys but {len(buffers)} buffers")
        dsts = [_as_bytes_array(b, self.page_bytes, True, f"buffer {i}") for i, b in enumerate(buffers)]
        if not keys:
            return 0
        ans = yield {"op": "acquire", "keys": list(keys)}
        offsets = ans["offsets"]
        if not offsets:
            return 0
        try:
            for dst, off in zip(dsts, offsets, strict=False):
                np.copyto(dst, self._slot(off))
        finally:
            yield _NoReply(op="release", lease=ans["lease"])
        return len(offsets)

    def op_get(self, keys: Sequence[str]) -> Op:
        if not keys:
            return []
        ans = yield {"op": "acquire", "keys": list(keys)}
        if not ans["offsets"]:
            return []
        try:
            return [self._slot(off).tobytes() for off in ans["offsets"]]
        finally:
            yield _NoReply(op="release", lease=ans["lease"])

    def op_prefetch(self, keys: Sequence[str], priority: int) -> Op:
        return (yield {"op": "prefetch", "keys": list(keys), "priority": int(priority)})["handle"]

    def op_wait(self, handle: int, timeout: float | None) -> Op:
        req: dict[str, Any] = {"op": "wait", "handle": handle}
        if timeout is not None:
            req["timeout"] = float(timeout)
        return (yield req)["n"]

    def op_pin(self, keys: Sequence[str]) -> Op:
        return (yield {"op": "pin", "keys": list(keys)})["n"]

    def op_unpin(self, keys: Sequence[str]) -> Op:
        return (yield {"op": "unpin", "keys": list(keys)})["n"]

    def op_simple(self, op: str) -> Op:
        ans = yield {"op": op}
        ans.pop("id", None)
        return ans
