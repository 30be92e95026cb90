"""A request's span ends: the profiler learns its SLO verdict, the span what it used.

A span with ``spanprof.cpu_time_s`` had its verdict taken by the exact profiler: it breached
when it also carries ``spanprof.slo.breached``, and met its SLO otherwise (one attribute less
per request than writing ``false`` on every good one). ``spanprof.alloc_bytes`` is left out
when none of the span's allocations was sampled (an estimate of 0 bytes).
"""

from __future__ import annotations

from opentelemetry.trace import Span

from .._labels._backend import SpanUsage
from .._profiling._runtime import ProfilerRuntime

__all__ = ["ALLOC_BYTES_ATTRIBUTE", "CPU_TIME_ATTRIBUTE", "end_span"]

CPU_TIME_ATTRIBUTE = "spanprof.cpu_time_s"
ALLOC_BYTES_ATTRIBUTE = "spanprof.alloc_bytes"


def end_span(
    runtime: ProfilerRuntime, span: Span | None, span_id: str | None, breached: bool | None
) -> SpanUsage | None:
    """Hand ``breached`` to the profiler (it labels the span's samples ``slo``); annotate ``span``.

    Call it once per request, while the span is still open when it can be. Never raises.
    """
    if span_id is None:
        return None
    usage = runtime.end_span(span_id, breached)
    if usage is not None and span is not None and span.is_recording():
        try:
            span.set_attribute(CPU_TIME_ATTRIBUTE, usage.cpu_ns / 1e9)
            # No sampled allocation (most short requests at the default rate): no attribute.
            # An attribute costs about 1.6 µs with the SDK, 1% of a trivial request.
            if usage.alloc_bytes:
                span.set_attribute(ALLOC_BYTES_ATTRIBUTE, usage.alloc_bytes)
        except Exception:  # a span implementation that refuses attributes: not the request's
            pass
    return usage
