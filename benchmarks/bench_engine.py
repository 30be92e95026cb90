"""Label engine cost per task step: labels unchanged vs changed, recorder vs real agent.

Two tasks each ``await asyncio.sleep(0)`` in a loop, so the loop alternates between them step by
step. *Unchanged*: both tasks run with the same label set object, so no step changes the
thread's labels (the engine's fast path: one context lookup and an identity check).
*Changed*: the tasks carry different request label sets, so every step switches the thread's
labels and pushes to the backend (with pyroscope-io: 2 tag removes and 2 adds). The baseline
is the same two tasks without the engine. Variants run interleaved, round-robin, on asyncio and
uvloop; the pyroscope-io ones in a child process (see ``_child``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import uvloop

import spanprof
from spanprof._labels._labelset import LABELS, LabelSet

from ._child import child_main, run_child
from ._report import Section, Spread, Verdict, markdown_table

__all__ = ["BUDGET_NS", "main", "run"]

BUDGET_NS = 200.0
"""The label engine may cost at most 200 ns per task step when labels do not change."""

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
MODES = ["baseline", "unchanged", "changed"]
TASKS = 2

_A = LabelSet(
    {
        "span_id": "00f067aa0ba902b7",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "span_name": "GET /items/{item_id}",
    }
)
_B = LabelSet(
    {
        "span_id": "53995c3f42cd8ad8",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "span_name": "GET /items/{item_id}",
    }
)


async def _steps(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _batch(mode: str, backend: spanprof.ProfilerBackend, steps: int) -> int:
    """CPU nanoseconds of this thread for ``TASKS`` tasks to take ``steps`` steps each."""
    engine = mode != "baseline"
    label_sets = [_A, _A] if mode == "unchanged" else [_A, _B]
    if engine:
        # Installed from inside the loop, so loops with compiled handles get the task factory.
        spanprof.engine.install_label_engine(backend)
    try:
        tasks = []
        for labels in label_sets:
            # Tasks copy the context they are created in: set the labels just for that.
            token = LABELS.set(labels)
            try:
                tasks.append(asyncio.ensure_future(_steps(steps)))
            finally:
                LABELS.reset(token)
        # CPU time: time spent descheduled by other processes is not the engine's cost.
        start = time.thread_time_ns()
        await asyncio.gather(*tasks)
        return time.thread_time_ns() - start
    finally:
        if engine:
            spanprof.engine.uninstall_label_engine()


def measure(
    backend: spanprof.ProfilerBackend, rounds: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """Nanoseconds per step, ``{loop: {mode: [one value per round]}}``."""
    loops = {name: factory() for name, factory in LOOPS.items()}
    combos = [(loop, mode) for loop in loops for mode in MODES]
    results: dict[str, dict[str, list[float]]] = {loop: {m: [] for m in MODES} for loop in loops}
    try:
        for loop_name, mode in combos:  # warm-up
            loops[loop_name].run_until_complete(_batch(mode, backend, max(steps // 10, 100)))
        for index in range(rounds):
            shift = index % len(combos)
            for loop_name, mode in combos[shift:] + combos[:shift]:
                gc.collect()
                elapsed = loops[loop_name].run_until_complete(_batch(mode, backend, steps))
                results[loop_name][mode].append(elapsed / (steps * TASKS))
        return results
    finally:
        for loop in loops.values():
            loop.close()


def _child_run(args: argparse.Namespace, backend: spanprof.ProfilerBackend) -> dict[str, Any]:
    return measure(backend, args.rounds, args.size)


main = child_main("label engine cost per step with the real Pyroscope agent (child)", _child_run)


def _over(values: list[float], baseline: list[float]) -> Spread:
    return Spread.of([v - b for v, b in zip(values, baseline, strict=True)])


def run(quick: bool) -> Section:
    """Measure with the recorder here and with the agent in a child process."""
    rounds, steps = (7, 10_000) if quick else (41, 20_000)
    section = Section("engine", "Label engine cost per task step")
    recorder = spanprof.RecorderBackend(max_switches=1000)
    by_sink = {"RecorderBackend": measure(recorder, rounds, steps)}
    agent, sink = run_child(
        "benchmarks.bench_engine", ["--rounds", str(rounds), "--size", str(steps)]
    )
    by_sink["pyroscope-io agent"] = agent
    rows = []
    for sink_name, per_loop in by_sink.items():
        for loop_name, per_mode in per_loop.items():
            base = per_mode["baseline"]
            for mode in MODES:
                over = _over(per_mode[mode], base) if mode != "baseline" else None
                rows.append(
                    [
                        sink_name,
                        loop_name,
                        mode,
                        Spread.of(per_mode[mode]).format(0),
                        over.format(0) if over is not None else "—",
                    ]
                )
                if mode == "unchanged" and over is not None:
                    section.verdicts.append(
                        Verdict(
                            f"engine cost per step, labels unchanged, {loop_name}, {sink_name} "
                            f"≤ {BUDGET_NS:.0f} ns",
                            over.median <= BUDGET_NS,
                            f"{over.median:+.0f} ns/step (IQR {over.q1:+.0f}..{over.q3:+.0f}) "
                            f"over {Spread.of(base).median:.0f} ns/step without the engine",
                        )
                    )
    section.body += [
        f"{TASKS} tasks each doing `await asyncio.sleep(0)` {steps:,} times, so the loop "
        "alternates between them every step. *unchanged*: both tasks carry the same "
        "request label set (span_id, trace_id, span_name), so consecutive steps never change "
        "the thread's labels. *changed*: the two tasks carry different request label sets, so "
        "every step switches labels and pushes to the backend (pyroscope-io: 2 tag removes, 2 "
        "adds). *baseline*: the same tasks with no engine installed. The engine is installed "
        "only around its own batches; asyncio is hooked through `Handle._run` (with the C "
        "extension, the hook runs asyncio's own handles itself instead of wrapping the Python "
        "original, so it can cost less than no hook at all), uvloop through the engine's task "
        f"factory. {rounds} rounds, interleaved over loops and modes; times "
        "are the loop thread's CPU time (`time.thread_time_ns`); "
        '"over baseline" is the median of per-round differences. The pyroscope-io rows come '
        "from a child process with the agent running (100 Hz, 1 s uploads to a `PushReceiver` "
        "in the parent). " + sink.describe(),
        markdown_table(
            [
                "sink",
                "loop",
                "labels",
                "CPU ns/step: median (IQR; min..max)",
                "ns/step over baseline: median (IQR; min..max)",
            ],
            rows,
        ),
    ]
    return section


if __name__ == "__main__":
    main(None)
