"""The protobuf field writers: every encoding is a key varint, then a varint or a length and
the bytes, whatever path (one-byte or general) the writer takes, and the C writers (``_wire``)
write exactly what the Python ones write."""

from __future__ import annotations

import importlib
import importlib.util
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from spanprof._profiling._encoders import _protowire
from spanprof._profiling._encoders._protowire import (
    PYTHON_WRITERS,
    WIRE_LEN,
    WIRE_VARINT,
    decode_varint,
    iter_fields,
)

from .conftest import require

# Around each boundary of the one-byte fast paths: keys of fields 15 and 16, values and
# lengths of 127 and 128, and the 64-bit extremes.
FIELDS = [1, 2, 15, 16, 17, 2047, 2048, 536_870_911]
VALUES = [0, 1, 2, 126, 127, 128, 129, 255, 256, 16_383, 16_384, 2**63 - 1, 2**64 - 1, -1, -128]
SIZES = [0, 1, 126, 127, 128, 129, 16_383, 16_384]

Writers = dict[str, Callable[..., None]]


def reference_varint(value: int) -> bytes:
    """A varint written the long way, independent of both writers under test."""
    value &= (1 << 64) - 1
    out = []
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def c_writers() -> Writers:
    """The C module's writers; skips (fails under CI) when it is not built."""
    require(
        importlib.util.find_spec("spanprof._profiling._encoders._wire") is not None,
        "spanprof._profiling._encoders._wire is not built (installed without a C compiler)",
    )
    # Built but failing to import is a failure, not a skip.
    module = importlib.import_module("spanprof._profiling._encoders._wire")
    return {name: getattr(module, name) for name in PYTHON_WRITERS}


@pytest.fixture(params=["python", "c"])
def writers(request: pytest.FixtureRequest) -> Writers:
    return dict(PYTHON_WRITERS) if request.param == "python" else c_writers()


def test_the_encoders_use_the_c_writers_when_built() -> None:
    c = c_writers()
    for name, writer in c.items():
        assert getattr(_protowire, name) is writer, name


@pytest.mark.parametrize("field", FIELDS)
def test_varint_fields_are_key_then_value(writers: Writers, field: int) -> None:
    for value in VALUES:
        buf = bytearray(b"x")
        writers["put_varint_field"](buf, field, value)
        key = reference_varint(field << 3 | WIRE_VARINT)
        expected = b"" if value == 0 else key + reference_varint(value)
        assert bytes(buf) == b"x" + expected, (field, value)


def test_varints_are_64_bit(writers: Writers) -> None:
    for value in [*VALUES, -(2**63), -(2**64) + 1, -(2**70) - 5]:
        buf = bytearray(b"x")
        writers["put_varint"](buf, value)
        assert bytes(buf) == b"x" + reference_varint(value), value
        assert decode_varint(bytes(buf), 1) == (value & (2**64 - 1), len(buf))
    with pytest.raises(OverflowError):
        writers["put_varint"](bytearray(), 2**64)


@pytest.mark.parametrize("field", FIELDS)
def test_bytes_fields_are_key_length_then_bytes(writers: Writers, field: int) -> None:
    for size in SIZES:
        data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        for given in (data, bytearray(data), memoryview(data)):
            buf = bytearray(b"x")
            writers["put_bytes_field"](buf, field, given)
            key = reference_varint(field << 3 | WIRE_LEN)
            assert bytes(buf) == b"x" + key + reference_varint(size) + data
            assert list(iter_fields(bytes(buf[1:]))) == [(field, WIRE_LEN, data)]


@pytest.mark.parametrize("text", ["", "span_id", "GET /health", "naïve ☃ 𝄞", "x" * 200])
def test_string_fields_are_utf8(writers: Writers, text: str) -> None:
    buf = bytearray(b"x")
    writers["put_string_field"](buf, 6, text)
    data = text.encode()
    key = reference_varint(6 << 3 | WIRE_LEN)
    assert bytes(buf) == b"x" + key + reference_varint(len(data)) + data


def test_a_string_that_is_not_utf8_is_refused(writers: Writers) -> None:
    with pytest.raises(UnicodeEncodeError):
        writers["put_string_field"](bytearray(), 6, "lone \udc80 surrogate")


def _generated(values: list[int]) -> Iterator[int]:
    yield from values


@pytest.mark.parametrize("field", FIELDS)
def test_packed_varints_decode_back(writers: Writers, field: int) -> None:
    values = [v for v in VALUES if v >= 0] + [5, 0, 127]
    given: Iterable[int]
    for given in (values, tuple(values), _generated(values), [*values] * 20):
        expected = list(given) if isinstance(given, list | tuple) else values
        buf = bytearray()
        writers["put_packed_varints_field"](buf, field, given)
        ((number, wire, payload),) = list(iter_fields(bytes(buf)))
        assert (number, wire) == (field, WIRE_LEN)
        assert isinstance(payload, bytes)
        assert payload == b"".join(reference_varint(v) for v in expected)
        decoded, pos = [], 0
        while pos < len(payload):
            value, pos = decode_varint(payload, pos)
            decoded.append(value)
        assert decoded == expected


def test_an_empty_packed_field_is_left_out(writers: Writers) -> None:
    buf = bytearray()
    writers["put_packed_varints_field"](buf, 3, [])
    writers["put_packed_varints_field"](buf, 3, iter(()))
    assert buf == b""


def test_the_c_writers_write_what_the_python_writers_write() -> None:
    c = c_writers()
    rng = random.Random(7)
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for _ in range(3000):
        field = rng.choice([*FIELDS, rng.randrange(1, 1 << 29)])
        value = rng.choice([*VALUES, rng.randrange(-(2**64), 2**64), rng.randrange(1 << 20)])
        data = rng.randbytes(rng.choice([0, 5, 127, 128, 300]))
        values = [rng.randrange(0, 2 ** rng.randrange(1, 64)) for _ in range(rng.randrange(90))]
        calls += [
            ("put_varint", (value,)),
            ("put_varint_field", (field, value)),
            ("put_bytes_field", (field, data)),
            ("put_string_field", (field, data.decode("latin-1"))),
            ("put_packed_varints_field", (field, values)),
        ]
    python_buf, c_buf = bytearray(), bytearray()
    for name, args in calls:
        PYTHON_WRITERS[name](python_buf, *args)
        c[name](c_buf, *args)
    assert c_buf == python_buf


def test_the_c_writers_refuse_what_they_cannot_write() -> None:
    c = c_writers()
    with pytest.raises(TypeError, match="bytearray"):
        c["put_varint"](b"immutable", 1)
    with pytest.raises(TypeError, match="int"):
        c["put_varint_field"](bytearray(), 1, 1.5)
    with pytest.raises(TypeError, match="str"):
        c["put_string_field"](bytearray(), 1, b"bytes")
    with pytest.raises(TypeError):
        c["put_bytes_field"](bytearray(), 1, "text")
    with pytest.raises(TypeError):
        c["put_packed_varints_field"](bytearray(), 1, [1, "2"])
    with pytest.raises(ValueError, match="field number"):
        c["put_bytes_field"](bytearray(), 1 << 29, b"")
    with pytest.raises(TypeError, match="3 arguments"):
        c["put_bytes_field"](bytearray(), 1)
    # A bytearray with a view on it cannot grow: the write fails, nothing is half-written.
    buf = bytearray(b"held")
    with memoryview(buf), pytest.raises(BufferError):
        c["put_varint"](buf, 300)
    assert buf == b"held"


# --- pprof's sample label fields, written whole in C ------------------------------------------


def _label_sets(rng: random.Random, count: int) -> list[tuple[tuple[str, str], ...]]:
    """Label tuples as a memory window's spans bring them: shared pairs, new ids, an empty
    value (string index 0: its field is left out) and enough strings for two-byte indices."""
    out = []
    for span in range(count):
        pairs = [
            ("span_id", f"{rng.getrandbits(64):016x}"),
            ("span_name", rng.choice(["GET /health", "POST /items/{item_id}", ""])),
            ("trace_id", f"{span:032x}"),
        ]
        if rng.random() < 0.3:
            pairs.append(("slo", rng.choice(["ok", "breached"])))
        if rng.random() < 0.1:
            pairs.append(("tenant", "é" * rng.randrange(1, 4)))
        out.append(tuple(sorted(pairs)))
    return out


def test_the_c_label_fields_build_the_profile_the_python_ones_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same bytes and same string table, over enough strings for multi-byte indices."""
    from spanprof._profiling._encoders import _pprof
    from spanprof._profiling._window import Frame

    module = importlib.import_module("spanprof._profiling._encoders._wire")
    c_writers()  # skips (fails under CI) when _wire is not built
    assert _pprof._c_label_fields is module.pprof_label_fields
    stack = tuple(Frame(f"f{i}", "app.py", i) for i in range(5))
    labels = _label_sets(random.Random(11), 400)

    def build() -> bytes:
        builder = _pprof.ProfileBuilder()
        for i, pairs in enumerate(labels):
            builder.add(stack, i + 1, pairs)
            builder.add(stack, 1, pairs)  # merged into the same sample
        return builder.build()

    with_c = build()
    monkeypatch.setattr(_pprof, "_c_label_fields", None)
    with_python = build()
    assert with_c == with_python
    profile = _pprof.decode_profile(with_c)
    decoded = {tuple(sorted(sample.labels)): sample.value for sample in profile.samples}
    assert decoded == {pairs: i + 2 for i, pairs in enumerate(labels)}


def test_the_c_label_fields_refuse_what_they_cannot_write() -> None:
    c_writers()
    module = importlib.import_module("spanprof._profiling._encoders._wire")
    write = module.pprof_label_fields
    strings: dict[str, int] = {"": 0}
    table = [""]
    cache: dict[tuple[str, str], bytes] = {}
    with pytest.raises(TypeError, match="pair"):
        write([("a", "b", "c")], cache, strings, table)
    with pytest.raises(TypeError, match="sequence"):
        write(3, cache, strings, table)
    with pytest.raises(TypeError, match="dict"):
        write([], [], strings, table)
    with pytest.raises(TypeError, match="4 arguments"):
        write([], cache, strings)
    with pytest.raises(TypeError, match="unhashable"):
        write([("a", ["list"])], cache, strings, table)
    # A failure leaves the string table whole: every string interned is in both.
    assert len(strings) == len(table)
    assert all(table[index] == text for text, index in strings.items())
    cache[("k", "v")] = "not bytes"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="bytes"):
        write([("k", "v")], cache, strings, table)
