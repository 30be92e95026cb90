"""The allocation sampler: rate, labels at allocation, in-use, bounds, re-entrancy, the hooks."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice, repeat
from typing import Any

import pytest

from spanprof._labels._labelset import EMPTY, LABELS, LabelSet
from spanprof._profiling._samplers._memory import (
    MemorySampler,
    MemorySamplerUnavailable,
    ignore_profiler_thread,
    memory_unavailable_reason,
)
from spanprof._profiling._window import MemoryWindow

from .conftest import ALLOC_INDICES, IN_CI, MEMORY_VERSIONS, require

pytestmark = [pytest.mark.engine, MEMORY_VERSIONS]

# Every object below is a bytes object of this many bytes of payload; the allocator sees its
# whole size (header included), which sys.getsizeof reports.
PAYLOAD = 1000
BLOCK = sys.getsizeof(bytes(PAYLOAD))


def _available() -> None:
    reason = memory_unavailable_reason()
    # Under CI the extension must be built (gcc is in .ci/run's packages).
    built = importlib.util.find_spec("spanprof._profiling._samplers._alloc") is not None
    if reason is not None and IN_CI and not built:
        pytest.fail(f"missing under CI: {reason}")
    require(reason is None, reason or "")


@contextmanager
def sampling(**options: object) -> Iterator[MemorySampler]:
    """A started sampler (seeded, never drained by its thread unless asked), stopped after."""
    _available()
    options.setdefault("seed", 12345)
    options.setdefault("drain_interval", 3600.0)
    sampler = MemorySampler(**options)  # type: ignore[arg-type]
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()


def by_function(window: MemoryWindow, function: str) -> dict[LabelSet, list[float]]:
    """[alloc objects, alloc bytes, inuse objects, inuse bytes] per labels, for samples whose
    leaf-most Python frame is ``function``."""
    out: dict[LabelSet, list[float]] = {}
    for key in window.values.keys() | window.inuse.keys():
        # Before 3.12 a list comprehension runs in a frame of its own: skip it.
        stack = [f for f in window.stack(key[0]) if not f.function.endswith("<listcomp>")]
        if not stack or stack[0].function != function:
            continue
        row = out.setdefault(key[1], [0.0, 0.0, 0.0, 0.0])
        row[0] += window.alloc_objects.get(key, 0)
        row[1] += window.values.get(key, 0)
        inuse = window.inuse.get(key, (0, 0))
        row[2] += inuse[0]
        row[3] += inuse[1]
    return out


def total(rows: dict[LabelSet, list[float]], column: int) -> float:
    return sum(row[column] for row in rows.values())


# --- the functions that allocate (their names are what the tests look for in stacks) -----------


# repeat(None, n) yields without allocating (range would allocate an int per step), so these
# functions allocate their blocks and (when they keep them) a list's array only.
# The list's array goes through PyMem (sampled on 3.12+): grown by appends it is reallocated
# about 90 times for 20,000 items, 7% over the blocks' bytes; so the lists whose allocated
# bytes are counted against a truth are made at their full size first (one array, 0.8%),
# filled through indices made once at import (ALLOC_INDICES).
LIST_OVERHEAD = 0.03


def churn(count: int) -> None:
    for _ in repeat(None, count):
        bytes(PAYLOAD)


def keep_blocks(count: int) -> list[bytes]:
    # A comprehension: counted in use only, where the grown array's old copies are gone.
    return [bytes(PAYLOAD) for _ in repeat(None, count)]


def drop_blocks(count: int) -> None:
    blocks = [b""] * count
    for i in islice(ALLOC_INDICES, count):
        blocks[i] = bytes(PAYLOAD)
    del blocks


def big_blocks(count: int, size: int) -> None:
    for _ in repeat(None, count):
        bytes(size)


def task_a_allocates(count: int) -> list[bytes]:
    return [bytes(PAYLOAD) for _ in repeat(None, count)]


def task_b_allocates(count: int) -> list[bytes]:
    return [bytes(PAYLOAD) for _ in repeat(None, count)]


def warm_up() -> None:
    """Call the allocating functions once unsampled. On 3.10 a function's first call leaves its
    frame on its code object for the next call ("zombie frame"): sampled, that frame would stay
    in use for good, under the function's caller."""
    keep_blocks(1)
    drop_blocks(1)


# --- tests --------------------------------------------------------------------------------------


def bound(expected_samples: float, sigmas: float = 4.0) -> float:
    """Relative error an estimate from ``expected_samples`` samples stays within."""
    return sigmas / math.sqrt(expected_samples)


def test_a_profiler_thread_is_ignored_before_its_own_check_allocates() -> None:
    """ignore_profiler_thread() samples none of its own allocations, even with every block
    sampled (its check of the OS thread allocates two ints); the main thread stays sampled."""
    with sampling(sample_bytes=1, max_samples=100_000) as sampler:
        worker = threading.Thread(target=ignore_profiler_thread)
        worker.start()
        worker.join()
        ignore_profiler_thread()  # the main OS thread: left sampled
        churn(100)
        window = sampler.take_window()
    functions = {f.function for key in window.values for f in window.stack(key[0])}
    assert "ignore_profiler_thread" not in functions
    assert "in_main_os_thread" not in functions
    assert "churn" in functions


@pytest.mark.parametrize("mean", [16 * 1024, 512 * 1024])
def test_estimates_match_the_bytes_and_objects_allocated(mean: int) -> None:
    """Allocated bytes and objects, scaled from the samples, are within 4 sigma of the truth."""
    count = 200_000 if mean > 100_000 else 40_000
    with sampling(sample_bytes=mean) as sampler:
        churn(count)
        window = sampler.take_window()
        stats = sampler.stats()
    rows = by_function(window, "churn")
    truth_bytes = count * BLOCK
    p = -math.expm1(-BLOCK / mean)
    tolerance = bound(count * p)
    assert stats["dropped"] == 0, stats
    assert total(rows, 1) == pytest.approx(truth_bytes, rel=tolerance), (rows, stats)
    assert total(rows, 0) == pytest.approx(count, rel=tolerance), (rows, stats)


def test_large_blocks_are_weighted_by_their_sampling_probability() -> None:
    """Blocks larger than the mean are sampled most of the time, and weighted 1/p, not S/R."""
    size, count, mean = 1 << 20, 400, 512 * 1024
    with sampling(sample_bytes=mean) as sampler:
        big_blocks(count, size)
        window = sampler.take_window()
    rows = by_function(window, "big_blocks")
    p = -math.expm1(-(size + 33) / mean)
    tolerance = bound(count * p / (1 - p))
    assert total(rows, 0) == pytest.approx(count, rel=tolerance), rows
    assert total(rows, 1) == pytest.approx(count * (size + 33), rel=tolerance), rows


def test_unsampled_rate_is_what_the_mean_says() -> None:
    """The number of samples over many small blocks is Poisson with mean allocated / R."""
    count, mean = 100_000, 64 * 1024
    with sampling(sample_bytes=mean) as sampler:
        churn(count)
        window = sampler.take_window()
    samples = sum(1 for key in window.values if window.stack(key[0])[0].function == "churn")
    # Each sample of a 1 KB block weighs ~1/p objects; count the samples back from the weights.
    p = -math.expm1(-BLOCK / mean)
    expected = count * p
    estimated_samples = total(by_function(window, "churn"), 0) * p
    assert samples >= 1
    assert estimated_samples == pytest.approx(expected, abs=4 * math.sqrt(expected))


def test_freed_blocks_leave_in_use_and_kept_ones_stay() -> None:
    """In-use shows the blocks still referenced, not the ones already freed."""
    warm_up()
    with sampling(sample_bytes=8 * 1024) as sampler:
        kept = keep_blocks(20_000)
        drop_blocks(20_000)
        window = sampler.take_window()
        kept_rows = by_function(window, "keep_blocks")
        dropped_rows = by_function(window, "drop_blocks")
        truth = len(kept) * BLOCK
        p = -math.expm1(-BLOCK / (8 * 1024))
        tolerance = bound(len(kept) * p) + LIST_OVERHEAD
        assert total(kept_rows, 3) == pytest.approx(truth, rel=tolerance), kept_rows
        assert total(dropped_rows, 1) == pytest.approx(truth, rel=tolerance), dropped_rows
        # Freed, all but (on 3.10) a frame, which CPython keeps on its code
        # object for the next call ("zombie frame"): one sample of ~400 bytes, now and then.
        # So what is left is no payload block: its bytes per object are a frame's, not BLOCK.
        left_objects, left_bytes = total(dropped_rows, 2), total(dropped_rows, 3)
        assert left_bytes <= 0.001 * truth, dropped_rows
        assert left_bytes == 0 or left_bytes / left_objects < BLOCK / 2, dropped_rows
        # Allocation values are per window; in-use is a snapshot, and follows frees.
        del kept
        later = sampler.take_window()
    assert total(by_function(later, "keep_blocks"), 1) == 0
    assert total(by_function(later, "keep_blocks"), 3) == 0


def small_churn(count: int) -> None:
    for _ in repeat(None, count):
        bytes(100)  # a pymalloc block (512 bytes or less), unlike PAYLOAD's


def test_a_freed_sample_leaves_no_filter_bit_behind() -> None:
    """pymalloc hands a freed block's address straight back out: once a sampled block is freed,
    the blocks given its address after it must not each look in the in-use table."""
    with sampling(sample_bytes=16 * 1024) as sampler:
        kept = keep_blocks(2_000)  # about 130 tracked: the free path consults the filter
        before = sampler.stats()
        small_churn(200_000)
        after = sampler.stats()
        assert after["tracked"] > 0, after
        sampled = after["samples"] - before["samples"]
        probes = after["probes"] - before["probes"]
        # Each sampled block's own free probes, and a few others share a tracked bit: with a
        # bit left set, nearly every one of the 200,000 frees would.
        assert 0 < sampled < 5_000, (before, after)
        assert probes < sampled + 5_000, (sampled, probes)
        del kept


def test_frees_of_tracked_blocks_that_share_a_filter_bit_are_all_seen() -> None:
    """The free path's filter maps many addresses to one bit. Freeing one tracked block of a
    bit must leave the bit set for the others, or their frees go unseen and in-use keeps them."""
    # 64 bits for 4,000 tracked blocks: every bit is shared by dozens.
    warm_up()
    with sampling(sample_bytes=1, filter_bits=6, max_samples=50_000) as sampler:
        kept = keep_blocks(4_000)
        del kept[::2]  # frees every other block: each of their bits has kept blocks too
        half = sampler.take_window()
        kept_rows = by_function(half, "keep_blocks")
        # Every block is sampled (weight 1 / (1 - exp(-BLOCK)) = 1).
        assert total(kept_rows, 2) == len(kept) == 2_000, kept_rows
        assert total(kept_rows, 3) == len(kept) * BLOCK, kept_rows
        del kept
        later = sampler.take_window()
        stats = sampler.stats()
    assert total(by_function(later, "keep_blocks"), 2) == 0, stats
    assert total(by_function(later, "keep_blocks"), 3) == 0, stats


_FREES_SCRIPT = """
import sys
from itertools import repeat
from spanprof._profiling._samplers._memory import MemorySampler

def small(count):
    return [bytes(100) for _ in repeat(None, count)]  # pymalloc blocks (512 bytes or less)

small(10)
sampler = MemorySampler(sample_bytes=1, max_samples=100_000, drain_interval=3600.0, seed=7)
sampler.start()
try:
    before = sampler.stats()["tracked"]
    kept = small(4000)
    dropped = small(4000)
    with_both = sampler.stats()["tracked"]
    del dropped
    after_drop = sampler.stats()["tracked"]
    del kept
    after_all = sampler.stats()["tracked"]
    mode = sampler.stats()["frees_via_raw"]
    sampler.take_window()
finally:
    sampler.stop()
print(int(mode), int(with_both - before), int(with_both - after_drop), int(with_both - after_all))
"""


@pytest.mark.parametrize(
    ("allocator", "via_raw"), [(None, 1), ("malloc", 0), ("pymalloc_debug", 0), ("debug", 0)]
)
def test_every_sampled_small_block_is_seen_freed_under_each_allocator(
    allocator: str | None, via_raw: int
) -> None:
    """Under the default allocators a sampled block is asked for past pymalloc's pools, so that
    its free reaches the RAW hook; under any other (PYTHONMALLOC) the free hooks stay. Either
    way every sampled pymalloc-sized block that is freed leaves the in-use table."""
    _available()
    env = dict(os.environ)
    env.pop("PYTHONMALLOC", None)
    if allocator is not None:
        env["PYTHONMALLOC"] = allocator
    result = subprocess.run(
        [sys.executable, "-c", _FREES_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    mode, tracked, freed_half, freed_all = map(int, result.stdout.split())
    assert mode == via_raw, result.stdout
    # Every block is sampled (1 byte on average between samples): 8,000 blocks, and the two
    # lists' arrays and the interpreter's own blocks around them. The counts between are
    # taken by calls that allocate (and keep) a few blocks of their own; an unseen free would
    # keep one of the 4,000 in the table each.
    assert tracked >= 8000, result.stdout
    assert freed_half >= 3990, result.stdout
    assert freed_all >= 7980, result.stdout


def test_frees_without_the_gil_never_touch_the_table() -> None:
    """RAW is called by threads that do not hold the GIL (ctypes releases it around a call).
    With every filter bit set, each of their frees passes the filter, and must still leave the
    table (guarded by the GIL) alone: no probe, and every tracked block still tracked."""
    _available()
    import ctypes

    libc_view = ctypes.CDLL(None)  # a CDLL call runs without the GIL
    raw_malloc, raw_free = libc_view.PyMem_RawMalloc, libc_view.PyMem_RawFree
    raw_malloc.restype, raw_malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    raw_free.restype, raw_free.argtypes = None, [ctypes.c_void_p]
    calls = 5000

    def churn_raw() -> None:
        for _ in repeat(None, calls):
            raw_free(raw_malloc(700))

    warm_up()
    with sampling(sample_bytes=4096, filter_bits=6) as sampler:
        kept = keep_blocks(2_000)  # 64 filter bits, about 500 tracked blocks: all set
        before = sampler.stats()
        assert before["tracked"] > 300, before
        threads = [threading.Thread(target=churn_raw) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = sampler.stats()
        assert after["frees_via_raw"] == 1
        # The threads' own Python code (with the GIL) has a few hundred blocks sampled and
        # freed; without the guard each of their 20,000 GIL-less frees would probe too.
        assert after["probes"] - before["probes"] < calls, (before, after)
        assert after["tracked"] >= before["tracked"], (before, after)
        del kept


def test_sampled_blocks_keep_the_interpreters_block_count() -> None:
    """Sampled blocks are still asked of pymalloc (which hands them to RAW and counts them):
    sys.getallocatedblocks() is the same before sampling and after, however many were sampled
    (a sampled block allocated around pymalloc would be counted freed but never allocated)."""
    warm_up()

    def sampled_round() -> tuple[float, int]:
        gc.collect()
        before = sys.getallocatedblocks()
        with sampling(sample_bytes=1, max_samples=100_000) as sampler:
            small_churn(50_000)
            sampled = sampler.stats()["samples"]
            sampler.take_window()
        gc.collect()
        return sampled, sys.getallocatedblocks() - before

    # The first round grows the sampler's own tables and caches (about 1,000 blocks on 3.10 and
    # 3.11, once); the second measures the steady state, where the bug would drift by one block a
    # sample.
    sampled_round()
    sampled, drift = sampled_round()
    assert sampled >= 50_000
    assert abs(drift) < sampled / 20, drift


_SUBINTERPRETER_SCRIPT = """
import gc, sys
try:
    import _interpreters as interpreters  # 3.13+
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.10-3.12
from spanprof._profiling._samplers._memory import MemorySampler

def main_alloc():
    return [bytes(1000) for _ in range(3000)]

sampler = MemorySampler(sample_bytes=4096, drain_interval=3600, max_samples=100000, seed=1)
sampler.start()
kept = main_alloc()
interp = interpreters.create()
run = getattr(interpreters, "run_string", None) or interpreters.exec
code = "def sub_alloc():\\n    return [bytes(1000) for _ in range(3000)]\\n"
run(interp, code + "x = sub_alloc()\\ndel x\\n")
interpreters.destroy(interp)
gc.collect()
window = sampler.take_window()
sampler.stop()

def booked(function):
    return sum(
        value for (sid, _), value in window.values.items()
        if any(frame.function == function for frame in window.stack(sid))
    )

def in_use(function):
    return sum(
        nbytes for (sid, _), (_, nbytes) in window.inuse.items()
        if any(frame.function == function for frame in window.stack(sid))
    )

print(round(booked("main_alloc")), round(booked("sub_alloc")), round(in_use("sub_alloc")))
"""


def test_a_subinterpreters_allocations_are_not_sampled() -> None:
    """Before 3.12 every interpreter shares one GIL, and the hooks took any interpreter's
    allocations for the main one's: a subinterpreter's blocks were sampled, but their frees
    never seen (the GIL check compares with the main interpreter's thread state), so they
    stayed in use for good, about 3 MB of 3 MB freed, holding slots of the tracked table."""
    _available()
    result = subprocess.run(
        [sys.executable, "-c", _SUBINTERPRETER_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    main_bytes, sub_bytes, sub_in_use = map(int, result.stdout.split())
    assert main_bytes > 1_000_000  # the main interpreter's ~3 MB are sampled
    assert (sub_bytes, sub_in_use) == (0, 0)


def test_labels_are_the_allocating_tasks_while_tasks_interleave() -> None:
    """Two asyncio tasks take turns every few blocks: each sample carries its own task's labels."""
    a = LabelSet({"span_id": "a" * 16})
    b = LabelSet({"span_id": "b" * 16})

    async def run(labels: LabelSet, allocate: Callable[[int], list[bytes]]) -> list[bytes]:
        LABELS.set(labels)  # the task's own context copy
        kept: list[bytes] = []
        for _ in range(400):
            kept += allocate(10)
            await asyncio.sleep(0)
        return kept

    async def main() -> None:
        await asyncio.gather(run(a, task_a_allocates), run(b, task_b_allocates))

    with sampling(sample_bytes=2048) as sampler:
        asyncio.run(main())
        window = sampler.take_window()
    rows_a = by_function(window, "task_a_allocates")
    rows_b = by_function(window, "task_b_allocates")
    assert set(rows_a) == {a}, rows_a
    assert set(rows_b) == {b}, rows_b
    assert total(rows_a, 0) > 1000


def test_labels_are_the_allocating_threads() -> None:
    """Threads switched every 50 µs: each sample carries the labels of the thread that allocated."""
    a = LabelSet({"span_id": "a" * 16})
    b = LabelSet({"span_id": "b" * 16})

    def run(labels: LabelSet, allocate: Callable[[int], list[bytes]]) -> None:
        LABELS.set(labels)
        for _ in range(300):
            allocate(20)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)
    try:
        with sampling(sample_bytes=2048) as sampler:
            threads = [
                threading.Thread(target=run, args=(a, task_a_allocates)),
                threading.Thread(target=run, args=(b, task_b_allocates)),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            window = sampler.take_window()
    finally:
        sys.setswitchinterval(interval)
    rows_a = by_function(window, "task_a_allocates")
    rows_b = by_function(window, "task_b_allocates")
    assert set(rows_a) == {a}, rows_a
    assert set(rows_b) == {b}, rows_b


def test_stack_is_leaf_first_with_lines() -> None:
    """A sample's stack starts at the allocating function and names its callers, with lines."""
    with sampling(sample_bytes=1) as sampler:
        keep = keep_blocks(5)
        window = sampler.take_window()
    stacks = [window.stack(key[0]) for key in window.values]
    mine = [
        [f for f in s if not f.function.endswith("<listcomp>")]
        for s in stacks
        if s and s[0].function.endswith(("keep_blocks", "<listcomp>"))
    ]
    mine = [s for s in mine if s and s[0].function == "keep_blocks"]
    assert mine, stacks[:5]
    assert mine[0][1].function == "test_stack_is_leaf_first_with_lines"
    assert mine[0][0].filename == __file__
    assert mine[0][0].line > keep_blocks.__code__.co_firstlineno
    assert len(keep) == 5


def test_a_stack_an_earlier_drain_met_comes_as_its_key_and_keeps_its_frames() -> None:
    """Samples of a stack the drain's caller knows arrive without their frames; the sampler
    still names that stack in its window."""
    from spanprof._profiling._samplers import _alloc

    warm_up()
    keep: list[bytes] = []
    with sampling(sample_bytes=1) as sampler:
        known: dict[bytes, int] = {}
        drained = []
        for _ in range(2):
            keep += keep_blocks(5)  # one call site: the same stacks both times
            samples, _ = _alloc.drain(known)
            drained.append(samples)
            known.update(dict.fromkeys((sample[7] for sample in samples), 0))
        first, again = drained
        assert first
        assert all(s[4] is not None and s[5] is not None for s in first)
        repeated = [s for s in again if s[7] in {f[7] for f in first}]
        assert repeated, again[:3]
        assert all(s[4] is None and s[5] is None for s in repeated)
        with pytest.raises(TypeError):
            _alloc.drain([])  # type: ignore[arg-type]  # known must be a dict
        # Through the sampler: its first drain interns the stack, the window's drain passes the
        # samples of it as keys alone, and both drains' blocks are there under its name.
        for step in range(2):
            keep += keep_blocks(5)
            if step == 0:
                sampler.drain()
        window = sampler.take_window()
    rows = by_function(window, "keep_blocks")
    assert total(rows, 0) >= 10, rows
    assert len(keep) == 20


def test_blocks_freed_before_a_drain_come_as_one_sample_per_stack_and_label_set() -> None:
    """A block freed before the drain saw it is never in use at a window: the drain hands
    those of one stack and one label set over as one sample, their estimates summed, and
    leaves their frees out; blocks still in use come one by one, tracked, with their ids."""
    from spanprof._profiling._samplers import _alloc

    size = 300_000  # sampled with probability 1 - exp(-size): each stands for one block
    block = sys.getsizeof(bytes(size))  # what bytes(size) asks the allocator for
    span_a, span_b = LabelSet({"span_id": "a"}), LabelSet({"span_id": "b"})
    big_blocks(1, size)
    keep: list[bytes] = []
    with sampling(sample_bytes=1):
        _alloc.drain()
        for labels, count in ((span_a, 7), (span_b, 5)):
            token = LABELS.set(labels)
            try:
                big_blocks(count, size)
                keep += keep_blocks(3)
            finally:
                LABELS.reset(token)
        samples, freed = _alloc.drain({})

        def leaf(sample: _alloc.RawSample) -> str:
            codes = sample[4]
            assert codes is not None  # nothing is known to this drain
            # Before 3.12 a list comprehension runs in a frame of its own: its caller's name.
            return codes[1 if codes[0].co_name == "<listcomp>" else 0].co_name

        big = [s for s in samples if leaf(s) == "big_blocks" and s[1] == block]
        assert sorted((str(s[3]), s[8], s[9], s[2]) for s in big) == [
            (str(span_a), 7.0, 7.0 * block, False),
            (str(span_b), 5.0, 5.0 * block, False),
        ]
        kept = [s for s in samples if leaf(s) == "keep_blocks" and s[1] > PAYLOAD]
        assert len(kept) == 6, kept
        assert all(s[2] for s in kept)  # in use, each with its own id
        drained_ids = {s[0] for s in samples}
        assert not drained_ids & set(freed)  # frees of this drain's blocks are left out
        del keep[:]
        _, freed = _alloc.drain({})
        assert {s[0] for s in kept} <= set(freed)  # a tracked block's free still comes


def test_the_tracked_table_is_bounded_and_counts_what_it_left_out() -> None:
    """Past max_tracked, samples still count as allocated, not in use, and are counted."""
    with sampling(sample_bytes=1, max_tracked=50, max_samples=100_000) as sampler:
        kept = keep_blocks(2000)
        window = sampler.take_window()
        stats = sampler.stats()
    assert stats["tracked"] <= 50, stats
    assert stats["untracked"] >= 1900, stats
    rows = by_function(window, "keep_blocks")
    # Every block is sampled (and, on 3.12+, the list's array each time it grows).
    assert total(rows, 0) == pytest.approx(len(kept), rel=LIST_OVERHEAD)
    assert total(rows, 2) <= 50


def test_a_full_buffer_drops_and_counts_samples() -> None:
    """Samples beyond max_samples between two drains are dropped and counted, not written."""
    with sampling(sample_bytes=1, max_samples=64) as sampler:
        churn(5000)
        stats = sampler.stats()
        window = sampler.take_window()
    assert stats["dropped"] >= 4000, stats
    assert sum(1 for _ in window.values) <= 64 + 8


def test_a_failed_drain_leaves_the_frees_it_had_to_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain that runs out of memory loses its samples (counted), not the frees of blocks
    an earlier drain handed over: those blocks would stay in use for good."""
    try:
        _testcapi: Any = importlib.import_module("_testcapi")
    except ImportError:  # CPython's test module: every build spanprof supports ships it
        _testcapi = None
    require(_testcapi is not None, "CPython's _testcapi module (to fail a drain's allocations)")
    from spanprof._profiling._samplers import _alloc as real
    from spanprof._profiling._samplers import _memory

    failing = {"once": True}

    class FailingDrain:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def drain(self, known: dict[bytes, Any] | None = None) -> object:
            if not failing["once"]:
                return real.drain(known)
            failing["once"] = False
            _testcapi.set_nomemory(0)  # every allocation fails from here
            try:
                return real.drain(known)
            finally:
                _testcapi.remove_mem_hooks()

    warm_up()
    with sampling(sample_bytes=8 * 1024) as sampler:
        kept = keep_blocks(20_000)
        sampler.drain()
        held = total(by_function(sampler.take_window(), "keep_blocks"), 3)
        assert held > 0.5 * len(kept) * BLOCK
        del kept
        monkeypatch.setattr(_memory, "_alloc", FailingDrain())
        sampler.drain()
        monkeypatch.setattr(_memory, "_alloc", real)
        assert sampler.drain_errors == 1
        window = sampler.take_window()
    assert total(by_function(window, "keep_blocks"), 3) == 0


def test_a_long_drain_lets_other_threads_run_and_keeps_every_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain past its time slice yields the GIL every 32 samples; none is skipped."""
    from spanprof._profiling._samplers import _memory

    count = 1000
    yields: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            yields.append(seconds)
        real_sleep(seconds)

    warm_up()
    # The object domain only: on 3.12+ the list's growing array (mem domain) would be sampled
    # too, under the same stack as the blocks.
    with sampling(sample_bytes=1, max_samples=4 * count, mem_domain=False) as sampler:
        blocks = keep_blocks(count)
        monkeypatch.setattr(_memory, "_SLICE_NS", 0)
        monkeypatch.setattr(time, "sleep", sleep)
        sampler.drain()
        monkeypatch.undo()
        window = sampler.take_window()
        stats = sampler.stats()
    rows = by_function(window, "keep_blocks")
    assert stats["dropped"] == 0, stats
    # Sampled at 1 byte, every block is a sample of weight 1 object (and stays in use).
    assert total(rows, 0) == pytest.approx(count, rel=0.01), rows
    assert total(rows, 2) == pytest.approx(count, rel=0.01), rows
    assert len(yields) >= count // 32 - 1, len(yields)
    del blocks


def test_the_samplers_own_allocations_are_not_sampled() -> None:
    """drain() allocates with the guard up: those allocations re-enter the hook unsampled."""
    with sampling(sample_bytes=1) as sampler:
        churn(200)
        sampler.drain()
        sampler.drain()
        window = sampler.take_window()
        stats = sampler.stats()
    assert stats["reentered"] > 0, stats
    functions = {frame.function for key in window.values for frame in window.stack(key[0])}
    assert "churn" in functions
    assert not {"_drain_locked", "_drain_unsampled", "_intern", "take_window"} & functions


def test_stop_restores_the_previous_allocators() -> None:
    """start() wraps the OBJ (and MEM) allocator, and RAW's frees under the default allocators;
    stop() puts exactly the previous ones back."""
    _available()
    alloc = importlib.import_module("spanprof._profiling._samplers._alloc")
    before = [alloc.allocator(domain) for domain in (0, 1, 2)]
    with sampling() as sampler:
        during = [alloc.allocator(domain) for domain in (0, 1, 2)]
        assert sampler.stats()["frees_via_raw"] == 1, "this suite runs the default allocators"
        # RAW: the same ctx, malloc and calloc; its realloc and free are ours.
        assert during[0][:3] == before[0][:3]
        assert during[0][3] != before[0][3]
        assert during[0][4] != before[0][4]
        # OBJ: ours, but for the free, which goes straight to pymalloc.
        assert during[2][1] != before[2][1]
        assert during[2][4] == before[2][4]
        if sys.version_info >= (3, 12):
            assert during[1][1] != before[1][1]
            assert during[1][4] == before[1][4]
        else:
            assert during[1] == before[1]
    assert [alloc.allocator(domain) for domain in (0, 1, 2)] == before


def test_a_hook_installed_over_ours_is_not_cut_off() -> None:
    """With tracemalloc installed after it, stop() leaves its hooks idle in place instead, and
    start() refuses while tracemalloc sits over them. Once tracemalloc is stopped (it puts back
    what it saved: our idle hooks, on top again), start() takes them out and starts afresh."""
    _available()
    script = """
import tracemalloc
from spanprof._profiling._samplers._memory import MemorySampler
from spanprof._profiling._samplers import _alloc
before = _alloc.allocator(2)
sampler = MemorySampler(sample_bytes=1024)
sampler.start()
tracemalloc.start()
sampler.stop()
sampled = _alloc.stats()["samples"]
blocks = [bytes(100) for _ in range(10000)]
assert tracemalloc.get_traced_memory()[0] > 1_000_000
stats = _alloc.stats()
assert stats["stuck"] == 1 and stats["active"] == 0, stats
# Idle: a megabyte through the hooks at one sample per KiB, and none taken.
assert stats["samples"] == sampled, (stats, sampled)
try:
    sampler.start()
except RuntimeError as exc:
    print("refused:", exc)
tracemalloc.stop()
del blocks
sampler.start()
blocks = [bytes(1000) for _ in range(1000)]
window = sampler.take_window()
sampler.stop()
assert sum(window.values.values()) > 0, window.values
assert _alloc.allocator(2) == before
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout
    assert "another allocator hook" in result.stdout
    assert result.stdout.strip().endswith("ok")


_CUT_OFF_SCRIPT = """
import gc, json, tracemalloc
from spanprof._profiling._samplers._memory import MemorySampler
from spanprof._profiling._samplers import _alloc

def kept_alloc():
    return [bytes(1000) for _ in range(10000)]

def later_alloc():
    return [bytes(1000) for _ in range(10000)]

def in_window(window, function, inuse):
    values = window.inuse.items() if inuse else window.values.items()
    return sum(
        (v[1] if inuse else v)
        for (sid, _), v in values
        if any(frame.function == function for frame in window.stack(sid))
    )

before = [_alloc.allocator(domain) for domain in (0, 1, 2)]
tracemalloc.start()
sampler = MemorySampler(sample_bytes=8192, drain_interval=3600.0, max_samples=100_000, seed=3)
sampler.start()
kept = kept_alloc()
sampler.drain()
tracemalloc.stop()  # puts back the allocators it saved: ours are out of the chain
del kept
gc.collect()
later = later_alloc()
window = sampler.take_window()
stats = sampler.stats()
raw = _alloc.stats()
sampler.stop()
out = {
    "kept_inuse": in_window(window, "kept_alloc", True),
    "cut_off": stats.get("cut_off"),
    "active": raw["active"],
    "stuck": _alloc.stats()["stuck"],
    "restored": [_alloc.allocator(domain) for domain in (0, 1, 2)] == before,
}
try:
    sampler.start()
except RuntimeError as exc:
    out["restart"] = str(exc)
else:
    later = later_alloc()
    again = sampler.take_window()
    sampler.stop()
    out["restart"] = in_window(again, "later_alloc", False)
    out["restored_again"] = [_alloc.allocator(domain) for domain in (0, 1, 2)] == before
print(json.dumps(out))
"""


def test_hooks_cut_out_of_the_chain_are_reported_and_do_not_block_a_restart() -> None:
    """tracemalloc started before the sampler and stopped while it samples puts back the
    allocators it saved, under the sampler's hooks: those are out of the chain. The sampler
    says so (stats, one warning) and drops the in-use memory whose frees it can no longer see;
    stop() does not mistake it for a hook over its own (which leaves them stuck and refuses
    every later start), and a new start() samples again."""
    _available()
    result = subprocess.run(
        [sys.executable, "-c", _CUT_OFF_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["cut_off"] == 1, out
    assert out["active"] == 0, out
    assert out["kept_inuse"] == 0, out  # 10 MB, all freed since
    assert out["stuck"] == 0, out
    assert out["restored"] is True, out
    assert isinstance(out["restart"], int), out  # not the refusal's message
    assert out["restart"] > 5_000_000, out  # 10 MB allocated
    assert out["restored_again"] is True, out
    assert result.stderr.count("taken out from under it") == 1, result.stderr
    assert "another allocator hook" not in result.stderr, result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_a_forked_child_does_not_sample_until_it_starts_its_own_sampler() -> None:
    """A child forked from a sampling process (a multiprocessing worker, a subprocess before
    its exec) has the hooks but no drain thread: it gets the previous allocators back at the
    fork, so it neither pays for sampling nor fills buffers nobody drains. A sampler started in
    the child then samples there."""
    _available()
    script = """
import os, sys
from spanprof._profiling._samplers._memory import MemorySampler
from spanprof._profiling._samplers import _alloc
before = [_alloc.allocator(domain) for domain in (0, 1, 2)]
sampler = MemorySampler(sample_bytes=1024, drain_interval=3600.0)
sampler.start()
assert _alloc.allocator(2) != before[2]
pid = os.fork()
if pid == 0:
    status = 0
    if [_alloc.allocator(domain) for domain in (0, 1, 2)] != before:
        print("child: the parent's hooks are still installed", flush=True)
        status = 1
    blocks = [bytes(1000) for _ in range(1000)]
    sampler.start()  # the child's own: it samples
    blocks = [bytes(1000) for _ in range(1000)]
    window = sampler.take_window()
    sampler.stop()
    if sum(window.values.values()) <= 0:
        print("child: its own sampler took no sample", flush=True)
        status = 1
    os._exit(status)
_, status = os.waitpid(pid, 0)
# The parent samples on.
blocks = [bytes(1000) for _ in range(1000)]
assert sum(sampler.take_window().values.values()) > 0
sampler.stop()
sys.exit(os.waitstatus_to_exitcode(status))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_restart_after_stop() -> None:
    """A stopped sampler starts again in the same process and samples again."""
    with sampling(sample_bytes=4096) as sampler:
        churn(1000)
    sampler.start()
    try:
        churn(1000)
        window = sampler.take_window()
    finally:
        sampler.stop()
    assert total(by_function(window, "churn"), 1) > 0


def test_a_restarted_sampler_keeps_no_in_use_memory_of_its_earlier_session() -> None:
    """stop() discards the in-use table, so the frees of the blocks the first session tracked are
    never reported: a start() after it (ExactBackend.shutdown() then start() reuses its sampler)
    must not keep them in use for good."""
    warm_up()
    with sampling(sample_bytes=8 * 1024) as sampler:
        kept = keep_blocks(20_000)
        first = sampler.take_window()
    assert total(by_function(first, "keep_blocks"), 3) > 0.5 * len(kept) * BLOCK
    del kept  # freed while nothing samples
    sampler.start()
    try:
        churn(1000)
        second = sampler.take_window()
        stats = sampler.stats()
    finally:
        sampler.stop()
    assert total(by_function(second, "churn"), 1) > 0  # the new session samples
    assert total(by_function(second, "keep_blocks"), 3) == 0, by_function(second, "keep_blocks")
    # The first session's ~2,500 tracked samples are forgotten; the new one's blocks were freed
    # as soon as made, bar a few of the interpreter's own.
    assert stats["live"] < 100, stats


def test_free_threaded_builds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a free-threaded CPython the sampler refuses to start and says why."""
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else None
    )
    reason = memory_unavailable_reason()
    assert reason is not None
    assert "free-threaded" in reason
    with pytest.raises(MemorySamplerUnavailable, match="free-threaded"):
        MemorySampler().start()


def test_bad_sample_size_is_a_value_error() -> None:
    """alloc_sample_bytes outside [1, 2**40] is refused with the option's name."""
    with pytest.raises(ValueError, match="alloc_sample_bytes"):
        MemorySampler(sample_bytes=0)


def _intern_failing_once(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Make the drain's next interning of a stack run out of memory (once, when armed)."""
    from spanprof._profiling._samplers import _memory

    real = _memory._intern
    armed = {"fail": False}

    def intern(*args: object) -> int:
        if armed["fail"]:
            armed["fail"] = False
            raise MemoryError
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_memory, "_intern", intern)
    return armed


def test_a_drain_that_fails_while_interning_keeps_the_frees_it_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The frees a drain took from C are applied even when interning its samples fails: else
    the blocks they free would stay in use for good."""
    armed = _intern_failing_once(monkeypatch)
    warm_up()
    with sampling(sample_bytes=8 * 1024) as sampler:
        kept = keep_blocks(20_000)
        sampler.drain()
        del kept
        drop_blocks(20_000)  # a stack not interned yet
        armed["fail"] = True
        with pytest.raises(MemoryError):
            sampler.drain()
        window = sampler.take_window()
    assert total(by_function(window, "keep_blocks"), 3) == 0


def test_the_drain_thread_outlives_a_failed_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain that fails (out of memory) is counted; the drain thread goes on draining."""
    armed = _intern_failing_once(monkeypatch)
    warm_up()
    with sampling(sample_bytes=8 * 1024, drain_interval=0.01) as sampler:
        armed["fail"] = True
        drop_blocks(20_000)
        deadline = time.monotonic() + 10
        while sampler.drain_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        drains = sampler.drains
        while sampler.drains == drains and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.drain_errors == 1
        assert sampler.drains > drains


def test_drain_thread_keeps_the_buffer_from_filling() -> None:
    """With its thread draining every 20 ms, a buffer of a quarter second's samples drops
    nothing over a burst of four times that (on a busy machine the drain thread can wait for a
    core for tens of milliseconds)."""
    with sampling(sample_bytes=16 * 1024, max_samples=16384, drain_interval=0.02) as sampler:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            churn(1000)
            time.sleep(0.001)
        stats = sampler.stats()
    assert stats["drains"] >= 10, stats
    assert stats["dropped"] == 0, stats


# --- per-span totals (spanprof.alloc_bytes) -----------------------------------------------------


def span_allocates(count: int) -> list[bytes]:
    blocks = [b""] * count
    for i in islice(ALLOC_INDICES, count):
        blocks[i] = bytes(PAYLOAD)
    return blocks


def span_bytes_in(window: MemoryWindow, span_id: str) -> float:
    return sum(v for (_sid, labels), v in window.values.items() if labels.get("span_id") == span_id)


def test_a_span_total_is_what_its_samples_stand_for_drained_or_not() -> None:
    """take_span counts every sample of the span, under any of its label sets, before any drain,
    and equals what the same samples add up to in the window; then it is forgotten."""
    base = LabelSet({"span_id": "a" * 16, "trace_id": "t" * 32})
    nested = base.merged({"tenant": "x"})  # a user label inside the request: same span
    other = LabelSet({"span_id": "b" * 16})
    count = 20_000
    with sampling(sample_bytes=16 * 1024) as sampler:
        token = LABELS.set(base)
        try:
            kept = span_allocates(count)
            inner = LABELS.set(nested)
            try:
                kept += span_allocates(count)
            finally:
                LABELS.reset(inner)
        finally:
            LABELS.reset(token)
        token = LABELS.set(other)
        try:
            churn(count)
        finally:
            LABELS.reset(token)
        churn(count)  # unlabelled
        # Nothing drained yet: the totals come from the hook itself.
        assert sampler.stats()["drains"] == 0
        taken = sampler.span_alloc_bytes("a" * 16)
        again = sampler.span_alloc_bytes("a" * 16)
        take = sampler.span_bytes_taker()
        assert take is not None
        nested_again = take("a" * 16)
        window = sampler.take_window()
        stats = sampler.stats()
    assert type(taken) is int  # a whole count of bytes, as the span's attribute carries it
    assert again == 0
    assert nested_again == 0
    p = -math.expm1(-BLOCK / (16 * 1024))
    truth = 2 * count * BLOCK
    assert taken == pytest.approx(truth, rel=bound(2 * count * p) + LIST_OVERHEAD), stats
    # The same samples, scaled the same way: equal to rounding.
    assert taken == pytest.approx(span_bytes_in(window, "a" * 16), abs=2.0)
    assert stats["span_totals"] == 1, stats  # b is still in flight, a was taken
    del kept


def test_a_span_total_outside_a_running_sampler_is_none() -> None:
    _available()
    sampler = MemorySampler(seed=1)
    assert sampler.span_alloc_bytes("a" * 16) is None
    assert sampler.span_bytes_taker() is None


def test_span_totals_are_bounded_and_unended_spans_are_swept() -> None:
    """More in-flight spans than the table holds are counted, not stored; spans nobody ends are
    swept after enough drains, so later spans find room again."""
    with sampling(sample_bytes=256, max_samples=200_000) as sampler:
        for i in range(5000):
            token = LABELS.set(LabelSet({"span_id": f"{i:016x}"}))
            try:
                churn(4)  # 4 KB at a 256-byte mean: sampled, bar one in 10**6
            finally:
                LABELS.reset(token)
        full = sampler.stats()
        for _ in range(242):
            sampler.drain()
        swept = sampler.stats()
        token = LABELS.set(LabelSet({"span_id": "late" + "0" * 12}))
        try:
            churn(4)
        finally:
            LABELS.reset(token)
        late = sampler.span_alloc_bytes("late" + "0" * 12)
    assert full["span_totals"] == 4096, full
    assert full["span_full"] > 0, full
    assert swept["span_totals"] == 0, swept
    assert swept["span_expired"] == 4096, swept
    assert late is not None
    assert late > 0


def test_a_sample_taken_inside_contextvar_reset_leaves_its_cache_alone() -> None:
    """ContextVar.reset() to "no value" allocates after clearing the variable's lookup cache and
    before it releases the old value: a lookup by the hook there must not cache that value, or
    the next LABELS.get() returns it freed (seen as a crash in the collector)."""
    other: contextvars.ContextVar[int] = contextvars.ContextVar("other")

    def body(sampler: MemorySampler) -> list[str]:
        other.set(1)  # a second variable: the reset's new HAMT is a node to allocate
        wrong: list[str] = []
        for i in range(300):
            token = LABELS.set(LabelSet({"span_id": f"{i:016x}"}))
            LABELS.reset(token)  # every allocation sampled: some of them inside the reset
            sampler.take_window()  # the samples' references to the label set go with it
            current = LABELS.get()
            if current is not EMPTY:
                wrong.append(repr(current)[:80])
        return wrong

    # sample_bytes=1: every block is sampled.
    with sampling(sample_bytes=1, max_samples=1_000_000) as sampler:
        wrong = contextvars.Context().run(body, sampler)
    assert wrong == []


def spin_labelled(seconds: float) -> None:
    """CPU without allocating: a sample here can only come from something else's allocation."""
    end = time.thread_time() + seconds
    n = 0
    while time.thread_time() < end:
        n += 1


def under_cpu_sampler(
    labels: LabelSet, work: Callable[[], None], min_ticks: int
) -> tuple[MemoryWindow, int]:
    """``work`` run in ``labels`` under the CPU sampler at 250 Hz, with an allocation sample
    every 64 bytes or so, again until ``min_ticks`` ticks ran (at most 20 times: a busy machine
    folds CPU-timer expiries into fewer signals): the memory window, and the ticks that ran."""
    from spanprof._profiling._samplers._signal import Sampler

    with sampling(sample_bytes=64, max_samples=1_000_000) as memory:
        cpu = Sampler(sample_rate=250)
        cpu.start()
        try:
            token = LABELS.set(labels)
            try:
                for _ in range(20):
                    work()
                    if cpu.ticks >= min_ticks:
                        break
            finally:
                LABELS.reset(token)
        finally:
            cpu.stop()
        return memory.take_window(), cpu.ticks


def handler_stacks(window: MemoryWindow, labels: LabelSet) -> list[list[tuple[str, int]]]:
    """The top frames of each stack sampled in ``labels`` that passes through the CPU sampler's
    module: its signal handler's allocations, counted as the request's."""
    return [
        [(frame.function, frame.line) for frame in window.stack(sid)[:3]]
        for (sid, key_labels) in window.values
        if key_labels == labels
        and any(frame.filename.endswith("_signal.py") for frame in window.stack(sid))
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU sampler needs Linux")
def test_the_cpu_samplers_own_allocations_are_nobodys() -> None:
    """The SIGPROF handler runs in the interrupted request's context: what it allocates (its
    stack walk, its window) must not be sampled as that request's memory."""
    labels = LabelSet({"span_id": "c" * 16})
    window, ticks = under_cpu_sampler(labels, lambda: spin_labelled(0.3), 10)
    assert ticks >= 10
    assert handler_stacks(window, labels) == []


class _Cycle:
    __slots__ = ("other",)
    other: _Cycle


def make_cycles(seconds: float) -> None:
    """Garbage in reference cycles, for as long as ``seconds`` of CPU: the collector's work."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        for _ in repeat(None, 20):
            cycle = _Cycle()
            cycle.other = cycle


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU sampler needs Linux")
def test_a_collection_at_the_handlers_edges_is_not_the_requests_memory() -> None:
    """On 3.12+ a due collection runs at an eval-breaker check: one is on the handler's entry
    and one after its last call, where the thread's ignore guard is off. What the collection
    allocates there ran under the handler's frame, in the interrupted request's context, and
    was sampled as that request's memory, allocated by spanprof's handler."""
    import gc

    labels = LabelSet({"span_id": "d" * 16})
    threshold = gc.get_threshold()
    # A collection falls due at every tracked allocation, the handler's own included.
    gc.set_threshold(1)
    try:
        window, ticks = under_cpu_sampler(labels, lambda: make_cycles(0.3), 20)
    finally:
        gc.set_threshold(*threshold)
    assert ticks >= 20
    assert by_function(window, "make_cycles"), "the application's allocations are missing"
    assert handler_stacks(window, labels) == []
