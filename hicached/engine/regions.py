"""Engine-side memory regions: `shared_buffer` (a uint8 tensor over a new sealed memfd), describing a
tensor or an fd as a `region_attach` request, the side connection that passes a memfd to the daemon, the
region operations, written once (as generators, like the rest of `_Ops`) for both clients, and the book of
registered regions that a client registers again after a reconnect, and the fences of a connection's region
requests (hicached.engine.fences): its board is registered with its first region, and each store_pages /
load_pages names a slot of it."""

from __future__ import annotations

import fcntl
import operator
import os
import socket
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from hicached.common import fence, protocol
from hicached.common.errors import BAD_REQUEST, CONNECTION, NOT_FOUND, TIMEOUT, HicachedError
from hicached.common.geometry import default_num_pages
from hicached.common.memfd import SEALS, map_memfd
from hicached.engine.fences import Board, DaemonProcess, settle, settle_async, unfenced_once

Op = Generator[dict[str, Any], dict[str, Any] | None, Any]

CUDA_IPC_VERSION = 1
_MAX_ANSWER = 1 << 20
FENCED_OPS = ("store_pages", "load_pages")
# Set to False (tests) to send region requests without fences, as a client without the C module does.
USE_FENCES = True

# Buffers made by shared_buffer: base address -> (memfd, size). An entry lives as long as the mapping,
# which lives as long as any tensor over it; register_region finds a tensor's memfd here.
_shared: dict[int, tuple[int, int]] = {}
_shared_lock = threading.Lock()


def _forget(base: int, fd: int) -> None:
    with _shared_lock:
        _shared.pop(base, None)
    os.close(fd)


def shared_buffer(nbytes: int, name: str = "hicached-region") -> Any:
    """A uint8 CPU tensor of `nbytes` over a new memfd, sealed so it cannot shrink, that
    `register_region` accepts (the whole tensor or any contiguous slice of it). The memory goes when the
    last tensor over it goes."""
    import torch

    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise HicachedError(BAD_REQUEST, f"nbytes must be a positive integer, got {nbytes!r}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        # Prefaulted: a copy into a fresh mapping runs at a fraction of memcpy speed (NOTES). In 2 MiB
        # pages where the node allows them for shared memory, as the pool (hicached.common.memfd.map_memfd).
        mm = map_memfd(fd, nbytes, True, "the shared buffer")
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping for as long as it lives
    base = tensor.data_ptr()
    with _shared_lock:
        _shared[base] = (fd, nbytes)
    weakref.finalize(mm, _forget, base, fd)
    return tensor


def _find_shared(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """(memfd, offset) of the shared_buffer holding [ptr, ptr + nbytes), if any."""
    with _shared_lock:
        for base, (fd, size) in _shared.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return fd, ptr - base
    return None


def cuda_fields(tensor: Any) -> dict[str, Any]:
    """The explicit, versioned IPC fields of a CUDA tensor's storage (the device by UUID, since
    CUDA_VISIBLE_DEVICES may number devices differently in the daemon)."""
    import torch

    (
        device,
        handle,
        storage_bytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = tensor.untyped_storage()._share_cuda_()
    return {
        "version": CUDA_IPC_VERSION,
        "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "ipc_handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle or b""),
        "event_sync_required": bool(event_sync_required),
    }


def describe(
    memory: Any, page_bytes: int, segments: Sequence[Sequence[int]] | None, num_pages: int | None
) -> tuple[dict[str, Any], int | None]:
    """The region_attach fields for `memory` (a tensor from shared_buffer, a CUDA tensor, or the fd of a
    memfd, sealed or not: the daemon guards its copies of one that may shrink), and the fd to pass with
    them (None for CUDA)."""
    fd: int | None
    fields: dict[str, Any]
    if isinstance(memory, int) and not isinstance(memory, bool):
        fd = memory
        try:
            nbytes = os.fstat(fd).st_size
        except OSError as e:
            raise HicachedError(BAD_REQUEST, f"fd {fd}: {e.strerror}") from None
        fields = {"kind": "host", "offset": 0, "nbytes": nbytes}
    elif hasattr(memory, "data_ptr") and hasattr(memory, "is_cuda"):
        if not memory.is_contiguous():
            raise HicachedError(BAD_REQUEST, "a region must be a contiguous tensor")
        nbytes = memory.numel() * memory.element_size()
        if memory.is_cuda:
            fd = None
            offset = memory.storage_offset() * memory.element_size()
            fields = {"kind": "cuda", "offset": offset, "nbytes": nbytes}  # its IPC fields last (below)
        else:
            found = _find_shared(memory.data_ptr(), nbytes)
            if found is None:
                raise HicachedError(
                    BAD_REQUEST,
                    "this CPU tensor is not in shared memory: allocate it with "
                    "hicached.client.shared_buffer(), or register a memfd's fd",
                )
            fd, offset = found
            fields = {"kind": "host", "offset": offset, "nbytes": nbytes}
    else:
        raise HicachedError(BAD_REQUEST, "a region is a tensor (CUDA, or from shared_buffer) or a memfd's fd")
    segs = None
    if segments is not None:
        try:
            segs = [[operator.index(v) for v in seg] for seg in segments]
        except TypeError:
            raise HicachedError(BAD_REQUEST, "segments must be (offset, length, stride) integers") from None
        fields["segments"] = segs
    if num_pages is None:
        num_pages = default_num_pages(page_bytes, [tuple(s) for s in segs] if segs else None, nbytes)
        if num_pages <= 0:
            raise HicachedError(BAD_REQUEST, f"the region ({nbytes} bytes) does not hold one whole page")
    fields.update(page_bytes=page_bytes, num_pages=num_pages)
    if fields["kind"] == "cuda":
        # Last, once nothing here can refuse the region: exporting takes a reference that only the daemon
        # (or release_cuda_fields) gives back, and until then torch never frees the tensor's memory.
        fields["cuda"] = cuda_fields(memory)
    return fields, fd


def release_cuda_fields(cuda: dict[str, Any]) -> None:
    """Give back the reference that exporting took (cuda_fields), for a region the daemon refused: torch
    keeps an exported block out of its allocator until every reference is given back."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(cuda["ref_counter_handle"], cuda["ref_counter_offset"])


PIDFD_KEY = "_pidfd"  # in side_attach's answer: an fd that came with it (not a field of the protocol)


class SideAttach(dict):
    """A region_attach request that travels, with `fd`, on a connection of its own (a transport cannot
    pass fds); the answer comes back on it too."""

    fd: int = -1


def side_attach(
    connect: Callable[[str, float], tuple[socket.socket, dict[str, Any], int]],
    path: str,
    req: SideAttach,
    timeout: float,
) -> dict[str, Any]:
    """Blocking: open a connection, send the request with its fd, return the answer."""
    sock, _, pool_fd = connect(path, timeout)
    os.close(pool_fd)
    try:
        sock.settimeout(timeout)
        data = protocol.encode({**req, "id": 1})
        sent = socket.send_fds(sock, [data], [req.fd])
        if sent < len(data):
            sock.sendall(data[sent:])
        decoder = protocol.FrameDecoder(_MAX_ANSWER)
        pidfd = -1
        try:
            while True:
                chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
                for fd in fds:  # a fence board's answer carries the daemon's pidfd (fences.DaemonProcess)
                    if pidfd < 0:
                        pidfd = fd
                    else:
                        os.close(fd)
                if not chunk:
                    raise HicachedError(CONNECTION, "the daemon closed the connection during region_attach")
                msgs = decoder.feed(chunk)
                if msgs:
                    answer = protocol.raise_for_error(msgs[0])
                    if pidfd >= 0 and isinstance(answer, dict):
                        answer[PIDFD_KEY], pidfd = pidfd, -1
                    return answer
        finally:
            if pidfd >= 0:
                os.close(pidfd)
    except TimeoutError:
        raise HicachedError(TIMEOUT, f"no answer to region_attach within {timeout}s") from None
    except OSError as e:
        raise HicachedError(CONNECTION, f"region_attach failed: {e}") from None
    finally:
        sock.close()


def _indices(values: Any) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        out = [operator.index(i) for i in values]
    except TypeError:
        out = None
    if out is None or any(isinstance(i, bool) for i in values):
        raise HicachedError(BAD_REQUEST, "page_indices must be integers")
    return out


class RegionOps:
    """The region operations of `_Ops`: no I/O. Needs `token` (from the welcome), `regions` (handle ->
    the memory the client keeps alive while the daemon uses it), and for fences `daemon` (the process the
    connection's requests go to) and `fences` (its board, made with its first region)."""

    token: str
    regions: dict[int, Any]
    daemon: DaemonProcess | None = None
    fences: Board | None = None
    _fences_refused: bool = False
    _fences_lock = threading.Lock()  # one board a connection, when threads register regions at once (rare)

    def op_register_region(
        self, memory: Any, page_bytes: int, segments: Sequence[Sequence[int]] | None, num_pages: int | None
    ) -> Op:
        fields, fd = describe(memory, page_bytes, segments, num_pages)
        yield from self._register_board()
        if fd is None:
            try:
                ans = yield {"op": "region_attach", **fields}
            except HicachedError as e:
                # An answer says the daemon holds no mapping; without one (connection, time-out) it may
                # still open the handle, and the reference stays its to give back.
                if e.code not in (CONNECTION, TIMEOUT):
                    release_cuda_fields(fields["cuda"])
                raise
        else:
            req = SideAttach(op="region_attach", token=self.token, **fields)
            req.fd = fd
            ans = yield req
        self.regions[ans["handle"]] = memory
        return ans["handle"]

    def op_unregister_region(self, handle: int) -> Op:
        try:
            yield {"op": "region_detach", "handle": operator.index(handle)}
        finally:
            self.regions.pop(handle, None)

    # Fences (hicached.engine.fences).

    def _register_board(self) -> Op:
        """Hands the connection's fence board to the daemon, once (again after an answer that did not come:
        the daemon maps the same memfd in place of the first). A daemon that refuses it (older, or without
        the C module) gets requests without fences, as does a client without the C module."""
        if self._fences_refused or not USE_FENCES:
            return
        if self.daemon is None or not fence.AVAILABLE:
            self._fences_refused = True
            unfenced_once(
                "hicached.common._pageio is not built, or older" if not fence.AVAILABLE else "no daemon"
            )
            return
        with self._fences_lock:
            if self.fences is None:
                self.fences = Board()
            board = self.fences
        if board.registered:
            return
        req = SideAttach(op="region_attach", kind=fence.KIND, token=self.token, slots=board.slots)
        req.fd = board.fd
        try:
            answer = yield req
            pidfd = answer.pop(PIDFD_KEY, None) if isinstance(answer, dict) else None
            if pidfd is not None:
                self.daemon.watch(pidfd)
        except HicachedError as e:
            if e.code in (CONNECTION, TIMEOUT):
                raise
            self._fences_refused = True
            unfenced_once(f"the daemon refused the fence board: {e.message}")
            return
        board.registered = True

    def _fence_request(self, req: dict[str, Any]) -> None:
        """Names a free slot of the board in a store_pages / load_pages (drivers call it before they send
        any request); busy when every slot is taken."""
        board = self.fences
        if board is None or not board.registered or req.get("op") not in FENCED_OPS or "fence" in req:
            return
        handle = req.get("handle")
        memory = self.regions.get(handle) if isinstance(handle, int) else None
        if memory is None:
            return
        req["fence"] = board.take()

    def _fence_answered(self, req: dict[str, Any]) -> None:
        """The request's answer came (whatever it says): its copies are over, its slot is free again."""
        slot = req.get("fence")
        if slot is not None and self.fences is not None:
            self.fences.free(slot)

    def _fence_what(self, req: dict[str, Any]) -> str:
        return f"a {req.get('op')} of {len(req.get('keys', ()))} pages gave up on its answer"

    def _fence_hold(self, req: dict[str, Any]) -> bool:
        """Whether the request is fenced; if so, its slot is held for _fence_settle, which the driver calls
        next. Called before the request is left to a late answer (which frees the slot only once the settle
        is over: else a new request could take the slot, and the settle cancel that one)."""
        slot = req.get("fence")
        if slot is None or self.fences is None or not self.fences.owns(slot):
            return False
        self.fences.hold(slot)
        return True

    def _fence_settle(self, req: dict[str, Any]) -> None:
        """Blocking: the request will get no answer the caller reads (its time-out, a broken connection):
        cancels it and returns once no copy of it touches the engine's memory (hicached.engine.fences.settle;
        no time bound). Its slot stays taken: a late answer frees it (_fence_answered)."""
        slot, board = req["fence"], self.fences
        try:
            settle(board, slot, self.daemon, self._fence_what(req))
        finally:
            board.unhold(slot)

    async def _fence_settle_async(self, req: dict[str, Any]) -> None:
        """_fence_settle on an event loop."""
        slot, board = req["fence"], self.fences
        try:
            await settle_async(board, slot, self.daemon, self._fence_what(req))
        finally:
            board.unhold(slot)

    def op_store_pages(self, handle: int, page_indices: Any, keys: Sequence[str]) -> Op:
        keys, pages = list(keys), _indices(page_indices)
        if len(keys) != len(pages):
            raise HicachedError(BAD_REQUEST, f"{len(pages)} page indices but {len(keys)} keys")
        if not keys:
            return []
        req = {"op": "store_pages", "handle": operator.index(handle), "page_indices": pages, "keys": keys}
        return (yield req)["ok"]

    def op_load_pages(self, handle: int, page_indices: Any, keys: Sequence[str], fetch: bool = True) -> Op:
        keys, pages = list(keys), _indices(page_indices)
        if len(keys) != len(pages):
            raise HicachedError(BAD_REQUEST, f"{len(pages)} page indices but {len(keys)} keys")
        if not keys:
            return 0
        req = {"op": "load_pages", "handle": operator.index(handle), "page_indices": pages, "keys": keys}
        if not fetch:
            req["fetch"] = False  # lease only what L2 holds: no L3 read
        return (yield req)["n"]


@dataclass
class _Registered:
    memory: Any  # what the engine registered (a tensor), or our duplicate of the fd it registered
    page_bytes: int
    segments: list[list[int]] | None
    num_pages: int | None
    owned_fd: int | None  # ours to close: a duplicate, since the engine may close its own fd
    gen: int  # the connection the daemon's handle belongs to
    daemon: int
    lost: str | None = None  # why it could not be registered again after a reconnect


class RegionBook:
    """The regions a client registered, kept so that it can register them again on a new connection after
    the daemon restarted (regions belong to a connection): the engine keeps its handle, the daemon's may
    change. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._book: dict[int, _Registered] = {}

    def __len__(self) -> int:
        return len(self._book)

    def add(
        self,
        memory: Any,
        page_bytes: int,
        segments: Sequence[Sequence[int]] | None,
        num_pages: int | None,
        gen: int,
        daemon: int,
        current_gen: int,
    ) -> int:
        """Records a region the daemon registered on connection `gen` as `daemon`; the engine's handle."""
        owned = None
        if isinstance(memory, int) and not isinstance(memory, bool):
            owned = memory = fcntl.fcntl(memory, fcntl.F_DUPFD_CLOEXEC, 3)
        segs = [[operator.index(v) for v in s] for s in segments] if segments is not None else None
        entry = _Registered(memory, page_bytes, segs, num_pages, owned, gen, daemon)
        if gen != current_gen:  # the daemon restarted while it was being registered: it went with it
            entry.lost = "the daemon restarted while it was being registered"
        with self._lock:
            handle = daemon
            if handle in self._book or handle < 0:
                handle = max(1, max(self._book, default=0) + 1)
            self._book[handle] = entry
        return handle

    def daemon_handle(self, handle: Any, gen: int) -> Any:
        """The daemon's handle, on connection `gen`, of the engine's `handle`; raises not_found for a region
        that could not be registered again after a reconnect. Handles this book does not know (local
        regions, wrong ones) pass as they are."""
        entry = self._book.get(handle) if isinstance(handle, int) else None
        if entry is None:
            return handle
        if entry.gen == gen and entry.lost is None:
            return entry.daemon
        why = entry.lost or "it belonged to a connection that is gone"
        raise HicachedError(
            NOT_FOUND,
            f"region {handle} is not registered with the daemon any more ({why}): unregister it and "
            "register it again",
        )

    def entries(self) -> list[tuple[int, _Registered]]:
        with self._lock:
            return list(self._book.items())

    def moved(self, handle: int, gen: int, daemon: int) -> bool:
        """The region was registered again on connection `gen`; False if it was unregistered meanwhile."""
        with self._lock:
            entry = self._book.get(handle)
            if entry is None:
                return False
            entry.gen, entry.daemon, entry.lost = gen, daemon, None
            return True

    def lose(self, handle: int, why: str) -> None:
        with self._lock:
            entry = self._book.get(handle)
            if entry is not None:
                entry.lost = why

    def pop(self, handle: Any) -> _Registered | None:
        with self._lock:
            entry = self._book.pop(handle, None) if isinstance(handle, int) else None
        if entry is not None and entry.owned_fd is not None:
            os.close(entry.owned_fd)
            entry.memory = entry.owned_fd = None
        return entry

    def close(self) -> None:
        for handle, _ in self.entries():
            self.pop(handle)
