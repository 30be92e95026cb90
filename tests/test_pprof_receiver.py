"""pprof / push.v1 codecs and the local PushReceiver, down to the real pyroscope-io agent."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import logging
import socket
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spanprof._local._receiver import PushReceiver, ReceivedPush
from spanprof._local._stacks import FramePool
from spanprof._logging import reset_log_once
from spanprof._profiling._encoders._otlp import OtlpTooLargeError, decode_export_request
from spanprof._profiling._encoders._pprof import (
    DEFAULT_MAX_DEPTH,
    InflatedTooLargeError,
    Profile,
    ProfileBuilder,
    ProfileDecodeError,
    ProfileTooLargeError,
    Sample,
    decode_profile,
    encode_profile,
    gunzip_bounded,
)
from spanprof._profiling._encoders._protowire import (
    WIRE_LEN,
    as_bytes,
    as_int,
    as_str,
    iter_fields,
    put_bytes_field,
    put_packed_varints_field,
    put_string_field,
    put_varint_field,
    unpack_varints,
)
from spanprof._profiling._encoders._push import (
    PUSH_CONTENT_TYPE,
    PUSH_PATH,
    PushDecodeError,
    PushTooLargeError,
    decode_push_request,
    encode_push_request,
)
from spanprof._profiling._window import Frame

SPAN_ID = "0123456789abcdef"
TRACE_ID = "0123456789abcdef0123456789abcdef"
TEN_MS_NS = 10_000_000

LEAF = Frame("leaf", "/app/mod.py", 12)
MID = Frame("mid", "/app/mod.py", 30)
ROOT = Frame("<module>", "/app/main.py", 1)


@pytest.fixture
def push_receiver() -> Iterator[PushReceiver]:
    """A started PushReceiver on an ephemeral port, stopped afterwards."""
    with PushReceiver() as receiver:
        yield receiver


def _sample_profile() -> Profile:
    return Profile(
        sample_types=(("cpu", "nanoseconds"), ("samples", "count")),
        period_type=("cpu", "nanoseconds"),
        period=TEN_MS_NS,
        time_nanos=1_700_000_000_000_000_000,
        duration_nanos=1_000_000_000,
        samples=(
            Sample(
                (LEAF, MID, ROOT),
                (30_000_000, 3),
                (("span_id", SPAN_ID), ("route", "/a"), ("span_id", "fedcba9876543210")),
            ),
            Sample((MID, ROOT), (-10, 1), (), (("bytes", 4096, "bytes"),)),
            Sample((ROOT,), (0, 0), (("empty", ""),)),
            Sample((), (5, 1)),
        ),
        comments=("made by a test",),
        default_sample_type="cpu",
    )


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def test_profile_round_trip_keeps_everything() -> None:
    """decode(encode(p)) == p, including duplicate label keys, numeric labels and negatives."""
    profile = _sample_profile()
    assert decode_profile(encode_profile(profile)) == profile


def test_profile_decode_accepts_gzip() -> None:
    """A gzip-compressed pprof decodes to the same profile as the raw one."""
    profile = _sample_profile()
    assert decode_profile(gzip.compress(encode_profile(profile))) == profile


def test_sample_label_values_keeps_duplicate_keys() -> None:
    """label_values returns every value of a repeated key in wire order."""
    sample = decode_profile(encode_profile(_sample_profile())).samples[0]
    assert sample.label_values("span_id") == (SPAN_ID, "fedcba9876543210")
    assert sample.label("route") == "/a"
    assert sample.label("missing") is None


def test_encoded_profile_is_structurally_valid_pprof() -> None:
    """The encoder writes string_table[0]="", 1-based dense ids and packed sample fields."""
    data = encode_profile(_sample_profile())
    strings: list[str] = []
    function_ids: list[int] = []
    location_ids: list[int] = []
    referenced_functions: set[int] = set()
    referenced_locations: set[int] = set()
    for field, _wire, value in iter_fields(data):
        if field == 6:
            strings.append(as_str(value))
        elif field == 5:
            function_ids.extend(as_int(v) for f, _w, v in iter_fields(as_bytes(value)) if f == 1)
        elif field == 4:
            for f, _w, v in iter_fields(as_bytes(value)):
                if f == 1:
                    location_ids.append(as_int(v))
                elif f == 4:
                    referenced_functions.update(
                        as_int(lv) for lf, _lw, lv in iter_fields(as_bytes(v)) if lf == 1
                    )
        elif field == 2:
            for f, w, v in iter_fields(as_bytes(value)):
                if f in (1, 2):
                    assert w == WIRE_LEN, "repeated scalars must be packed"
                if f == 1:
                    referenced_locations.update(unpack_varints(v))
    assert strings[0] == ""
    assert len(strings) == len(set(strings)), "strings are interned once"
    assert function_ids == list(range(1, len(function_ids) + 1))
    assert location_ids == list(range(1, len(location_ids) + 1))
    assert referenced_functions <= set(function_ids)
    assert referenced_locations <= set(location_ids)
    assert len(location_ids) == 3, "identical frames share one location"


def test_decode_flattens_inlined_frames_in_order() -> None:
    """A Location with several Line entries yields its frames callee first, then round-trips."""
    strings = ["", "cpu", "nanoseconds", "inlined_callee", "caller", "/f.py", "root"]
    buf = bytearray()
    vt = bytearray()
    put_varint_field(vt, 1, 1)
    put_varint_field(vt, 2, 2)
    put_bytes_field(buf, 1, vt)
    sample = bytearray()
    put_packed_varints_field(sample, 1, [7, 9])
    put_packed_varints_field(sample, 2, [20])
    put_bytes_field(buf, 2, sample)
    for loc_id, lines in ((7, [(11, 3), (12, 8)]), (9, [(13, 1)])):
        loc = bytearray()
        put_varint_field(loc, 1, loc_id)
        for func_id, line_no in lines:
            line = bytearray()
            put_varint_field(line, 1, func_id)
            put_varint_field(line, 2, line_no)
            put_bytes_field(loc, 4, line)
        put_bytes_field(buf, 4, loc)
    for func_id, name_idx in ((11, 3), (12, 4), (13, 6)):
        fn = bytearray()
        put_varint_field(fn, 1, func_id)
        put_varint_field(fn, 2, name_idx)
        put_varint_field(fn, 4, 5)
        put_bytes_field(buf, 5, fn)
    for s in strings:
        put_string_field(buf, 6, s)

    profile = decode_profile(bytes(buf))
    assert profile.samples[0].stack == (
        Frame("inlined_callee", "/f.py", 3),
        Frame("caller", "/f.py", 8),
        Frame("root", "/f.py", 1),
    )
    assert profile.period_type == ("", "")
    assert decode_profile(encode_profile(profile)) == profile


def test_decode_rejects_malformed_profiles() -> None:
    """Garbage bytes, bad gzip and dangling string indexes raise ProfileDecodeError."""
    with pytest.raises(ProfileDecodeError):
        decode_profile(b"\xff\xff\xff")
    with pytest.raises(ProfileDecodeError):
        decode_profile(b"\x1f\x8bnot gzip at all")
    bad = bytearray()
    vt = bytearray()
    put_varint_field(vt, 1, 42)
    put_bytes_field(bad, 1, vt)
    put_string_field(bad, 6, "")
    with pytest.raises(ProfileDecodeError, match="string index"):
        decode_profile(bytes(bad))


def test_builder_merges_identical_stack_and_labels() -> None:
    """ProfileBuilder sums values of identical stack+labels and keeps distinct ones apart."""
    builder = ProfileBuilder(period=TEN_MS_NS)
    builder.add([LEAF, ROOT], TEN_MS_NS, [("span_id", SPAN_ID)])
    builder.add((LEAF, ROOT), TEN_MS_NS, (("span_id", SPAN_ID),))
    builder.add([LEAF, ROOT], TEN_MS_NS)
    builder.add([MID, ROOT], [TEN_MS_NS], [("span_id", SPAN_ID)])
    assert len(builder) == 3
    profile = decode_profile(builder.build(time_nanos=5, duration_nanos=7))
    assert profile.sample_types == (("cpu", "nanoseconds"),)
    assert profile.period_type == ("cpu", "nanoseconds")
    assert (profile.period, profile.time_nanos, profile.duration_nanos) == (TEN_MS_NS, 5, 7)
    assert [(s.stack, s.values, s.labels) for s in profile.samples] == [
        ((LEAF, ROOT), (2 * TEN_MS_NS,), (("span_id", SPAN_ID),)),
        ((LEAF, ROOT), (TEN_MS_NS,), ()),
        ((MID, ROOT), (TEN_MS_NS,), (("span_id", SPAN_ID),)),
    ]
    builder.reset()
    assert len(builder) == 0
    assert decode_profile(builder.build()).samples == ()


def test_builder_rejects_wrong_number_of_values() -> None:
    """add() needs exactly one value per sample type."""
    builder = ProfileBuilder((("cpu", "nanoseconds"), ("samples", "count")))
    with pytest.raises(ValueError, match="expected 2"):
        builder.add([LEAF], 1)


def test_push_request_round_trip() -> None:
    """encode_push_request output decodes back, raw or gzip'd, with labels, profiles and IDs."""
    profile = _sample_profile()
    labels = [("__name__", "process_cpu"), ("service_name", "svc")]
    ids = iter(["id-1", "id-2", "id-3"])
    body = encode_push_request(
        [(labels, [encode_profile(profile), gzip.compress(encode_profile(profile))]), ([], [])],
        make_id=lambda: next(ids),
    )
    for payload, encoding in ((body, None), (gzip.compress(body), "gzip"), (body, "identity")):
        series = decode_push_request(payload, encoding)
        assert len(series) == 2
        assert series[0].labels == tuple(labels)
        assert series[0].label("service_name") == "svc"
        assert series[0].profiles == (profile, profile)
        assert series[0].sample_ids == ("id-1", "id-2")
        assert series[1].labels == ()
        assert series[1].profiles == ()


def test_push_request_rejects_bad_input() -> None:
    """Unknown encodings, broken gzip and garbage protobuf raise PushDecodeError."""
    with pytest.raises(PushDecodeError, match="Content-Encoding"):
        decode_push_request(b"", "br")
    with pytest.raises(PushDecodeError):
        decode_push_request(b"\x1f\x8b\x08garbage", "gzip")
    with pytest.raises(PushDecodeError):
        decode_push_request(b"\x0a\x05\x12\x03\xff\xff\xff", None)


def test_receiver_accepts_push_like_pyroscope(push_receiver: PushReceiver) -> None:
    """A gzip'd Connect push gets 200 with an empty application/proto body and is stored."""
    builder = ProfileBuilder(period=TEN_MS_NS)
    builder.add([LEAF, ROOT], 3 * TEN_MS_NS, [("span_id", SPAN_ID)])
    series_labels = [("__name__", "process_cpu"), ("service_name", "unit")]
    body = gzip.compress(encode_push_request([(series_labels, [builder.build()])]))
    status, headers, payload = _post(
        push_receiver.url + PUSH_PATH,
        body,
        {"Content-Type": PUSH_CONTENT_TYPE, "Content-Encoding": "gzip"},
    )
    assert (status, payload) == (200, b"")
    assert headers["Content-Type"] == "application/proto"
    assert push_receiver.pushes == 1
    assert push_receiver.errors == []
    [sample] = push_receiver.samples()
    assert sample.series_labels == tuple(series_labels)
    assert sample.stack == (LEAF, ROOT)
    assert sample.value == 3 * TEN_MS_NS
    assert sample.labels == (("span_id", SPAN_ID),)
    assert push_receiver.wait_for(lambda r: len(r.series()) == 1, timeout=0.1)
    push_receiver.clear()
    assert (push_receiver.pushes, push_receiver.samples()) == (0, [])
    assert not push_receiver.wait_for(lambda r: r.pushes > 0, timeout=0.05)


def test_receiver_rejects_garbage_with_400(push_receiver: PushReceiver) -> None:
    """An undecodable body gets a Connect invalid_argument 400 and is recorded as an error."""
    status, headers, payload = _post(
        push_receiver.url + PUSH_PATH,
        b"\x1f\x8bthis is not gzip",
        {"Content-Type": PUSH_CONTENT_TYPE, "Content-Encoding": "gzip"},
    )
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert json.loads(payload)["code"] == "invalid_argument"
    assert push_receiver.pushes == 0
    assert len(push_receiver.errors) == 1


def test_receiver_ignores_legacy_ingest_and_unknown_paths(push_receiver: PushReceiver) -> None:
    """POST /ingest is answered 200 and dropped; other paths get 404."""
    assert _post(push_receiver.url + "/ingest?name=x", b"foo;bar 1\n", {})[0] == 200
    assert _post(push_receiver.url + "/nope", b"", {})[0] == 404
    assert push_receiver.pushes == 0
    assert push_receiver.errors == []


def test_a_client_that_hangs_up_with_a_reset_is_not_an_error(push_receiver: PushReceiver) -> None:
    """A client closing its keep-alive connection with a reset (its unread reply discarded, as
    a client that reads the status only does) is ordinary: the receiver records nothing."""
    conn = socket.create_connection(("127.0.0.1", push_receiver.port), timeout=5)
    try:
        conn.sendall(b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
        assert conn.recv(12).startswith(b"HTTP/1.1 404")
        # Linger 0: close sends RST, which the handler's wait for the next request reads.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        conn.close()
    assert not push_receiver.wait_for(lambda r: bool(r.errors), timeout=1.0), push_receiver.errors


def test_receiver_on_push_callback_errors_are_recorded() -> None:
    """on_push sees each push; its exceptions become errors, not HTTP failures."""
    seen: list[int] = []

    def on_push(push: ReceivedPush) -> None:
        seen.append(1)
        raise RuntimeError("boom")

    with PushReceiver(on_push=on_push) as receiver:
        status, _headers, _payload = _post(
            receiver.url + PUSH_PATH, encode_push_request([]), {"Content-Type": PUSH_CONTENT_TYPE}
        )
        assert status == 200
        assert receiver.wait_for(lambda r: len(r.errors) == 1, timeout=2)
    assert seen == [1]
    assert "boom" in receiver.errors[0]


MIB = 1024 * 1024


def _bomb(inflated: int) -> bytes:
    """A gzip body of ``inflated`` zero bytes: about a thousandth of that on the wire."""
    return gzip.compress(bytes(inflated), compresslevel=9)


def _peak_bytes(call: Callable[[], object]) -> int:
    """The peak of Python allocations while ``call`` runs (its exception is swallowed)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(Exception):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_gzip_bomb_stops_inflating_at_the_cap() -> None:
    """A body that inflates past max_inflated raises PushTooLargeError and never inflates fully."""
    bomb = _bomb(64 * MIB)
    assert len(bomb) < 100_000
    with pytest.raises(PushTooLargeError):
        decode_push_request(bomb, None, max_inflated=MIB)
    assert _peak_bytes(lambda: decode_push_request(bomb, "gzip", max_inflated=MIB)) < 8 * MIB


def test_gzip_bombs_nested_in_a_push_share_one_budget() -> None:
    """A gzipped profile inside the push, or gzip inside gzip, counts against the same cap."""
    nested = encode_push_request([([("__name__", "process_cpu")], [_bomb(64 * MIB)])])
    with pytest.raises(PushTooLargeError):
        decode_push_request(gzip.compress(nested), "gzip", max_inflated=MIB)
    with pytest.raises(InflatedTooLargeError):
        decode_profile(_bomb(64 * MIB), max_inflated=MIB)
    double = gzip.compress(_bomb(64 * MIB))
    twice = encode_push_request([([("__name__", "process_cpu")], [double])])
    assert _peak_bytes(lambda: decode_push_request(twice, None, max_inflated=MIB)) < 8 * MIB


def test_bounded_gunzip_reads_what_gzip_reads() -> None:
    """Concatenated members and zero padding inflate; a truncated stream is an error."""
    raw = encode_profile(_sample_profile())
    two = gzip.compress(raw[:10]) + gzip.compress(raw[10:]) + bytes(8)
    assert decode_profile(two, max_inflated=len(raw)) == _sample_profile()
    with pytest.raises(ProfileDecodeError, match="truncated"):
        decode_profile(gzip.compress(raw)[:-12], max_inflated=MIB)
    with pytest.raises(InflatedTooLargeError):
        decode_profile(gzip.compress(raw), max_inflated=len(raw) - 1)


def _raw_request(port: int, head: bytes, *, timeout: float = 5.0) -> bytes:
    """Send ``head`` on a fresh connection left open, and read the response's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        return sock.makefile("rb").readline()


@pytest.mark.parametrize("size", [b"-1", b"+5", b"0x5", b"1_0", b" ", b"fffffffffffffffffff"])
def test_malformed_chunk_sizes_get_400_without_waiting_for_the_client(
    push_receiver: PushReceiver, size: bytes
) -> None:
    """A chunk size int(, 16) would accept but HTTP does not is answered at once, not read on."""
    head = (
        b"POST " + PUSH_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/proto\r\nTransfer-Encoding: chunked\r\n\r\n"
        + size
        + b"\r\nabcde\r\n"
    )
    assert _raw_request(push_receiver.port, head, timeout=3).startswith(b"HTTP/1.1 400")
    assert push_receiver.pushes == 0
    assert "chunk" in push_receiver.errors[-1]


def test_chunked_bodies_are_capped_in_total() -> None:
    """Many small chunks adding up past max_body_bytes get 413."""
    with PushReceiver(max_body_bytes=1000) as receiver:
        head = (
            b"POST " + PUSH_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/proto\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"100\r\n" + bytes(256) + b"\r\n" for _ in range(5))
        )
        assert _raw_request(receiver.port, head).startswith(b"HTTP/1.1 413")


def test_receiver_answers_a_bomb_413_and_keeps_serving() -> None:
    """An oversized gzip push gets resource_exhausted; the next real push is accepted."""
    with PushReceiver(max_inflated_bytes=MIB) as receiver:
        status, _headers, payload = _post(
            receiver.url + PUSH_PATH, _bomb(64 * MIB), {"Content-Type": PUSH_CONTENT_TYPE}
        )
        assert status == 413
        assert json.loads(payload)["code"] == "resource_exhausted"
        ok = _post(receiver.url + PUSH_PATH, encode_push_request([]), _PROTO)
        assert ok[0] == 200
        assert receiver.pushes == 1


_PROTO = {"Content-Type": PUSH_CONTENT_TYPE}


def test_receiver_answers_an_otlp_bomb_413_and_keeps_serving() -> None:
    """OTLP profiles inflate under the same cap as pushes: a bomb gets 413, not gigabytes."""
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    with PushReceiver(max_inflated_bytes=MIB) as receiver:
        url = receiver.url + "/v1development/profiles"
        bomb = _bomb(64 * MIB)
        assert _peak_bytes(lambda: _post(url, bomb, headers)) < 16 * MIB
        assert _post(url, bomb, headers)[0] == 413
        assert _post(url, gzip.compress(b""), headers)[0] == 200


def _many_lines_profile(lines: int, samples: int, refs: int = 1) -> bytes:
    """pprof with one location of ``lines`` Line entries that ``samples`` samples reference
    ``refs`` times each: a few bytes on the wire per reference, ``lines`` frames decoded."""
    buf = bytearray()
    vt = bytearray()
    put_varint_field(vt, 1, 1)
    put_varint_field(vt, 2, 2)
    put_bytes_field(buf, 1, vt)
    fn = bytearray()
    put_varint_field(fn, 1, 1)
    put_varint_field(fn, 2, 3)
    put_varint_field(fn, 4, 4)
    put_bytes_field(buf, 5, fn)
    loc = bytearray()
    put_varint_field(loc, 1, 1)
    for line_no in range(lines):
        line = bytearray()
        put_varint_field(line, 1, 1)
        put_varint_field(line, 2, line_no)
        put_bytes_field(loc, 4, line)
    put_bytes_field(buf, 4, loc)
    sample = bytearray()
    put_packed_varints_field(sample, 1, [1] * refs)
    put_packed_varints_field(sample, 2, [1])
    buf += b"".join(_field(2, sample) for _ in range(samples))
    for text in ("", "cpu", "nanoseconds", "f", "/f.py"):
        put_string_field(buf, 6, text)
    return bytes(buf)


def _field(number: int, payload: bytes | bytearray) -> bytes:
    out = bytearray()
    put_bytes_field(out, number, payload)
    return bytes(out)


def test_deep_stacks_decode_cut_as_local_mode_keeps_them() -> None:
    """A stack past DEFAULT_MAX_DEPTH decodes to its leaf and root ends around a marker, the
    very frames FramePool keeps, whether its depth comes from many locations or many lines."""
    depth = DEFAULT_MAX_DEPTH + 1000
    frames = tuple(Frame(f"f{i}", "/deep.py", i) for i in range(depth))
    profile = Profile((("cpu", "nanoseconds"),), ("cpu", "nanoseconds"), 1, 0, 0, (
        Sample(frames, (1,)),
    ))  # fmt: skip
    stack = decode_profile(encode_profile(profile)).samples[0].stack
    assert len(stack) == DEFAULT_MAX_DEPTH
    assert stack == FramePool(DEFAULT_MAX_DEPTH).keep(frames)
    half = DEFAULT_MAX_DEPTH // 2
    assert stack == (*frames[:half], Frame("[1001 frames elided]", "", 0), *frames[-half + 1 :])

    inlined = decode_profile(_many_lines_profile(depth, 1, refs=2)).samples[0].stack
    lines = tuple(Frame("f", "/f.py", i) for i in range(depth)) * 2
    assert inlined == FramePool(DEFAULT_MAX_DEPTH).keep(lines)
    assert decode_profile(_many_lines_profile(5, 1, refs=2)).samples[0].stack == lines[:5] * 2


def test_a_push_decoding_to_millions_of_frames_gets_413_and_the_receiver_keeps_serving() -> None:
    """One location of 2,000 lines referenced by 2,000 samples: 28 KB that decoded to 4 million
    frames (30 MiB) is refused as too large, and the next push is taken."""
    bomb = encode_push_request([([("__name__", "process_cpu")], [_many_lines_profile(2000, 2000)])])
    assert len(bomb) < 30_000
    with pytest.raises(PushTooLargeError, match="frames"):
        decode_push_request(bomb)
    with pytest.raises(ProfileTooLargeError, match="frames"):
        decode_profile(_many_lines_profile(2000, 2000))
    with PushReceiver() as receiver:
        status, _headers, payload = _post(receiver.url + PUSH_PATH, bomb, _PROTO)
        assert status == 413
        assert json.loads(payload)["code"] == "resource_exhausted"
        assert receiver.pushes == 0
        assert "frames" in receiver.errors[-1]
        ok = encode_push_request([([("__name__", "process_cpu")], [_many_lines_profile(50, 50)])])
        assert _post(receiver.url + PUSH_PATH, ok, _PROTO)[0] == 200
        assert [len(s.stack) for s in receiver.samples()] == [50] * 50


def _otlp_many_lines(lines: int, stacks: int, refs: int) -> bytes:
    """An OTLP dictionary with one location of ``lines`` lines and ``stacks`` stacks listing it
    ``refs`` times each."""
    dictionary = _field(5, b"") + _field(3, b"")
    dictionary += _field(2, _field(3, b"") * lines)
    stack = bytearray()
    put_packed_varints_field(stack, 1, [0] * refs)
    dictionary += _field(7, stack) * stacks
    return _field(2, dictionary)


def test_otlp_profiles_decoding_to_millions_of_frames_get_413() -> None:
    """2,000 stacks of a 2,000-line location (14 KB, 4 million frames) are refused as too
    large; one stack listing it 100,000 times decodes to a cut stack and is taken."""
    bomb = _otlp_many_lines(2000, 2000, 1)
    assert len(bomb) < 16_000
    with pytest.raises(OtlpTooLargeError, match="frames"):
        decode_export_request(bomb)
    headers = {"Content-Type": "application/x-protobuf"}
    with PushReceiver() as receiver:
        url = receiver.url + "/v1development/profiles"
        assert _post(url, bomb, headers)[0] == 413
        assert "frames" in receiver.errors[-1]
        assert _post(url, _otlp_many_lines(2000, 1, 100_000), headers)[0] == 200


def test_receiver_refuses_what_a_web_page_can_send(
    push_receiver: PushReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    """Origin, a foreign Host, no Content-Type, a preflight: all refused, each kind logged once."""
    reset_log_once()
    body = encode_push_request([([("__name__", "process_cpu")], [])])
    url = push_receiver.url + PUSH_PATH
    with caplog.at_level(logging.WARNING, logger="spanprof"):
        for _ in range(3):
            origin = {**_PROTO, "Origin": "https://evil.example"}
            assert _post(url, body, origin)[0] == 403
            assert _post(url, body, {**_PROTO, "Host": "evil.example"})[0] == 403
        conn = http.client.HTTPConnection("127.0.0.1", push_receiver.port, timeout=5)
        try:
            # A no-cors fetch with a Blob body: no Content-Type (urllib would add a form type).
            conn.request("POST", PUSH_PATH, body=body, headers={})
            response = conn.getresponse()
            response.read()
            assert response.status == 415
            conn.request("OPTIONS", PUSH_PATH, headers={})
            assert conn.getresponse().status == 405
        finally:
            conn.close()
    assert push_receiver.pushes == 0
    foreign = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len([m for m in foreign if "Origin" in m]) == 1, foreign
    assert len([m for m in foreign if "Host" in m]) == 1, foreign
    assert len([e for e in push_receiver.errors if "refused" in e]) == 6
    for host in (f"127.0.0.1:{push_receiver.port}", f"localhost:{push_receiver.port}"):
        assert _post(url, body, {**_PROTO, "Host": host})[0] == 200


def test_receiver_keeps_a_bounded_error_list(push_receiver: PushReceiver) -> None:
    """A flood of rejected requests keeps the last 1,000 errors, not all of them."""
    conn = http.client.HTTPConnection("127.0.0.1", push_receiver.port, timeout=5)
    try:
        for _ in range(1005):
            conn.request("POST", PUSH_PATH, body=b"x", headers={"Content-Type": "text/plain"})
            response = conn.getresponse()
            response.read()
            assert response.status == 415
    finally:
        conn.close()
    assert len(push_receiver.errors) == 1000


def test_receiver_survives_a_thousand_half_open_connections(push_receiver: PushReceiver) -> None:
    """1,000 connections that send half a request open at once; pushes are still accepted."""
    sockets = []
    started = time.monotonic()
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", push_receiver.port), timeout=5)
            sock.sendall(b"POST " + PUSH_PATH.encode() + b" HTTP/1.1\r\nHost: ")
            sockets.append(sock)
        status = _post(push_receiver.url + PUSH_PATH, encode_push_request([]), _PROTO)[0]
        assert status == 200
        # With socketserver's backlog of 5, dropped SYNs made this take minutes.
        assert time.monotonic() - started < 20
    finally:
        for sock in sockets:
            sock.close()


_AGENT_SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    import pyroscope

    # Route the agent's own log (e.g. "Sending Session failed") to stderr.
    logging.basicConfig(level=logging.WARNING)

    # Bounded by wall time, not CPU time: the agent counts 10 ms ticks in which
    # the thread looks active (runnable counts), so under CPU contention a
    # CPU-time bound would inflate the reported value.
    def marker_burn_alpha(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def marker_burn_beta(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    pyroscope.configure(
        application_name="spanprof-test",
        server_address=sys.argv[1],
        upload_interval=1,
        enable_logging=True,
    )
    pyroscope.add_thread_tag("span_id", sys.argv[2])
    pyroscope.add_thread_tag("trace_id", sys.argv[3])
    marker_burn_alpha(1.5)
    pyroscope.remove_thread_tag("span_id", sys.argv[2])
    pyroscope.remove_thread_tag("trace_id", sys.argv[3])
    marker_burn_beta(0.5)
    sys.exit(0 if pyroscope.shutdown() else 3)
    """
)


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_real_pyroscope_agent_pushes_span_labels(
    push_receiver: PushReceiver, tmp_path: Path
) -> None:
    """pyroscope-io uploads to the receiver; thread tags arrive as per-sample pprof labels."""
    script = tmp_path / "agent.py"
    script.write_text(_AGENT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), push_receiver.url, SPAN_ID, TRACE_ID],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "failed" not in proc.stderr.lower(), proc.stderr
    assert push_receiver.errors == []
    assert push_receiver.pushes >= 1

    for series in push_receiver.series():
        assert series.label("service_name") == "spanprof-test"
        assert series.label("__name__") == "process_cpu"
        for profile in series.profiles:
            assert profile.sample_types == (("cpu", "nanoseconds"),)
            assert profile.period_type == ("cpu", "nanoseconds")
            assert profile.period == TEN_MS_NS
            assert profile.duration_nanos > 0

    samples = push_receiver.samples()
    alpha = [s for s in samples if s.has_function("marker_burn_alpha")]
    beta = [s for s in samples if s.has_function("marker_burn_beta")]
    assert alpha
    assert beta
    # The agent aggregates per (stack, labels) and reports CPU time: 10 ms per tick.
    assert all(s.value > 0 and s.value % TEN_MS_NS == 0 for s in samples)
    for s in alpha:
        if s.label_values("span_id"):
            assert s.label_values("span_id") == (SPAN_ID,)
            assert s.label_values("trace_id") == (TRACE_ID,)
    # Samples are aggregated, so weigh by value: a tick racing the tag removal may
    # land in alpha without labels.
    alpha_total = sum(s.value for s in alpha)
    tagged_total = sum(s.value for s in alpha if s.label_values("span_id") == (SPAN_ID,))
    assert tagged_total >= 0.9 * alpha_total
    assert all(s.label_values("span_id") == () for s in beta)
    assert all(s.label_values("trace_id") == () for s in beta)
    # 1.5 s (alpha) and 0.5 s (beta) of busy wall time at 100 Hz. On a loaded
    # machine the sampler misses ticks, or catches up with extra ones (seen: 1.67 s
    # for alpha), hence the slack.
    assert 0.5e9 <= alpha_total <= 2.5e9
    assert 0.1e9 <= sum(s.value for s in beta) <= 1.2e9


def test_bounded_gunzip_takes_an_empty_member() -> None:
    """gzip of nothing is valid gzip (it was called a truncated stream)."""
    assert gunzip_bounded(gzip.compress(b""), MIB) == b""
    assert gunzip_bounded(gzip.compress(b"") + gzip.compress(b"ab"), MIB) == b"ab"
