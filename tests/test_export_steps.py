"""Export steps are timed without the garbage collector's pauses, which are counted apart."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from spanprof._profiling._exporters._steps import StepTimer


def _heap(objects: int) -> list[list[int]]:
    # Containers the collector must traverse: a full collection over them takes milliseconds.
    return [[i] for i in range(objects)]


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_collection_inside_a_step_is_counted_apart_from_the_step() -> None:
    heap = _heap(400_000)
    timer = StepTimer()

    def step() -> None:
        _burn(0.001)
        gc.collect()

    timer.run(step)
    del heap
    assert timer.steps == 1
    # The full collection over 400,000 lists is far longer than the step's own millisecond.
    assert timer.max_gc_ns > 3_000_000, vars(timer)
    assert 900_000 <= timer.max_ns < 3_000_000, vars(timer)
    assert timer.cpu_ns == timer.max_ns
    assert timer.gc_ns == timer.max_gc_ns
    # Two clocks: wall time covers both parts, within the clocks' granularity.
    assert timer.max_wall_ns >= 0.95 * (timer.max_ns + timer.max_gc_ns), vars(timer)
    assert timer._on_gc not in gc.callbacks
    stats = timer.stats("otlp_")
    assert stats["otlp_export_steps"] == 1
    assert stats["otlp_max_export_step_us"] == timer.max_ns / 1e3
    assert stats["otlp_max_export_step_gc_us"] > 3_000
    assert stats["otlp_max_export_step_gc_us"] == pytest.approx(stats["otlp_export_gc_ms"] * 1e3)


def test_a_collection_on_another_thread_during_a_step_is_not_the_steps() -> None:
    heap = _heap(400_000)
    timer = StepTimer()
    collected = threading.Event()
    collection_cpu_ns: list[int] = []

    def collect() -> None:
        start = time.thread_time_ns()
        gc.collect()
        collection_cpu_ns.append(time.thread_time_ns() - start)
        collected.set()

    def step() -> None:
        # The step waits with the GIL released while another thread collects.
        other = threading.Thread(target=collect)
        other.start()
        other.join()

    # Only the other thread's explicit collection may run: an automatic one that starting the
    # thread sets off on this thread would be this step's, and counted (rightly) as such.
    enabled = gc.isenabled()
    gc.disable()
    try:
        timer.run(step)
    finally:
        if enabled:
            gc.enable()
    del heap
    assert collected.is_set()
    assert timer.gc_ns == 0, vars(timer)
    # Starting and joining a thread costs the step a little CPU, more on a loaded VM whose stolen
    # time lands on the thread clock; the other thread's collection would cost it all of its own.
    (collection,) = collection_cpu_ns
    assert collection > 20_000_000, collection_cpu_ns
    assert timer.max_ns < collection / 4, (vars(timer), collection)


def test_a_failing_step_raises_and_stops_listening_to_the_collector() -> None:
    timer = StepTimer()
    listeners = len(gc.callbacks)

    def step() -> None:
        raise RuntimeError("encoder bug")

    with pytest.raises(RuntimeError, match="encoder bug"):
        timer.run(step)
    assert len(gc.callbacks) == listeners
    assert timer.steps == 1
