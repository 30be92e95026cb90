"""Codec for Pyroscope's ``push.v1.PusherService/Push`` request body.

Schema (grafana/pyroscope ``api/push/v1/push.proto``)::

    message PushRequest      { repeated RawProfileSeries series = 1; }
    message RawProfileSeries { repeated types.v1.LabelPair labels = 1;
                               repeated RawSample samples = 2; }
    message LabelPair        { string name = 1; string value = 2; }
    message RawSample        { bytes raw_profile = 1; string ID = 2; }

Observed from pyroscope-io 1.4.0 (pyroscope-rs, reqwest): one Connect unary call
per upload interval, ``POST /push.v1.PusherService/Push`` with
``Content-Type: application/proto`` and ``Content-Encoding: gzip`` (the whole
body is gzipped). With CPU profiling only, it holds one series labelled
``__name__=process_cpu``, ``service_name=<application_name>`` (plus static tags and
``otel.scope.*``/``process.runtime.*``) with one RawSample whose ``raw_profile``
is a raw, *not* gzipped, pprof and whose ``ID`` is a random UUID string. The
server answers ``200`` with an empty ``PushResponse``; the agent only looks at
the status code.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._pprof import (
    DEFAULT_MAX_DEPTH,
    InflatedTooLargeError,
    Profile,
    ProfileDecodeError,
    ProfileTooLargeError,
    decode_profile,
    frame_budget,
    gunzip_bounded,
)
from ._protowire import (
    WIRE_LEN,
    ProtoDecodeError,
    as_bytes,
    as_str,
    iter_fields,
    put_string_field,
    put_tag,
    put_varint,
)

__all__ = [
    "DEFAULT_MAX_INFLATED",
    "PUSH_CONTENT_TYPE",
    "PUSH_PATH",
    "PushDecodeError",
    "PushSeries",
    "PushTooLargeError",
    "decode_push_request",
    "decode_push_request_raw",
    "encode_push_request",
]

#: URL path of the Connect unary Push RPC, relative to the server address.
PUSH_PATH = "/push.v1.PusherService/Push"
#: Content-Type the agent sends (Connect protocol, binary protobuf codec).
PUSH_CONTENT_TYPE = "application/proto"

_GZIP_MAGIC = b"\x1f\x8b"
#: What a push may inflate to, envelope and embedded profiles together, unless told otherwise.
DEFAULT_MAX_INFLATED = 256 * 1024 * 1024

_REQ_SERIES = 1
_SERIES_LABELS = 1
_SERIES_SAMPLES = 2
_LABEL_NAME = 1
_LABEL_VALUE = 2
_RAW_PROFILE = 1
_RAW_ID = 2


class PushDecodeError(ProtoDecodeError):
    """Raised when a push request body cannot be decoded."""


class PushTooLargeError(PushDecodeError):
    """Raised when a push request inflates past its ``max_inflated`` limit."""


@dataclass(frozen=True, slots=True)
class PushSeries:
    """One ``RawProfileSeries``: series labels plus its decoded profiles."""

    labels: tuple[tuple[str, str], ...]
    profiles: tuple[Profile, ...]
    sample_ids: tuple[str, ...] = ()

    def label(self, name: str) -> str | None:
        """Return the value of series label ``name`` (first one), or ``None``."""
        for k, v in self.labels:
            if k == name:
                return v
        return None


def _decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        # Tolerate a gzip body sent without the header; sniffing is unambiguous
        # because 0x1f cannot start a protobuf message.
        if body[:2] != _GZIP_MAGIC:
            return body
        encoding = "gzip"
    if encoding != "gzip":
        raise PushDecodeError(f"unsupported Content-Encoding {content_encoding!r}")
    try:
        return gunzip_bounded(body, limit)
    except InflatedTooLargeError as exc:
        raise PushTooLargeError(str(exc)) from exc
    except ProfileDecodeError as exc:
        raise PushDecodeError(f"invalid gzip body: {exc}") from exc


def decode_push_request_raw(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_inflated: int = DEFAULT_MAX_INFLATED,
) -> list[tuple[tuple[tuple[str, str], ...], tuple[tuple[bytes, str], ...]]]:
    """Decode a push body into ``(labels, ((raw_profile, id), ...))`` without parsing pprof.

    A gzip body may inflate to ``max_inflated`` bytes; past that, ``PushTooLargeError``.
    """
    data = _decompress(body, content_encoding, max_inflated)
    out: list[tuple[tuple[tuple[str, str], ...], tuple[tuple[bytes, str], ...]]] = []
    try:
        for field, _w, value in iter_fields(data):
            if field != _REQ_SERIES:
                continue
            labels: list[tuple[str, str]] = []
            raws: list[tuple[bytes, str]] = []
            for sf, _sw, sv in iter_fields(as_bytes(value)):
                if sf == _SERIES_LABELS:
                    name = val = ""
                    for lf, _lw, lv in iter_fields(as_bytes(sv)):
                        if lf == _LABEL_NAME:
                            name = as_str(lv)
                        elif lf == _LABEL_VALUE:
                            val = as_str(lv)
                    labels.append((name, val))
                elif sf == _SERIES_SAMPLES:
                    raw = b""
                    sid = ""
                    for rf, _rw, rv in iter_fields(as_bytes(sv)):
                        if rf == _RAW_PROFILE:
                            raw = as_bytes(rv)
                        elif rf == _RAW_ID:
                            sid = as_str(rv)
                    raws.append((raw, sid))
            out.append((tuple(labels), tuple(raws)))
    except PushDecodeError:
        raise
    except ProtoDecodeError as exc:
        raise PushDecodeError(f"invalid PushRequest: {exc}") from exc
    return out


def decode_push_request(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_inflated: int = DEFAULT_MAX_INFLATED,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> list[PushSeries]:
    """Decode a ``PushRequest`` body (per its Content-Encoding) including every pprof in it.

    The body and every gzip-compressed profile in it inflate to ``max_inflated`` bytes in
    all, and the profiles decode to ``frame_budget`` of their inflated size in frames, a
    stack to ``max_depth`` (see ``decode_profile``); past either, ``PushTooLargeError``.
    Raises ``PushDecodeError`` if the envelope or any embedded profile is malformed.
    """
    raw_series = decode_push_request_raw(body, content_encoding, max_inflated=max_inflated)
    # Embedded profiles may be gzipped again: they share what is left of the budget, so
    # nesting bombs inside the envelope buys nothing.
    budget = max_inflated - sum(len(raw) for _labels, raws in raw_series for raw, _sid in raws)
    # Shared too, so that many small profiles cannot each spend the floor of their own.
    frames_left = frame_budget(0)
    series: list[PushSeries] = []
    for labels, raws in raw_series:
        profiles: list[Profile] = []
        for raw, _sid in raws:
            try:
                if raw[:2] == _GZIP_MAGIC:
                    raw = gunzip_bounded(raw, max(budget, 0))
                    budget -= len(raw)
                frames_left += frame_budget(len(raw)) - frame_budget(0)
                profile = decode_profile(
                    raw, max_inflated=max(budget, 0), max_depth=max_depth, max_frames=frames_left
                )
            except ProfileTooLargeError as exc:
                raise PushTooLargeError(f"series {dict(labels)!r}: {exc}") from exc
            except ProfileDecodeError as exc:
                raise PushDecodeError(f"invalid pprof in series {dict(labels)!r}: {exc}") from exc
            frames_left -= sum(len(sample.stack) for sample in profile.samples)
            profiles.append(profile)
        series.append(PushSeries(labels, tuple(profiles), tuple(sid for _raw, sid in raws)))
    return series


def _new_id() -> str:
    return str(uuid.uuid4())


def encode_push_request(
    series: Sequence[tuple[Sequence[tuple[str, str]], Sequence[bytes]]],
    *,
    make_id: Callable[[], str] = _new_id,
) -> bytes:
    """Encode a ``PushRequest`` as raw (uncompressed) protobuf bytes.

    Each item of ``series`` is ``(labels, raw_profiles)``; the profiles are
    embedded as given, so pass raw pprof to match pyroscope-io. Each RawSample
    gets ``make_id()`` as its ID (a random UUID, like the agent). Gzip the result
    and send it with ``Content-Encoding: gzip`` to match the agent byte for byte
    in shape.
    """
    # The profiles (up to megabytes each) are copied once, by the final join: nested
    # bytearrays copied each one three times, and regrew, in a single step under the GIL.
    parts: list[bytes] = []
    for labels, raws in series:
        series_parts: list[bytes] = []
        for name, value in labels:
            pair = bytearray()
            put_string_field(pair, _LABEL_NAME, name)
            put_string_field(pair, _LABEL_VALUE, value)
            series_parts.append(_header(_SERIES_LABELS, len(pair)) + pair)
        for raw in raws:
            head = _header(_RAW_PROFILE, len(raw))
            id_field = bytearray()
            put_string_field(id_field, _RAW_ID, make_id())
            sample_size = len(head) + len(raw) + len(id_field)
            series_parts.append(_header(_SERIES_SAMPLES, sample_size) + head)
            series_parts.append(bytes(raw))
            series_parts.append(bytes(id_field))
        parts.append(_header(_REQ_SERIES, sum(map(len, series_parts))))
        parts.extend(series_parts)
    return b"".join(parts)


def _header(field: int, length: int) -> bytes:
    # The key and length of a length-delimited field whose payload follows separately.
    head = bytearray()
    put_tag(head, field, WIRE_LEN)
    put_varint(head, length)
    return bytes(head)
