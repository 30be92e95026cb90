"""Location ids shared from one profile to the next (``SharedLocations``).

A stack met in an earlier window keeps its encoded location ids; each profile still carries
exactly the locations, functions and strings its samples use, and reads back (with our
decoder and with ``go tool pprof``) as the same samples as a profile with private ids.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from spanprof._labels._labelset import LabelSet
from spanprof._profiling._encoders._memory import MemoryEncoder
from spanprof._profiling._encoders._pprof import (
    ProfileBuilder,
    SharedLocations,
    decode_profile,
    next_slice,
)
from spanprof._profiling._encoders._protowire import (
    as_bytes,
    as_int,
    as_str,
    iter_fields,
    unpack_varints,
)
from spanprof._profiling._encoders._window import WindowEncoder
from spanprof._profiling._window import Frame, MemoryWindow, StackTables, Window

from .conftest import require
from .exporting import timed_steps

A = (Frame("leaf_a", "a.py", 3), Frame("mid", "m.py", 10), Frame("root", "r.py", 1))
B = (Frame("leaf_b", "b.py", 7), Frame("mid", "m.py", 10), Frame("root", "r.py", 1))
C = (Frame("leaf_c", "c.py", 9), Frame("root", "r.py", 1))


def _tables(*stacks: tuple[Frame, ...]) -> tuple[StackTables, list[int]]:
    tables = StackTables()
    sids = []
    for stack in stacks:
        ids = []
        for frame in stack:
            ids.append(len(tables.frames))
            tables.frames.append(frame)
        sids.append(tables.add_stack(tuple(ids)))
    return tables, sids


def _span(n: int) -> LabelSet:
    return LabelSet({"span_id": f"{n:016x}", "span_name": "GET /x"})


def _encode(
    window: Window, locations: SharedLocations | None, max_samples: int = 32
) -> list[bytes]:
    encoder = WindowEncoder(
        window, period_ns=10_000_000, max_samples=max_samples, locations=locations
    )
    while not encoder.step():
        pass
    return encoder.profiles


def _samples(
    profiles: list[bytes],
) -> list[tuple[tuple[Frame, ...], int, tuple[tuple[str, str], ...]]]:
    out = []
    for raw in profiles:
        for s in decode_profile(raw).samples:
            out.append((tuple(s.stack), s.values[0], tuple(sorted(s.labels))))
    return sorted(out)


def _tables_of(raw: bytes) -> tuple[set[int], set[int], set[int], set[int], list[str]]:
    """The profile's location ids, the ids its samples use, function ids, the function ids
    its locations use, and its string table."""
    locations: set[int] = set()
    used: set[int] = set()
    functions: set[int] = set()
    used_functions: set[int] = set()
    strings: list[str] = []
    for field, _wire, value in iter_fields(raw):
        if field == 2:
            for f, _w, v in iter_fields(as_bytes(value)):
                if f == 1:
                    used.update(unpack_varints(v))
        elif field == 4:
            for f, _w, v in iter_fields(as_bytes(value)):
                if f == 1:
                    locations.add(as_int(v))
                elif f == 4:
                    used_functions.update(
                        as_int(lv) for lf, _lw, lv in iter_fields(as_bytes(v)) if lf == 1
                    )
        elif field == 5:
            functions.update(as_int(v) for f, _w, v in iter_fields(as_bytes(value)) if f == 1)
        elif field == 6:
            strings.append(as_str(value))
    return locations, used, functions, used_functions, strings


def test_shared_ids_read_back_as_private_ids_do_across_windows() -> None:
    """Two windows through one SharedLocations decode to the same samples as private ids."""
    tables, (a, b, c) = _tables(A, B, C)
    first = Window(0, tables, values={(a, _span(1)): 10, (b, _span(2)): 20, (c, _span(3)): 5})
    second = Window(1, tables, values={(b, _span(4)): 7, (a, _span(5)): 3})
    shared = SharedLocations()
    for window in (first, second):
        assert _samples(_encode(window, shared)) == _samples(_encode(window, None))
    # Split into one-sample profiles, every profile still stands alone.
    assert _samples(_encode(first, shared, max_samples=1)) == _samples(_encode(first, None))


def test_a_stack_met_before_is_not_encoded_again() -> None:
    """The second window's stacks were the first's: no location is added for them."""
    tables, (a, b, _c) = _tables(A, B, C)
    shared = SharedLocations()
    _encode(Window(0, tables, values={(a, _span(1)): 1, (b, _span(2)): 1}), shared)
    known = len(shared)
    assert known == 4  # leaf_a, leaf_b, mid, root
    calls = []
    original = shared._location_id

    def counting(frame: Frame) -> int:
        calls.append(frame)
        return original(frame)

    shared._location_id = counting  # type: ignore[method-assign]
    profiles = _encode(Window(1, tables, values={(b, _span(n)): n for n in range(1, 50)}), shared)
    assert calls == []
    assert len(shared) == known
    assert len(_samples(profiles)) == 49


def test_each_profile_carries_only_what_its_samples_use() -> None:
    """Sparse shared ids: a profile's locations are exactly those its samples reference,
    its functions exactly those its locations reference, and its strings are its own."""
    tables, (a, _b, c) = _tables(A, B, C)
    shared = SharedLocations()
    _encode(Window(0, tables, values={(a, _span(1)): 1}), shared)
    (raw,) = _encode(Window(1, tables, values={(c, _span(2)): 1}), shared)
    locations, used, functions, used_functions, strings = _tables_of(raw)
    assert locations == used == {shared._locations[f] for f in C}
    assert functions == used_functions
    assert len(functions) == 2
    assert "leaf_a" not in strings
    assert "a.py" not in strings
    assert {"leaf_c", "c.py", "root", "r.py"} <= set(strings)
    assert len(strings) == len(set(strings))


def test_memory_profiles_share_ids_too() -> None:
    """MemoryEncoder: allocation and in-use values come back whole with shared ids."""
    tables, (a, b, _c) = _tables(A, B, C)
    window = MemoryWindow(
        0,
        tables,
        values={(a, _span(1)): 4096, (b, _span(2)): 8192},
        end_ns=5,
        alloc_objects={(a, _span(1)): 4, (b, _span(2)): 8},
        inuse={(b, _span(2)): (2, 2048)},
    )
    shared = SharedLocations()
    decoded = []
    for locations in (shared, shared, None):
        encoder = MemoryEncoder(window, period=524288, locations=locations)
        while not encoder.step():
            pass
        decoded.append(
            sorted(
                (tuple(s.stack), s.values, tuple(sorted(s.labels)))
                for raw in encoder.profiles
                for s in decode_profile(raw).samples
            )
        )
    assert decoded[0] == decoded[1] == decoded[2]
    assert (B, (8, 8192, 2, 2048)) in [(stack, values) for stack, values, _ in decoded[0]]


def test_another_live_thread_keeps_its_claim() -> None:
    """While one live thread holds the ids, another encodes with private ids; once that
    thread is gone, the ids pass on."""
    shared = SharedLocations()
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        assert shared.claim() is shared
        holding.set()
        release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(10)
        assert shared.claim() is None
        tables, (a,) = _tables(A)
        window = Window(0, tables, values={(a, _span(1)): 1})
        assert _samples(_encode(window, shared)) == _samples(_encode(window, None))
        assert len(shared) == 0, "the private encode left the shared ids alone"
    finally:
        release.set()
        thread.join(10)
    assert shared.claim() is shared


def test_ids_are_forgotten_past_their_bounds_at_a_claim() -> None:
    """Past max_locations or max_stacks the next claim starts afresh: memory stays bounded."""
    shared = SharedLocations(max_locations=3, max_stacks=100)
    tables, (a, b, c) = _tables(A, B, C)
    window = Window(0, tables, values={(a, _span(1)): 1, (b, _span(2)): 1, (c, _span(3)): 1})
    assert _samples(_encode(window, shared)) == _samples(_encode(window, None))
    assert len(shared) == 5
    assert shared.clears == 0
    assert _samples(_encode(window, shared)) == _samples(_encode(window, None))
    assert shared.clears == 1
    assert len(shared) == 5
    many = SharedLocations(max_locations=1000, max_stacks=1)
    _encode(window, many)
    _encode(window, many)
    assert many.clears == 1


def test_go_tool_pprof_reads_profiles_with_shared_ids(tmp_path: Path) -> None:
    """go tool pprof reads a second window's profile, whose location ids are sparse."""
    go = shutil.which("go")
    require(go is not None, "go tool pprof (Debian's golang-go) is not installed")
    assert go is not None
    tables, (a, b, c) = _tables(A, B, C)
    shared = SharedLocations()
    _encode(Window(0, tables, values={(a, _span(1)): 1, (b, _span(2)): 1}), shared)
    (raw,) = _encode(Window(1, tables, values={(c, _span(3)): 30_000_000}), shared)
    assert min(_tables_of(raw)[0]) > 1, "the ids are not the dense ids of a private table"
    path = tmp_path / "cpu.pb"
    path.write_bytes(raw)
    env = {**os.environ, "HOME": str(tmp_path), "GOTOOLCHAIN": "local"}
    result = subprocess.run(
        [go, "tool", "pprof", "-top", "-nodecount=10", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    flat = {line[-1]: line[0] for line in lines if line and line[-1] in ("leaf_c", "root")}
    assert flat.get("leaf_c") == "30ms", result.stdout


@pytest.mark.parametrize("locations", [None, "shared"])
def test_labels_and_values_merge_as_before(locations: str | None) -> None:
    """Same stack, same labels: one sample, values summed, with either kind of ids."""
    tables, (a,) = _tables(A)
    labels = _span(1)
    window = Window(0, tables, values={(a, labels): 5})
    shared = SharedLocations() if locations else None
    encoder = WindowEncoder(window, period_ns=1, locations=shared)
    encoder.step()
    encoder._builder.add(A, 7, labels.items_tuple)
    encoder._builder.add(A, 1, labels.items_tuple)
    while not encoder.step():
        pass
    ((stack, value, _),) = _samples(encoder.profiles)
    assert (stack, value) == (A, 13)


@pytest.mark.parametrize(("max_samples", "profiles"), [(None, 1), (1000, 3)])
def test_a_big_memory_window_is_written_in_short_slices(
    max_samples: int | None, profiles: int
) -> None:
    """3,000 distinct memory samples: steps of < 2 ms CPU, one profile written a slice at a
    time (or one per max_samples), nothing lost."""

    def make() -> MemoryEncoder:
        tables, sids = _tables(A, B, C)
        keys = [(sids[n % 3], _span(n)) for n in range(3000)]
        window = MemoryWindow(
            0,
            tables,
            values={key: 1000 + n for n, key in enumerate(keys)},
            end_ns=5,
            alloc_objects=dict.fromkeys(keys, 1),
        )
        shared = SharedLocations()
        if max_samples is None:
            return MemoryEncoder(window, period=524288, locations=shared)
        return MemoryEncoder(window, period=524288, locations=shared, max_samples=max_samples)

    encoder, longest, steps = timed_steps(make)
    assert longest < 2_000_000
    assert steps > 1
    assert len(encoder.profiles) == profiles
    decoded = [s for raw in encoder.profiles for s in decode_profile(raw).samples]
    assert len(decoded) == 3000
    assert sum(s.values[1] for s in decoded) == sum(1000 + n for n in range(3000))


@pytest.mark.parametrize("locations", [None, "shared"])
def test_a_released_builder_wrote_the_same_profile_and_holds_nothing(
    locations: str | None,
) -> None:
    """build_in_slices(release=True) frees the builder's samples and tables in slices
    (freeing a big profile's objects at once is a long GIL hold): same bytes as build()."""
    shared = SharedLocations() if locations else None
    profiles = []
    for release in (False, True):
        builder = ProfileBuilder(locations=shared)
        for n in range(600):
            builder.add((A, B, C)[n % 3], n + 1, _span(n).items_tuple)
        slices = builder.build_in_slices(time_nanos=5, budget_ns=1, release=release)
        steps = 0
        while (profile := next_slice(slices)) is None:
            steps += 1
        profiles.append(profile)
        assert steps > 1
        assert (len(builder), len(builder._label_cache), len(builder._sample_index)) == (
            (600, 601, 600) if not release else (0, 0, 0)
        )
    assert profiles[0] == profiles[1]
    assert len(decode_profile(profiles[1]).samples) == 600
