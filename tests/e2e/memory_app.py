"""The memory end-to-end app: requests allocate blocks of known size, keep a part, say how much.

Request ``i`` allocates ``BLOCKS * (1 + i % 2)`` bytes objects of ``PAYLOAD`` bytes in its own
marker function (``alloc_request_ii``), spread over its handler task (in steps separated by
awaits, so requests interleave on the loop), a child task, Starlette's ``run_in_threadpool`` and
``loop.run_in_executor``; one block in ``KEEP_EVERY`` is kept alive until the process exits, the
others are dropped at once. The response returns the request's labels and the true numbers
(bytes allocated and kept, as the allocator saw them: ``sys.getsizeof`` of each block). An
unlabelled lifespan task allocates on the same loop meanwhile (``background_alloc``).

The profiler comes from ``SPANPROF_PROFILER`` and the ``PYROSCOPE_*`` / ``SPANPROF_*`` environment.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from itertools import repeat

import anyio
import anyio.lowlevel
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels

ALLOC_PREFIX = "alloc_request_"
PAYLOAD = int(os.environ.get("E2E_PAYLOAD", "4000"))
BLOCKS = int(os.environ.get("E2E_BLOCKS", "4000"))
KEEP_EVERY = 4
BLOCK = sys.getsizeof(bytes(PAYLOAD))


class _AllocBytes(SpanProcessor):
    """``spanprof.alloc_bytes`` of every ended server span, by span id."""

    def __init__(self) -> None:
        self.spans: dict[str, object] = {}

    def on_end(self, span: ReadableSpan) -> None:
        if span.kind is SpanKind.SERVER and span.context is not None:
            attributes = span.attributes or {}
            self.spans[format(span.context.span_id, "016x")] = attributes.get(
                "spanprof.alloc_bytes"
            )


ALLOC_BYTES = _AllocBytes()
_provider = TracerProvider()
_provider.add_span_processor(ALLOC_BYTES)
trace.set_tracer_provider(_provider)

# Kept blocks, per request: alive until the process exits, so the last upload shows them in use.
KEPT: dict[int, list[bytes]] = {}

_SOURCE = """
def {name}(count, kept):
    # repeat() allocates nothing per step; every KEEP_EVERY-th block is kept, the rest freed.
    n = 0
    for _ in repeat(None, count // KEEP_EVERY):
        kept.append(bytes(PAYLOAD))
        for _ in repeat(None, KEEP_EVERY - 1):
            bytes(PAYLOAD)
        n += KEEP_EVERY
    return n
"""


def _make(name: str) -> Callable[[int, list[bytes]], int]:
    namespace: dict[str, object] = {"repeat": repeat, "KEEP_EVERY": KEEP_EVERY, "PAYLOAD": PAYLOAD}
    exec(_SOURCE.format(name=name), namespace)
    function = namespace[name]
    assert callable(function)
    return function


ALLOCATORS = [_make(f"{ALLOC_PREFIX}{i:02d}") for i in range(64)]


def alloc_index(function_names: list[str] | tuple[str, ...]) -> int | None:
    """The request's allocating function in a stack, if any."""
    for name in function_names:
        if name.startswith(ALLOC_PREFIX):
            return int(name[len(ALLOC_PREFIX) :])
    return None


async def alloc(request: Request) -> Response:
    index = int(request.path_params["index"])
    units = 1 + index % 2
    allocate = ALLOCATORS[index]
    kept = KEPT.setdefault(index, [])
    total = BLOCKS * units
    step = 200
    blocks = 0
    # Half in the handler's own task, in steps: the requests interleave on the loop.
    for _ in range(total // 2 // step):
        blocks += allocate(step, kept)
        await anyio.lowlevel.checkpoint()
    counts: list[int] = []

    async def child() -> None:
        done = 0
        for _ in range(total // 8 // step):
            done += allocate(step, kept)
            await anyio.lowlevel.checkpoint()
        counts.append(done)

    async with anyio.create_task_group() as group:
        group.start_soon(child)
        group.start_soon(child)
    blocks += sum(counts)
    for job in range(total // 4 // step):
        if job % 2:
            blocks += await asyncio.get_running_loop().run_in_executor(None, allocate, step, kept)
        else:
            blocks += await run_in_threadpool(allocate, step, kept)
    return JSONResponse(
        {
            "labels": dict(current_labels()),
            "allocated": blocks * BLOCK,
            "kept": len(kept) * BLOCK,
        }
    )


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


async def stats(request: Request) -> Response:
    profiler = app.profiler
    read: Callable[[], dict[str, float]] | None = getattr(profiler, "stats", None)
    return JSONResponse(
        {
            "mode": getattr(profiler, "mode", "pyroscope"),
            **(read() if read else {}),
            "span_alloc_bytes": dict(ALLOC_BYTES.spans),
        }
    )


def background_alloc(count: int) -> None:
    """Unlabelled allocations on the loop, between the requests' steps."""
    for _ in repeat(None, count):
        bytes(PAYLOAD)


async def _background(stop: anyio.Event) -> None:
    while not stop.is_set():
        background_alloc(100)
        await anyio.sleep(0.002)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(_background, stop)
        try:
            yield
        finally:
            stop.set()


app = ProfilingMiddleware(
    Starlette(
        routes=[
            Route("/alloc/{index:int}", alloc),
            Route("/health", health),
            Route("/stats", stats),
        ],
        lifespan=lifespan,
    ),
)
