"""pprof (``perftools.profiles.Profile``) codec without third-party dependencies.

The model is deliberately symbolic: a sample is a stack of ``Frame`` objects
(function, file, line), not addresses and mappings, because that is all a Python
profiler produces and all the UI needs. Locations with several ``Line`` entries
(inlined frames) are flattened in their on-the-wire order, which pprof defines as
callee first, so a flattened stack stays leaf first.

Field numbers follow github.com/google/pprof/proto/profile.proto.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from .._window import Frame
from ._protowire import (
    ProtoDecodeError,
    as_bytes,
    as_int,
    iter_fields,
    put_bytes_field,
    put_packed_varints_field,
    put_string_field,
    put_varint_field,
    to_int64,
    unpack_varints,
)

_LabelFields = Callable[
    [Sequence[tuple[str, str]], dict[tuple[str, str], bytes], dict[str, int], list[str]], bytes
]
_c_label_fields: _LabelFields | None
try:
    from ._wire import pprof_label_fields as _c_label_fields
except ImportError:  # built without a compiler, or the module cannot load here
    _c_label_fields = None

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "FrameBudget",
    "InflatedTooLargeError",
    "Profile",
    "ProfileBuilder",
    "ProfileDecodeError",
    "ProfileTooLargeError",
    "Sample",
    "SharedLocations",
    "cut_stack",
    "decode_profile",
    "frame_budget",
    "encode_profile",
    "gunzip_bounded",
    "maybe_gunzip",
    "next_slice",
]

_GZIP_MAGIC = b"\x1f\x8b"

#: Frames a decoded stack keeps (what local mode's stores keep too): deeper stacks keep their
#: leaf and root ends around an ``[N frames elided]`` frame. The profilers send 256 at most.
DEFAULT_MAX_DEPTH = 2048
# Frames one upload may decode to, per byte of its inflated profiles. A profile's samples name
# each frame with a location id of at least one byte, so a real upload stays under one frame per
# byte; only locations with many lines, referenced over and over, expand further. Every decoded
# frame is a pointer (8 bytes) or a Frame (~100), so this keeps a decode within tens of bytes
# per inflated byte instead of the thousands a location of 10,000 lines referenced 10,000
# times costs.
_FRAMES_PER_BYTE = 2
# Small uploads (tests, a first window) get at least this many, whatever their size.
_MIN_FRAMES = 65536

# perftools.profiles.Profile
_P_SAMPLE_TYPE = 1
_P_SAMPLE = 2
_P_MAPPING = 3
_P_LOCATION = 4
_P_FUNCTION = 5
_P_STRING_TABLE = 6
_P_TIME_NANOS = 9
_P_DURATION_NANOS = 10
_P_PERIOD_TYPE = 11
_P_PERIOD = 12
_P_COMMENT = 13
_P_DEFAULT_SAMPLE_TYPE = 14
# ValueType
_VT_TYPE = 1
_VT_UNIT = 2
# Sample
_S_LOCATION_ID = 1
_S_VALUE = 2
_S_LABEL = 3
# Label
_L_KEY = 1
_L_STR = 2
_L_NUM = 3
_L_NUM_UNIT = 4
# Mapping
_M_ID = 1
_M_FILENAME = 5
# Location
_LOC_ID = 1
_LOC_MAPPING_ID = 2
_LOC_ADDRESS = 3
_LOC_LINE = 4
# Line
_LINE_FUNCTION_ID = 1
_LINE_LINE = 2
# Function
_F_ID = 1
_F_NAME = 2
_F_SYSTEM_NAME = 3
_F_FILENAME = 4


class ProfileDecodeError(ProtoDecodeError):
    """Raised when bytes are not a decodable pprof profile."""


class ProfileTooLargeError(ProfileDecodeError):
    """Raised when input decodes to more than the caller's limit allows."""


class InflatedTooLargeError(ProfileTooLargeError):
    """Raised when gzip-compressed input inflates past the caller's limit."""


def frame_budget(inflated_bytes: int) -> int:
    """How many frames an upload of ``inflated_bytes`` (profiles, uncompressed) may decode to."""
    return _FRAMES_PER_BYTE * inflated_bytes + _MIN_FRAMES


class FrameBudget:
    """The frames a decoder may still make: location lines and stack frames alike, each an
    object or a pointer kept. ``spend`` raises ``error`` once more than ``limit`` are made."""

    __slots__ = ("_error", "_left")

    def __init__(self, limit: int, error: Exception) -> None:
        self._left = limit
        self._error = error

    def spend(self, count: int) -> None:
        """Take ``count`` frames from what is left."""
        self._left -= count
        if self._left < 0:
            raise self._error


def cut_stack(parts: Sequence[Sequence[Frame]], max_depth: int) -> tuple[Frame, ...]:
    """The frames of ``parts`` (a stack's locations, leaf first) in order, at most ``max_depth``.

    A deeper stack keeps its leaf and root ends around an ``[N frames elided]`` frame, and is
    built without flattening the whole of it: a location can hold thousands of lines.
    """
    total = sum(map(len, parts))
    if total <= max_depth:
        return tuple([frame for part in parts for frame in part])
    keep = max_depth - 1
    leaf, root = keep - keep // 2, keep // 2
    head: list[Frame] = []
    for part in parts:
        if len(head) >= leaf:
            break
        head.extend(part[: leaf - len(head)])
    tail: list[Frame] = []
    for part in reversed(parts):
        if len(tail) >= root:
            break
        # Reversed, so the last frames of the stack come first; flipped back below.
        tail.extend(reversed(part[max(len(part) - (root - len(tail)), 0) :]))
    tail.reverse()
    marker = Frame(f"[{total - leaf - root} frames elided]", "", 0)
    return (*head, marker, *tail)


@dataclass(frozen=True, slots=True)
class Sample:
    """One pprof sample.

    ``stack`` is leaf first. ``labels`` are the string labels in wire order; a key
    may legitimately appear more than once, so they are kept as pairs rather than
    a dict. ``num_labels`` holds numeric labels as ``(key, num, num_unit)``.
    """

    stack: tuple[Frame, ...]
    values: tuple[int, ...]
    labels: tuple[tuple[str, str], ...] = ()
    num_labels: tuple[tuple[str, int, str], ...] = ()

    def label_values(self, key: str) -> tuple[str, ...]:
        """Return every string value carried under ``key``, in wire order."""
        return tuple(v for k, v in self.labels if k == key)

    def label(self, key: str) -> str | None:
        """Return the first string value under ``key``, or ``None`` if absent."""
        for k, v in self.labels:
            if k == key:
                return v
        return None

    @property
    def value(self) -> int:
        """The first sample value (the only one for Pyroscope's CPU profiles)."""
        return self.values[0]


@dataclass(frozen=True, slots=True)
class Profile:
    """A decoded pprof profile: ``(type, unit)`` pairs plus symbolised samples."""

    sample_types: tuple[tuple[str, str], ...]
    period_type: tuple[str, str]
    period: int
    time_nanos: int
    duration_nanos: int
    samples: tuple[Sample, ...]
    comments: tuple[str, ...] = ()
    default_sample_type: str = ""

    def total(self, value_index: int = 0) -> int:
        """Sum of ``values[value_index]`` over all samples."""
        return sum(s.values[value_index] for s in self.samples)


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """Gunzip ``data`` (one or more members), refusing to produce more than ``limit`` bytes.

    Inflates incrementally and stops at the cap, so a small body that expands a thousandfold
    (a gzip bomb) costs ``limit`` bytes of memory, not its inflated size. Raises
    ``InflatedTooLargeError`` past the cap, ``ProfileDecodeError`` for broken gzip.
    """
    out = bytearray()
    pending = data
    try:
        while True:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            while not inflater.eof:
                # One byte over the cap is enough to know the cap is exceeded.
                chunk = inflater.decompress(pending, limit - len(out) + 1)
                out += chunk
                if len(out) > limit:
                    raise InflatedTooLargeError(f"gzip body inflates past {limit} bytes")
                pending = inflater.unconsumed_tail
                # No output and no input left is a truncated stream, unless the member just
                # ended (an empty member ends without producing a byte).
                if not chunk and not pending and not inflater.eof:
                    raise ProfileDecodeError("invalid gzip data: truncated stream")
            # gzip allows concatenated members and zero padding after the last one.
            pending = inflater.unused_data.lstrip(b"\0")
            if not pending:
                return bytes(out)
    except zlib.error as exc:
        raise ProfileDecodeError(f"invalid gzip data: {exc}") from exc


def maybe_gunzip(data: bytes, limit: int | None = None) -> bytes:
    """Return ``data`` gunzipped if it starts with the gzip magic, else unchanged.

    Sniffing is unambiguous for protobuf: 0x1f would be field 3 with wire type 7,
    which does not exist. With ``limit``, inflating stops there (see ``gunzip_bounded``).
    """
    if data[:2] != _GZIP_MAGIC:
        return data
    if limit is not None:
        return gunzip_bounded(data, limit)
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise ProfileDecodeError(f"invalid gzip data: {exc}") from exc


def decode_profile(
    data: bytes,
    *,
    max_inflated: int | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_frames: int | None = None,
) -> Profile:
    """Decode a pprof profile, gzip-compressed or raw, into a ``Profile``.

    A stack deeper than ``max_depth`` keeps its leaf and root ends (see ``cut_stack``). Raises
    ``ProfileDecodeError`` on malformed input (bad wire format, dangling
    string/function/location references), and its subclass ``ProfileTooLargeError`` when the
    profile decodes to more than ``max_frames`` frames (default: ``frame_budget`` of its
    inflated size) or, as ``InflatedTooLargeError``, when a gzip-compressed profile inflates
    past ``max_inflated`` bytes.
    """
    if max_depth < 3:
        raise ValueError(f"max_depth: expected at least 3 (leaf, marker, root), got {max_depth}")
    try:
        raw = maybe_gunzip(data, max_inflated)
        limit = frame_budget(len(raw)) if max_frames is None else max_frames
        return _decode_profile(raw, max_depth, limit)
    except ProfileDecodeError:
        raise
    except ProtoDecodeError as exc:
        raise ProfileDecodeError(str(exc)) from exc


def _decode_profile(data: bytes, max_depth: int, max_frames: int) -> Profile:
    raw_sample_types: list[bytes] = []
    raw_samples: list[bytes] = []
    raw_mappings: list[bytes] = []
    raw_locations: list[bytes] = []
    raw_functions: list[bytes] = []
    strings: list[str] = []
    raw_period_type: bytes | None = None
    time_nanos = duration_nanos = period = 0
    comment_idx: list[int] = []
    default_sample_type_idx = 0

    for field, _wire, value in iter_fields(data):
        if field == _P_SAMPLE_TYPE:
            raw_sample_types.append(as_bytes(value))
        elif field == _P_SAMPLE:
            raw_samples.append(as_bytes(value))
        elif field == _P_MAPPING:
            raw_mappings.append(as_bytes(value))
        elif field == _P_LOCATION:
            raw_locations.append(as_bytes(value))
        elif field == _P_FUNCTION:
            raw_functions.append(as_bytes(value))
        elif field == _P_STRING_TABLE:
            try:
                strings.append(as_bytes(value).decode("utf-8"))
            except UnicodeDecodeError:
                # Symbol names from native code are not guaranteed UTF-8; keep going.
                strings.append(as_bytes(value).decode("utf-8", "replace"))
        elif field == _P_TIME_NANOS:
            time_nanos = to_int64(as_int(value))
        elif field == _P_DURATION_NANOS:
            duration_nanos = to_int64(as_int(value))
        elif field == _P_PERIOD_TYPE:
            raw_period_type = as_bytes(value)
        elif field == _P_PERIOD:
            period = to_int64(as_int(value))
        elif field == _P_COMMENT:
            comment_idx.extend(unpack_varints(value))
        elif field == _P_DEFAULT_SAMPLE_TYPE:
            default_sample_type_idx = as_int(value)
        # drop_frames/keep_frames/doc_url and unknown fields are ignored.

    if strings and strings[0] != "":
        raise ProfileDecodeError("string_table[0] must be the empty string")
    if not strings:
        strings = [""]
    n_strings = len(strings)

    def s(idx: int) -> str:
        if idx >= n_strings:
            raise ProfileDecodeError(f"string index {idx} out of range ({n_strings})")
        return strings[idx]

    def value_type(raw: bytes) -> tuple[str, str]:
        type_idx = unit_idx = 0
        for f, _w, v in iter_fields(raw):
            if f == _VT_TYPE:
                type_idx = as_int(v)
            elif f == _VT_UNIT:
                unit_idx = as_int(v)
        return s(type_idx), s(unit_idx)

    functions: dict[int, tuple[str, str]] = {}
    for raw in raw_functions:
        fid = name_idx = file_idx = 0
        for f, _w, v in iter_fields(raw):
            if f == _F_ID:
                fid = as_int(v)
            elif f == _F_NAME:
                name_idx = as_int(v)
            elif f == _F_FILENAME:
                file_idx = as_int(v)
        functions[fid] = (s(name_idx), s(file_idx))

    mapping_files: dict[int, str] = {}
    for raw in raw_mappings:
        mid = file_idx = 0
        for f, _w, v in iter_fields(raw):
            if f == _M_ID:
                mid = as_int(v)
            elif f == _M_FILENAME:
                file_idx = as_int(v)
        mapping_files[mid] = s(file_idx)

    spend = FrameBudget(
        max_frames, ProfileTooLargeError(f"profile decodes to more than {max_frames} frames")
    ).spend

    locations: dict[int, tuple[Frame, ...]] = {}
    for raw in raw_locations:
        lid = mapping_id = address = 0
        frames: list[Frame] = []
        for f, _w, v in iter_fields(raw):
            if f == _LOC_ID:
                lid = as_int(v)
            elif f == _LOC_MAPPING_ID:
                mapping_id = as_int(v)
            elif f == _LOC_ADDRESS:
                address = as_int(v)
            elif f == _LOC_LINE:
                func_id = line_no = 0
                for lf, _lw, lv in iter_fields(as_bytes(v)):
                    if lf == _LINE_FUNCTION_ID:
                        func_id = as_int(lv)
                    elif lf == _LINE_LINE:
                        line_no = to_int64(as_int(lv))
                func = functions.get(func_id)
                if func is None:
                    raise ProfileDecodeError(
                        f"location {lid} references unknown function {func_id}"
                    )
                spend(1)
                frames.append(Frame(func[0], func[1], line_no))
        if not frames:
            # Unsymbolised native location: the address is the best name there is.
            spend(1)
            frames.append(Frame(f"0x{address:x}", mapping_files.get(mapping_id, ""), 0))
        locations[lid] = tuple(frames)

    samples: list[Sample] = []
    for raw in raw_samples:
        parts: list[tuple[Frame, ...]] = []
        values: list[int] = []
        labels: list[tuple[str, str]] = []
        num_labels: list[tuple[str, int, str]] = []
        for f, _w, v in iter_fields(raw):
            if f == _S_LOCATION_ID:
                for lid in unpack_varints(v):
                    loc = locations.get(lid)
                    if loc is None:
                        raise ProfileDecodeError(f"sample references unknown location {lid}")
                    parts.append(loc)
            elif f == _S_VALUE:
                values.extend(to_int64(x) for x in unpack_varints(v))
            elif f == _S_LABEL:
                key_idx = str_idx = num = num_unit_idx = 0
                for lf, _lw, lv in iter_fields(as_bytes(v)):
                    if lf == _L_KEY:
                        key_idx = as_int(lv)
                    elif lf == _L_STR:
                        str_idx = as_int(lv)
                    elif lf == _L_NUM:
                        num = to_int64(as_int(lv))
                    elif lf == _L_NUM_UNIT:
                        num_unit_idx = as_int(lv)
                # pprof says a label is either str or num. A label with neither set is
                # read as an empty string label so ("k", "") survives a round trip.
                if str_idx == 0 and (num != 0 or num_unit_idx != 0):
                    num_labels.append((s(key_idx), num, s(num_unit_idx)))
                else:
                    labels.append((s(key_idx), s(str_idx)))
        stack = cut_stack(parts, max_depth)
        spend(len(stack))
        samples.append(Sample(stack, tuple(values), tuple(labels), tuple(num_labels)))

    return Profile(
        sample_types=tuple(value_type(r) for r in raw_sample_types),
        period_type=value_type(raw_period_type) if raw_period_type is not None else ("", ""),
        period=period,
        time_nanos=time_nanos,
        duration_nanos=duration_nanos,
        samples=tuple(samples),
        comments=tuple(s(i) for i in comment_idx),
        default_sample_type=s(default_sample_type_idx),
    )


def _put_location_field(buf: bytearray, lid: int, fid: int, line: int) -> None:
    """Append the Profile.location field of location ``lid``: one line of function ``fid``."""
    line_msg = bytearray()
    put_varint_field(line_msg, _LINE_FUNCTION_ID, fid)
    put_varint_field(line_msg, _LINE_LINE, line)
    msg = bytearray()
    put_varint_field(msg, _LOC_ID, lid)
    put_bytes_field(msg, _LOC_LINE, line_msg)
    put_bytes_field(buf, _P_LOCATION, msg)


class SharedLocations:
    """Location and function ids kept from one profile to the next by one exporter.

    A window's samples mostly repeat stacks that earlier windows had, each with other labels
    (a memory sample with a span's labels is a sample of its own): with ids private to each
    profile, every profile encodes each of its stacks again, frame by frame. With these, a
    stack's location ids are encoded once, for as long as the stack stays in the tables; a
    profile writes the Location message of each frame it uses (encoded once too) and the
    Function messages those need, whose names it interns in its own string table. Ids are
    sparse within one profile, which pprof allows (Pyroscope and ``go tool pprof`` map them).

    One exporter thread uses it at a time: ``claim()`` hands it to the calling thread unless
    another live thread has it (the caller then encodes with private ids), and forgets every
    id first when it has grown past its bounds, so a claim is the only moment ids change.
    """

    def __init__(self, *, max_locations: int = 65536, max_stacks: int = 16384) -> None:
        self.max_locations = max_locations
        self.max_stacks = max_stacks
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self.clears = 0
        self._clear()

    def _clear(self) -> None:
        self._locations: dict[Frame, int] = {}
        # By location id - 1: the encoded Location field, and its function's id.
        self.location_fields: list[bytes] = []
        self.location_functions: list[int] = []
        self._functions: dict[tuple[str, str], int] = {}
        # By function id - 1: (name, filename).
        self.function_keys: list[tuple[str, str]] = []
        # id(stack) -> (stack, its packed sample.location_id field, its location ids); the
        # stack is kept so that its id stays its own.
        self._stacks: dict[int, tuple[Sequence[Frame], bytes, tuple[int, ...]]] = {}

    def __len__(self) -> int:
        """Locations known."""
        return len(self.location_fields)

    def claim(self) -> SharedLocations | None:
        """These ids for the calling thread's next profiles, or ``None`` (another has them)."""
        with self._lock:
            me = threading.current_thread()
            owner = self._owner
            if owner is not None and owner is not me and owner.is_alive():
                return None
            self._owner = me
            if (
                len(self.location_fields) > self.max_locations
                or len(self._stacks) > self.max_stacks
            ):
                self._clear()
                self.clears += 1
            return self

    def stack(self, stack: Sequence[Frame]) -> tuple[Sequence[Frame], bytes, tuple[int, ...]]:
        """``stack``'s entry: ``(stack, packed location ids field, location ids)``."""
        entry = self._stacks.get(id(stack))
        if entry is not None and entry[0] is stack:
            return entry
        ids = tuple([self._location_id(frame) for frame in stack])
        field = bytearray()
        put_packed_varints_field(field, _S_LOCATION_ID, ids)
        entry = (stack, bytes(field), ids)
        if type(stack) is tuple:  # a list could change under the same id
            self._stacks[id(stack)] = entry
        return entry

    def _location_id(self, frame: Frame) -> int:
        lid = self._locations.get(frame)
        if lid is not None:
            return lid
        fkey = (frame.function, frame.filename)
        fid = self._functions.get(fkey)
        if fid is None:
            fid = len(self.function_keys) + 1
            self._functions[fkey] = fid
            self.function_keys.append(fkey)
        lid = len(self.location_fields) + 1
        self._locations[frame] = lid
        field = bytearray()
        _put_location_field(field, lid, fid, frame.line)
        self.location_fields.append(bytes(field))
        self.location_functions.append(fid)
        return lid


class ProfileBuilder:
    """Incrementally build a pprof profile, interning strings, functions and locations.

    Meant for an in-process sampler: each ``add`` costs a few dict lookups, the
    Function/Location messages are serialised once when first seen, and samples
    with the same stack and the same labels (same order) are merged by summing
    their values, the way pprof producers aggregate. Pass labels in a consistent
    order for merging to be effective.

    One builder produces one profile; create a new builder (or ``reset()``) per
    upload interval. With ``locations`` (claimed by the calling thread), its location and
    function ids are those shared ids.
    """

    def __init__(
        self,
        sample_types: Sequence[tuple[str, str]] = (("cpu", "nanoseconds"),),
        period_type: tuple[str, str] | None = None,
        period: int = 0,
        *,
        comments: Sequence[str] = (),
        default_sample_type: str = "",
        locations: SharedLocations | None = None,
    ) -> None:
        self._shared = locations
        self._sample_types = tuple((t, u) for t, u in sample_types)
        if period_type is None:
            period_type = self._sample_types[0] if self._sample_types else ("", "")
        self._period_type = period_type
        self._period = period
        self._comments = tuple(comments)
        self._default_sample_type = default_sample_type
        self.reset()

    def reset(self) -> None:
        """Drop all samples and interned data, keeping the profile configuration."""
        self._strings: dict[str, int] = {"": 0}
        self._string_list: list[str] = [""]
        self._functions: dict[tuple[int, int], int] = {}
        self._function_buf = bytearray()
        self._locations: dict[Frame, int] = {}
        self._location_buf = bytearray()
        # A stack tuple's encoded location ids by the tuple's id (the tuple kept, so the id
        # stays its own): a window's stack comes once per label set, i.e. once per span, and
        # each frame's lookup would hash a Frame through its Python-level __hash__. The ids are
        # kept as the sample's packed field, written as is by build() and hashed once (bytes
        # cache their hash) as the merge key.
        self._stack_locations: dict[int, tuple[Sequence[Frame], bytes]] = {}
        # A label pair's encoded sample.label field (tag and length included).
        self._label_cache: dict[tuple[str, str], bytes] = {}
        # A label tuple's encoded sample.label fields, by the tuple's id (the tuple kept, as
        # for stacks): a LabelSet hands out one cached tuple, and a span's labels come once per
        # stack it has, so they are encoded once and the merge key hashes bytes, not pairs.
        self._label_fields: dict[int, tuple[Sequence[tuple[str, str]], bytes]] = {}
        self._samples: list[tuple[bytes, bytes, list[int]]] = []
        self._sample_index: dict[tuple[bytes, bytes], int] = {}
        # With shared locations: the location ids the samples use, and the stacks (by their
        # packed field) already counted in them.
        self._used_locations: set[int] = set()
        self._used_stacks: set[bytes] = set()
        # Header strings are interned up front so the string table is complete
        # whenever build() runs.
        for t, u in (*self._sample_types, self._period_type):
            self._intern(t)
            self._intern(u)
        for c in self._comments:
            self._intern(c)
        self._intern(self._default_sample_type)

    def __len__(self) -> int:
        """Number of distinct (stack, labels) samples so far."""
        return len(self._samples)

    def _intern(self, value: str) -> int:
        idx = self._strings.get(value)
        if idx is None:
            idx = len(self._string_list)
            self._strings[value] = idx
            self._string_list.append(value)
        return idx

    def _location_id(self, frame: Frame) -> int:
        lid = self._locations.get(frame)
        if lid is not None:
            return lid
        fkey = (self._intern(frame.function), self._intern(frame.filename))
        fid = self._functions.get(fkey)
        if fid is None:
            fid = len(self._functions) + 1
            self._functions[fkey] = fid
            msg = bytearray()
            put_varint_field(msg, _F_ID, fid)
            put_varint_field(msg, _F_NAME, fkey[0])
            # system_name = name, as Go's runtime/pprof writes; tools display either.
            put_varint_field(msg, _F_SYSTEM_NAME, fkey[0])
            put_varint_field(msg, _F_FILENAME, fkey[1])
            put_bytes_field(self._function_buf, _P_FUNCTION, msg)
        lid = len(self._locations) + 1
        self._locations[frame] = lid
        _put_location_field(self._location_buf, lid, fid, frame.line)
        return lid

    def _label_field(self, pair: tuple[str, str]) -> bytes:
        """The sample.label field of ``pair``, its strings interned (cached per pair)."""
        msg = bytearray()
        put_varint_field(msg, _L_KEY, self._intern(pair[0]))
        put_varint_field(msg, _L_STR, self._intern(pair[1]))
        field = bytearray()
        put_bytes_field(field, _S_LABEL, msg)
        cached = self._label_cache[pair] = bytes(field)
        return cached

    def _num_label_bytes(self, label: tuple[str, int, str]) -> bytes:
        msg = bytearray()
        put_varint_field(msg, _L_KEY, self._intern(label[0]))
        put_varint_field(msg, _L_NUM, label[1])
        put_varint_field(msg, _L_NUM_UNIT, self._intern(label[2]))
        return bytes(msg)

    def _values(self, value: int | Sequence[int]) -> list[int]:
        values = [value] if isinstance(value, int) else list(value)
        if len(values) != len(self._sample_types):
            raise ValueError(
                f"expected {len(self._sample_types)} sample value(s), got {len(values)}"
            )
        return values

    def add(
        self,
        stack: Sequence[Frame],
        value: int | Sequence[int],
        labels: Sequence[tuple[str, str]] = (),
        *,
        num_labels: Sequence[tuple[str, int, str]] = (),
    ) -> None:
        """Add one observation; ``stack`` is leaf first, ``value`` one int per sample type.

        An observation with the same stack and labels as an earlier one is merged
        into it by summing values.
        """
        values = self._values(value)
        locations = self._stack_field(stack)
        cached_labels = self._label_fields.get(id(labels))
        if cached_labels is not None and cached_labels[0] is labels:
            label_field = cached_labels[1]
        else:
            label_field = self._labels_field(labels, ())
            if type(labels) is tuple:  # a list could change under the same id
                self._label_fields[id(labels)] = (labels, label_field)
        if num_labels:
            # Numeric labels are rare (Python agents never emit them): do not bother
            # merging, just keep such samples separate.
            label_field += self._labels_field((), num_labels)
            self._samples.append((locations, label_field, values))
            return
        key = (locations, label_field)
        idx = self._sample_index.get(key)
        if idx is None:
            self._sample_index[key] = len(self._samples)
            self._samples.append((locations, label_field, values))
        else:
            acc = self._samples[idx][2]
            for i, v in enumerate(values):
                acc[i] += v

    def _stack_field(self, stack: Sequence[Frame]) -> bytes:
        """``stack``'s packed sample.location_id field, its locations interned."""
        shared = self._shared
        if shared is not None:
            _, locations, ids = shared.stack(stack)
            if locations not in self._used_stacks:
                self._used_stacks.add(locations)
                self._used_locations.update(ids)
            return locations
        cached = self._stack_locations.get(id(stack))
        if cached is not None and cached[0] is stack:
            return cached[1]
        locations = self._locations_field(stack)
        if type(stack) is tuple:  # a list could change under the same id
            self._stack_locations[id(stack)] = (stack, locations)
        return locations

    def _locations_field(self, stack: Sequence[Frame]) -> bytes:
        field = bytearray()
        put_packed_varints_field(field, _S_LOCATION_ID, [self._location_id(f) for f in stack])
        return bytes(field)

    def _labels_field(
        self, labels: Sequence[tuple[str, str]], num_labels: Sequence[tuple[str, int, str]]
    ) -> bytes:
        """The sample.label fields of ``labels`` then ``num_labels``, in order."""
        # A span's labels are new pairs (span and trace ids) among pairs every span shares:
        # each pair's whole field is cached, and a sample's fields are joined.
        cache = self._label_cache
        if not num_labels and _c_label_fields is not None:
            # The same bytes and string table, at about a tenth of the cost for a new span.
            return _c_label_fields(labels, cache, self._strings, self._string_list)
        fields = [cache.get(pair) or self._label_field(pair) for pair in labels]
        for num in num_labels:
            field = bytearray()
            put_bytes_field(field, _S_LABEL, self._num_label_bytes(num))
            fields.append(bytes(field))
        return b"".join(fields)

    def _add_unmerged(self, sample: Sample) -> None:
        locations = self._stack_field(sample.stack)
        label_field = self._labels_field(sample.labels, sample.num_labels)
        self._samples.append((locations, label_field, self._values(sample.values)))

    def build(self, *, time_nanos: int = 0, duration_nanos: int = 0) -> bytes:
        """Serialise the profile as raw (not gzip-compressed) pprof bytes."""
        slices = self.build_in_slices(time_nanos=time_nanos, duration_nanos=duration_nanos)
        while True:
            profile = next_slice(slices)
            if profile is not None:
                return profile

    def build_in_slices(
        self,
        *,
        time_nanos: int = 0,
        duration_nanos: int = 0,
        budget_ns: int | None = None,
        release: bool = False,
    ) -> Generator[None, None, bytes]:
        """``build()`` a slice at a time: each ``next()`` works until ``budget_ns`` has passed
        (``None``: to the end), and the generator returns the profile (see ``next_slice``).

        An encoder holds the GIL while it works: one profile per window, written in slices,
        keeps each hold short without splitting the window into profiles that would each
        carry their locations, functions and strings again. Add nothing meanwhile. With
        ``release``, the builder's samples and tables are then freed in slices too (tens of
        thousands of objects, freed at once, hold the GIL for milliseconds), leaving it empty.
        """
        clock = time.perf_counter_ns
        budget = budget_ns if budget_ns is not None else 1 << 62
        deadline = clock() + budget
        buf = bytearray()
        strings = self._strings
        for t, u in self._sample_types:
            vt = bytearray()
            put_varint_field(vt, _VT_TYPE, strings[t])
            put_varint_field(vt, _VT_UNIT, strings[u])
            put_bytes_field(buf, _P_SAMPLE_TYPE, vt)
        msg = bytearray()
        for n, (locations, label_field, values) in enumerate(self._samples, 1):
            msg[:] = locations
            put_packed_varints_field(msg, _S_VALUE, values)
            msg += label_field
            put_bytes_field(buf, _P_SAMPLE, msg)
            if not n & 63 and clock() > deadline:
                yield
                deadline = clock() + budget
        shared = self._shared
        if shared is None:
            buf += self._location_buf
            buf += self._function_buf
        else:
            # The Location and Function messages of the shared ids the samples use; the
            # functions' names go into this profile's string table.
            fields = shared.location_fields
            functions = shared.location_functions
            used_functions: set[int] = set()
            # In set order: sorting tens of thousands of ids would be one long GIL hold.
            for n, lid in enumerate(self._used_locations, 1):
                buf += fields[lid - 1]
                used_functions.add(functions[lid - 1])
                if not n & 255 and clock() > deadline:
                    yield
                    deadline = clock() + budget
            keys = shared.function_keys
            for n, fid in enumerate(used_functions, 1):
                name, filename = keys[fid - 1]
                name_idx = self._intern(name)
                msg = bytearray()
                put_varint_field(msg, _F_ID, fid)
                put_varint_field(msg, _F_NAME, name_idx)
                put_varint_field(msg, _F_SYSTEM_NAME, name_idx)
                put_varint_field(msg, _F_FILENAME, self._intern(filename))
                put_bytes_field(buf, _P_FUNCTION, msg)
                if not n & 63 and clock() > deadline:
                    yield
                    deadline = clock() + budget
        for n, text in enumerate(self._string_list, 1):
            put_string_field(buf, _P_STRING_TABLE, text)
            if not n & 127 and clock() > deadline:
                yield
                deadline = clock() + budget
        put_varint_field(buf, _P_TIME_NANOS, time_nanos)
        put_varint_field(buf, _P_DURATION_NANOS, duration_nanos)
        if self._period_type != ("", ""):
            vt = bytearray()
            put_varint_field(vt, _VT_TYPE, strings[self._period_type[0]])
            put_varint_field(vt, _VT_UNIT, strings[self._period_type[1]])
            put_bytes_field(buf, _P_PERIOD_TYPE, vt)
        put_varint_field(buf, _P_PERIOD, self._period)
        put_packed_varints_field(buf, _P_COMMENT, (strings[c] for c in self._comments))
        put_varint_field(buf, _P_DEFAULT_SAMPLE_TYPE, strings[self._default_sample_type])
        profile = bytes(buf)
        if release:
            del buf, msg
            lists: tuple[list[Any], ...] = (self._samples, self._string_list)
            dicts: tuple[dict[Any, Any], ...] = (
                self._sample_index,
                self._label_fields,
                self._label_cache,
                self._strings,
                self._stack_locations,
                self._locations,
                self._functions,
            )
            for items in lists:
                while items:
                    del items[-256:]
                    if clock() > deadline:
                        yield
                        deadline = clock() + budget
            for table in dicts:
                pop = table.popitem
                for n in range(len(table)):
                    pop()
                    if not n & 255 and clock() > deadline:
                        yield
                        deadline = clock() + budget
            self.reset()
        return profile


def next_slice(slices: Generator[None, None, bytes]) -> bytes | None:
    """Run one slice of a ``ProfileBuilder.build_in_slices``: the profile once it is built."""
    try:
        next(slices)
    except StopIteration as done:
        profile: bytes = done.value
        return profile
    return None


def encode_profile(profile: Profile) -> bytes:
    """Encode ``profile`` as raw (not gzip-compressed) pprof bytes.

    Samples are written in order and not merged, so ``decode_profile`` returns an
    equal ``Profile``. Each distinct frame becomes one single-line location: the
    inlining structure of a decoded profile is not kept, only its flattened stacks.
    """
    builder = ProfileBuilder(
        profile.sample_types,
        profile.period_type,
        profile.period,
        comments=profile.comments,
        default_sample_type=profile.default_sample_type,
    )
    for sample in profile.samples:
        builder._add_unmerged(sample)
    return builder.build(time_nanos=profile.time_nanos, duration_nanos=profile.duration_nanos)
