"""CUDA regions on the daemon's side: an engine's CUDA tensor opened from the explicit IPC fields it sent,
and one copy thread per device that owns a CUDA stream, pins the L2 pool in place once, and moves a batch
of pages with few large copies. Imported only when a CUDA region arrives.

A batch whose pages are scattered in the region (or split into segments) is gathered on the device into a
page-major staging buffer with one kernel per segment, then crosses PCIe in one copy per run of adjacent
pool slots; a load runs the other way. Each job records an event on the stream and the thread waits on it
before the request's future completes (`call_soon_threadsafe`), so an answer means the bytes are there.

A fenced request (hicached.common.fence) counts its job in before the job enqueues any copy, and out only
after the thread has waited for that event: an engine that gave up on the answer and cancelled the request
either finds the job not yet entered (it then copies nothing) or waits until no copy of it runs any more.
The pool is pinned arena by arena (each tenant's arena is a mapping of its own memfd).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from hicached.common import fence as fence_mod
from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.common.geometry import Geometry, plan
from hicached.daemon.l2.pool import Pool
from hicached.daemon.regions.jobs import Batch, Tracker, call_on_loop

try:
    from hicached.common import _pageio
except ImportError:  # not built: checksums in Python
    _pageio = None

log = logging.getLogger("hicached.cuda")

IPC_VERSION = 1
PIN_CHUNK = 64 << 30  # the most cudaHostRegister is given at once
STAGING_MAX = 256 << 20  # device staging buffer per device thread
# A store into the pool is issued in parts of about this size (whole pages), each with an event: a part's
# checksums are taken as soon as its copies ended, by up to `hash_threads()` jobs, while the next parts still
# cross PCIe. xxh3 from memory runs at ~6 GB/s a thread against ~50 GB/s over PCIe (H200, NOTES).
PART_BYTES = 16 << 20
CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, not only the registering one's


def unavailable() -> str | None:
    """Why this process cannot serve CUDA regions, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed in the daemon's environment"
    if not torch.cuda.is_available():
        return "the daemon sees no CUDA device (torch.cuda.is_available() is False in the daemon)"
    return None


def normalize_uuid(value: str) -> str:
    v = value.strip().lower()
    return v[4:] if v.startswith("gpu-") else v


def device_uuid(index: int) -> str:
    """The device's UUID: what identifies it across processes (CUDA_VISIBLE_DEVICES renumbers indices)."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def find_device(uuid: str) -> int:
    import torch

    want = normalize_uuid(uuid)
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if want not in seen:
        raise HicachedError(
            BAD_REQUEST, f"cuda.device_uuid {uuid!r} is not a device this daemon sees ({', '.join(seen)})"
        )
    return seen.index(want)


_IPC_FIELDS: dict[str, type] = {
    "device_uuid": str,
    "ipc_handle": bytes,
    "storage_bytes": int,
    "storage_offset": int,
    "ref_counter_handle": bytes,
    "ref_counter_offset": int,
    "event_handle": bytes,
    "event_sync_required": bool,
}


def parse_ipc(value: Any) -> dict[str, Any]:
    """The `cuda` fields of a region_attach request: explicit, versioned, never pickled."""
    if not isinstance(value, dict):
        raise HicachedError(BAD_REQUEST, "a CUDA region needs a `cuda` map of IPC fields")
    if value.get("version") != IPC_VERSION:
        got = value.get("version")
        raise HicachedError(
            BAD_REQUEST, f"cuda.version {got!r} is not supported (this daemon: {IPC_VERSION})"
        )
    out = {}
    for name, kind in _IPC_FIELDS.items():
        v = value.get(name)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise HicachedError(BAD_REQUEST, f"cuda.{name} must be {kind.__name__}, got {type(v).__name__}")
        if kind is int and v < 0:
            raise HicachedError(BAD_REQUEST, f"cuda.{name} cannot be negative")
        out[name] = v
    if out["storage_bytes"] <= 0:
        raise HicachedError(BAD_REQUEST, "cuda.storage_bytes must be positive")
    return out


def slot_runs(slots: list[int], page_bytes: int) -> list[tuple[int, int, int]]:
    """(first page, pages, pool offset) for each run of pages whose slots follow each other."""
    runs: list[tuple[int, int, int]] = []
    for k, off in enumerate(slots):
        if runs:
            first, n, start = runs[-1]
            if start + n * page_bytes == off:
                runs[-1] = (first, n + 1, start)
                continue
        runs.append((k, 1, off))
    return runs


def element_bytes(dev: Any, geom: Geometry) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides the region's start and size, and each segment's
    offset, length and stride: the gather / scatter of a staged copy moves such elements."""
    g = math.gcd(dev.storage_offset(), dev.numel(), geom.page_bytes)
    for s in geom.segments:
        g = math.gcd(g, s.offset, s.length, s.stride)
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


def uniform_rows(geom: Geometry) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(L, first row, row stride) of each segment when every segment is L bytes long and starts at a multiple
    of L on every page (SGLang's and vLLM's layouts): the region is then a table of rows of L bytes, and a
    page's segments are rows of it, gathered or scattered in one kernel. None otherwise."""
    L = geom.segments[0].length
    if any(s.length != L or s.offset % L or s.stride % L for s in geom.segments):
        return None
    first = np.array([s.offset // L for s in geom.segments], dtype=np.int64)
    stride = np.array([s.stride // L for s in geom.segments], dtype=np.int64)
    return L, first, stride


def pieces(n: int, marks: Sequence[int]) -> list[tuple[int, int]]:
    """[0, n) cut at `marks` (and nowhere else)."""
    cuts = sorted({0, n, *(m for m in marks if 0 < m < n)})
    return list(zip(cuts, cuts[1:], strict=False))


def copy_pages(
    dev: Any,
    host: Any,
    geom: Geometry,
    pages: list[int],
    slots: list[int],
    to_pool: bool,
    staging: Callable[[int], Any],
    non_blocking: bool,
    marks: Sequence[int] = (),
    on_mark: Callable[[int], None] | None = None,
) -> int:
    """Issue the copies of one batch between `dev` (the region, 1-D uint8) and `host` (the pool, 1-D uint8)
    on the current stream; returns the bytes moved. Plain torch: it runs on CPU tensors too (tests).
    `marks` (page counts, ascending): once the copies of the batch's first `m` pages are issued, and before
    any later page's, `on_mark(m)` is called (a store records an event there: its checksums start)."""
    import torch

    p = plan(geom, pages, slots)
    P = geom.page_bytes
    n = len(pages)
    marked = set(marks)

    def mark(k: int) -> None:
        if on_mark is not None and k in marked:
            on_mark(k)

    if len(p) <= len(slot_runs(slots, P)):
        # Already as few copies as there are runs of slots (big pages, or neighbours in both places).
        for a, b in pieces(n, marks):
            q = plan(geom, pages[a:b], slots[a:b]) if (a, b) != (0, n) else p
            for r, o, ln in zip(q.region_off.tolist(), q.pool_off.tolist(), q.length.tolist(), strict=True):
                if to_pool:
                    host[o : o + ln].copy_(dev[r : r + ln], non_blocking=non_blocking)
                else:
                    dev[r : r + ln].copy_(host[o : o + ln], non_blocking=non_blocking)
            mark(b)
        return p.nbytes
    # Staged: the pages gathered on the device into a page-major buffer (or scattered from it), which crosses
    # PCIe in one copy per run of slots. The gather / scatter moves elements as wide as every offset, length
    # and stride allows (byte elements take ~8x longer), in one kernel where the segments are uniform.
    w = element_bytes(dev, geom)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
    wide = dev.view(dtype)
    uniform = uniform_rows(geom)
    if uniform is not None:
        L, first, stride = uniform
        table = wide[: wide.numel() // (L // w) * (L // w)].view(-1, L // w)
        rows = first[None, :] + np.asarray(pages, dtype=np.int64)[:, None] * stride[None, :]
        # Made before this job queues any copy: the host waits for the stream's copies queued before it.
        index = torch.from_numpy(rows.reshape(-1)).to(dev.device)
        S = len(geom.segments)
    else:
        base = wide.storage_offset()
        seg_rows = [
            wide.as_strided((geom.num_pages, s.length // w), (s.stride // w, 1), base + s.offset // w)
            for s in geom.segments
        ]
        within = [sum(s.length for s in geom.segments[:j]) // w for j in range(len(geom.segments))]
        index = torch.tensor(pages, dtype=torch.int64).to(dev.device)
    per = max(1, STAGING_MAX // P)
    for c0 in range(0, n, per):
        c1 = min(n, c0 + per)
        m = c1 - c0
        flat = staging(m * P)[: m * P]
        st = flat.view(dtype).view(m, P // w)
        if to_pool:
            if uniform is not None:
                torch.index_select(table, 0, index[c0 * S : c1 * S], out=st.view(m * S, L // w))
            elif len(seg_rows) == 1:
                torch.index_select(seg_rows[0], 0, index[c0:c1], out=st)
            else:
                for row, at, s in zip(seg_rows, within, geom.segments, strict=True):
                    st[:, at : at + s.length // w].copy_(row.index_select(0, index[c0:c1]))
            for a, b in pieces(n, marks):
                if b <= c0 or a >= c1:
                    continue
                a, b = max(a, c0), min(b, c1)
                for k, r, q in slot_runs(slots[a:b], P):
                    at = (a - c0 + k) * P
                    host[q : q + r * P].copy_(flat[at : at + r * P], non_blocking=non_blocking)
                mark(b)
        else:
            for k, r, q in slot_runs(slots[c0:c1], P):
                flat[k * P : (k + r) * P].copy_(host[q : q + r * P], non_blocking=non_blocking)
            if uniform is not None:
                table.index_copy_(0, index[c0 * S : c1 * S], st.view(m * S, L // w))
            else:
                for row, at, s in zip(seg_rows, within, geom.segments, strict=True):
                    row.index_copy_(0, index[c0:c1], st[:, at : at + s.length // w])
    return p.nbytes


def pin_ranges(pool: Pool) -> list[tuple[int, int]]:
    """(pool offset, bytes) of each piece to pin: one per arena. The arenas are mappings of memfds of their
    own placed back to back; one cudaHostRegister over several mappings is not asked for."""
    return [(a.base, a.size) for a in pool.arenas if a.size > 0]


def hash_threads() -> int:
    """Threads that take the checksums of pages copied from a device (measured on a 16-core H200 node:
    6.3 GB/s with one, 26-39 GB/s with 8)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def checksum_slots(pool: Any, slots: list[int], size: int, sums: np.ndarray) -> None:
    """sums[i] = xxh3-64 of the pool's slot at slots[i] (`size` bytes): in C with the GIL released where the
    C module is built."""
    if _pageio is not None and hasattr(_pageio, "checksums"):
        _pageio.checksums(pool, np.asarray(slots, dtype=np.uint64), size, sums)
        return
    view = memoryview(pool).cast("B")
    for i, o in enumerate(slots):
        sums[i] = xxhash.xxh3_64_intdigest(view[o : o + size])


def take_last_error() -> None:
    """Clear this thread's last CUDA runtime error. torch's cudart bindings hand cudaHostRegister's error
    back without clearing it, and torch checks every kernel launch with cudaGetLastError(): the next launch
    on this thread (a gather for a store) would fail with it. A launch here takes it instead."""
    import torch

    try:
        torch.ones(1, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    except RuntimeError:
        pass


Done = Callable[[Any, str | None], None]


class _Device(threading.Thread):
    """The copy thread of one device: owns its stream and staging buffer; runs jobs one at a time."""

    def __init__(self, owner: CudaCopier, index: int) -> None:
        super().__init__(name=f"hicached-cuda{index}", daemon=True)
        self.owner = owner
        self.index = index
        self.jobs: queue.SimpleQueue[tuple[Callable[[_Device], Any], Done] | None] = queue.SimpleQueue()
        self._staging: Any = None

    def staging(self, nbytes: int) -> Any:
        import torch

        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # give the old one back before asking for a bigger one
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", self.index))
        return self._staging

    def run(self) -> None:
        import torch

        try:
            torch.cuda.set_device(self.index)  # creates the device's context: can fail (memory, compute mode)
            stream = torch.cuda.Stream(device=self.index)
        except Exception as e:
            why = f"CUDA device {self.index} could not be set up in the daemon: {type(e).__name__}: {e}"
            log.error("%s; its regions are refused", why)
            while (item := self.jobs.get()) is not None:  # answer every job, or its request waits forever
                item[1](None, why)
                item = None
            return
        tracker = self.owner.tracker
        while True:
            item = self.jobs.get()
            if item is None:
                break
            fn, done = item
            item = None
            jid = tracker.start()
            result, error = None, None
            try:
                with torch.cuda.stream(stream):
                    result = fn(self)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"  # a string: a traceback would pin the region's tensor
            try:
                # Also after a failure: copies the job issued before it failed may still run, and the
                # answer gives their slots (aborted store, released lease) and pages back at once.
                event = torch.cuda.Event()
                event.record(stream)
                event.synchronize()
            except Exception as e:
                error = error or f"{type(e).__name__}: {e}"
            tracker.end(jid, result if isinstance(result, int) else 0, error is None)
            done(result, error)
            fn = done = result = None  # drop references to the region before waiting for the next job
        self._staging = None
        stream.synchronize()


class CudaCopier:
    """CUDA regions of every device; one `_Device` thread each, started on first use."""

    def __init__(self, pool: Pool, tracker: Tracker) -> None:
        import torch

        self.pool = pool
        self.tracker = tracker
        self.host: Any = torch.frombuffer(pool.mm, dtype=torch.uint8)
        self.devices: dict[int, _Device] = {}
        self._pin_lock = threading.Lock()
        self._pin_tried = False
        self._pinned: list[int] = []
        self.pinned_bytes = 0
        self.hash_threads = hash_threads()
        self.hasher = ThreadPoolExecutor(self.hash_threads, thread_name_prefix="hicached-cudahash")

    def _device(self, index: int) -> _Device:
        d = self.devices.get(index)
        if d is None:
            d = self.devices[index] = _Device(self, index)
            d.start()
        return d

    def ensure_pinned(self) -> None:
        """Pin the L2 pool in place, once, in chunks (on a device thread: it takes a while for a big pool).
        Never pin_memory(): that copies, and the caching allocator rounds sizes up to a power of two."""
        import torch

        with self._pin_lock:
            if self._pin_tried:
                return
            self._pin_tried = True
            cudart = torch.cuda.cudart()
            ptr = self.host.data_ptr()
            for start, size in pin_ranges(self.pool):
                for off in range(start, start + size, PIN_CHUNK):
                    n = min(PIN_CHUNK, start + size - off)
                    err = cudart.cudaHostRegister(ptr + off, n, CUDA_HOST_REGISTER_PORTABLE)
                    if int(err) != 0:
                        log.warning(
                            "could not pin the L2 pool for CUDA copies (cudaHostRegister of %d bytes at "
                            "pool offset %d: error %d); copies will go through the driver's bounce buffers, "
                            "slower",
                            n,
                            off,
                            int(err),
                        )
                        self._unpin()
                        take_last_error()
                        return
                    self._pinned.append(ptr + off)
                    self.pinned_bytes += n
            log.info(
                "pinned the L2 pool (%d bytes, %d arenas) for CUDA copies",
                self.pinned_bytes,
                len(self.pool.arenas),
            )

    def _unpin(self) -> None:
        import torch

        cudart = torch.cuda.cudart()
        for ptr in self._pinned:
            cudart.cudaHostUnregister(ptr)
        self._pinned.clear()
        self.pinned_bytes = 0

    def _call(self, index: int, fn: Callable[[_Device], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: str | None) -> None:
            if not fut.done():
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(HicachedError(BAD_REQUEST, error))

        def done(result: Any, error: str | None) -> None:
            call_on_loop(loop, settle, result, error)

        self._device(index).jobs.put((fn, done))
        return fut

    async def open(self, req: dict[str, Any], offset: int, nbytes: int) -> tuple[int, Any]:
        """(device index, 1-D uint8 tensor over the engine's region), opened on the device's thread."""
        f = parse_ipc(req)
        index = await asyncio.to_thread(find_device, f["device_uuid"])  # may initialise CUDA: off the loop
        if offset + nbytes > f["storage_bytes"]:
            raise HicachedError(
                BAD_REQUEST,
                f"offset + nbytes ({offset + nbytes}) is past the end of the CUDA storage "
                f"({f['storage_bytes']} bytes)",
            )
        counter = "/dev/shm/" + f["ref_counter_handle"].decode(errors="replace").lstrip("/")
        if not os.access(counter, os.R_OK | os.W_OK):
            # torch gives the export's reference back from here when the region goes, in a file its owner
            # made 0600: without access the engine's allocator never gets the tensor's memory back.
            log.warning(
                "cannot update the engine's CUDA IPC reference count (%s): once unregistered and freed, "
                "this region's GPU memory stays reserved in the engine (run the daemon as its user)",
                counter,
            )

        def open_ipc(d: _Device) -> Any:
            import torch

            self.ensure_pinned()
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                f["ipc_handle"],
                f["storage_bytes"],
                f["storage_offset"],
                f["ref_counter_handle"],
                f["ref_counter_offset"],
                f["event_handle"],
                f["event_sync_required"],
            )
            whole = torch.empty((0,), dtype=torch.uint8, device=torch.device("cuda", index))
            whole.set_(storage, 0, (f["storage_bytes"],), (1,))
            return whole[offset : offset + nbytes]

        try:
            tensor = await self._call(index, open_ipc)
        except HicachedError as e:
            raise HicachedError(
                BAD_REQUEST, f"could not open the CUDA region on device {f['device_uuid']}: {e.message}"
            ) from None
        return index, tensor

    def parts(self, n: int, page_bytes: int) -> list[list[tuple[int, int]]]:
        """The parts a store of `n` pages is issued in, each as its checksum jobs' (first, end) pages."""
        threads = self.hash_threads
        per = max(1, PART_BYTES // page_bytes)
        out = []
        for k0 in range(0, n, per):
            m = min(n, k0 + per) - k0
            j = min(threads, m)
            out.append([(k0 + i * m // j, k0 + (i + 1) * m // j) for i in range(j)])
        return out

    def copy(
        self,
        region: Any,
        to_pool: bool,
        geom: Geometry,
        pages: list[int],
        slots: list[int],
        batch: Batch,
        fence: tuple[Any, int] | None = None,
        sums: np.ndarray | None = None,
    ) -> None:
        """Queue the batch's copy job on the region's device. With `sums` (a store), the batch also counts one
        checksum job a part (`parts`): the copy job issues every part with an event, waits for each in turn
        and hands the part's slots to the hash threads, which fill `sums`. With `fence` (the engine's board
        and slot) the job counts itself in before it enqueues a copy, or copies nothing once the engine has
        cancelled the request; it counts itself out once the thread has waited for the stream's last event
        (`_Device.run`)."""
        tensor, host = region.tensor, self.host
        P = geom.page_bytes
        parts = self.parts(len(pages), P) if sums is not None else []
        jobs = sum(len(part) for part in parts)
        entered: list[bool] = []
        handed: list[int] = []  # checksum jobs given to the hash threads

        def job(d: _Device) -> int:
            import torch

            if fence is not None:
                entered.append(fence_mod.enter(*fence))
                if not entered[0]:
                    return 0
            self.ensure_pinned()
            if sums is None:
                return copy_pages(tensor, host, geom, pages, slots, to_pool, d.staging, True)
            events = []

            def on_mark(k: int) -> None:
                events.append(torch.cuda.Event())
                events[-1].record()

            marks = [part[-1][1] for part in parts]
            moved = copy_pages(tensor, host, geom, pages, slots, True, d.staging, True, marks, on_mark)
            for part, event in zip(parts, events, strict=True):
                event.synchronize()
                for h0, h1 in part:
                    handed.append(h0)
                    self.hasher.submit(self._hash_part, batch, slots[h0:h1], P, sums[h0:h1])
            return moved

        def done(result: Any, error: str | None) -> None:
            # On the device thread, after its last event: every copy the job issued has ended.
            if entered and entered[0]:
                fence_mod.leave(*fence)  # type: ignore[misc]
            batch.job_done(error, None, entered == [False])
            for _ in range(jobs - len(handed)):  # parts never copied: no checksum job will come
                batch.job_done(error)

        self._device(region.device).jobs.put((job, done))

    def _hash_part(self, batch: Batch, slots: list[int], size: int, sums: np.ndarray) -> None:
        """On a hash thread: the checksums of one part of a store, whose copies have ended."""
        jid = self.tracker.start()
        error = None
        try:
            if self.host is None:
                raise RuntimeError("the copier is closed")
            checksum_slots(self.pool.view, slots, size, sums)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self.tracker.end(jid, 0, error is None)  # bytes: those copied; this job copies none
        batch.job_done(error)

    def release(self, region: Any) -> None:
        """Drop the region's tensor on its device's thread (closing the IPC mapping there)."""
        held = [region.tensor]
        region.tensor = None
        self._device(region.device).jobs.put((lambda d: held.clear(), lambda result, error: None))

    def close(self) -> None:
        """Blocking: let every device thread finish its queue, then unpin the pool."""
        for d in self.devices.values():
            d.jobs.put(None)
        for d in self.devices.values():
            d.join(timeout=60)
            if d.is_alive():
                log.error("CUDA copy thread of device %d did not stop; leaving the pool pinned", d.index)
                return
        self.hasher.shutdown(wait=True)
        self._unpin()
        self.host = None
