"""The load-test app: every kind of exit path, with and without spanprof (LOAD_SPANPROF=0|1).

``/_stats`` sits outside the middleware and reports what must be zero after the load: threads
still carrying labels (the recorder backend sees every push), spans started but not ended, and
the process's resident memory.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from spanprof import ProfilingMiddleware, RecorderBackend

SPANPROF = os.environ.get("LOAD_SPANPROF", "1") == "1"


class CountingProcessor(SpanProcessor):
    """Counts spans started and not yet ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        with self._lock:
            self.open += 1

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self.open -= 1


counting = CountingProcessor()
provider = TracerProvider()
provider.add_span_processor(counting)
trace.set_tracer_provider(provider)
recorder = RecorderBackend(max_switches=1)


async def ok(request: Request) -> Response:
    return PlainTextResponse(f"ok {request.path_params['i']}")


async def error(request: Request) -> Response:
    raise RuntimeError("planned failure")


async def stream(request: Request) -> Response:
    i = request.path_params["i"]

    async def body() -> Any:
        for k in range(5):
            await asyncio.sleep(0)
            yield f"{i}-{k}\n".encode()

    return StreamingResponse(body(), media_type="text/plain")


async def slow_body(request: Request) -> Response:
    async def body() -> Any:
        for _ in range(40):
            await asyncio.sleep(0.005)
            yield b"x" * 1024

    return StreamingResponse(body(), media_type="application/octet-stream")


async def hang(request: Request) -> Response:
    # Answer only after the client gave up (or 10 s): the client's timeout always wins, so the
    # outcome is the same however loaded the machine is.
    for _ in range(1000):
        if await request.is_disconnected():
            break
        await asyncio.sleep(0.01)
    return PlainTextResponse("late")


async def timeout(request: Request) -> Response:
    try:
        await asyncio.wait_for(asyncio.sleep(1), 0.001)
    except asyncio.TimeoutError:
        return PlainTextResponse("timed out", status_code=504)
    return PlainTextResponse("impossible")


async def ws(websocket: WebSocket) -> None:
    await websocket.accept()
    for _ in range(3):
        text = await websocket.receive_text()
        await websocket.send_text(f"echo {text}")
    await websocket.close()


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


inner = Starlette(
    routes=[
        Route("/ok/{i:int}", ok),
        Route("/error/{i:int}", error),
        Route("/stream/{i:int}", stream),
        Route("/slow-body/{i:int}", slow_body),
        Route("/hang/{i:int}", hang),
        Route("/timeout/{i:int}", timeout),
        WebSocketRoute("/ws/{i:int}", ws),
    ]
)
wrapped: Any = ProfilingMiddleware(inner, profiler=recorder) if SPANPROF else inner


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Dispatch /_stats outside the middleware; everything else through it."""
    if scope["type"] == "http" and scope["path"] == "/_stats":
        gc.collect()
        body = json.dumps(
            {
                "labelled_threads": len(recorder.labelled_threads()),
                "open_spans": counting.open,
                "rss_kib": _rss_kib(),
                "python": sys.version,
            }
        ).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
        return
    await wrapped(scope, receive, send)
