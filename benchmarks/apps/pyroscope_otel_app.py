"""The accuracy benchmark's handler, instrumented the pyroscope-otel way (the peer we compare).

Same routes, marker burns, child task, thread-pool work and unlabelled background task as
``tests/e2e/asgi_app.py`` (served with spanprof), but: ``pyroscope.configure`` from the
``PYROSCOPE_*`` environment at lifespan startup, an SDK ``TracerProvider`` with pyroscope-otel's
``PyroscopeSpanProcessor`` (thread tags added on span start, removed on span end), and
OpenTelemetry's ASGI middleware with its defaults. Each response returns the ids of the server
span it ran in, so the benchmark can check whose labels each sample carried.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pyroscope
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from pyroscope.otel import PyroscopeSpanProcessor
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from tests.e2e.markers import MARKERS, background_burn

__all__ = ["app"]

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.02"))
HANDLER_STEPS = int(os.environ.get("E2E_HANDLER_STEPS", "4"))
CHILD_STEPS = int(os.environ.get("E2E_CHILD_STEPS", "2"))
POOL_SECONDS = float(os.environ.get("E2E_POOL_SECONDS", "0.04"))


def _span_ids() -> dict[str, str]:
    span = trace.get_current_span()
    ctx = span.get_span_context()
    return {
        "span_id": format(ctx.span_id, "016x"),
        "trace_id": format(ctx.trace_id, "032x"),
        "span_name": str(getattr(span, "name", "")),
    }


async def burn(request: Request) -> Response:
    marker = MARKERS[int(request.path_params["index"])]
    for _ in range(HANDLER_STEPS):
        marker(STEP)
        await asyncio.sleep(0)

    async def child() -> None:
        for _ in range(CHILD_STEPS):
            marker(STEP)
            await asyncio.sleep(0)

    await asyncio.create_task(child())
    await run_in_threadpool(marker, POOL_SECONDS)
    return JSONResponse(_span_ids())


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


async def _background(stop: asyncio.Event) -> None:
    while not stop.is_set():
        background_burn(0.005)
        await asyncio.sleep(0.01)


def _configure_pyroscope() -> None:
    # What a pyroscope-otel user writes: the agent configured directly, from the environment.
    interval = os.environ.get("PYROSCOPE_UPLOAD_INTERVAL", "10").strip().removesuffix("s")
    pyroscope.configure(
        application_name=os.environ.get("PYROSCOPE_APPLICATION_NAME", "pyroscope-otel-app"),
        server_address=os.environ["PYROSCOPE_SERVER_ADDRESS"],
        upload_interval=int(interval),
    )


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    _configure_pyroscope()
    stop = asyncio.Event()
    task = asyncio.create_task(_background(stop))
    try:
        yield
    finally:
        stop.set()
        await task
        pyroscope.shutdown()  # sends the last window


_provider = TracerProvider()
_provider.add_span_processor(PyroscopeSpanProcessor())

app = OpenTelemetryMiddleware(
    Starlette(
        routes=[Route("/burn/{index:int}", burn), Route("/health", health)], lifespan=lifespan
    ),
    tracer_provider=_provider,
)
