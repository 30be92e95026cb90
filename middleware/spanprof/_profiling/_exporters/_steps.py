"""Export work in timed steps: how long each step held the GIL, the collector's pauses apart."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable


class StepTimer:
    """Runs export work one step at a time and keeps the longest step's CPU and wall time.

    A step's CPU time leaves out the garbage collections that ran inside it: the collector
    runs on whichever thread crosses its allocation threshold, so a collection that lands in
    a step would have paused the application anyway, and counting it would make the step
    budget measure the heap's size instead of the encoder. The pauses are counted apart.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.cpu_ns = 0
        self.max_ns = 0
        self.max_wall_ns = 0
        self.gc_ns = 0
        self.max_gc_ns = 0
        self._thread: int | None = None
        self._gc_started: int | None = None
        self._step_gc_ns = 0

    def run(self, work: Callable[[], object]) -> None:
        """Run one step of ``work`` under the GIL, then let waiting threads in."""
        self._thread = threading.get_ident()
        self._step_gc_ns = 0
        # Listening only during a step keeps the application's own collections free of it.
        gc.callbacks.append(self._on_gc)
        cpu = time.thread_time_ns()
        wall = time.perf_counter_ns()
        try:
            work()
        finally:
            used = time.thread_time_ns() - cpu
            wall_used = time.perf_counter_ns() - wall
            with contextlib.suppress(ValueError):  # the application cleared gc.callbacks
                gc.callbacks.remove(self._on_gc)
            self._gc_started = None
            paused = self._step_gc_ns
            self.gc_ns += paused
            self.max_gc_ns = max(self.max_gc_ns, paused)
            used = max(0, used - paused)
            self.cpu_ns += used
            self.max_ns = max(self.max_ns, used)
            self.max_wall_ns = max(self.max_wall_ns, wall_used)
            self.steps += 1
        time.sleep(0)

    def stats(self, prefix: str = "") -> dict[str, float]:
        """Steps, their CPU, the longest step (CPU and wall) and the collections apart."""
        return {
            f"{prefix}export_steps": self.steps,
            f"{prefix}export_cpu_ms": self.cpu_ns / 1e6,
            f"{prefix}max_export_step_us": self.max_ns / 1e3,
            f"{prefix}max_export_step_wall_us": self.max_wall_ns / 1e3,
            f"{prefix}export_gc_ms": self.gc_ns / 1e6,
            f"{prefix}max_export_step_gc_us": self.max_gc_ns / 1e3,
        }

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # The callback runs on the collecting thread; only the step's own thread counts.
        if threading.get_ident() != self._thread:
            return
        now = time.thread_time_ns()
        if phase == "start":
            self._gc_started = now
        elif self._gc_started is not None:
            self._step_gc_ns += now - self._gc_started
            self._gc_started = None
