"""The wire protocol, without I/O: length-prefixed msgpack frames and the shape of requests and answers.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. A request is a map with an
integer `id`, a string `op` and the op's arguments; its answer carries the same `id` and either the result
fields or `error: {code, message}`. Several requests may be in flight on one connection; answers come back
in any order. Page bytes never travel here: they live in shared memory.

Connections. On connect the daemon speaks first: a welcome frame (`version`, `pool_bytes`, `max_frame`,
`max_keys`, `pid`, and `token`, a random string naming this connection) that carries the pool's memfd as
SCM_RIGHTS. What the peer sends first decides what the connection is:

- an **engine connection** sends frames without fds (hello first), and stays open;
- a **region-attach connection** sends exactly one frame, `{op: "region_attach", token: <the token of the
  engine connection the region is for>, kind: "host", ...}`, in the same `sendmsg` as one fd (a memfd open
  read-write; one not sealed with F_SEAL_SHRINK may shrink, and a region whose memory shrank is dropped:
  the copy that found it gone answers copy_failed, its handle not_found); the daemon answers
  `{handle, num_pages, nbytes}` or an error, and closes it. The region belongs to the engine connection
  and is unregistered when that connection closes. A transport cannot receive fds, so the daemon reads a
  connection's first bytes on the raw socket; an engine sends hello right away, so this costs it no round
  trip.

Stores (after hello): `alloc {keys} -> {status: [ALLOC_*], offsets}` hands out WRITING slots; the client
copies the pages in and sends `commit {keys} -> {ok: [bool]}` (or `abort {keys}`). `reserve {n} ->
{offsets, limit}` sets up to n slots aside for the connection's next stores (limit: how many it may hold,
pool.reserve_per_connection and a pool-wide bound); the client copies pages into them without asking
first, and `put {keys, offsets} -> {status: [PUT_*]}` binds them to keys (a slot whose key is there
already, or that the backup queue cannot take, stays reserved). Slots in WRITING or reserved are freed
when the connection closes. `alloc`, `reserve` and `put` are refused while the daemon drains; `commit`
and `abort` are not.

Recency (after hello): `touch {keys} -> {n}` makes the keys' pages in L2 the most recently used (what the
engine's own cache just used, so that eviction follows use): no lease, no L3 read, nothing copied; n: how many
were in L2.

Regions (requests on an engine connection, after hello):
- `region_attach` with `kind: "cuda"` needs no fd and is sent on the engine connection itself: `cuda` is a
  map of explicit IPC fields `{version: 1, device_uuid, ipc_handle, storage_bytes, storage_offset,
  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required}` (never pickled bytes).
- Both kinds: `nbytes` and `offset` (where the region starts in the memfd or the CUDA storage),
  `page_bytes` (the connection's), `num_pages`, and optional `segments: [[offset, length, stride], ...]`
  (page i's segment j at offset + i * stride; lengths add up to page_bytes; L2 holds their concatenation).
- `region_detach {handle}`; `store_pages {handle, page_indices, keys} -> {ok: [bool], copied}` (copied: how
  many pages the daemon copied; the others it held already, or did not take);
  `load_pages {handle, page_indices, keys, fetch=true} -> {n}` (leading hits copied into the region).
- Fences (hicached.common.fence): `region_attach {kind: "fence", token, slots}` on a side connection, with a
  memfd sealed against shrinking of `slots` 8-byte words, registers the connection's fence board (again:
  in place of the first); `store_pages` / `load_pages` of a host region may then carry `fence: <slot>`.
  Each copy job of the request counts itself in and out of that word, and copies nothing once the engine
  set its CANCELLED bit; the request then fails (`copy_failed`; a store commits nothing).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from hicached.common.errors import HicachedError

VERSION = 1
LENGTH = struct.Struct(">I")
MAX_FRAME_HARD = 1 << 31


# Status of each key in an `alloc` answer.
ALLOC_WRITE = 0  # write the page at the offset given, then commit
ALLOC_PRESENT = 1  # the daemon has (or is receiving) this page: nothing to write
ALLOC_NO_SPACE = 2  # no slot could be freed
ALLOC_BUSY = 3  # backup queue full: try later
# What `put` did with each reserved slot it was given (answer field "status").
PUT_STORED = 0  # bound to its key: the page is stored
PUT_PRESENT = 1  # the daemon has (or is receiving) this key already: the slot stays reserved
PUT_BUSY = 3  # backup queue full: not stored, the slot stays reserved


class FrameError(Exception):
    """A frame that cannot be read: the connection it came on is closed. `messages` holds the good
    messages that came before it in the same feed, which are still answered."""

    def __init__(self, message: str, messages: list[Any] | None = None) -> None:
        super().__init__(message)
        self.messages = messages or []


def encode(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def error_answer(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "error": {"code": code, "message": message}}


class FrameDecoder:
    """Feed bytes in, take whole decoded messages out."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = LENGTH.unpack_from(buf, pos)
            if n > self.max_frame:
                raise FrameError(f"frame of {n} bytes exceeds the limit of {self.max_frame}", out)
            if len(buf) - pos - 4 < n:
                break
            body = bytes(buf[pos + 4 : pos + 4 + n])
            pos += 4 + n
            try:
                out.append(msgpack.unpackb(body, raw=False, strict_map_key=True))
            except Exception as e:
                raise FrameError(f"frame is not valid msgpack: {e}", out) from None
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


def raise_for_error(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer itself, or the HicachedError it carries."""
    err = answer.get("error")
    if err is not None:
        if isinstance(err, dict):
            raise HicachedError(str(err.get("code", "internal")), str(err.get("message", "")))
        raise HicachedError("internal", repr(err))
    return answer


# Argument checks shared by the server's handlers: they raise bad_request with a message naming the field.


def arg(req: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    value = req.get(name, default)
    if value is ...:
        raise HicachedError("bad_request", f"missing field {name!r}")
    if value is default and default is not ...:
        return value
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float, (int, float))):
        raise HicachedError("bad_request", f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def keys_arg(req: dict[str, Any], limit: int) -> list[str]:
    keys = arg(req, "keys", list)
    if len(keys) > limit:
        raise HicachedError("bad_request", f"{len(keys)} keys in one request; the limit is {limit}")
    return keys
