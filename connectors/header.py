"""The page header stored in front of every L3 object: format version, payload length, checksum, key tag.

Pure functions over bytes. A page whose header or checksum does not verify is a miss: corrupt KV is never
handed to an engine. The key tag binds an object to its namespace and key, so an object copied or renamed
under another key is caught as well. A whole page that does not fit its reader (another page size, another
format version: a node of the fleet configured otherwise) is a miss too, but not corrupt: it is left alone
for the nodes it fits (MisfitPage).
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"HKVP"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQQ")  # magic, version, header length, payload length, xxh3-64, key tag
HEADER_SIZE = _HEADER.size  # 32 bytes


class CorruptPage(ValueError):
    """An object that is not a valid page for the key it was read under; `reason` is a short stable word."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class MisfitPage(CorruptPage):
    """A page of the key read, whole as far as its header says, for another page size ("length": its
    `payload_len`) or format version ("version"): a miss for this reader, never removed (it may be another
    node's good page)."""

    def __init__(self, reason: str, message: str, payload_len: int = -1) -> None:
        super().__init__(reason, message)
        self.payload_len = payload_len


def key_tag(namespace: str, key: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{namespace}/{key}".encode())


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode(namespace: str, key: str, payload: memoryview | bytes, digest: int | None = None) -> bytes:
    """The header for `payload` stored under (namespace, key); `digest`, its checksum where the caller has it
    (taken as the engine stored the page), else computed here."""
    return pack(namespace, key, len(payload), checksum(payload) if digest is None else digest)


def pack(namespace: str, key: str, payload_len: int, digest: int) -> bytes:
    """The header for a payload of `payload_len` bytes whose checksum is `digest` (computed by the caller)."""
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, payload_len, digest, key_tag(namespace, key))


def parse(
    header: memoryview | bytes, namespace: str, key: str, expected_len: int, object_len: int | None = None
) -> int:
    """Checks a header for (namespace, key) and a payload of `expected_len`; returns the stored checksum. A
    header of another payload length is a MisfitPage when the object is as long as it says (`object_len`,
    where the caller knows it), else corrupt."""
    if len(header) < HEADER_SIZE:
        raise CorruptPage("short", f"header of {len(header)} bytes, expected {HEADER_SIZE}")
    magic, version, header_len, payload_len, digest, tag = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptPage("magic", "not a hicached page (bad magic)")
    if version != VERSION or header_len != HEADER_SIZE:
        raise MisfitPage("version", f"page format version {version}, this daemon reads {VERSION}")
    if tag != key_tag(namespace, key):
        raise CorruptPage("key", "object belongs to another key or namespace")
    if payload_len != expected_len:
        if object_len is not None and object_len != HEADER_SIZE + payload_len:
            raise CorruptPage("length", f"object of {object_len} bytes, its header says {payload_len}")
        raise MisfitPage(
            "length", f"a page of {payload_len} bytes, this reader's are {expected_len}", payload_len
        )
    return digest


def verify(header: memoryview | bytes, namespace: str, key: str, payload: memoryview | bytes) -> None:
    """Raises CorruptPage unless `header` + `payload` form a valid page for (namespace, key)."""
    digest = parse(header, namespace, key, len(payload))
    if checksum(payload) != digest:
        raise CorruptPage("checksum", "payload checksum does not match the header")
