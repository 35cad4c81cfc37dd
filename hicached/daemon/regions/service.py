"""Engine memory regions: registering them (a memfd or a tmpfs file passed with SCM_RIGHTS, or a CUDA
tensor's IPC fields), unregistering them when their connection closes, and the store_pages / load_pages
requests that copy a batch of pages between a region and L2 through the copy executor. What registration
accepts and how it maps it is in hicached.daemon.regions.checks, the records it keeps in .region.

A memfd the engine did not seal against shrinking, and a tmpfs file (vLLM's /dev/shm region, which can never
be sealed), are copied guarded: if the file shrinks, the copy that finds its memory gone fails (copy_failed)
instead of the daemon dying of SIGBUS, and the region is dropped.

A store is `Tiers.alloc` -> copy region -> slots -> `Tiers.commit` (abort on a failed copy); a load is
`Tiers.acquire` (reading L3 as needed) -> copy slots -> region -> `Tiers.release`: leases, backups and
prefetch keep one implementation. A copy cannot be stopped once a thread runs it, so the slots, leases and
mappings a copy uses are only given back after it ended, even when its connection closed meanwhile.

Fences (hicached.common.fence): a connection may register a fence board (`region_attach` with kind
"fence", its memfd on a side connection as a host region's), and name a word of it in each store_pages /
load_pages of a region, host or CUDA (`fence: <slot>`). Each copy job counts itself in and out of that
word, and copies nothing once the engine has cancelled the request (it gave up on the answer and will
reuse its memory); a request with a job cancelled fails as a whole: a store commits nothing. What an
engine writes into its own board can only skip or run its own copies.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import time
from collections.abc import Callable
from typing import Any

from hicached.common import fence as fence_mod
from hicached.common.errors import BAD_REQUEST, COPY_FAILED, NO_SPACE, NOT_FOUND, HicachedError
from hicached.common.geometry import check_pages, parse_geometry
from hicached.common.keys import check_keys
from hicached.common.memfd import MEMFD
from hicached.common.protocol import ALLOC_PRESENT, ALLOC_WRITE, arg, keys_arg
from hicached.config import Config
from hicached.daemon.regions.checks import check_fd, map_board, map_host
from hicached.daemon.regions.copier import Copier
from hicached.daemon.regions.jobs import CopyCancelled, RegionGone
from hicached.daemon.regions.region import Region, SessionRegions
from hicached.daemon.sched.tiers import Session, Tiers

# Importable from here, as before registration's checks and the region records had modules of their own.
__all__ = ["KINDS", "Region", "RegionService", "SessionRegions", "check_fd", "map_board", "map_host"]

log = logging.getLogger("hicached.regions")

KINDS = ("host", "cuda", fence_mod.KIND)
CANCEL_LOG_S = 10.0  # cancelled copies are logged at most this often (with how many since the last line)


class RegionService:
    """The region requests of every connection; `cfg()` gives the configuration in force (reloads)."""

    def __init__(self, cfg: Callable[[], Config], tiers: Tiers) -> None:
        self.cfg = cfg
        self.tiers = tiers
        self.copier = Copier(tiers.pool, cfg().regions.copy_threads)
        self.count = 0
        self.nbytes = 0
        self.inflight = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self._idle: asyncio.Event | None = None
        # Seconds spent by store_pages / load_pages requests that copied, in three phases: before the copy
        # (slots, leases, L3 reads), the copy, after it (commit, release); and how many such requests.
        self.phases: dict[str, list[float]] = {op: [0, 0.0, 0.0, 0.0] for op in ("store_pages", "load_pages")}
        self._cancel_logged = 0.0  # when cancelled copies were last logged
        self._cancel_unlogged = 0  # cancelled copy jobs since

    # Registration.

    def _state(self, s: Session) -> SessionRegions:
        if s.regions is None:
            s.regions = SessionRegions(session=s)
        return s.regions

    async def attach(self, s: Session, req: dict[str, Any], fd: int | None) -> dict[str, Any]:
        """Register a region for session `s`. The caller keeps ownership of `fd` (and closes it)."""
        s.require_hello()
        kind = arg(req, "kind", str)
        if kind not in KINDS:
            raise HicachedError(BAD_REQUEST, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == fence_mod.KIND:
            return self._attach_board(s, req, fd)
        if fd is not None:
            # Say first that memory the daemon does not take is refused, whatever else is wrong.
            check_fd(fd, 0)
        nbytes = arg(req, "nbytes", int)
        offset = arg(req, "offset", int, 0)
        if nbytes <= 0 or offset < 0:
            raise HicachedError(BAD_REQUEST, "nbytes must be positive and offset not negative")
        geom = parse_geometry(req, nbytes)
        if geom.page_bytes != s.page_bytes:
            raise HicachedError(
                BAD_REQUEST, f"page_bytes is {geom.page_bytes}; this connection's pages are {s.page_bytes}"
            )
        if kind == "host" and fd is None:
            raise HicachedError(
                BAD_REQUEST,
                "a host region's memfd must come with region_attach as the first frame of a connection of "
                "its own (SCM_RIGHTS); see hicached.common.protocol",
            )
        if kind == "cuda" and fd is not None:
            raise HicachedError(BAD_REQUEST, "a CUDA region is named by its IPC fields; it carries no fd")
        st = self._state(s)
        limits = self.cfg().regions
        if len(st.regions) + st.opening >= limits.max_per_connection:
            n = limits.max_per_connection
            raise HicachedError(NO_SPACE, f"this connection has {n} regions (regions.max_per_connection)")
        if st.bytes + nbytes > limits.max_bytes_per_connection:
            raise HicachedError(
                NO_SPACE,
                f"registering {nbytes} more bytes would pass regions.max_bytes_per_connection "
                f"({limits.max_bytes_per_connection}); {st.bytes} are registered",
            )
        region = Region(next(s.ids), kind, geom, nbytes)
        st.opening += 1
        st.bytes += nbytes
        try:
            if kind == "host":
                loop = asyncio.get_running_loop()
                mapped = await loop.run_in_executor(None, map_host, fd, offset, nbytes)
                region.mm, region.array, mem = mapped
                region.may_shrink, region.memory = mem.can_shrink, mem.kind
                region.end = offset + nbytes
            else:
                loop = asyncio.get_running_loop()
                cuda = await loop.run_in_executor(None, self.copier.cuda)  # imports torch, starts CUDA
                region.device, region.tensor = await cuda.open(req.get("cuda"), offset, nbytes)
        except BaseException:
            st.bytes -= nbytes
            raise
        finally:
            st.opening -= 1
        self.count += 1
        self.nbytes += nbytes
        if st.closing:  # the connection closed while we opened the region
            self._release(region, st)
            raise HicachedError(NOT_FOUND, "the connection this region was registered for has closed")
        st.regions[region.handle] = region
        self.counters[f"attached.{kind}"] += 1
        if region.may_shrink:
            self.counters["attached.unsealed"] += 1
        if region.memory != MEMFD:
            self.counters["attached.tmpfs"] += 1
        log.debug("region %d (%s, %d bytes) for %s", region.handle, kind, nbytes, s.peer)
        return {"handle": region.handle, "num_pages": geom.num_pages, "nbytes": nbytes}

    def _attach_board(self, s: Session, req: dict[str, Any], fd: int | None) -> dict[str, Any]:
        """The connection's fence board: a memfd of `slots` words. A second one takes the place of the first
        (a client that registers its board again after an answer it did not get); copies running keep the
        mapping they were started with."""
        if fd is None:
            raise HicachedError(
                BAD_REQUEST,
                "a fence board's memfd must come with region_attach on a side connection (SCM_RIGHTS)",
            )
        slots = arg(req, "slots", int)
        st = self._state(s)
        board = map_board(fd, slots)
        if st.closing:
            board.close()
            raise HicachedError(NOT_FOUND, "the connection this fence board was registered for has closed")
        st.board = board
        self.counters["attached.fence"] += 1
        return {"slots": slots, "kind": fence_mod.KIND}  # the server adds its pidfd to this answer

    def _fence(self, s: Session, req: dict[str, Any], region: Region) -> tuple[mmap.mmap, int] | None:
        """The request's fence (its board and slot), None without one; bad_request for one that does not
        fit."""
        slot = req.get("fence")
        if slot is None:
            return None
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise HicachedError(BAD_REQUEST, f"field 'fence' has the wrong type ({type(slot).__name__})")
        board = s.regions.board if s.regions is not None else None
        if board is None:
            raise HicachedError(
                BAD_REQUEST, "a fence was named, but this connection registered no fence board"
            )
        slots = len(board) // fence_mod.WORD_BYTES
        if not 0 <= slot < slots:
            raise HicachedError(
                BAD_REQUEST, f"fence slot {slot} is outside this connection's board of {slots}"
            )
        return board, slot

    def detach(self, s: Session, handle: int) -> None:
        st = s.regions
        region = st.regions.pop(handle, None) if st is not None else None
        if region is None:
            if st is not None and st.dropped.pop(handle, None) is not None:
                return  # dropped already (its memory went): the engine lets go of its handle
            raise HicachedError(NOT_FOUND, f"no region {handle} on this connection")
        region.closed = True
        if region.users == 0:
            self._release(region, st)

    def _release(self, region: Region, st: SessionRegions) -> None:
        if region.released:
            return
        region.released = True
        if region.kind == "host":
            region.unmap()
        else:
            self.copier.release(region)
        st.bytes -= region.nbytes
        self.count -= 1
        self.nbytes -= region.nbytes

    def close_session(self, s: Session, after: Callable[[Session], None]) -> None:
        """The connection closed: unregister its regions and call `after(s)` (which releases its slots and
        leases), both once no copy of this connection runs any more."""
        st = s.regions
        if st is None:
            after(s)
            return
        st.closing = True  # a region still being opened is released as soon as it is
        st.after = after
        for region in st.regions.values():
            region.closed = True
        if st.inflight == 0:
            self._finish(st)

    def _drop(self, st: SessionRegions, region: Region) -> str:
        """A copy found the region's memory gone (its memfd shrank): no request may copy it again, it is
        released once no copy runs on it, and its handle answers why. Returns why; logs once a region."""
        if region.gone is not None:
            return region.gone
        try:
            size = f"{region.mm.size()} bytes" if region.mm is not None else "smaller"
        except OSError:
            size = "smaller"
        region.gone = (
            f"region {region.handle} was dropped: its memory shrank under the daemon (the {region.memory} is "
            f"now {size}; the region reaches byte {region.end}); register the memory again"
        )
        region.closed = True
        if st.regions.get(region.handle) is region:
            del st.regions[region.handle]
            st.dropped[region.handle] = region.gone
        self.counters["dropped.shrunk"] += 1
        peer = st.session.peer if st.session is not None else "?"
        log.warning(
            "region %d of %s: its %s shrank under the daemon (now %s; the region reaches byte %d); "
            "dropped it, and failed the copies that found its memory gone",
            region.handle,
            peer,
            region.memory,
            size,
            region.end,
        )
        if region.users == 0:
            self._release(region, st)
        return region.gone

    def _finish(self, st: SessionRegions) -> None:
        for region in list(st.regions.values()):
            if region.users == 0:
                self._release(region, st)
        st.regions.clear()
        board, st.board = st.board, None
        if board is not None:
            try:
                board.close()
            except BufferError:  # a job's view still in it: it goes with the last one
                pass
        after, st.after = st.after, None
        if after is not None and st.session is not None:
            after(st.session)

    # Copies.

    def _lookup(self, s: Session, req: dict[str, Any], unique: bool) -> tuple[Region, list[int], list[str]]:
        s.require_hello()
        handle = arg(req, "handle", int)
        region = s.regions.regions.get(handle) if s.regions is not None else None
        if region is None:
            why = s.regions.dropped.get(handle) if s.regions is not None else None
            raise HicachedError(NOT_FOUND, why or f"no region {handle} on this connection")
        if region.geom.page_bytes != s.page_bytes:
            raise HicachedError(
                BAD_REQUEST,
                f"region {handle} holds pages of {region.geom.page_bytes} bytes; this connection now uses "
                f"{s.page_bytes}",
            )
        try:
            keys = list(check_keys(keys_arg(req, self.cfg().server.max_keys_per_request)))
        except ValueError as e:
            raise HicachedError(BAD_REQUEST, str(e)) from None
        pages = check_pages(req.get("page_indices"), region.geom, len(keys), unique)
        return region, pages, keys

    def _start_copy(
        self,
        s: Session,
        region: Region,
        to_pool: bool,
        pages: list[int],
        slots: list[int],
        fence: tuple[mmap.mmap, int] | None = None,
    ) -> asyncio.Future[list[int] | None]:
        if region.closed:
            raise HicachedError(NOT_FOUND, region.gone or f"region {region.handle} was unregistered")
        fut = self.copier.copy(region, to_pool, region.geom, pages, slots, fence)
        st = s.regions
        st.inflight += 1
        region.users += 1
        self.inflight += 1
        fut.add_done_callback(lambda f: self._copied(f, st, region))
        return fut

    def _copied(self, fut: asyncio.Future[list[int] | None], st: SessionRegions, region: Region) -> None:
        error = None if fut.cancelled() else fut.exception()  # also marks it retrieved: nobody may await it
        if isinstance(error, CopyCancelled):
            self._cancelled(st, region, error.jobs)
        elif error is not None:
            self.counters["copy_errors"] += 1
            if isinstance(error, RegionGone):
                self._drop(st, region)
        st.inflight -= 1
        region.users -= 1
        self.inflight -= 1
        if region.closed and region.users == 0:
            self._release(region, st)
        if st.closing and st.inflight == 0:
            self._finish(st)
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    def _cancelled(self, st: SessionRegions, region: Region, jobs: int) -> None:
        """Copy jobs that found their request cancelled by the engine: counted, and logged at most every
        CANCEL_LOG_S (an engine whose answers time out cancels many)."""
        self.counters["copies_cancelled"] += jobs
        self._cancel_unlogged += jobs
        now = time.monotonic()
        if now - self._cancel_logged < CANCEL_LOG_S:
            return
        peer = st.session.peer if st.session is not None else "?"
        log.warning(
            "%d copy jobs skipped since the last such line (latest: region %d of %s): their engines "
            "cancelled the requests (the answers timed out or the connections broke) and may have reused the "
            "memory; those requests stored or loaded nothing",
            self._cancel_unlogged,
            region.handle,
            peer,
        )
        self._cancel_logged, self._cancel_unlogged = now, 0

    def _timed(self, op: str, t0: float, t1: float, t2: float) -> None:
        row = self.phases[op]
        t3 = time.perf_counter()
        row[0] += 1
        row[1] += t1 - t0
        row[2] += t2 - t1
        row[3] += t3 - t2

    async def store_pages(self, s: Session, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        region, pages, keys = self._lookup(s, req, unique=False)
        fence = self._fence(s, req, region)
        status, offsets = self.tiers.alloc(s, keys)
        result = [st == ALLOC_PRESENT for st in status]
        todo = [i for i, st in enumerate(status) if st == ALLOC_WRITE]
        if not todo:
            return {"ok": result, "copied": 0}
        # Out of the engine's reach until the copy ended: an abort, commit or hello meanwhile would free
        # the slots (or make them evictable) while the copy still writes into them.
        held = self.tiers.hold_writing(s, [keys[i] for i in todo])
        t1 = time.perf_counter()
        try:
            fut = self._start_copy(
                s, region, True, [pages[i] for i in todo], [offsets[i] for i in todo], fence
            )
            # Shielded: a cancelled request (its connection closed) must not forget a copy still running.
            sums = await asyncio.shield(fut)
        except asyncio.CancelledError:
            raise  # the connection closed: its slots go once the copy has ended (close_session)
        except BaseException as e:
            self.tiers.abort_held(s, held)
            if isinstance(e, RegionGone):
                raise HicachedError(COPY_FAILED, self._drop(s.regions, region)) from None
            raise
        t2 = time.perf_counter()
        self.tiers.commit_held(s, held, sums)
        for i in todo:
            result[i] = True
        self.counters["store_pages"] += len(todo)
        self._timed("store_pages", t0, t1, t2)
        return {"ok": result, "copied": len(todo)}  # pages copied; the others were held or not taken

    async def load_pages(self, s: Session, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        region, pages, keys = self._lookup(s, req, unique=True)
        fence = self._fence(s, req, region)
        lease, offsets = await self.tiers.acquire(s, keys, arg(req, "fetch", bool, True))
        if not offsets:
            return {"n": 0}
        n = len(offsets)
        self.tiers.hold_lease(s, lease)  # an engine's release of it meanwhile would free slots under the copy
        t1 = time.perf_counter()
        try:
            await asyncio.shield(self._start_copy(s, region, False, pages[:n], offsets, fence))
        except asyncio.CancelledError:
            raise  # the connection closed: its lease goes once the copy has ended (close_session)
        except BaseException as e:
            self.tiers.release_held(s, lease)
            if isinstance(e, RegionGone):
                raise HicachedError(COPY_FAILED, self._drop(s.regions, region)) from None
            raise
        t2 = time.perf_counter()
        self.tiers.release_held(s, lease)
        self.counters["load_pages"] += n
        self._timed("load_pages", t0, t1, t2)
        return {"n": n}

    # Wiring.

    def handlers(self) -> dict[str, Callable[[Session, dict[str, Any]], Any]]:
        def detach(s: Session, req: dict[str, Any]) -> dict:
            self.detach(s, arg(req, "handle", int))
            return {}

        return {
            "region_attach": lambda s, req: self.attach(s, req, None),
            "region_detach": detach,
            "store_pages": self.store_pages,
            "load_pages": self.load_pages,
        }

    async def close(self, timeout: float) -> None:
        """Wait (bounded) for copies in flight, then stop the copy threads and let go of the pool."""
        if self.inflight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                log.error("%d region copies still running at shutdown; not waiting for them", self.inflight)
                return
        await asyncio.to_thread(self.copier.close)

    def stats(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.nbytes,
            "inflight": self.inflight,
            "copies_cancelled": self.counters["copies_cancelled"],
            "phases_s": {
                op: {
                    "requests": int(n),
                    "before_copy": round(a, 6),
                    "copy": round(b, 6),
                    "after_copy": round(c, 6),
                }
                for op, (n, a, b, c) in self.phases.items()
            },
            "counters": dict(self.counters),
            "copier": self.copier.stats(),
        }
