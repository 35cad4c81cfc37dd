"""What each client operation does, written once as generators that yield requests and receive answers
(no I/O): `Client` and `AsyncClient` in hicached.client only carry the requests. Also the checks that turn
pages and buffers into byte views, and the mapping of the shared pool on the client's side and the copies
into and out of it. The store's pipeline is in hicached.engine.store, what an operation yields in
hicached.engine.requests."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from hicached.common import protocol
from hicached.common.errors import BAD_REQUEST, CONNECTION, NOT_FOUND, HicachedError
from hicached.common.geometry import check_pages
from hicached.common.keys import check_namespace
from hicached.engine.fences import DaemonProcess
from hicached.engine.local import LocalRegion, RegionPage
from hicached.engine.regions import RegionOps, _indices
from hicached.engine.requests import Op, _Await, _held, _NoReply, _Send, peer_closed_check
from hicached.engine.store import StoreOps

try:  # the compiled part (setup.py); without it, pages are copied with numpy, one call per page
    from hicached.common._pageio import copy_pages as _copy_pages
except ImportError:
    _copy_pages = None

# Importable from here, as before the store and the request kinds had modules of their own.
__all__ = ["Op", "_Await", "_NoReply", "_Ops", "_Send", "_held", "peer_closed_check"]

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _populate(mm: mmap.mmap, size: int) -> None:
    step = 256 << 20
    # An older kernel, or a client closed meanwhile: then pages fault in on first use instead.
    with contextlib.suppress(OSError, ValueError):
        for start in range(0, size, step):
            mm.madvise(_MADV_POPULATE_WRITE, start, min(step, size - start))


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


class _Ops(StoreOps, RegionOps):
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
        self.local: dict[int, LocalRegion] = {}  # local regions, by their handles: -1, -2, ...
        # Offsets of slots the daemon set aside for this connection's next stores (its `reserve`), and how
        # many it lets this connection hold (None: not asked yet). Shared by the threads of one Client.
        self._reserve_lock = threading.Lock()
        self._reserved: list[int] = []
        self._reserve_limit: int | None = None
        # Set by the client to a check that the daemon has closed the connection: then the slots held
        # ahead are freed on its side and may already belong to another page, so they are never written.
        self.peer_closed: Callable[[], bool] = lambda: False

    def _attach(self, welcome: dict[str, Any], fd: int, sock: Any = None) -> None:
        """Maps the pool from the welcome; with `sock`, the connection's socket, watches the daemon process
        that accepted it (fences: hicached.engine.fences)."""
        self.token = welcome.get("token", "")
        if sock is not None:
            self.daemon = DaemonProcess(sock, welcome.get("pid"))
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
        self._drop_reserved()  # the daemon frees a closed connection's reserved slots itself
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

    def _copy(self, offsets: list[int], pages: list[Any], into_pool: bool) -> list[int] | None:
        """Copies each page into (or out of) the pool's slot at its offset: in one C call with the GIL
        released where hicached.common._pageio is built (~0.3 us a page, against ~2.4 us for a numpy view and
        copyto), else page by page with numpy. Into the pool, returns each page's checksum (xxh3-64, as the
        page header keeps it), taken in the same pass with the C module: what the page's bytes must hash to
        from now on (the daemon publishes a page in L3 only if they do). None for copies out of it."""
        if self._mm is None:
            raise HicachedError(CONNECTION, "the client is closed")
        if pages and type(pages[0]) is RegionPage:  # pages of one local region: one plan, one C call
            return pages[0].region.copy(self._pool, [p.index for p in pages], offsets, into_pool)
        if _copy_pages is not None:
            sums = np.empty(len(offsets), dtype=np.uint64) if into_pool else None
            _copy_pages(self._mm, offsets, self.page_bytes, pages, into_pool, sums)
            return None if sums is None else sums.tolist()
        sums = [] if into_pool else None
        for off, page in zip(offsets, pages, strict=True):
            src = np.frombuffer(page, dtype=np.uint8) if type(page) is bytes else page
            if into_pool:
                np.copyto(self._slot(off), src)
                sums.append(xxhash.xxh3_64_intdigest(src))  # of the source, still in the CPU cache
            else:
                np.copyto(page, self._slot(off))
        return sums

    def op_hello(self) -> Op:
        return (yield {"op": "hello", "namespace": self.namespace, "page_bytes": self.page_bytes})

    def op_exists(self, keys: Sequence[str]) -> Op:
        return (yield {"op": "exists", "keys": list(keys)})["n"]

    def op_present(self, keys: Sequence[str]) -> Op:
        if not keys:
            return []
        return [bool(p) for p in (yield {"op": "present", "keys": list(keys)})["present"]]

    def op_touch(self, keys: Sequence[str]) -> Op:
        if not keys:
            return 0
        return (yield {"op": "touch", "keys": list(keys)})["n"]

    def op_store_pages_copied(self, handle: int, page_indices: Any, keys: Sequence[str]) -> Op:
        """op_store_pages, and how many pages the daemon copied (None where it does not say: an older
        daemon, or a local region, which this client copies itself)."""
        if isinstance(handle, int) and handle < 0:
            return (yield from self.op_store_pages(handle, page_indices, keys)), None
        keys, pages = list(keys), _indices(page_indices)
        if len(keys) != len(pages):
            raise HicachedError(BAD_REQUEST, f"{len(pages)} page indices but {len(keys)} keys")
        if not keys:
            return [], 0
        ans = yield {"op": "store_pages", "handle": handle, "page_indices": pages, "keys": keys}
        return ans["ok"], ans.get("copied")

    def op_store(self, keys: Sequence[str], pages: Sequence[Any]) -> Op:
        keys = list(keys)
        if len(keys) != len(pages):
            raise HicachedError(BAD_REQUEST, f"{len(keys)} keys but {len(pages)} pages")
        if not keys:
            return []
        # Every page is checked before anything is sent (a bad one must not cost L2 any page). Pages that
        # are bytes of the right length need no more than that check.
        nbytes = self.page_bytes
        srcs: list[Any] = [
            p if type(p) is bytes and len(p) == nbytes else _as_bytes_array(p, nbytes, False, f"page {i}")
            for i, p in enumerate(pages)
        ]
        return (yield from self._store(keys, srcs))

    def _orphaned(self, req: dict[str, Any], ans: Any) -> dict[str, Any] | None:
        """An answer that came after its caller stopped waiting for it (a time-out, a cancelled task): gives
        back what it holds. Returns the request (sent without waiting for its answer) that frees it on the
        daemon's side, if one is needed: else a lease or slots stay taken until the connection closes."""
        self._fence_answered(req)  # an answer, whatever it says: the request's copies are over
        if not isinstance(ans, dict) or ans.get("error") is not None:
            return None
        op = req.get("op")
        if op == "acquire" and ans.get("offsets"):
            return _NoReply(op="release", lease=ans["lease"])
        if op == "alloc":
            keys = [
                k
                for k, st in zip(req["keys"], ans.get("status", ()), strict=False)
                if st == protocol.ALLOC_WRITE
            ]
            return _NoReply(op="abort", keys=keys) if keys else None
        if op == "reserve":
            self._give_back(list(ans.get("offsets", ())))  # still this connection's: the next stores use them
        return None

    def op_load(self, keys: Sequence[str], buffers: Sequence[Any]) -> Op:
        if len(keys) != len(buffers):
            raise HicachedError(BAD_REQUEST, f"{len(keys)} keys but {len(buffers)} buffers")
        dsts = [_as_bytes_array(b, self.page_bytes, True, f"buffer {i}") for i, b in enumerate(buffers)]
        return (yield from self._load(keys, dsts))

    def _load(self, keys: Sequence[str], dsts: list[Any], fetch: bool = True) -> Op:
        """The load into checked buffers (byte arrays, or RegionPage of one local region); without `fetch`,
        of what L2 holds only."""
        if not keys:
            return 0
        req = {"op": "acquire", "keys": list(keys)}
        if not fetch:
            req["fetch"] = False
        ans = yield req
        offsets = ans["offsets"]
        if not offsets:
            return 0
        try:
            self._copy(offsets, dsts[: len(offsets)], False)
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

    # Local regions: memory of this process that the client copies itself (hicached.engine.local).

    def op_register_local(
        self, memory: Any, page_bytes: int, segments: Sequence[Sequence[int]] | None, num_pages: int | None
    ) -> Op:
        if page_bytes != self.page_bytes:
            raise HicachedError(
                BAD_REQUEST, f"a region of {page_bytes}-byte pages on a connection of {self.page_bytes}"
            )
        region = LocalRegion(memory, page_bytes, segments, num_pages)
        handle = -(len(self.local) + 1)
        while handle in self.local:
            handle -= 1
        self.local[handle] = region
        return handle
        yield  # a generator like every op: it never needs the daemon

    def op_unregister_region(self, handle: int) -> Op:
        if isinstance(handle, int) and handle < 0:
            self.local.pop(handle, None)
            return None
        return (yield from super().op_unregister_region(handle))

    def _local_pages(self, handle: int, page_indices: Any, keys: Sequence[str], unique: bool) -> list[Any]:
        region = self.local.get(handle)
        if region is None:
            raise HicachedError(NOT_FOUND, f"no local region {handle} on this client")
        pages = check_pages(_indices(page_indices), region.geom, len(keys), unique)
        return [RegionPage(region, i) for i in pages]

    def op_store_pages(self, handle: int, page_indices: Any, keys: Sequence[str]) -> Op:
        if isinstance(handle, int) and handle < 0:
            srcs = self._local_pages(handle, page_indices, keys, unique=False)
            return (yield from self._store(list(keys), srcs)) if keys else []
        return (yield from super().op_store_pages(handle, page_indices, keys))

    def op_load_pages(self, handle: int, page_indices: Any, keys: Sequence[str], fetch: bool = True) -> Op:
        if isinstance(handle, int) and handle < 0:
            dsts = self._local_pages(handle, page_indices, keys, unique=True)
            return (yield from self._load(keys, dsts, fetch))
        return (yield from super().op_load_pages(handle, page_indices, keys, fetch))

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
