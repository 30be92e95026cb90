"""The Prometheus end-to-end app: a slow route that breaches its SLO and a /metrics endpoint."""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, PrometheusMetrics, current_labels

trace.set_tracer_provider(TracerProvider())
metrics = PrometheusMetrics()


async def work(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("sleep", "0")))
    return JSONResponse(dict(current_labels()))


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


app = ProfilingMiddleware(
    Starlette(
        routes=[
            Route("/work", work),
            Route("/health", health),
            Route("/metrics", metrics.asgi_app()),
        ]
    ),
    profiler=None,
    route_slos={"/work": 0.1},
    prometheus=metrics,
)
