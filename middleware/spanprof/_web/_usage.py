"""A request's span ends: the profiler learns its SLO verdict, the span what it used.

``spanprof.cpu_time_s`` is the CPU the span's own samples account for, and
``spanprof.alloc_bytes`` the bytes its sampled allocations stand for. Each is left out at 0 (no
tick landed in the request, none of its allocations was sampled: most short requests), as the
CPU histogram leaves such requests out: an attribute costs the SDK a lock and a value check,
about 2% of a trivial request on a slow machine, for a figure the span's absence already says.
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
    # The backend's end_span called here, not through a method of the runtime's: the request
    # path pays about 1,000 instructions a Python frame.
    end = runtime.span_ender
    if end is None:
        return None
    try:
        usage = end(span_id, breached)
    except Exception:
        runtime.end_span_failed()
        return None
    # Most requests have nothing to set: asked first, that spares them the SDK's Python call.
    if (
        usage is not None
        and (usage.cpu_ns or usage.alloc_bytes)
        and span is not None
        and span.is_recording()
    ):
        try:
            if usage.cpu_ns:
                span.set_attribute(CPU_TIME_ATTRIBUTE, usage.cpu_ns / 1e9)
            if usage.alloc_bytes:
                span.set_attribute(ALLOC_BYTES_ATTRIBUTE, usage.alloc_bytes)
        except Exception:  # a span implementation that refuses attributes: not the request's
            pass
    return usage
