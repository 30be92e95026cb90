"""Turns a sampler's ``Window`` into one OTLP ``ExportProfilesServiceRequest``, in bounded slices.

The request follows ``opentelemetry.proto.profiles.v1development`` at the v1.10 layout (the one
``opentelemetry-proto`` 1.45 generates), hand-encoded with ``_protowire`` so that spanprof does
not need the ``protobuf`` package at run time::

    ExportProfilesServiceRequest { resource_profiles = 1; dictionary = 2 }
    ResourceProfiles   { resource = 1; scope_profiles = 2 }
    ScopeProfiles      { scope = 1; profiles = 2 }
    Profile            { sample_type = 1; samples = 2; time_unix_nano = 3 (fixed64);
                         duration_nano = 4; period_type = 5; period = 6; profile_id = 7;
                         attribute_indices = 11 }
    Sample             { stack_index = 1; attribute_indices = 2; link_index = 3; values = 4 }
    ProfilesDictionary { mapping_table = 1; location_table = 2; function_table = 3;
                         link_table = 4; string_table = 5; attribute_table = 6;
                         stack_table = 7 }

Every dictionary table starts with its zero value at index 0 (``string_table[0] == ""``,
``Mapping{}``, ``Location{}``, ``Function{}``, ``KeyValueAndUnit{}``, ``Stack{}``, and
``Link{trace_id=16 zero bytes, span_id=8 zero bytes}`` as the proto recommends), so index 0
means "none" everywhere. A sample's ``span_id`` and ``trace_id`` labels become its ``Link``;
its other labels (``span_name``, user labels) become string attributes.

The sample type is ``samples/count`` with period type ``cpu/nanoseconds`` and period 1: each
unit of a value is one nanosecond of CPU (the sampler weighs every sample by the CPU its thread
used, so values are not whole ticks). Pyroscope maps exactly that type to ``process_cpu`` and
multiplies values by the period, so it stores the same ``process_cpu:cpu:nanoseconds`` series
the pprof push gives, which Grafana's trace-to-profiles link queries.

``OtlpTables`` (the shared dictionary), ``put_sample`` and ``OtlpRequestEncoder`` (the slicing
and the request around the profiles) serve every window type: ``_otlp_memory`` builds the
memory profiles on them.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from ..._labels._labelset import LabelSet
from ..._logging import log_once
from ..._version import __version__
from .._window import Frame, Window, utf8_text
from ._memory import MEMORY_PERIOD_TYPE, MEMORY_SAMPLE_TYPES
from ._pprof import (
    DEFAULT_MAX_DEPTH,
    FrameBudget,
    Profile,
    Sample,
    cut_stack,
    frame_budget,
)
from ._protowire import (
    WIRE_LEN,
    FieldValue,
    ProtoDecodeError,
    as_bytes,
    as_int,
    as_str,
    iter_fields,
    put_bytes_field,
    put_fixed64_field,
    put_packed_varints_field,
    put_string_field,
    put_tag,
    put_varint,
    put_varint_field,
    to_int64,
    unpack_varints,
)
from ._push import PushSeries
from ._window import STEP_BUDGET_NS, WALL_TIME

__all__ = [
    "PERIOD",
    "PERIOD_TYPE",
    "SAMPLE_TYPE",
    "SCOPE_NAME",
    "OtlpDecodeError",
    "OtlpEncoder",
    "OtlpRequestEncoder",
    "OtlpTables",
    "OtlpTooLargeError",
    "current_resource_attributes",
    "decode_export_request",
    "encode_resource",
    "encode_scope",
    "put_sample",
]

SAMPLE_TYPE = ("samples", "count")
PERIOD_TYPE = ("cpu", "nanoseconds")
PERIOD = 1
SCOPE_NAME = "spanprof"

# ExportProfilesServiceRequest / ResourceProfiles / ScopeProfiles
_REQ_RESOURCE_PROFILES = 1
_REQ_DICTIONARY = 2
_RP_RESOURCE = 1
_RP_SCOPE_PROFILES = 2
_SP_SCOPE = 1
_SP_PROFILES = 2
# Profile
_P_SAMPLE_TYPE = 1
_P_SAMPLES = 2
_P_TIME_UNIX_NANO = 3
_P_DURATION_NANO = 4
_P_PERIOD_TYPE = 5
_P_PERIOD = 6
_P_PROFILE_ID = 7
_P_ATTRIBUTE_INDICES = 11
# Sample
_S_STACK_INDEX = 1
_S_ATTRIBUTE_INDICES = 2
_S_LINK_INDEX = 3
_S_VALUES = 4
# ProfilesDictionary
_D_MAPPING = 1
_D_LOCATION = 2
_D_FUNCTION = 3
_D_LINK = 4
_D_STRING = 5
_D_ATTRIBUTE = 6
_D_STACK = 7
# Location / Line / Function / Link / Stack / ValueType / KeyValueAndUnit
_LOC_LINES = 3
_LINE_FUNCTION_INDEX = 1
_LINE_LINE = 2
_F_NAME = 1
_F_SYSTEM_NAME = 2
_F_FILENAME = 3
_LINK_TRACE_ID = 1
_LINK_SPAN_ID = 2
_STACK_LOCATIONS = 1
_VT_TYPE = 1
_VT_UNIT = 2
_KVU_KEY = 1
_KVU_VALUE = 2
# common.v1: KeyValue, AnyValue, ArrayValue, InstrumentationScope; resource.v1: Resource
_KV_KEY = 1
_KV_VALUE = 2
_AV_STRING = 1
_AV_BOOL = 2
_AV_INT = 3
_AV_DOUBLE = 4
_AV_ARRAY = 5
_AV_BYTES = 7
_ARRAY_VALUES = 1
_SCOPE_NAME = 1
_SCOPE_VERSION = 2
_RESOURCE_ATTRIBUTES = 1

_T = TypeVar("_T")
_I = TypeVar("_I")
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_NO_TRACE = bytes(16)
_NO_SPAN = bytes(8)
_HEX = frozenset("0123456789abcdef")


def _int_text(value: int) -> str:
    try:
        return str(value)
    except ValueError:  # past sys.get_int_max_str_digits()
        return f"<int of {value.bit_length()} bits>"


def _any_value(value: object) -> bytes:
    out = bytearray()
    if isinstance(value, bool):
        put_tag(out, _AV_BOOL, 0)
        put_varint(out, int(value))
    elif isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            put_tag(out, _AV_INT, 0)
            put_varint(out, value)
        else:
            # OTLP's int is an int64: a bigger one raised (every window dropped) or, up to
            # 2**64, went out wrapped to a negative number. Its digits keep its value.
            log_once(
                "otlp-attribute-int64",
                "spanprof: an OTLP resource attribute's integer does not fit in 64 bits; it is "
                "sent as a string (logged once)",
                exc_info=False,
            )
            put_string_field(out, _AV_STRING, _int_text(value))
    elif isinstance(value, float):
        put_tag(out, _AV_DOUBLE, 1)
        out += struct.pack("<d", value)
    elif isinstance(value, (bytes, bytearray)):
        # A Sequence too, but the SDK's exporters send it as bytes_value, not ints.
        put_bytes_field(out, _AV_BYTES, bytes(value))
    elif isinstance(value, str):
        # OTEL_RESOURCE_ATTRIBUTES is decoded with surrogateescape like any variable.
        put_string_field(out, _AV_STRING, utf8_text(value))
    elif isinstance(value, Sequence):
        array = bytearray()
        for item in value:
            put_bytes_field(array, _ARRAY_VALUES, _any_value(item))
        put_bytes_field(out, _AV_ARRAY, array)
    else:
        put_string_field(out, _AV_STRING, utf8_text(str(value)))
    return bytes(out)


def encode_resource(attributes: Mapping[str, object]) -> bytes:
    """A ``Resource`` message with ``attributes`` as ``KeyValue``s (by key, not by index)."""
    out = bytearray()
    for key, value in attributes.items():
        kv = bytearray()
        put_string_field(kv, _KV_KEY, utf8_text(key))
        put_bytes_field(kv, _KV_VALUE, _any_value(value))
        put_bytes_field(out, _RESOURCE_ATTRIBUTES, kv)
    return bytes(out)


def encode_scope(name: str = SCOPE_NAME, version: str = __version__) -> bytes:
    """An ``InstrumentationScope`` message."""
    out = bytearray()
    put_string_field(out, _SCOPE_NAME, name)
    put_string_field(out, _SCOPE_VERSION, version)
    return bytes(out)


def current_resource_attributes() -> Mapping[str, object]:
    """The traces' resource: the global tracer provider's if it is an SDK one, else the default.

    ``Resource.create()`` reads ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` exactly
    as the SDK's own ``TracerProvider()`` does, so both signals carry the same ``service.name``.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource

    resource = getattr(trace.get_tracer_provider(), "resource", None)
    if not isinstance(resource, Resource):
        resource = Resource.create()
    return dict(resource.attributes)


def _value_type(strings: _Strings, pair: tuple[str, str]) -> bytes:
    out = bytearray()
    put_varint_field(out, _VT_TYPE, strings.index(pair[0]))
    put_varint_field(out, _VT_UNIT, strings.index(pair[1]))
    return bytes(out)


def _hex_id(value: object, length: int) -> bytes | None:
    if isinstance(value, str) and len(value) == 2 * length and _HEX.issuperset(value):
        raw = bytes.fromhex(value)
        if any(raw):
            return raw
    return None


class _Strings:
    __slots__ = ("buf", "ids")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"": 0}
        self.buf = bytearray()
        put_string_field(self.buf, _D_STRING, "")

    def index(self, value: str) -> int:
        idx = self.ids.get(value)
        if idx is None:
            idx = self.ids[value] = len(self.ids)
            put_string_field(self.buf, _D_STRING, value)
        return idx


class OtlpTables:
    """One request's ``ProfilesDictionary``, filled as samples are added; its profiles share it.

    Each table is kept as its repeated dictionary field, its zero value first, and every entry is
    interned: a stack, link or attribute that several samples (or profiles) use is written once.
    """

    def __init__(self) -> None:
        self.strings = _Strings()
        self._mappings = bytearray()
        put_bytes_field(self._mappings, _D_MAPPING, b"")
        self._locations = bytearray()
        put_bytes_field(self._locations, _D_LOCATION, b"")
        self._functions = bytearray()
        put_bytes_field(self._functions, _D_FUNCTION, b"")
        self._links = bytearray()
        put_bytes_field(self._links, _D_LINK, self._link_message(_NO_TRACE, _NO_SPAN))
        self._attributes = bytearray()
        put_bytes_field(self._attributes, _D_ATTRIBUTE, b"")
        self._stacks = bytearray()
        put_bytes_field(self._stacks, _D_STACK, b"")
        self._location_ids: dict[Frame, int] = {}
        self._function_ids: dict[tuple[int, int], int] = {}
        self._stack_ids: dict[int, int] = {}
        self._stack_keys: dict[tuple[int, ...], int] = {(): 0}
        self._link_ids: dict[tuple[bytes, bytes], int] = {}
        self._attribute_ids: dict[tuple[str, str], int] = {}
        self._label_parts: dict[LabelSet, bytes] = {}

    def stack(self, window: Window, sid: int) -> int:
        """The ``stack_table`` index of the window's stack ``sid``."""
        idx = self._stack_ids.get(sid)
        if idx is None:
            idx = self._stack(sid, window.stack(sid))
        return idx

    def sample_labels(self, labels: LabelSet) -> bytes:
        """A sample's ``attribute_indices`` and ``link_index`` fields for ``labels``, encoded."""
        # Cached per distinct label set: a request's samples share one.
        part = self._label_parts.get(labels)
        if part is None:
            part = self._labels(labels)
        return part

    def value_type(self, pair: tuple[str, str]) -> bytes:
        """A ``ValueType`` message: ``(type, unit)`` as string indices."""
        return _value_type(self.strings, pair)

    def dictionary(self) -> list[bytes | bytearray]:
        """The request's ``dictionary`` field, as chunks to join."""
        return _wrap(
            _REQ_DICTIONARY,
            [
                self._mappings,
                self._locations,
                self._functions,
                self._links,
                self.strings.buf,
                self._attributes,
                self._stacks,
            ],
        )

    def _stack(self, sid: int, frames: tuple[Frame, ...]) -> int:
        key = tuple(self._location(frame) for frame in frames)
        idx = self._stack_keys.get(key)
        if idx is None:
            idx = self._stack_keys[key] = len(self._stack_keys)
            msg = bytearray()
            put_packed_varints_field(msg, _STACK_LOCATIONS, key)
            put_bytes_field(self._stacks, _D_STACK, msg)
        self._stack_ids[sid] = idx
        return idx

    def _location(self, frame: Frame) -> int:
        idx = self._location_ids.get(frame)
        if idx is not None:
            return idx
        strings = self.strings
        fkey = (strings.index(frame.function), strings.index(frame.filename))
        fidx = self._function_ids.get(fkey)
        if fidx is None:
            fidx = self._function_ids[fkey] = len(self._function_ids) + 1
            msg = bytearray()
            put_varint_field(msg, _F_NAME, fkey[0])
            put_varint_field(msg, _F_SYSTEM_NAME, fkey[0])
            put_varint_field(msg, _F_FILENAME, fkey[1])
            put_bytes_field(self._functions, _D_FUNCTION, msg)
        line = bytearray()
        put_varint_field(line, _LINE_FUNCTION_INDEX, fidx)
        put_varint_field(line, _LINE_LINE, frame.line)
        msg = bytearray()
        put_bytes_field(msg, _LOC_LINES, line)
        put_bytes_field(self._locations, _D_LOCATION, msg)
        idx = self._location_ids[frame] = len(self._location_ids) + 1
        return idx

    def _labels(self, labels: LabelSet) -> bytes:
        items = labels.items_tuple
        span = _hex_id(labels.get("span_id"), 8)
        link = 0
        if span is not None:
            # Without a trace_id label (SPANPROF_TRACE_ID_LABEL=false) the trace is unknown:
            # the all-zero, invalid trace id says so, keeping the link 16/8 bytes.
            trace = _hex_id(labels.get("trace_id"), 16) or _NO_TRACE
            link = self._link(trace, span)
        indices = [
            self.attribute(pair)
            for pair in items
            if not (span is not None and pair[0] in ("span_id", "trace_id"))
        ]
        part = bytearray()
        put_packed_varints_field(part, _S_ATTRIBUTE_INDICES, indices)
        put_varint_field(part, _S_LINK_INDEX, link)
        result = self._label_parts[labels] = bytes(part)
        return result

    @staticmethod
    def _link_message(trace: bytes, span: bytes) -> bytes:
        msg = bytearray()
        put_bytes_field(msg, _LINK_TRACE_ID, trace)
        put_bytes_field(msg, _LINK_SPAN_ID, span)
        return bytes(msg)

    def _link(self, trace: bytes, span: bytes) -> int:
        key = (trace, span)
        idx = self._link_ids.get(key)
        if idx is None:
            idx = self._link_ids[key] = len(self._link_ids) + 1
            put_bytes_field(self._links, _D_LINK, self._link_message(trace, span))
        return idx

    def attribute(self, pair: tuple[str, str]) -> int:
        """The ``attribute_table`` index of the string attribute ``(key, value)``."""
        idx = self._attribute_ids.get(pair)
        if idx is None:
            idx = self._attribute_ids[pair] = len(self._attribute_ids) + 1
            msg = bytearray()
            put_varint_field(msg, _KVU_KEY, self.strings.index(pair[0]))
            value = bytearray()
            put_string_field(value, _AV_STRING, pair[1])
            put_bytes_field(msg, _KVU_VALUE, value)
            put_bytes_field(self._attributes, _D_ATTRIBUTE, msg)
        return idx


def put_sample(out: bytearray, stack: int, labels: bytes, value: int) -> None:
    """Append one single-valued ``Sample`` to ``out`` as a ``Profile.samples`` field.

    ``labels`` is ``OtlpTables.sample_labels``'s encoding of the sample's labels.
    """
    msg = bytearray()
    put_varint_field(msg, _S_STACK_INDEX, stack)
    msg += labels
    # values: one packed int64.
    put_tag(msg, _S_VALUES, WIRE_LEN)
    payload = bytearray()
    put_varint(payload, value)
    put_varint(msg, len(payload))
    msg += payload
    put_bytes_field(out, _P_SAMPLES, msg)


class OtlpRequestEncoder(Generic[_I]):
    """Encodes a window as one ``ExportProfilesServiceRequest``, one slice per ``step()``.

    Each step feeds ``items`` to ``_add`` until ``budget_ns`` has passed; the last one joins the
    tables and the profiles ``_profiles`` returns (copies of already encoded bytes). ``request``
    holds the raw (uncompressed) body once ``done``. Subclasses say what an item is, how it
    becomes samples, and which profiles the request carries; ``OtlpTables`` is shared by them.
    """

    def __init__(
        self,
        window: Window,
        items: Iterable[_I],
        *,
        resource: bytes,
        scope: bytes,
        attributes: Iterable[tuple[str, str]],
        budget_ns: int,
    ) -> None:
        self.window = window
        self.resource = resource
        self.scope = scope
        self.budget_ns = budget_ns
        self.request = b""
        #: Samples written, over all profiles.
        self.samples = 0
        self.tables = OtlpTables()
        self._items = iter(items)
        self._exhausted = False
        self._done = False
        self._profile_attributes = [self.tables.attribute(pair) for pair in attributes]

    @property
    def done(self) -> bool:
        """Whether ``request`` is complete."""
        return self._done

    def step(self) -> bool:
        """Do one slice of work; return ``True`` when the request is fully encoded."""
        if self._done:
            return True
        if self._exhausted:
            self._assemble()
            return True
        deadline = time.perf_counter_ns() + self.budget_ns
        add = self._add
        for item in self._items:
            add(item)
            if time.perf_counter_ns() > deadline:
                return False
        self._exhausted = True
        return False

    def _add(self, item: _I) -> None:
        raise NotImplementedError

    def _profiles(self) -> list[list[bytes | bytearray]]:
        raise NotImplementedError

    def _profile(
        self,
        sample_type: tuple[str, str],
        samples: bytearray,
        *,
        period_type: tuple[str, str],
        period: int,
        profile_id: bytes,
    ) -> list[bytes | bytearray]:
        """One ``Profile`` of the window (a ``ScopeProfiles.profiles`` field), as chunks."""
        window = self.window
        head = bytearray()
        put_bytes_field(head, _P_SAMPLE_TYPE, self.tables.value_type(sample_type))
        tail = bytearray()
        put_fixed64_field(tail, _P_TIME_UNIX_NANO, window.start_ns)
        put_varint_field(tail, _P_DURATION_NANO, max(0, window.end_ns - window.start_ns))
        put_bytes_field(tail, _P_PERIOD_TYPE, self.tables.value_type(period_type))
        put_varint_field(tail, _P_PERIOD, period)
        put_bytes_field(tail, _P_PROFILE_ID, profile_id)
        put_packed_varints_field(tail, _P_ATTRIBUTE_INDICES, self._profile_attributes)
        return _wrap(_SP_PROFILES, [head, samples, tail])

    def _assemble(self) -> None:
        # The nested messages are length-prefixed chunks joined once at the end: the samples
        # and tables (most of the bytes) are copied a single time.
        profiles = [chunk for profile in self._profiles() for chunk in profile]
        scope = bytearray()
        put_bytes_field(scope, _SP_SCOPE, self.scope)
        scope_profiles = _wrap(_RP_SCOPE_PROFILES, [scope, *profiles])
        resource = bytearray()
        put_bytes_field(resource, _RP_RESOURCE, self.resource)
        resource_profiles = _wrap(_REQ_RESOURCE_PROFILES, [resource, *scope_profiles])
        self.request = b"".join([*resource_profiles, *self.tables.dictionary()])
        self._done = True


class OtlpEncoder(OtlpRequestEncoder[tuple[tuple[int, LabelSet], int]]):
    """Encodes a CPU ``Window`` as an ``ExportProfilesServiceRequest``, one slice per ``step()``.

    One profile, ``samples/count`` with period type ``cpu/nanoseconds`` and period 1; a
    wall-clock window's (``wall_period_ns`` set) is ``wall/nanoseconds`` with period type
    ``wall/nanoseconds`` and that period: its values are wall time, and Pyroscope stores no
    CPU for it.

    Arguments:
        window: the samples to encode (no longer written by the sampler).
        resource: an encoded ``Resource`` (``encode_resource``).
        scope: an encoded ``InstrumentationScope`` (``encode_scope``).
        attributes: attributes of the whole profile (the backend's static tags).
        budget_ns: the time after which a slice stops.
        profile_id: 16 bytes; random by default.
        wall_period_ns: the sampling period of a wall-clock sampler's window; 0 for CPU.
    """

    def __init__(
        self,
        window: Window,
        *,
        resource: bytes,
        scope: bytes,
        attributes: Iterable[tuple[str, str]] = (),
        budget_ns: int = STEP_BUDGET_NS,
        profile_id: bytes | None = None,
        wall_period_ns: int = 0,
    ) -> None:
        if wall_period_ns < 0:
            raise ValueError(f"wall_period_ns: expected 0 or more, got {wall_period_ns}")
        super().__init__(
            window,
            list(window.values.items()),
            resource=resource,
            scope=scope,
            attributes=attributes,
            budget_ns=budget_ns,
        )
        self.profile_id = profile_id if profile_id is not None else os.urandom(16)
        self.wall_period_ns = wall_period_ns
        self._samples = bytearray()

    def _add(self, item: tuple[tuple[int, LabelSet], int]) -> None:
        (sid, labels), value = item
        tables = self.tables
        put_sample(
            self._samples, tables.stack(self.window, sid), tables.sample_labels(labels), value
        )
        self.samples += 1

    def _profiles(self) -> list[list[bytes | bytearray]]:
        wall = self.wall_period_ns
        return [
            self._profile(
                WALL_TIME if wall else SAMPLE_TYPE,
                self._samples,
                period_type=WALL_TIME if wall else PERIOD_TYPE,
                period=wall if wall else PERIOD,
                profile_id=self.profile_id,
            )
        ]


def _wrap(field: int, chunks: list[bytes | bytearray]) -> list[bytes | bytearray]:
    """``chunks`` as the payload of length-delimited ``field``: a prefix, then the chunks."""
    prefix = bytearray()
    put_tag(prefix, field, WIRE_LEN)
    put_varint(prefix, sum(len(chunk) for chunk in chunks))
    return [prefix, *chunks]


# --- decoding (for the local receiver) ------------------------------------------------------------


class OtlpDecodeError(ProtoDecodeError):
    """Raised when a body is not a decodable ``ExportProfilesServiceRequest``."""


class OtlpTooLargeError(OtlpDecodeError):
    """Raised when a request decodes to more frames than the caller allows."""


def _fields(data: bytes) -> dict[int, list[FieldValue]]:
    out: dict[int, list[FieldValue]] = {}
    for field, _wire, value in iter_fields(data):
        out.setdefault(field, []).append(value)
    return out


def _ints(fields: dict[int, list[FieldValue]], field: int) -> list[int]:
    return [v for raw in fields.get(field, ()) for v in unpack_varints(raw)]


def _int(fields: dict[int, list[FieldValue]], field: int) -> int:
    values = fields.get(field)
    return to_int64(as_int(values[-1])) if values else 0


def _msg(fields: dict[int, list[FieldValue]], field: int) -> bytes:
    values = fields.get(field)
    return as_bytes(values[-1]) if values else b""


def _any_text(data: bytes, strings: Sequence[str]) -> str:
    fields = _fields(data)
    if _AV_STRING in fields:
        return as_str(fields[_AV_STRING][-1])
    if _AV_BOOL in fields:
        return "true" if _int(fields, _AV_BOOL) else "false"
    if _AV_INT in fields:
        return str(_int(fields, _AV_INT))
    if _AV_DOUBLE in fields:
        return repr(struct.unpack("<d", as_int(fields[_AV_DOUBLE][-1]).to_bytes(8, "little"))[0])
    if 8 in fields:  # string_value_strindex
        return _at(strings, _int(fields, 8), "string")
    return ""


def _at(table: Sequence[_T], index: int, what: str) -> _T:
    if not 0 <= index < len(table):
        raise OtlpDecodeError(f"{what} index {index} out of range ({len(table)})")
    return table[index]


def decode_export_request(
    data: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, max_frames: int | None = None
) -> list[PushSeries]:
    """An uncompressed ``ExportProfilesServiceRequest`` as push series, as Pyroscope ingests it.

    One series per profile, labelled ``__name__`` (``process_cpu`` for ``samples/count`` with
    period ``cpu/nanoseconds``, whose values become nanoseconds; else the sample type) and
    ``service_name`` (the resource's ``service.name``), plus the resource's other string
    attributes. A sample's link becomes ``span_id``/``trace_id`` hex labels, its attributes
    the other labels.

    Memory profiles (``alloc_*``/``inuse_*`` with period type ``space/bytes``) of one
    ``ScopeProfiles`` become one ``memory`` series instead, one profile of the four sample types
    with a sample per stack and labels: exactly what the Pyroscope memory push carries, so
    memory is stored alike whichever way it came. (Pyroscope 2.x's own OTLP ingest names every
    profile that is not off-CPU ``process_cpu``, telling memory apart by sample type only.)

    A stack deeper than ``max_depth`` keeps its leaf and root ends (see ``cut_stack``); a
    request that decodes to more than ``max_frames`` frames (default: ``frame_budget`` of its
    size) raises ``OtlpTooLargeError``, any other malformed one ``OtlpDecodeError``.
    """
    if max_depth < 3:
        raise ValueError(f"max_depth: expected at least 3 (leaf, marker, root), got {max_depth}")
    limit = frame_budget(len(data)) if max_frames is None else max_frames
    try:
        return _decode_export_request(data, max_depth, limit)
    except OtlpDecodeError:
        raise
    except ProtoDecodeError as exc:
        raise OtlpDecodeError(f"invalid ExportProfilesServiceRequest: {exc}") from exc


def _decode_export_request(data: bytes, max_depth: int, max_frames: int) -> list[PushSeries]:
    request = _fields(data)
    d = _fields(_msg(request, _REQ_DICTIONARY))
    strings = [as_str(v) for v in d.get(_D_STRING, ())] or [""]
    functions = []
    for raw in d.get(_D_FUNCTION, ()):
        f = _fields(as_bytes(raw))
        functions.append(
            (_at(strings, _int(f, _F_NAME), "string"), _at(strings, _int(f, _F_FILENAME), "string"))
        )
    # Samples share the dictionary's stacks, so they cost nothing more.
    spend = FrameBudget(
        max_frames, OtlpTooLargeError(f"profiles decode to more than {max_frames} frames")
    ).spend

    locations: list[tuple[Frame, ...]] = []
    for raw in d.get(_D_LOCATION, ()):
        loc = _fields(as_bytes(raw))
        lines = loc.get(_LOC_LINES, ())
        spend(len(lines))
        frames = []
        for line_raw in lines:
            line = _fields(as_bytes(line_raw))
            name, filename = _at(functions, _int(line, _LINE_FUNCTION_INDEX), "function")
            frames.append(Frame(name, filename, _int(line, _LINE_LINE)))
        locations.append(tuple(frames))
    stacks = []
    for raw in d.get(_D_STACK, ()):
        parts = [
            _at(locations, i, "location") for i in _ints(_fields(as_bytes(raw)), _STACK_LOCATIONS)
        ]
        stack = cut_stack(parts, max_depth)
        spend(len(stack))
        stacks.append(stack)
    links = []
    for raw in d.get(_D_LINK, ()):
        link = _fields(as_bytes(raw))
        links.append((_msg(link, _LINK_TRACE_ID).hex(), _msg(link, _LINK_SPAN_ID).hex()))
    attributes = []
    for raw in d.get(_D_ATTRIBUTE, ()):
        kv = _fields(as_bytes(raw))
        attributes.append(
            (_at(strings, _int(kv, _KVU_KEY), "string"), _any_text(_msg(kv, _KVU_VALUE), strings))
        )
    series: list[PushSeries] = []
    for rp_raw in request.get(_REQ_RESOURCE_PROFILES, ()):
        rp = _fields(as_bytes(rp_raw))
        resource: dict[str, str] = {}
        for kv_raw in _fields(_msg(rp, _RP_RESOURCE)).get(_RESOURCE_ATTRIBUTES, ()):
            kv = _fields(as_bytes(kv_raw))
            resource[as_str(_msg(kv, _KV_KEY))] = _any_text(_msg(kv, _KV_VALUE), strings)
        service = resource.pop("service.name", "") or "unknown_service"
        rest = [("service_name", service), *sorted(resource.items())]
        for sp_raw in rp.get(_RP_SCOPE_PROFILES, ()):
            memory: list[Profile] = []
            for p_raw in _fields(as_bytes(sp_raw)).get(_SP_PROFILES, ()):
                name, profile = _profile(
                    _fields(as_bytes(p_raw)), strings, stacks, links, attributes
                )
                if (
                    profile.sample_types[0] in MEMORY_SAMPLE_TYPES
                    and profile.period_type == MEMORY_PERIOD_TYPE
                ):
                    memory.append(profile)
                else:
                    series.append(PushSeries((("__name__", name), *rest), (profile,)))
            if memory:
                series.append(PushSeries((("__name__", "memory"), *rest), (_joined(memory),)))
    return series


def _profile(
    p: dict[int, list[FieldValue]],
    strings: Sequence[str],
    stacks: Sequence[tuple[Frame, ...]],
    links: Sequence[tuple[str, str]],
    attributes: Sequence[tuple[str, str]],
) -> tuple[str, Profile]:
    """The series name and the pprof model of one ``Profile``."""

    def value_type(field: int) -> tuple[str, str]:
        vt = _fields(_msg(p, field))
        return (
            _at(strings, _int(vt, _VT_TYPE), "string"),
            _at(strings, _int(vt, _VT_UNIT), "string"),
        )

    sample_type, period_type = value_type(_P_SAMPLE_TYPE), value_type(_P_PERIOD_TYPE)
    period = _int(p, _P_PERIOD)
    scale = 1
    name = sample_type[0] or "process_cpu"
    if sample_type == SAMPLE_TYPE and period_type == PERIOD_TYPE and period:
        # As Pyroscope converts it: CPU samples counted in periods become CPU nanoseconds.
        sample_type, scale, name = PERIOD_TYPE, period, "process_cpu"
    samples = []
    for s_raw in p.get(_P_SAMPLES, ()):
        s = _fields(as_bytes(s_raw))
        values = [to_int64(v) for v in _ints(s, _S_VALUES)]
        if not values:
            values = [len([t for raw in s.get(5, ()) for t in _fixed64s(raw)])]
        labels = [_at(attributes, i, "attribute") for i in _ints(s, _S_ATTRIBUTE_INDICES)]
        link = _int(s, _S_LINK_INDEX)
        if link:
            trace, span = _at(links, link, "link")
            labels.append(("span_id", span))
            if any(c != "0" for c in trace):
                labels.append(("trace_id", trace))
        samples.append(
            Sample(
                _at(stacks, _int(s, _S_STACK_INDEX), "stack"),
                (sum(values) * scale,),
                tuple(labels),
            )
        )
    profile = Profile(
        sample_types=(sample_type,),
        period_type=period_type,
        period=period,
        time_nanos=_fixed64(p, _P_TIME_UNIX_NANO),
        duration_nanos=_int(p, _P_DURATION_NANO),
        samples=tuple(samples),
    )
    return name, profile


def _joined(memory: list[Profile]) -> Profile:
    """Memory profiles of one sample type each as one of ``MEMORY_SAMPLE_TYPES``, joined per
    (stack, labels), 0 where a profile has no sample."""
    rows: dict[tuple[tuple[Frame, ...], tuple[tuple[str, str], ...]], list[int]] = {}
    for profile in memory:
        position = MEMORY_SAMPLE_TYPES.index(profile.sample_types[0])
        for sample in profile.samples:
            row = rows.setdefault((sample.stack, sample.labels), [0] * len(MEMORY_SAMPLE_TYPES))
            row[position] += sample.values[0]
    first = memory[0]
    return Profile(
        sample_types=MEMORY_SAMPLE_TYPES,
        period_type=MEMORY_PERIOD_TYPE,
        period=first.period,
        time_nanos=min(p.time_nanos for p in memory),
        duration_nanos=max(p.duration_nanos for p in memory),
        samples=tuple(
            Sample(stack, tuple(values), labels) for (stack, labels), values in rows.items()
        ),
    )


def _fixed64(fields: dict[int, list[FieldValue]], field: int) -> int:
    values = fields.get(field)
    return as_int(values[-1]) if values else 0


def _fixed64s(raw: FieldValue) -> list[int]:
    if isinstance(raw, int):
        return [raw]
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw) - 7, 8)]
