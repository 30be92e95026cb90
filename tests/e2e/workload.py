"""The end-to-end ASGI workload, without instrumentation: each request burns its own marker.

``GET /burn/{i}`` burns CPU in marker ``i``: handler steps and child-task steps separated by
awaits, then a job in Starlette's thread pool; an unlabelled lifespan task burns meanwhile.
``asgi_app.py`` serves it under spanprof and ``benchmarks/apps/pyroscope_otel_app.py`` the
pyroscope-otel way: one workload, so the accuracy benchmark compares only the instrumentation.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .markers import MARKERS, background_burn

__all__ = ["workload_app"]

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.02"))
HANDLER_STEPS = int(os.environ.get("E2E_HANDLER_STEPS", "4"))
CHILD_STEPS = int(os.environ.get("E2E_CHILD_STEPS", "2"))
POOL_SECONDS = float(os.environ.get("E2E_POOL_SECONDS", "0.04"))


def _nothing() -> None:
    return None


def workload_app(
    request_ids: Callable[[], Mapping[str, str]],
    *,
    startup: Callable[[], None] = _nothing,
    shutdown: Callable[[], None] = _nothing,
) -> Starlette:
    """The workload; ``/burn/{i}`` answers with ``request_ids()`` as JSON.

    ``startup`` runs before the background task starts, ``shutdown`` after it stopped.
    """

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
        return JSONResponse(dict(request_ids()))

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def background(stop: asyncio.Event) -> None:
        while not stop.is_set():
            background_burn(0.005)
            await asyncio.sleep(0.01)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        startup()
        stop = asyncio.Event()
        task = asyncio.create_task(background(stop))
        try:
            yield
        finally:
            stop.set()
            await task
            shutdown()

    return Starlette(
        routes=[Route("/burn/{index:int}", burn), Route("/health", health)], lifespan=lifespan
    )
