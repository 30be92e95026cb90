"""The exact-profiler end-to-end app: requests burn CPU in short steps, and say how much.

Request ``i`` burns ``1 + i % 2`` units of CPU in its own marker function (``burn_request_ii``,
as in ``markers.py``, but returning the CPU it used, measured with ``time.thread_time`` on the
thread it ran on): handler steps and child-task steps of ``E2E_STEP_SECONDS`` (0.5 ms) separated
by awaits, plus thread-pool jobs through Starlette's ``run_in_threadpool`` and
``loop.run_in_executor`` (under trio: ``trio.to_thread.run_sync``). The response returns the
request's labels and the CPU it burnt. Written against anyio, it runs under asyncio, uvloop
and trio (hypercorn ``--worker-class trio``).
Unlabelled CPU burns meanwhile in a lifespan task and in a plain thread (``E2E_BACKGROUND=0``
turns that off, for throughput runs against ``/health``).

The profiler comes from ``SPANPROF_PROFILER`` and the ``PYROSCOPE_*`` environment.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import sniffio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels

from .markers import MARKER_PREFIX, background_burn

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.0005"))
HANDLER_STEPS = int(os.environ.get("E2E_HANDLER_STEPS", "50"))
CHILD_STEPS = int(os.environ.get("E2E_CHILD_STEPS", "10"))
POOL_JOBS = int(os.environ.get("E2E_POOL_JOBS", "16"))
POOL_SECONDS = float(os.environ.get("E2E_POOL_SECONDS", "0.005"))
# 0 turns the unlabelled background load off (for throughput benchmarks of /health).
BACKGROUND = os.environ.get("E2E_BACKGROUND", "1") != "0"

trace.set_tracer_provider(TracerProvider())


_SOURCE = """
def {name}(seconds):
    started = time.thread_time()
    end = started + seconds
    while time.thread_time() < end:
        pass
    return time.thread_time() - started
"""


def _make(name: str) -> Callable[[float], float]:
    namespace: dict[str, object] = {"time": time}
    exec(_SOURCE.format(name=name), namespace)
    function = namespace[name]
    assert callable(function)
    return function


# Same names as markers.MARKERS, so analysis.attribute finds them in stacks.
TIMED_MARKERS = [_make(f"{MARKER_PREFIX}{i:02d}") for i in range(64)]


async def work(request: Request) -> Response:
    index = int(request.path_params["index"])
    units = 1 + index % 2
    marker = TIMED_MARKERS[index]
    loop_cpu = 0.0
    for _ in range(HANDLER_STEPS * units):
        loop_cpu += marker(STEP)
        await anyio.lowlevel.checkpoint()

    children: list[float] = []

    async def child() -> None:
        cpu = 0.0
        for _ in range(CHILD_STEPS * units):
            cpu += marker(STEP)
            await anyio.lowlevel.checkpoint()
        children.append(cpu)

    async with anyio.create_task_group() as group:
        group.start_soon(child)
        group.start_soon(child)
    loop_cpu += sum(children)
    pool_cpu = 0.0
    for job in range(POOL_JOBS * units):
        if job % 2:
            pool_cpu += await _native_thread(marker, POOL_SECONDS)
        else:
            pool_cpu += await run_in_threadpool(marker, POOL_SECONDS)
    return JSONResponse(
        {
            "labels": dict(current_labels()),
            "loop_cpu": loop_cpu,
            "pool_cpu": pool_cpu,
            "cpu": loop_cpu + pool_cpu,
        }
    )


async def _native_thread(marker: Callable[[float], float], seconds: float) -> float:
    # The event loop's own way to a thread, not anyio's: run_in_executor, or trio's to_thread.
    if sniffio.current_async_library() == "trio":
        import trio

        return await trio.to_thread.run_sync(marker, seconds)
    return await asyncio.get_running_loop().run_in_executor(None, marker, seconds)


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


async def stats(request: Request) -> Response:
    profiler = app.profiler
    read: Callable[[], dict[str, float]] | None = getattr(profiler, "stats", None)
    return JSONResponse(
        {"mode": getattr(profiler, "mode", "pyroscope"), **(read() if read else {})}
    )


async def _background(stop: anyio.Event) -> None:
    while not stop.is_set():
        background_burn(0.002)
        await anyio.sleep(0.01)


def _background_thread(stop: threading.Event) -> None:
    while not stop.is_set():
        background_burn(0.002)
        stop.wait(0.01)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    if not BACKGROUND:
        yield
        return
    stop = anyio.Event()
    stop_thread = threading.Event()
    thread = threading.Thread(target=_background_thread, args=(stop_thread,), daemon=True)
    thread.start()
    async with anyio.create_task_group() as group:
        group.start_soon(_background, stop)
        try:
            yield
        finally:
            stop.set()
            stop_thread.set()
    thread.join()


app = ProfilingMiddleware(
    Starlette(
        routes=[
            Route("/work/{index:int}", work),
            Route("/health", health),
            Route("/stats", stats),
        ],
        lifespan=lifespan,
    ),
    # The default middleware, as a user writes it: the profiler from the environment.
)
