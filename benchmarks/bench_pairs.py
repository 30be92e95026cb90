"""The default profiler's HTTP cost, part by part, from two servers sharing one core.

The exact section's HTTP run loads ten servers on two cores and compares configurations from
round to round; on a shared VM its rounds move by several points, about as much as the parts it
takes apart. Here two ``benchmarks/apps/switch_app.py`` servers are pinned to the same core and
loaded at once by a client pinned to the other, so whatever else the machine does slows both
alike, and each round's ratio compares them in the same seconds. They swap configurations every
round: the geometric mean of two consecutive rounds' ratios cancels the two processes' own
speeds (memory layout, hash seeds), which fresh processes of one configuration differ by.

Each step compares two configurations that differ by one part (``PARTS``), from no profiler to
the default; then the allocation samples at a 16th of the default rate and at 16 times it
(``RATES``), no profiler against the default directly (``WHOLE``), and no profiler against itself
(``CONTROL``, the A/A control: what the design reads when nothing differs). Each ratio is read
for every thread and for the main thread alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from spanprof._local._receiver import PushReceiver

from ._load import load
from ._report import Section, Spread, Verdict, markdown_table
from .bench_exact import (
    HTTP_VARIANTS,
    THROUGHPUT_BUDGET,
    profiler_stats,
    start_switch_apps,
    switch_to,
    threads_cpu_ns,
)

__all__ = ["CONTROL", "PARTS", "RATES", "STEPS", "WHOLE", "run"]

#: (baseline, variant): each step adds one part of the default, from no profiler to the default.
PARTS = (
    ("off", "nomem_1hz"),
    ("nomem_1hz", "nomem"),
    ("nomem", "hooks"),
    ("hooks", "exact"),
)
#: The allocation samples' cost at other rates: 16 times rarer (against the hooks alone), and
#: 16 times more often (against the default).
RATES = (
    ("hooks", "mem_8m"),
    ("exact", "mem_32k"),
)
WHOLE = ("off", "exact")
CONTROL = ("off", "off")
STEPS = (*PARTS, *RATES, WHOLE, CONTROL)

_NAMES = {
    "off": "no profiler",
    **HTTP_VARIANTS,
    "mem_8m": "the default sampling allocations once per 8 MiB (`SPANPROF_ALLOC_SAMPLE_BYTES`)",
    "mem_32k": "the default sampling allocations once per 32 KiB",
}

_STEP_NAMES = {
    ("off", "nomem_1hz"): "the request path, the label engine and the upload thread",
    ("nomem_1hz", "nomem"): "the ticks at the default 100 Hz",
    ("nomem", "hooks"): "the allocation hooks (never sampling)",
    ("hooks", "exact"): "the allocation samples at the default one per 512 KiB",
    ("hooks", "mem_8m"): "the allocation samples at one per 8 MiB (1/16 of the default's)",
    ("exact", "mem_32k"): "allocation samples 16 times as often as the default's (one per 32 KiB)",
    WHOLE: "the default profiler, whole",
    CONTROL: "nothing: the A/A control",
}

#: Seconds each round loads both servers after their switch before its clocks are read.
SETTLE_SECONDS = 3.0


def _pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core`` (threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), {core})


@contextlib.contextmanager
def _pinned_here(core: int) -> Iterator[None]:
    """The calling thread (the load's client) on ``core``, put back afterwards."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _step(
    ports: list[int], pids: list[int], base: str, variant: str, rounds: int, seconds: float
) -> tuple[list[float], list[float]]:
    """Per pair of rounds: the baseline's CPU per response over the variant's, servers
    swapped between the two rounds of a pair; every thread's, and the main thread's alone."""
    ratios: list[float] = []
    main_ratios: list[float] = []
    names = (base, variant)
    for t in range(rounds):
        names = (base, variant) if t % 2 == 0 else (variant, base)
        for port, name in zip(ports, names, strict=True):
            switch_to(port, name)
        load(ports, seconds=SETTLE_SECONDS)
        before = [threads_cpu_ns(pid) for pid in pids]
        served = load(ports, seconds=seconds)
        after = [threads_cpu_ns(pid) for pid in pids]
        per = [(sum(after[s]) - sum(before[s])) / served[ports[s]] for s in range(2)]
        main = [(after[s][0] - before[s][0]) / served[ports[s]] for s in range(2)]
        # Server 0 runs the baseline in even rounds, the variant in odd ones.
        ratios.append(per[0] / per[1] if t % 2 == 0 else per[1] / per[0])
        main_ratios.append(main[0] / main[1] if t % 2 == 0 else main[1] / main[0])
    # Each server still runs its configuration of the last round: a profiler's must be exact.
    for port, name in zip(ports, names, strict=True):
        if name != "off":
            found = profiler_stats(port, name)
            if found.get("mode") != "exact":
                raise RuntimeError(f"the exact profiler did not run ({name}): {found!r}")
    for port in ports:
        switch_to(port, "off")
    return _paired(ratios), _paired(main_ratios)


def _paired(ratios: list[float]) -> list[float]:
    """The geometric mean of each two consecutive rounds' ratios (servers swapped between)."""
    return [math.sqrt(ratios[i] * ratios[i + 1]) for i in range(0, len(ratios) - 1, 2)]


_Found = dict[tuple[str, str], tuple[list[float], list[float]]]


def _measure(rounds: int, seconds: float, workdir: Path) -> _Found:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the paired HTTP run needs two cores: one for the servers, one to load")
    server_core, client_core = cores[-1], cores[0]
    found: _Found = {}
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_APPLICATION_NAME": "bench-pairs",
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
        }
        with contextlib.ExitStack() as stack:
            ports, pids = start_switch_apps(stack, 2, env, workdir / "pairs")
            for pid in pids:
                _pin(pid, server_core)
            with _pinned_here(client_core):
                load(ports, seconds=2.0)  # warm-up: imports, first requests
                for base, variant in STEPS:
                    found[(base, variant)] = _step(ports, pids, base, variant, rounds, seconds)
        if receiver.errors:
            raise RuntimeError(f"the receiver rejected uploads: {receiver.errors[:3]}")
    return found


def run(quick: bool) -> Section:
    """Measure each part of the default's HTTP cost in same-core pairs."""
    started = time.monotonic()
    rounds, seconds = (4, 2.0) if quick else (12, 4.0)
    with tempfile.TemporaryDirectory() as tmp:
        found = _measure(rounds, seconds, Path(tmp))
    spreads = {step: Spread.of(pairs) for step, (pairs, _) in found.items()}
    mains = {step: Spread.of(pairs) for step, (_, pairs) in found.items()}
    whole = spreads[WHOLE]
    control = spreads[CONTROL]
    section = Section("pairs", "The default's HTTP cost, part by part (same-core pairs)")
    section.body += [
        "Two uvicorn servers of `benchmarks/apps/switch_app.py` (asyncio, a 2-byte "
        "`GET /health`, every request traced), every thread pinned to one core, loaded at once "
        "by a client pinned to the other core (8 keep-alive connections each). Each step runs "
        f"{rounds} rounds: both switch (one to each configuration), {SETTLE_SECONDS:g} s of "
        f"unclocked load, then {seconds:g} s clocked; they swap configurations every round. A "
        "round's ratio is the baseline server's CPU per response (every thread, "
        "`/proc/PID/task/*/schedstat`) over the variant's, in the same seconds; each pair of "
        "rounds gives the geometric mean of its two ratios, in which the two processes' own "
        "speeds cancel. The table gives the median pair and its spread, for every thread and "
        "for the main thread alone (where requests, ticks and allocation hooks run; the "
        "difference is the profiler's own threads: uploads and the allocation drain). Both "
        "servers share a core, as the exact section's ten servers share two; what the "
        "machine's neighbours do slows both alike.",
        markdown_table(
            ["step", "baseline", "variant", "x baseline", "points", "main thread x baseline"],
            [
                [
                    _STEP_NAMES[step],
                    _NAMES[step[0]],
                    _NAMES[step[1]],
                    spreads[step].format(3),
                    f"{100 * (1 - spreads[step].median):+.1f}",
                    mains[step].format(3),
                ]
                for step in STEPS
            ],
        ),
        f"The four parts add up to {100 * sum(1 - spreads[s].median for s in PARTS):.1f} "
        f"points; the default measured whole, {100 * (1 - whole.median):.1f}. Allocation "
        f"samples 16 times rarer cost {100 * (1 - spreads[RATES[0]].median):.1f} points over "
        f"the hooks; 16 times as many, {100 * (1 - spreads[RATES[1]].median):.1f} over the "
        "default.",
    ]
    section.verdicts.append(
        Verdict(
            f"throughput of a trivial endpoint with the default profiler >= "
            f"{THROUGHPUT_BUDGET:.2f} x no profiler (uvicorn over HTTP, server CPU per response, "
            "two servers on one core)",
            whole.median >= THROUGHPUT_BUDGET,
            f"{whole.median:.3f} x (IQR {whole.q1:.3f}..{whole.q3:.3f}); "
            f"A/A control {control.median:.3f} x (IQR {control.q1:.3f}..{control.q3:.3f})",
        )
    )
    section.seconds = time.monotonic() - started
    return section
