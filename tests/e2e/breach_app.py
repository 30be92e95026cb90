"""The breach-profile end-to-end app: a quarter of the requests run an extra function and breach.

``GET /checkout/{order}`` burns ``E2E_BASE_SECONDS`` of CPU in ``base_work`` and, for every
fourth order, ``E2E_EXTRA_SECONDS`` more in ``slow_path``, both in 0.5 ms steps separated by
awaits (so concurrent requests interleave). The response says how much CPU each function used,
measured with ``time.thread_time``. ``/verdicts`` returns every ended server span's SLO verdict
(``spanprof.slo.breached``) and ``spanprof.cpu_time_s`` by span id, so a test can tell which
value of the ``slo`` label each request's samples must carry.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import anyio.lowlevel
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels

STEP = 0.0005
BASE = float(os.environ.get("E2E_BASE_SECONDS", "0.002"))
EXTRA = float(os.environ.get("E2E_EXTRA_SECONDS", "0.008"))


class _Verdicts(SpanProcessor):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, dict[str, Any]] = {}

    def on_end(self, span: ReadableSpan) -> None:
        if span.kind is not SpanKind.SERVER or span.context is None:
            return
        attributes = span.attributes or {}
        with self.lock:
            self.spans[format(span.context.span_id, "016x")] = {
                "breached": bool(attributes.get("spanprof.slo.breached", False)),
                "cpu_time_s": attributes.get("spanprof.cpu_time_s"),
                "name": span.name,
            }


VERDICTS = _Verdicts()
_provider = TracerProvider()
_provider.add_span_processor(VERDICTS)
trace.set_tracer_provider(_provider)


def base_work(seconds: float) -> float:
    started = time.thread_time()
    end = started + seconds
    while time.thread_time() < end:
        pass
    return time.thread_time() - started


def slow_path(seconds: float) -> float:
    started = time.thread_time()
    end = started + seconds
    while time.thread_time() < end:
        pass
    return time.thread_time() - started


async def _burn(function: Any, seconds: float) -> float:
    used = 0.0
    for _ in range(max(1, round(seconds / STEP))):
        used += function(STEP)
        await anyio.lowlevel.checkpoint()
    return used


async def checkout(request: Request) -> Response:
    order = int(request.path_params["order"])
    base = await _burn(base_work, BASE)
    extra = await _burn(slow_path, EXTRA) if order % 4 == 0 else 0.0
    return JSONResponse({"labels": dict(current_labels()), "base": base, "extra": extra})


async def verdicts(request: Request) -> Response:
    with VERDICTS.lock:
        return JSONResponse(dict(VERDICTS.spans))


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


def make_app() -> ProfilingMiddleware:
    """The app, for ``spanprof dev --factory`` and for uvicorn (``app`` below)."""
    return ProfilingMiddleware(
        Starlette(
            routes=[
                Route("/checkout/{order:int}", checkout),
                Route("/verdicts", verdicts),
                Route("/health", health),
            ]
        ),
        excluded_urls="/health,/verdicts",
    )


app = make_app()
