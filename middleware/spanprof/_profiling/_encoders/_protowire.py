"""Minimal protobuf wire-format helpers shared by the pprof and push codecs.

Only what pprof, ``push.v1`` and OTLP profiles need: varints, length-delimited fields and packed
repeated varints. Hand-written on purpose so spanprof does not depend on the
``protobuf`` package (whose runtime/codegen version pinning is a frequent source
of conflicts in user applications).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

__all__ = [
    "WIRE_FIXED32",
    "WIRE_FIXED64",
    "WIRE_LEN",
    "WIRE_VARINT",
    "PYTHON_WRITERS",
    "FieldValue",
    "ProtoDecodeError",
    "as_bytes",
    "as_int",
    "as_str",
    "decode_varint",
    "encode_varint",
    "iter_fields",
    "put_bytes_field",
    "put_fixed64_field",
    "put_packed_varints_field",
    "put_string_field",
    "put_tag",
    "put_varint",
    "put_varint_field",
    "to_int64",
    "unpack_varints",
]

WIRE_VARINT = 0
WIRE_FIXED64 = 1
WIRE_LEN = 2
WIRE_FIXED32 = 5

_MASK64 = (1 << 64) - 1

#: A decoded field payload: ``int`` for varint/fixed wire types, ``bytes`` for
#: length-delimited ones.
FieldValue = int | bytes


class ProtoDecodeError(ValueError):
    """Raised when bytes are not valid protobuf wire format (or not the expected message)."""


def encode_varint(value: int) -> bytes:
    """Encode ``value`` as a base-128 varint; negative values use 64-bit two's complement."""
    buf = bytearray()
    put_varint(buf, value)
    return bytes(buf)


def _py_put_varint(buf: bytearray, value: int, /) -> None:
    """Append ``value`` to ``buf`` as a varint (negative values as 10-byte two's complement)."""
    if value < 0:
        value &= _MASK64
    elif value > _MASK64:
        raise OverflowError(f"varint: {value} does not fit in 64 bits")
    while value > 0x7F:
        buf.append((value & 0x7F) | 0x80)
        value >>= 7
    buf.append(value)


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode the varint starting at ``data[pos]``; return ``(value, next_pos)``."""
    result = 0
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise ProtoDecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        # 10 bytes is the longest legal varint (64 bits); more means garbage input.
        if shift >= 70:
            raise ProtoDecodeError("varint too long")


def to_int64(value: int) -> int:
    """Reinterpret an unsigned varint as a signed ``int64`` (proto ``int64`` fields)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def iter_fields(data: bytes) -> Iterator[tuple[int, int, FieldValue]]:
    """Yield ``(field_number, wire_type, value)`` for every field of a message.

    Varint and fixed-width fields yield ``int`` (fixed ones little-endian unsigned),
    length-delimited fields yield ``bytes``. Groups (wire types 3/4) are rejected:
    neither pprof nor push.v1 uses them, so seeing one means the input is not what
    we think it is.
    """
    pos = 0
    end = len(data)
    while pos < end:
        key, pos = decode_varint(data, pos)
        field = key >> 3
        wire = key & 7
        if field == 0:
            raise ProtoDecodeError("field number 0")
        if wire == WIRE_VARINT:
            value, pos = decode_varint(data, pos)
            yield field, wire, value
        elif wire == WIRE_LEN:
            length, pos = decode_varint(data, pos)
            stop = pos + length
            if stop > end:
                raise ProtoDecodeError("truncated length-delimited field")
            yield field, wire, data[pos:stop]
            pos = stop
        elif wire == WIRE_FIXED64:
            if pos + 8 > end:
                raise ProtoDecodeError("truncated fixed64")
            yield field, wire, int.from_bytes(data[pos : pos + 8], "little")
            pos += 8
        elif wire == WIRE_FIXED32:
            if pos + 4 > end:
                raise ProtoDecodeError("truncated fixed32")
            yield field, wire, int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
        else:
            raise ProtoDecodeError(f"unsupported wire type {wire}")


def as_int(value: FieldValue) -> int:
    """Return a scalar field value, rejecting a length-delimited payload."""
    if isinstance(value, int):
        return value
    raise ProtoDecodeError("expected a scalar field, got length-delimited")


def as_bytes(value: FieldValue) -> bytes:
    """Return a length-delimited field payload, rejecting a scalar."""
    if isinstance(value, bytes):
        return value
    raise ProtoDecodeError("expected a length-delimited field, got a scalar")


def as_str(value: FieldValue) -> str:
    """Return a ``string`` field decoded as UTF-8."""
    try:
        return as_bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtoDecodeError(f"invalid UTF-8 in string field: {exc}") from exc


def unpack_varints(value: FieldValue) -> list[int]:
    """Decode a repeated varint field occurrence, packed or not.

    Parsers must accept both encodings for repeated scalars, and producers differ
    (Go's pprof packs, some older writers do not).
    """
    if isinstance(value, int):
        return [value]
    out: list[int] = []
    pos = 0
    end = len(value)
    while pos < end:
        item, pos = decode_varint(value, pos)
        out.append(item)
    return out


def put_tag(buf: bytearray, field: int, wire: int) -> None:
    """Append a field key."""
    put_varint(buf, (field << 3) | wire)


# The writers below append one-byte varints (keys of fields 1 to 15, values and lengths under
# 128: most of what a profile holds) themselves, without a put_varint call each.


def _py_put_varint_field(buf: bytearray, field: int, value: int, /) -> None:
    """Append a varint field, omitting it when zero (proto3 default)."""
    if value:
        key = (field << 3) | WIRE_VARINT
        if key < 0x80 and 0 < value < 0x80:
            buf.append(key)
            buf.append(value)
            return
        _py_put_varint(buf, key)
        _py_put_varint(buf, value)


def _py_put_bytes_field(buf: bytearray, field: int, data: bytes | bytearray, /) -> None:
    """Append a length-delimited field (always written, even when empty)."""
    key = (field << 3) | WIRE_LEN
    size = len(data)
    if key < 0x80 and size < 0x80:
        buf.append(key)
        buf.append(size)
    else:
        _py_put_varint(buf, key)
        _py_put_varint(buf, size)
    buf += data


def put_fixed64_field(buf: bytearray, field: int, value: int) -> None:
    """Append a ``fixed64`` field (little-endian), omitting it when zero (proto3 default)."""
    if value:
        put_varint(buf, (field << 3) | WIRE_FIXED64)
        buf += (value & _MASK64).to_bytes(8, "little")


def _py_put_string_field(buf: bytearray, field: int, value: str, /) -> None:
    """Append a UTF-8 string field (always written, even when empty)."""
    _py_put_bytes_field(buf, field, value.encode("utf-8"))


def _py_put_packed_varints_field(buf: bytearray, field: int, values: Iterable[int], /) -> None:
    """Append a packed repeated varint field; omitted entirely when ``values`` is empty."""
    payload = bytearray()
    for v in values:
        if 0 <= v < 0x80:
            payload.append(v)
        else:
            _py_put_varint(payload, v)
    if payload:
        _py_put_bytes_field(buf, field, payload)


#: The writers in Python, by name: what the C module ``_wire`` replaces when it loads (the
#: tests check that both write the same bytes).
PYTHON_WRITERS: dict[str, Callable[..., None]] = {
    "put_bytes_field": _py_put_bytes_field,
    "put_packed_varints_field": _py_put_packed_varints_field,
    "put_string_field": _py_put_string_field,
    "put_varint": _py_put_varint,
    "put_varint_field": _py_put_varint_field,
}

try:
    from ._wire import (
        put_bytes_field,
        put_packed_varints_field,
        put_string_field,
        put_varint,
        put_varint_field,
    )
except ImportError:  # built without a compiler, or the module cannot load here
    put_bytes_field = _py_put_bytes_field
    put_packed_varints_field = _py_put_packed_varints_field
    put_string_field = _py_put_string_field
    put_varint = _py_put_varint
    put_varint_field = _py_put_varint_field
