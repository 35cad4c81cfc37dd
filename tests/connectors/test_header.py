"""The page header codec, tested with bytes alone."""

from __future__ import annotations

import struct

import pytest
from hicached.connectors import header

NS, KEY = "llama.bf16.p64", "ab" * 32
PAYLOAD = bytes(range(256)) * 16


def test_header_is_32_bytes_and_starts_with_magic() -> None:
    h = header.encode(NS, KEY, PAYLOAD)
    assert len(h) == header.HEADER_SIZE == 32
    assert h[:4] == header.MAGIC


def test_round_trip_returns_checksum() -> None:
    h = header.encode(NS, KEY, PAYLOAD)
    assert header.parse(h, NS, KEY, len(PAYLOAD)) == header.checksum(PAYLOAD)
    header.verify(h, NS, KEY, PAYLOAD)
    header.verify(memoryview(h), NS, KEY, memoryview(bytearray(PAYLOAD)))


def test_empty_payload() -> None:
    header.verify(header.encode(NS, KEY, b""), NS, KEY, b"")


def _reason(h: bytes, payload: bytes = PAYLOAD, ns: str = NS, key: str = KEY) -> str:
    with pytest.raises(header.CorruptPage) as e:
        header.verify(h, ns, key, payload)
    return e.value.reason


def _patch(h: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(h)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def test_each_field_is_checked() -> None:
    h = header.encode(NS, KEY, PAYLOAD)
    assert _reason(h[:31]) == "short"
    assert _reason(b"") == "short"
    assert _reason(b"XKVP" + h[4:]) == "magic"
    assert _reason(_patch(h, 4, "<H", header.VERSION + 1)) == "version"
    assert _reason(_patch(h, 6, "<H", 40)) == "version"
    assert _reason(_patch(h, 8, "<Q", len(PAYLOAD) + 1)) == "length"
    assert _reason(_patch(h, 16, "<Q", header.checksum(PAYLOAD) ^ 1)) == "checksum"
    assert _reason(_patch(h, 24, "<Q", 12345)) == "key"


def test_payload_of_other_length_is_refused() -> None:
    assert _reason(header.encode(NS, KEY, PAYLOAD), PAYLOAD[:-1]) == "length"


def test_flipped_payload_byte_fails_checksum() -> None:
    bad = bytearray(PAYLOAD)
    bad[1000] ^= 0x01
    assert _reason(header.encode(NS, KEY, PAYLOAD), bytes(bad)) == "checksum"


def test_header_binds_namespace_and_key() -> None:
    h = header.encode(NS, KEY, PAYLOAD)
    assert _reason(h, key="cd" * 32) == "key"
    assert _reason(h, ns="other.ns") == "key"
    assert header.key_tag("ns", "key") != header.key_tag("ns2", "key")


def test_trailing_bytes_after_header_are_ignored_by_parse() -> None:
    h = header.encode(NS, KEY, PAYLOAD)
    assert header.parse(h + b"extra", NS, KEY, len(PAYLOAD)) == header.checksum(PAYLOAD)
