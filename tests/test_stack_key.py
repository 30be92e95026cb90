"""The CPU sampler's stack ids through ``_alloc.stack_key``: the same stacks as the Python walk.

The signal handler looks a stack up by its C key (code addresses and instruction offsets read
from the interpreter's frames) and walks ``f_back`` in Python only for a key it has not seen.
That is right only if two stacks the walk tells apart never share a key: checked here on every
CPython the matrix runs, whose frame layouts differ.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import sysconfig
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

import pytest

from spanprof._profiling._samplers import _signal, _timer
from spanprof._profiling._samplers._signal import MAX_DEPTH, Sampler
from spanprof._profiling._window import Frame, StackTables

from .conftest import MEMORY_VERSIONS

_BUILT_FOR_THIS = not sysconfig.get_config_var("Py_GIL_DISABLED")
pytestmark = [
    pytest.mark.engine,
    MEMORY_VERSIONS,
    # The exact sampler refuses free-threaded builds (tested elsewhere): nothing keys there.
    pytest.mark.skipif(not _BUILT_FOR_THIS, reason="free-threaded build: no exact sampler"),
]
_T = TypeVar("_T")
_Stacks = tuple[tuple[Frame, ...], tuple[Frame, ...]]


def _needs_key() -> Callable[[FrameType, int], bytes | None]:
    key = _signal._c_stack_key
    # Built by the editable install wherever the memory sampler runs: missing is a failure.
    assert key is not None, "spanprof._profiling._samplers._alloc.stack_key is not available"
    return key


def _recurse(n: int, then: Callable[[FrameType], _T]) -> _T:
    """``then(frame)`` called ``n`` frames deeper: the frames are running while it looks."""
    if n:
        return _recurse(n - 1, then)
    return then(sys._getframe())


def _walked_and_keyed(frame: FrameType) -> _Stacks:
    """The stack the Python walk interns for ``frame``, and the one the keyed path hands back
    (checked against the C walk's, on tables of its own)."""
    sampler = Sampler(sample_rate=1)
    tables = StackTables()
    walked = tables.stacks[tables.stack_of(sampler._frame_ids_python(tables, frame))]
    keyed = tables.stacks[sampler._stack_id(tables, frame)]  # a miss: walks, then caches
    again = tables.stacks[sampler._stack_id(tables, frame)]  # a hit
    assert sampler._keyed, "the keyed path cached nothing"
    assert keyed == again
    fresh = StackTables()
    assert fresh.stacks[fresh.stack_of(sampler._frame_ids(fresh, frame))] == walked
    return walked, keyed


def _depth(frame: FrameType | None) -> int:
    depth = 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def test_a_keyed_stack_is_the_walked_stack() -> None:
    _needs_key()
    walked, keyed = _recurse(10, _walked_and_keyed)
    assert walked == keyed
    assert [f.function for f in walked[:3]] == ["_recurse", "_recurse", "_recurse"]


def test_keys_tell_apart_what_the_walk_tells_apart() -> None:
    """Same code at another instruction, another depth: other keys; as long as the walk."""
    key = _needs_key()
    here = sys._getframe()
    first = key(here, MAX_DEPTH)
    second = key(here, MAX_DEPTH)  # the same frame, at a later instruction
    assert first is not None
    assert second is not None
    assert first != second
    assert first[16:] == second[16:]  # the callers have not moved
    shallow = _recurse(1, lambda f: key(f, MAX_DEPTH))
    deep = _recurse(2, lambda f: key(f, MAX_DEPTH))
    assert shallow != deep
    # One frame is 16 bytes; the key stops at max_frames like the walk, or at the stack's end.
    assert _recurse(2, lambda f: len(key(f, 1) or b"")) == 16
    assert _recurse(2, lambda f: key(f, 0)) == b""
    lengths = _recurse(2, lambda f: (len(key(f, MAX_DEPTH) or b""), _depth(f)))
    assert lengths[0] == 16 * lengths[1]


def test_a_stack_deeper_than_the_limit_keys_and_walks_alike() -> None:
    """Past MAX_DEPTH both stop: stacks that differ only beyond it are one stack to both."""
    key = _needs_key()
    walked, keyed = _recurse(MAX_DEPTH + 20, _walked_and_keyed)
    assert walked == keyed
    assert len(walked) == MAX_DEPTH
    assert _recurse(MAX_DEPTH + 20, lambda f: len(key(f, MAX_DEPTH) or b"")) == 16 * MAX_DEPTH


def _generator() -> Iterator[_Stacks]:
    yield _walked_and_keyed(sys._getframe())


async def _coroutine() -> _Stacks:
    await asyncio.sleep(0)
    return _walked_and_keyed(sys._getframe())


def test_generator_and_coroutine_frames_key_like_they_walk() -> None:
    _needs_key()
    walked, keyed = next(_generator())
    assert walked == keyed
    assert walked[0].function == "_generator"
    walked, keyed = asyncio.run(_coroutine())
    assert walked == keyed
    assert walked[0].function == "_coroutine"


def test_a_frame_that_returned_is_walked_not_keyed() -> None:
    """Its copy has no link to its caller any more (3.11+): the key would be short."""
    key = _needs_key()
    done = _recurse(1, lambda f: f)
    assert isinstance(done, FrameType)
    if sys.version_info >= (3, 11):
        assert key(done, MAX_DEPTH) is None
    sampler = Sampler(sample_rate=1)
    tables = StackTables()
    assert tables.stacks[sampler._stack_id(tables, done)][0].function == "_recurse"


def test_the_cache_is_only_good_for_its_tables() -> None:
    """A key names code addresses, which only the tables that interned them keep: new tables
    start an empty cache."""
    _needs_key()
    sampler = Sampler(sample_rate=1)
    old, new = StackTables(), StackTables()

    def twice(frame: FrameType) -> tuple[int, int]:
        return sampler._stack_id(old, frame), sampler._stack_id(new, frame)

    _old_sid, new_sid = _recurse(3, twice)
    assert sampler._keyed_tables is new
    assert list(sampler._keyed.values()) == [new_sid]
    assert new.stacks[new_sid] == old.stacks[0]


def _needs_frame_ids() -> Callable[..., object]:
    frame_ids = _signal._c_stack_frame_ids
    assert frame_ids is not None, "_alloc.stack_frame_ids is not available"
    return frame_ids


def test_the_c_walk_hands_back_frames_it_has_no_id_for() -> None:
    """A frame the tables have not interned comes back as (code, lasti, line), in its place:
    the line the Python walk reads from it."""
    frame_ids = _needs_frame_ids()

    def look(frame: FrameType) -> None:
        tables = StackTables()
        sampler = Sampler(sample_rate=1)
        caller = frame.f_back
        assert caller is not None
        # Intern the callers only: the leaf is the one frame without an id.
        known = sampler._frame_ids_python(tables, caller)
        found = frame_ids(caller, MAX_DEPTH, tables.frame_ids)
        assert found == known
        found = frame_ids(frame, MAX_DEPTH, tables.frame_ids)
        assert isinstance(found, list)
        assert found[1:] == list(known)
        assert found[0] == (frame.f_code, frame.f_lasti, frame.f_lineno)
        assert frame_ids(frame, 2, tables.frame_ids)[1:] == list(known[:1])  # type: ignore[index]

    _recurse(3, look)


def test_a_new_leaf_under_known_callers_is_the_walked_stack() -> None:
    """The second sample of a frame at another instruction reuses its callers' ids: only the
    leaf is looked up, and the stack is the one the walk finds."""
    _needs_key()
    sampler = Sampler(sample_rate=1)
    tables = StackTables()

    def look(frame: FrameType) -> tuple[tuple[Frame, ...], tuple[Frame, ...]]:
        keyed = tables.stacks[sampler._stack_id(tables, frame)]
        other = StackTables()
        return keyed, other.stacks[other.stack_of(sampler._frame_ids_python(other, frame))]

    def twice(_frame: FrameType) -> tuple[_Stacks, _Stacks]:
        # The running frame, at two instructions (two lines) of its own.
        first = look(sys._getframe())
        second = look(sys._getframe())
        return first, second

    (first, first_walked), (second, second_walked) = _recurse(4, twice)
    assert first == first_walked
    assert second == second_walked
    assert first[1:] == second[1:]
    assert first[0] != second[0]  # another line of the same function
    assert len(sampler._keyed) == 2
    assert len(sampler._callers) == 1  # the second leaf found its callers cached


def test_stack_key_refuses_what_is_not_a_frame() -> None:
    key = _needs_key()
    with pytest.raises(TypeError):
        key("frame", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_frames"):
        key(sys._getframe(), MAX_DEPTH + 1)
    frame_ids = _needs_frame_ids()
    with pytest.raises(TypeError):
        frame_ids(sys._getframe(), 3)
    with pytest.raises(TypeError, match="dict"):
        frame_ids(sys._getframe(), 3, [])
    with pytest.raises(ValueError, match="max_frames"):
        frame_ids(sys._getframe(), -1, {})


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.architecture()[0] == "64bit"),
    reason="timer_arm is built for 64-bit Linux only (ctypes elsewhere)",
)
def test_the_timer_is_re_armed_in_c_where_it_can_be() -> None:
    """The handler re-arms on every tick: through ctypes that cost several microseconds."""
    assert _BUILT_FOR_THIS
    assert _timer._c_timer_arm is not None
