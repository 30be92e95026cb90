"""The protobuf field writers: every encoding is a key varint, then a varint or a length and
the bytes, whatever path (one-byte or general) the writer takes."""

from __future__ import annotations

import pytest

from spanprof._profiling._encoders._protowire import (
    WIRE_LEN,
    WIRE_VARINT,
    decode_varint,
    encode_varint,
    iter_fields,
    put_bytes_field,
    put_packed_varints_field,
    put_varint_field,
)

# Around each boundary of the one-byte fast paths: keys of fields 15 and 16, values and
# lengths of 127 and 128, and the 64-bit extremes.
FIELDS = [1, 2, 15, 16, 17, 2047, 2048, 536_870_911]
VALUES = [0, 1, 2, 126, 127, 128, 129, 255, 256, 16_383, 16_384, 2**63 - 1, 2**64 - 1, -1, -128]
SIZES = [0, 1, 126, 127, 128, 129, 16_383, 16_384]


@pytest.mark.parametrize("field", FIELDS)
def test_varint_fields_are_key_then_value(field: int) -> None:
    for value in VALUES:
        buf = bytearray(b"x")
        put_varint_field(buf, field, value)
        key = encode_varint(field << 3 | WIRE_VARINT)
        expected = b"" if value == 0 else key + encode_varint(value)
        assert bytes(buf) == b"x" + expected, (field, value)


@pytest.mark.parametrize("field", FIELDS)
def test_bytes_fields_are_key_length_then_bytes(field: int) -> None:
    for size in SIZES:
        data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        buf = bytearray(b"x")
        put_bytes_field(buf, field, data)
        key = encode_varint(field << 3 | WIRE_LEN)
        assert bytes(buf) == b"x" + key + encode_varint(size) + data
        assert list(iter_fields(bytes(buf[1:]))) == [(field, WIRE_LEN, data)]


@pytest.mark.parametrize("field", FIELDS)
def test_packed_varints_decode_back(field: int) -> None:
    values = [v for v in VALUES if v >= 0] + [5, 0, 127]
    buf = bytearray()
    put_packed_varints_field(buf, field, values)
    ((number, wire, payload),) = list(iter_fields(bytes(buf)))
    assert (number, wire) == (field, WIRE_LEN)
    assert isinstance(payload, bytes)
    assert payload == b"".join(encode_varint(v) for v in values)
    decoded, pos = [], 0
    while pos < len(payload):
        value, pos = decode_varint(payload, pos)
        decoded.append(value)
    assert decoded == values


def test_an_empty_packed_field_is_left_out() -> None:
    buf = bytearray()
    put_packed_varints_field(buf, 3, [])
    assert buf == b""
