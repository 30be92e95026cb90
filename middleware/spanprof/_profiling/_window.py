"""What a sampler hands to the encoders: frames, interned stacks, and one upload window.

A ``Window`` holds the samples of one upload interval as a weight per ``(stack id, labels)``
(a ``MemoryWindow`` adds allocated objects and the in-use memory at the window's end);
its stacks are interned in ``StackTables`` shared by consecutive windows, so a sample costs a
dict lookup at tick time and the encoders resolve ids only when they export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import NamedTuple

from .._labels._labelset import LabelSet

__all__ = ["Frame", "MemoryWindow", "StackTables", "Window", "code_name", "utf8_text"]


class Frame(NamedTuple):
    """One stack frame: function name, source file and line number (0 when unknown)."""

    # A named tuple, not a frozen dataclass: the encoders key their location tables by frame,
    # and a tuple hashes in C where a dataclass's __hash__ is a Python call (39 vs 144 ns a
    # lookup).

    function: str
    filename: str
    line: int


def code_name(code: CodeType) -> str:
    # Qualified names (Class.method) from 3.11 on, as pyroscope-io reports them.
    name: str = getattr(code, "co_qualname", code.co_name)
    return name


def utf8_text(text: str) -> str:
    """``text`` if UTF-8 can encode it, else with each lone surrogate spelled out.

    Every string of a profile goes on the wire as UTF-8, where a lone surrogate raises and
    would fail the whole window. Python makes them from undecodable bytes (``surrogateescape``:
    a module under a non-UTF-8 directory has ``caf\\udce9`` in its ``co_filename``); such a
    byte becomes ``\\xe9``, so two names that differ in it stay two names.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no undecodable byte gives (\ud800)
            return text.encode("utf-8", "backslashreplace").decode("utf-8")
        return raw.decode("utf-8", "backslashreplace")
    return text


def _frame(code: CodeType, line: int) -> Frame:
    # Once a frame, where it is interned: the encoders then write its strings as they are.
    return Frame(utf8_text(code_name(code)), utf8_text(code.co_filename), line)


class StackTables:
    """Interned frames and stacks, shared by consecutive windows."""

    __slots__ = ("code_refs", "frame_ids", "frames", "stack_ids", "stacks")

    def __init__(self) -> None:
        # (id(code), lasti) -> frame id; code objects are kept alive so their ids stay unique.
        self.frame_ids: dict[tuple[int, int], int] = {}
        self.frames: list[Frame] = []
        self.code_refs: dict[int, CodeType] = {}
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.stacks: list[tuple[Frame, ...]] = []

    def add_frame(self, key: tuple[int, int], frame: FrameType) -> int:
        code = frame.f_code
        self.code_refs[key[0]] = code
        fid = len(self.frames)
        self.frames.append(_frame(code, frame.f_lineno or code.co_firstlineno))
        self.frame_ids[key] = fid
        return fid

    def raw_frame(self, code: CodeType, lasti: int, line: int) -> int:
        key = (id(code), lasti)
        fid = self.frame_ids.get(key)
        if fid is None:
            self.code_refs[key[0]] = code
            fid = len(self.frames)
            self.frames.append(_frame(code, line))
            self.frame_ids[key] = fid
        return fid

    def stack_of(self, key: tuple[int, ...]) -> int:
        sid = self.stack_ids.get(key)
        if sid is None:
            sid = self.add_stack(key)
        return sid

    def add_stack(self, key: tuple[int, ...]) -> int:
        frames = self.frames
        sid = len(self.stacks)
        self.stacks.append(tuple(map(frames.__getitem__, key)))
        self.stack_ids[key] = sid
        return sid

    def __len__(self) -> int:
        return len(self.stacks) + len(self.frames)


@dataclass
class Window:
    """Samples of one upload interval: weight (ns) per ``(stack id, labels)``.

    ``stack(sid)`` resolves a stack id to its frames, leaf first. Ids below zero name stacks
    carried in ``foreign`` (samples held back from a window with other tables; see ``_hold``).
    """

    start_ns: int
    tables: StackTables
    values: dict[tuple[int, LabelSet], int] = field(default_factory=dict)
    end_ns: int = 0
    foreign: dict[int, tuple[Frame, ...]] = field(default_factory=dict)

    def stack(self, sid: int) -> tuple[Frame, ...]:
        """The frames of stack ``sid``, leaf first."""
        if sid < 0:
            return self.foreign[sid]
        return self.tables.stacks[sid]

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class MemoryWindow(Window):
    """Allocation samples of one upload interval, and the memory still in use at its end.

    Every number is an estimate, already scaled up from the samples: ``values`` holds the bytes
    allocated per ``(stack id, labels)`` during the interval (``Window``'s weight, in bytes),
    ``alloc_objects`` the objects allocated, ``inuse`` the ``(objects, bytes)`` of sampled
    allocations not yet freed at ``end_ns``, wherever they were allocated.
    """

    alloc_objects: dict[tuple[int, LabelSet], int] = field(default_factory=dict)
    inuse: dict[tuple[int, LabelSet], tuple[int, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.values.keys() | self.inuse.keys())
