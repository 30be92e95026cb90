"""The end-to-end ASGI app: each request burns CPU in its own marker function.

Served by a real uvicorn in a subprocess; the profiler comes from the PYROSCOPE_* environment.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels

from .markers import MARKERS, background_burn

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.02"))
HANDLER_STEPS = int(os.environ.get("E2E_HANDLER_STEPS", "4"))
CHILD_STEPS = int(os.environ.get("E2E_CHILD_STEPS", "2"))
POOL_SECONDS = float(os.environ.get("E2E_POOL_SECONDS", "0.04"))

trace.set_tracer_provider(TracerProvider())


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
    return JSONResponse(dict(current_labels()))


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


async def _background(stop: asyncio.Event) -> None:
    while not stop.is_set():
        background_burn(0.005)
        await asyncio.sleep(0.01)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(_background(stop))
    try:
        yield
    finally:
        stop.set()
        await task


app = ProfilingMiddleware(
    Starlette(
        routes=[Route("/burn/{index:int}", burn), Route("/health", health)], lifespan=lifespan
    )
)
