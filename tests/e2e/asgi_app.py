"""The end-to-end ASGI app: each request burns CPU in its own marker function.

The workload of ``workload.py`` under ``ProfilingMiddleware``; each response returns the
request's labels. Served by a real uvicorn in a subprocess; the profiler comes from the
PYROSCOPE_* environment.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from spanprof import ProfilingMiddleware, current_labels

from .workload import workload_app

trace.set_tracer_provider(TracerProvider())

app = ProfilingMiddleware(workload_app(current_labels))
