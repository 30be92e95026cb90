"""The accuracy benchmark's workload, instrumented the pyroscope-otel way (the peer we compare).

The workload of ``tests/e2e/workload.py`` (which ``tests/e2e/asgi_app.py`` serves with spanprof),
but: ``pyroscope.configure`` from the ``PYROSCOPE_*`` environment at lifespan startup, an SDK
``TracerProvider`` with pyroscope-otel's ``PyroscopeSpanProcessor`` (thread tags added on span
start, removed on span end), and OpenTelemetry's ASGI middleware with its defaults. Each
response returns the ids of the server span it ran in, so the benchmark can check whose labels
each sample carried.
"""

from __future__ import annotations

import os

import pyroscope
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from pyroscope.otel import PyroscopeSpanProcessor
from tests.e2e.workload import workload_app

__all__ = ["app"]


def _span_ids() -> dict[str, str]:
    span = trace.get_current_span()
    ctx = span.get_span_context()
    return {
        "span_id": format(ctx.span_id, "016x"),
        "trace_id": format(ctx.trace_id, "032x"),
        "span_name": str(getattr(span, "name", "")),
    }


def _configure_pyroscope() -> None:
    # What a pyroscope-otel user writes: the agent configured directly, from the environment.
    interval = os.environ.get("PYROSCOPE_UPLOAD_INTERVAL", "10").strip().removesuffix("s")
    pyroscope.configure(
        application_name=os.environ.get("PYROSCOPE_APPLICATION_NAME", "pyroscope-otel-app"),
        server_address=os.environ["PYROSCOPE_SERVER_ADDRESS"],
        upload_interval=int(interval),
    )


_provider = TracerProvider()
_provider.add_span_processor(PyroscopeSpanProcessor())

app = OpenTelemetryMiddleware(
    # pyroscope.shutdown() sends the last window.
    workload_app(_span_ids, startup=_configure_pyroscope, shutdown=pyroscope.shutdown),
    tracer_provider=_provider,
)
