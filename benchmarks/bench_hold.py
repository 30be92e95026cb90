"""Cost of the SLO hold: per request on the request path and in the exporter, and its memory.

- **Request path**: what a request's end costs with the exact profiler: ``end_span`` (the hold
  takes the verdict, the sampler hands over the span's CPU) of a started ``ExactBackend``
  pushing to an in-process receiver, alone and through the middlewares' ``end_span`` (which
  also annotates the span), against the same loop calling a no-op (the baseline), interleaved
  round by round.
- **Exporter**: one upload window of ``REQUESTS`` requests (3 stacks each, a quarter still in
  flight) through ``SloHold.take_window`` against handing the window on untouched; per request.
- **Memory**: what the hold keeps for 10,000 concurrent slow requests (4 stacks each) and for
  100,000 verdicts of one upload interval (tracemalloc).

Budget (spanprof's own; the issue names none): the hold at most 1.5 µs per request on the
request path.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc

from opentelemetry.sdk.trace import TracerProvider

from spanprof._labels._labelset import LabelSet
from spanprof._local._receiver import PushReceiver
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._hold import SloHold
from spanprof._profiling._runtime import ProfilerRuntime
from spanprof._profiling._window import Frame, StackTables, Window
from spanprof._web._usage import end_span

from ._report import Section, Spread, Verdict, markdown_table

__all__ = ["BUDGET_US", "run"]

BUDGET_US = 1.5
REQUESTS = 20_000


def _request_path(rounds: int, count: int) -> dict[str, list[float]]:
    tracer = TracerProvider().get_tracer("bench")
    results: dict[str, list[float]] = {"baseline": [], "profiler": [], "end_span": []}
    with PushReceiver() as receiver:
        backend = ExactBackend(server_address=receiver.url, upload_interval=1, memory=False)
        runtime = ProfilerRuntime(backend)
        runtime.start()
        try:
            if backend.mode != "exact":
                raise RuntimeError(f"the exact profiler did not start here ({backend.mode})")

            def nothing(runtime: object, span: object, span_id: str, breached: bool) -> None:
                return None

            def profiler(
                runtime: ProfilerRuntime, span: object, span_id: str, breached: bool
            ) -> None:
                backend.end_span(span_id, breached)

            variants = {"baseline": nothing, "profiler": profiler, "end_span": end_span}
            for index in range(rounds):
                spans = [tracer.start_span("GET /checkout") for _ in range(count)]
                ids = [format(s.get_span_context().span_id, "016x") for s in spans]
                names = list(variants)
                shift = index % len(names)
                names = names[shift:] + names[:shift]
                for name in names:
                    call = variants[name]
                    gc.collect()
                    started = time.thread_time_ns()
                    for i in range(count):
                        call(runtime, spans[i], ids[i], i % 4 == 0)
                    results[name].append((time.thread_time_ns() - started) / count / 1000)
                for span in spans:
                    span.end()
        finally:
            runtime.stop()
    return results


def _stack(tables: StackTables, name: str) -> int:
    tables.frames.append(Frame(name, "app.py", 1))
    return tables.add_stack((len(tables.frames) - 1,))


def _window(tables: StackTables, sids: list[int], first: int) -> Window:
    window = Window(0, tables)
    for request in range(first, first + REQUESTS):
        labels = LabelSet({"span_id": f"{request:016x}", "span_name": "GET /checkout"})
        for sid in sids:
            window.values[(sid, labels)] = 10_000_000
    return window


def _exporter(rounds: int) -> dict[str, list[float]]:
    tables = StackTables()
    sids = [_stack(tables, f"f{i}") for i in range(3)]
    results: dict[str, list[float]] = {"plain": [], "hold": []}
    for index in range(rounds):
        first = index * REQUESTS
        windows = [_window(tables, sids, first) for _ in range(2)]
        plain_window = windows[0]
        started = time.thread_time_ns()
        taken = (lambda: plain_window)()
        results["plain"].append((time.thread_time_ns() - started) / REQUESTS / 1000)
        hold_window = windows[1]
        hold = SloHold(lambda window=hold_window: window)  # type: ignore[misc]
        for request in range(first, first + REQUESTS):
            if request % 4:  # a quarter still in flight
                hold.end_span(f"{request:016x}", request % 8 == 1)
        gc.collect()
        started = time.thread_time_ns()
        taken = hold.take_window()
        results["hold"].append((time.thread_time_ns() - started) / REQUESTS / 1000)
        del taken
    return results


def _memory() -> tuple[float, float]:
    tables = StackTables()
    sids = [_stack(tables, f"f{i}") for i in range(4)]
    window = Window(0, tables)
    for request in range(10_000):
        labels = LabelSet({"span_id": f"{request:016x}", "span_name": "GET /checkout"})
        for sid in sids:
            window.values[(sid, labels)] = 1
    hold = SloHold(lambda: window)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        hold.take_window()
        held = tracemalloc.get_traced_memory()[0] - before
        ids = [f"{request:016x}" for request in range(10_000, 110_000)]
        before = tracemalloc.get_traced_memory()[0]
        for span_id in ids:
            hold.end_span(span_id, False)
        verdicts = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held / 1e6, verdicts / 1e6


def run(quick: bool) -> Section:
    """Measure the hold on the request path, in the exporter, and in memory."""
    rounds, count = (5, 5000) if quick else (21, 20_000)
    path = _request_path(rounds, count)
    exporter = _exporter(3 if quick else 9)
    held_mb, verdicts_mb = _memory()
    extra = [v - b for v, b in zip(path["profiler"], path["baseline"], strict=True)]
    full = [v - b for v, b in zip(path["end_span"], path["baseline"], strict=True)]
    section = Section("hold", "The SLO hold (breach-labelled profiles)")
    section.body += [
        "Request path: a request's end with the exact profiler running: "
        "`ExactBackend.end_span` (the hold takes the verdict, the sampler hands over the span's "
        "CPU), and the same through the middlewares' `end_span`, which annotates the SDK span "
        "(here with nothing: `spanprof.cpu_time_s` is left out of a span no sample landed in, "
        "as in most short requests, and no sample lands in these); "
        f"{rounds} rounds of {count} requests, interleaved with a no-op "
        "baseline, timed with the thread's CPU clock. Exporter: one upload window of "
        f"{REQUESTS:,} requests x 3 stacks, a quarter still in flight, through "
        "`SloHold.take_window` (off the request path, in the upload thread, yielding the GIL "
        "every 4,096 samples). A window holds at most one distinct sample per request per "
        "tick, so at 100 ticks per second the exporter's share stays under "
        f"{max(exporter['hold']) / 3 * 100 / 1e4:.2f}% of a core whatever the request rate.",
        markdown_table(
            ["what", "µs per request"],
            [
                ["request path: the hold and the span's CPU", Spread.of(extra).format(2)],
                [
                    "request path: the same + the span's annotation (none: no sample)",
                    Spread.of(full).format(2),
                ],
                [
                    "exporter, hold (3 distinct samples per request)",
                    Spread.of(exporter["hold"]).format(2),
                ],
                ["exporter, window handed on untouched", Spread.of(exporter["plain"]).format(3)],
            ],
        ),
        markdown_table(
            ["memory (tracemalloc)", "MB"],
            [
                ["held: 10,000 concurrent slow requests x 4 stacks", f"{held_mb:.1f}"],
                ["verdicts: 100,000 requests ended in one upload interval", f"{verdicts_mb:.1f}"],
            ],
        ),
        "Bounds: 65,536 held (stack, labels) pairs (more pass through unlabelled, counted), "
        "262,144 verdicts per upload interval, kept for two intervals.",
    ]
    median = statistics.median(extra)
    section.verdicts.append(
        Verdict(
            f"the hold's cost on the request path ≤ {BUDGET_US:g} µs/request",
            median <= BUDGET_US,
            f"{median:+.2f} µs/request",
        )
    )
    return section
