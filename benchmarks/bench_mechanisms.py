"""Label engine per-step cost by mechanism (CPython 3.14+): the context watcher vs the hooks.

The same two-task ping-pong as ``bench_engine`` (each task ``await asyncio.sleep(0)`` in a loop,
so the loop alternates between them step by step), with the engine installed as
``mechanism="watcher"`` (a ``PyContext_AddWatcher`` callback) or ``mechanism="hooks"`` (the C
``Handle._run`` replacement on asyncio, the task factory and C coroutine proxy on uvloop), and
a baseline without the engine, all interleaved round by round in one process. Label modes:

- *unlabelled*: neither task has labels (each mechanism's bare cost: nothing to push);
- *unchanged*: both tasks carry the same request label set;
- *changed*: the tasks carry different label sets.

Sinks: ``RecorderBackend`` (a push is a Python call), a recorder that reads the main thread's
context itself like the exact sampler (so the engine pushes nothing for the loop's thread: the
mechanism's overhead alone, spanprof's default), and the pyroscope-io agent in a child process.

Run alone (it is also ``python -m benchmarks.run --only mechanisms``)::

    python -m benchmarks.bench_mechanisms [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import uvloop

import spanprof
from spanprof._labels import _engine
from spanprof._labels._labelset import EMPTY, LABELS, LabelSet

from ._child import child_main, run_child
from ._report import Section, Spread, markdown_table, paired_ratios
from .bench_engine import _A, _B

__all__ = ["main", "measure", "run"]

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
LABEL_MODES: dict[str, tuple[LabelSet, LabelSet]] = {
    "unlabelled": (EMPTY, EMPTY),
    "unchanged": (_A, _A),
    "changed": (_A, _B),
}
TASKS = 2


class _ReadsMainContext(spanprof.RecorderBackend):
    """Like the exact sampler: the main thread's labels are read from its context, not pushed."""

    needs_step_hooks = False


def _variants() -> list[tuple[str, str]]:
    """(mechanism, label mode) pairs, the baseline first."""
    mechanisms = [m for m in _engine.MECHANISMS if m in _engine.available_mechanisms()]
    return [("baseline", "unlabelled")] + [(m, mode) for m in mechanisms for mode in LABEL_MODES]


async def _steps(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _batch(mechanism: str, mode: str, backend: spanprof.ProfilerBackend, steps: int) -> int:
    """CPU nanoseconds of this thread for ``TASKS`` tasks to take ``steps`` steps each."""
    engine = mechanism != "baseline"
    if engine:
        # From inside the loop, so a "hooks" engine gives uvloop its task factory.
        _engine.install_label_engine(backend, mechanism=mechanism)  # type: ignore[arg-type]
    try:
        tasks = []
        for labels in LABEL_MODES[mode]:
            token = LABELS.set(labels)
            try:
                tasks.append(asyncio.ensure_future(_steps(steps)))
            finally:
                LABELS.reset(token)
        start = time.thread_time_ns()
        await asyncio.gather(*tasks)
        return time.thread_time_ns() - start
    finally:
        if engine:
            _engine.uninstall_label_engine()


def measure(
    backend: spanprof.ProfilerBackend, rounds: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """Nanoseconds per step, ``{loop: {"mechanism/mode": [one value per round]}}``."""
    loops = {name: factory() for name, factory in LOOPS.items()}
    variants = _variants()
    combos = [(loop, variant) for loop in loops for variant in variants]
    results: dict[str, dict[str, list[float]]] = {
        loop: {f"{m}/{mode}": [] for m, mode in variants} for loop in loops
    }
    try:
        for loop_name, (mechanism, mode) in combos:  # warm-up
            loops[loop_name].run_until_complete(
                _batch(mechanism, mode, backend, max(steps // 10, 100))
            )
        for index in range(rounds):
            shift = index % len(combos)
            for loop_name, (mechanism, mode) in combos[shift:] + combos[:shift]:
                gc.collect()
                elapsed = loops[loop_name].run_until_complete(
                    _batch(mechanism, mode, backend, steps)
                )
                results[loop_name][f"{mechanism}/{mode}"].append(elapsed / (steps * TASKS))
        return results
    finally:
        for loop in loops.values():
            loop.close()


def _child_run(args: argparse.Namespace, backend: spanprof.ProfilerBackend) -> dict[str, Any]:
    return measure(backend, args.rounds, args.size)


_child_main = child_main(
    "label engine per-step cost by mechanism, pyroscope-io (child)", _child_run
)


def _rows(sink: str, per_loop: dict[str, dict[str, list[float]]]) -> list[list[str]]:
    rows = []
    for loop_name, per_variant in per_loop.items():
        base = per_variant["baseline/unlabelled"]
        for key, values in per_variant.items():
            mechanism, mode = key.split("/")
            if mechanism == "baseline":
                rows.append(
                    [sink, loop_name, "baseline", "—", Spread.of(values).format(0), "—", "—"]
                )
                continue
            over = Spread.of([v - b for v, b in zip(values, base, strict=True)])
            rows.append(
                [
                    sink,
                    loop_name,
                    mechanism,
                    mode,
                    Spread.of(values).format(0),
                    paired_ratios(values, base).format(3),
                    over.format(0),
                ]
            )
    return rows


def run(quick: bool) -> Section:
    """Measure both mechanisms with each sink (the agent's in a child process)."""
    section = Section("mechanisms", "Label engine per step: context watcher vs hooks (3.14+)")
    if "watcher" not in _engine.available_mechanisms():
        section.body.append(
            f"Not measured: CPython {sys.version_info.major}.{sys.version_info.minor} has no "
            "context watcher (`PyContext_AddWatcher` is 3.14+), or spanprof's C extension is "
            "missing. Run `python -m benchmarks.bench_mechanisms` with CPython 3.14+."
        )
        return section
    rounds, steps = (7, 5_000) if quick else (31, 20_000)
    by_sink = {
        "RecorderBackend": measure(spanprof.RecorderBackend(max_switches=1000), rounds, steps),
        "main thread read from its context": measure(
            _ReadsMainContext(max_switches=1000), rounds, steps
        ),
    }
    agent, sink = run_child(
        "benchmarks.bench_mechanisms", ["--rounds", str(rounds), "--size", str(steps)]
    )
    by_sink["pyroscope-io agent"] = agent
    rows = [row for name, per_loop in by_sink.items() for row in _rows(name, per_loop)]
    section.body += [
        f"{TASKS} tasks each doing `await asyncio.sleep(0)` {steps:,} times, so the loop "
        "alternates between them every step. *watcher*: the engine installed with "
        '`mechanism="watcher"` (a `PyContext_AddWatcher` callback: it runs on entering each '
        "step's context and on leaving it, so a labelled step costs two pushes, in and back "
        'out to the loop\'s unlabelled context); *hooks*: `mechanism="hooks"` (the C '
        "`Handle._run` replacement on asyncio; the task factory and C coroutine proxy on "
        "uvloop), which pushes only when the next step's labels differ from the last. "
        "*unlabelled*: neither task has labels; *unchanged*: both carry the same label set; "
        "*changed*: different ones. *baseline*: no engine. Sinks: `RecorderBackend`; a "
        "recorder that, like the exact sampler, reads the main thread's labels from its "
        "context (`needs_step_hooks = False`), so nothing is pushed for the loop's thread and "
        "the cost is the mechanism's own; the pyroscope-io agent in a child process (100 Hz, "
        f"1 s uploads to a `PushReceiver` in the parent). {rounds} rounds, interleaved over "
        "loops, mechanisms and modes; times are the loop thread's CPU time "
        "(`time.thread_time_ns`); ratios and differences are the medians of per-round ones "
        "against the baseline of the same round. " + sink.describe(),
        markdown_table(
            [
                "sink",
                "loop",
                "mechanism",
                "labels",
                "CPU ns/step: median (IQR; min..max)",
                "x baseline: median (IQR; min..max)",
                "ns/step over baseline",
            ],
            rows,
        ),
    ]
    return section


def main(argv: list[str] | None = None) -> None:
    """``--child ...``: the agent's child; otherwise measure and print the section."""
    args = sys.argv[1:] if argv is None else argv
    if "--child" in args:
        _child_main(args)
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mechanisms")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    quick = parser.parse_args(args).quick
    started = time.perf_counter()
    section = run(quick)
    print(f"## {section.title}\n")
    for block in section.body:
        print(block + "\n")
    print(f"_Section wall time: {time.perf_counter() - started:.0f} s._")


if __name__ == "__main__":
    main(None)
