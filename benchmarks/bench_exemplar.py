"""Cost of the request-duration histogram with SLO-breach exemplars, per request.

Three ways to record one request's duration into an SDK ``MeterProvider`` (default exemplar
settings, a reader that is never collected), interleaved round by round:

- ``plain``: ``histogram.record(seconds, attributes, context=<no span>)``, the histogram
  without exemplars (the baseline);
- ``within``: spanprof's ``DurationRecorder.record`` for a request within its SLO (no
  exemplar: the decision, the cached attributes, the suppressing context);
- ``breach``: the same for a request over its SLO (marks the span, keeps an exemplar with its
  trace and span id).

Budget: at most 10 µs per request over ``plain``.
"""

from __future__ import annotations

import gc
import statistics
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN, set_span_in_context

from spanprof import SloPolicy
from spanprof._signals._duration import DURATION_BUCKETS, DurationRecorder

from ._report import Section, Spread, Verdict, markdown_table

__all__ = ["BUDGET_US", "run"]

BUDGET_US = 10.0


def _measure(rounds: int, count: int) -> dict[str, list[float]]:
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    histogram = provider.get_meter("bench").create_histogram(
        "plain.duration", unit="s", explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS)
    )
    recorder = DurationRecorder(meter_provider=provider, slo=SloPolicy(default=0.5))
    tracer = TracerProvider().get_tracer("bench")
    no_span = set_span_in_context(INVALID_SPAN)
    attributes: dict[str, str | int] = {
        "http.request.method": "GET",
        "http.route": "/items/{item_id}",
        "url.scheme": "http",
        "http.response.status_code": 200,
    }

    def plain(span: object) -> None:
        histogram.record(0.1, attributes, context=no_span)

    def within(span: object) -> None:
        recorder.record(0.1, method="GET", route="/items/{item_id}", scheme="http",
                        status_code=200, exc=None, span=span)  # type: ignore[arg-type]  # fmt: skip

    def breach(span: object) -> None:
        recorder.record(0.9, method="GET", route="/items/{item_id}", scheme="http",
                        status_code=200, exc=None, span=span)  # type: ignore[arg-type]  # fmt: skip

    variants = {"plain": plain, "within": within, "breach": breach}
    spans = [tracer.start_span("GET /items/{item_id}") for _ in range(count)]
    results: dict[str, list[float]] = {name: [] for name in variants}
    for call in variants.values():  # warm-up
        for span in spans[:100]:
            call(span)
    for index in range(rounds):
        names = list(variants)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            call = variants[name]
            gc.collect()
            started = time.thread_time_ns()
            for span in spans:
                call(span)
            results[name].append((time.thread_time_ns() - started) / count / 1000)
    for span in spans:
        span.end()
    return results


def run(quick: bool) -> Section:
    """Measure the three ways to record; judge the exemplar path against the plain one."""
    rounds, count = (9, 2000) if quick else (41, 5000)
    results = _measure(rounds, count)
    section = Section("exemplar", "Duration histogram with SLO-breach exemplars")
    base = results["plain"]
    rows = []
    for name, label in (
        ("plain", "`histogram.record` without exemplar (baseline)"),
        ("within", "spanprof, request within its SLO (no exemplar)"),
        ("breach", "spanprof, request over its SLO (span marked, exemplar kept)"),
    ):
        spread = Spread.of([v - b for v, b in zip(results[name], base, strict=True)])
        rows.append([label, Spread.of(results[name]).format(2), spread.format(2)])
    section.body += [
        "One request's duration recorded into an SDK `MeterProvider` with the default exemplar "
        f"settings; {rounds} rounds of {count} records per variant, interleaved, timed with "
        "the thread's CPU clock. Extra = per-round difference to the baseline.",
        markdown_table(["variant", "µs/request", "extra µs over baseline"], rows),
    ]
    for name in ("within", "breach"):
        extra = statistics.median(v - b for v, b in zip(results[name], base, strict=True))
        section.verdicts.append(
            Verdict(
                f"histogram + exemplar path ({name}) ≤ {BUDGET_US:g} µs/request over the plain "
                "histogram",
                extra <= BUDGET_US,
                f"{extra:+.2f} µs/request",
            )
        )
    return section
