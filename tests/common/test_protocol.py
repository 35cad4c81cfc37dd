"""The wire protocol, tested with bytes alone."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest

from hicached.common import protocol
from hicached.common.errors import HicachedError
from hicached.common.protocol import (
    FrameDecoder,
    FrameError,
    arg,
    encode,
    error_answer,
    keys_arg,
    raise_for_error,
)

MSGS: list[dict[str, Any]] = [
    {"id": 1, "op": "hello", "version": protocol.VERSION, "namespace": "llama.bf16.p64", "page_bytes": 4096},
    {"id": 2, "op": "exists", "keys": ["ab" * 32, "cd" * 32]},
    {"id": 3, "status": [0, 1, 2, 3], "offsets": [0, 4096, -1, -1], "nested": {"a": [1, {"b": None}]}},
    {"id": 4, "blob": b"\x00\xff" * 10, "flag": True, "ratio": 0.5, "text": "h\u00e9\u4e16"},
    error_answer(5, "not_found", "no such handle"),
    {},
]


def test_encode_is_length_prefixed_msgpack() -> None:
    frame = encode({"id": 7, "op": "stats"})
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    assert msgpack.unpackb(frame[4:], raw=False) == {"id": 7, "op": "stats"}


@pytest.mark.parametrize("msg", MSGS)
def test_round_trip(msg: dict) -> None:
    d = FrameDecoder(1 << 20)
    assert d.feed(encode(msg)) == [msg]
    assert d.pending == 0


def test_bytes_stay_bytes_and_strings_stay_strings() -> None:
    (out,) = FrameDecoder(1 << 20).feed(encode({"b": b"abc", "s": "abc"}))
    assert type(out["b"]) is bytes
    assert type(out["s"]) is str


def test_split_at_every_byte_boundary() -> None:
    stream = b"".join(encode(m) for m in MSGS)
    for cut in range(len(stream) + 1):
        d = FrameDecoder(1 << 20)
        got = d.feed(stream[:cut]) + d.feed(stream[cut:])
        assert got == MSGS, cut
        assert d.pending == 0


def test_one_byte_at_a_time() -> None:
    frame = encode(MSGS[0])
    d = FrameDecoder(1 << 20)
    for i, byte in enumerate(frame[:-1]):
        assert d.feed(bytes([byte])) == []
        assert d.pending == i + 1
    assert d.feed(frame[-1:]) == [MSGS[0]]
    assert d.pending == 0


def test_several_frames_in_one_feed_keep_order_and_the_rest() -> None:
    frames = [encode(m) for m in MSGS]
    partial = encode({"id": 99})
    d = FrameDecoder(1 << 20)
    assert d.feed(b"".join(frames) + partial[:3]) == MSGS
    assert d.pending == 3
    assert d.feed(partial[3:]) == [{"id": 99}]


def test_feed_accepts_memoryview_and_bytearray() -> None:
    frame = encode({"id": 1})
    d = FrameDecoder(1 << 20)
    assert d.feed(memoryview(frame)[:5]) == []
    assert d.feed(bytearray(frame[5:])) == [{"id": 1}]


def test_empty_feed() -> None:
    d = FrameDecoder(1 << 20)
    assert d.feed(b"") == []
    assert d.pending == 0


def test_frame_at_the_limit_is_accepted() -> None:
    msg = {"blob": b"x" * 100}
    frame = encode(msg)
    d = FrameDecoder(len(frame) - 4)
    assert d.feed(frame) == [msg]


def test_oversized_frame_raises_before_the_body_arrives() -> None:
    frame = encode({"blob": b"x" * 100})
    d = FrameDecoder(len(frame) - 5)
    with pytest.raises(FrameError, match="exceeds"):
        d.feed(frame[:4])


def test_huge_declared_length_raises() -> None:
    d = FrameDecoder(8 << 20)
    with pytest.raises(FrameError):
        d.feed(struct.pack(">I", 0xFFFFFFFF))


def test_oversized_frame_after_a_good_one() -> None:
    d = FrameDecoder(64)
    with pytest.raises(FrameError):
        d.feed(encode({"id": 1}) + struct.pack(">I", 65) + b"\x00" * 65)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # nothing to decode
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # array of 2 with one element
        b"\x01\x02",  # two objects in one frame
        msgpack.packb({1: "int key"}),  # map keys must be strings or bytes
        b"\xa3ab",  # truncated string
    ],
)
def test_invalid_msgpack_raises_frame_error(body: bytes) -> None:
    d = FrameDecoder(1 << 20)
    with pytest.raises(FrameError, match="msgpack"):
        d.feed(struct.pack(">I", len(body)) + body)


def test_invalid_frame_after_good_ones_in_one_feed() -> None:
    d = FrameDecoder(1 << 20)
    with pytest.raises(FrameError):
        d.feed(encode({"id": 1}) + struct.pack(">I", 1) + b"\xc1")


def test_non_map_messages_decode() -> None:
    # The codec decodes any msgpack value; checking the shape is the server's job.
    d = FrameDecoder(1 << 20)
    body = msgpack.packb([1, 2])
    assert d.feed(struct.pack(">I", len(body)) + body) == [[1, 2]]


# Answers.


def test_raise_for_error_passes_a_good_answer() -> None:
    a = {"id": 1, "count": 3}
    assert raise_for_error(a) is a
    a = {"id": 1, "error": None}
    assert raise_for_error(a) is a


def test_raise_for_error_raises_code_and_message() -> None:
    with pytest.raises(HicachedError) as e:
        raise_for_error(error_answer(3, "no_space", "pool is full"))
    assert e.value.code == "no_space"
    assert e.value.message == "pool is full"
    assert "[no_space] pool is full" in str(e.value)


def test_raise_for_error_survives_a_wire_round_trip() -> None:
    (a,) = FrameDecoder(1 << 20).feed(encode(error_answer(3, "timeout", "slow backend")))
    with pytest.raises(HicachedError) as e:
        raise_for_error(a)
    assert (e.value.code, e.value.message) == ("timeout", "slow backend")


@pytest.mark.parametrize(
    "err, code, words",
    [
        ({}, "internal", ""),
        ({"message": "m"}, "internal", "m"),
        ({"code": "busy"}, "busy", ""),
        ("boom", "internal", "boom"),
        (["x"], "internal", "x"),
        (0, "internal", "0"),
    ],
)
def test_raise_for_error_odd_errors(err: Any, code: str, words: str) -> None:
    with pytest.raises(HicachedError) as e:
        raise_for_error({"id": 1, "error": err})
    assert e.value.code == code
    assert words in e.value.message


def test_error_answer_shape() -> None:
    assert error_answer(9, "bad_request", "no") == {
        "id": 9,
        "error": {"code": "bad_request", "message": "no"},
    }


# Argument checks.


def _bad(fn, *a) -> str:
    with pytest.raises(HicachedError) as e:
        fn(*a)
    assert e.value.code == "bad_request"
    return e.value.message


def test_arg_returns_the_value() -> None:
    req = {"n": 5, "s": "x", "l": [1], "f": 1.5, "d": {}, "b": True}
    assert arg(req, "n", int) == 5
    assert arg(req, "s", str) == "x"
    assert arg(req, "l", list) == [1]
    assert arg(req, "f", (int, float)) == 1.5
    assert arg(req, "n", (int, float)) == 5
    assert arg(req, "d", dict) == {}
    assert arg(req, "b", bool) is True


def test_arg_missing_field() -> None:
    assert "'n'" in _bad(arg, {}, "n", int)
    assert "missing" in _bad(arg, {"m": 1}, "n", int)


def test_arg_default() -> None:
    assert arg({}, "n", int, 7) == 7
    assert arg({}, "n", int, None) is None
    assert arg({"n": 3}, "n", int, 7) == 3
    assert arg({"n": None}, "n", int, None) is None


def test_arg_wrong_type() -> None:
    msg = _bad(arg, {"n": "5"}, "n", int)
    assert "'n'" in msg and "str" in msg
    assert "list" in _bad(arg, {"s": ["a"]}, "s", str)
    assert "str" in _bad(arg, {"l": "ab"}, "l", list)
    assert "'f'" in _bad(arg, {"f": "1.5"}, "f", (int, float))
    # A value given with a default must still have the right type.
    assert "'n'" in _bad(arg, {"n": "5"}, "n", int, 0)


@pytest.mark.parametrize("kind", [int, float, (int, float)])
def test_bool_is_not_a_number(kind) -> None:
    assert "bool" in _bad(arg, {"n": True}, "n", kind)
    assert "bool" in _bad(arg, {"n": False}, "n", kind, 0)


def test_keys_arg() -> None:
    keys = ["ab" * 32] * 3
    assert keys_arg({"keys": keys}, 3) == keys
    assert keys_arg({"keys": []}, 3) == []


def test_keys_arg_errors() -> None:
    assert "'keys'" in _bad(keys_arg, {}, 4)
    assert "'keys'" in _bad(keys_arg, {"keys": "ab" * 32}, 4)
    assert "'keys'" in _bad(keys_arg, {"keys": {"a": 1}}, 4)
    msg = _bad(keys_arg, {"keys": ["k"] * 5}, 4)
    assert "5 keys" in msg and "limit is 4" in msg
