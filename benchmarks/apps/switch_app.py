"""One server, every configuration of the exact section's HTTP run, switched between rounds.

Fresh server processes of one configuration differ by several percent in CPU per response
(memory layout, hash seeds), as much as the profiler costs: comparing configurations across
processes measures the processes as much as the profiler. This app serves ``GET /health`` (a
2-byte ``PlainTextResponse``) through one ``ProfilingMiddleware`` per configuration, all in one
process, and ``GET /switch?NAME`` routes the following requests through configuration ``NAME``:
it stops the profiler the previous one started and starts that one's, as a server starting up
would. The benchmark gives each server each configuration in turn (``bench_exact``), so that a
configuration's effect is measured within processes.

Configurations (``CONFIGURATIONS``, and ``RATE_CONFIGURATIONS`` for the pairs section): ``off``
has no profiler; the others are the default profiler as ``SPANPROF_PROFILER`` unset configures
it from this process's environment, with the overrides named. Requests are traced by an SDK
tracer provider without an exporter, as in the in-process rounds. ``GET /stats?NAME`` answers
that configuration's profiler counters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from spanprof import ProfilingMiddleware

__all__ = ["CONFIGURATIONS", "NEVER_SAMPLE_BYTES", "RATE_CONFIGURATIONS", "app"]

#: The largest mean gap between allocation samples: the hooks run, and almost never sample.
NEVER_SAMPLE_BYTES = 1 << 40

#: Each configuration's overrides of the environment (``None``: no profiler).
CONFIGURATIONS: Mapping[str, Mapping[str, str] | None] = {
    "off": None,
    "exact": {},
    "hooks": {"SPANPROF_ALLOC_SAMPLE_BYTES": str(NEVER_SAMPLE_BYTES)},
    "nomem": {"SPANPROF_MEMORY": "false"},
    "nomem_1hz": {"SPANPROF_MEMORY": "false", "PYROSCOPE_SAMPLE_RATE": "1"},
}

#: Configurations the pairs section also switches to, outside the exact section's rounds: the
#: default with allocation samples 16 times rarer and 16 times more often.
RATE_CONFIGURATIONS: Mapping[str, Mapping[str, str]] = {
    "mem_8m": {"SPANPROF_ALLOC_SAMPLE_BYTES": str(8 << 20)},
    "mem_32k": {"SPANPROF_ALLOC_SAMPLE_BYTES": str(32 << 10)},
}


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


def _middlewares() -> dict[str, ProfilingMiddleware]:
    inner = Starlette(routes=[Route("/health", health)])
    base = dict(os.environ)
    # An SDK tracer provider (no exporter), one for all: as in an app that traces, each request
    # gets a recording span, so its labels carry the span and its end reaches the profiler.
    # Without one, every span is the API's non-recording span, and the request path's labelled
    # work goes unmeasured.
    tracing = TracerProvider()
    return {
        name: ProfilingMiddleware(inner, profiler=None, environ=base, tracer_provider=tracing)
        if overrides is None
        else ProfilingMiddleware(inner, environ={**base, **overrides}, tracer_provider=tracing)
        for name, overrides in {**CONFIGURATIONS, **RATE_CONFIGURATIONS}.items()
    }


# Built on the first request, in the server: importing this module builds nothing.
_apps: dict[str, ProfilingMiddleware] = {}
_current = ["off"]


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(data)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _switch(name: str) -> None:
    previous = _apps[_current[0]]
    if name == _current[0]:
        return
    previous._runtime.stop()
    _current[0] = name
    _apps[name]._runtime.start()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The configuration of the moment, or the benchmark's ``/switch`` and ``/stats``."""
    if not _apps:
        _apps.update(_middlewares())
    if scope["type"] == "http" and scope["path"] in ("/switch", "/stats"):
        name = scope["query_string"].decode()
        if name not in _apps:
            await _answer(send, 404, {"error": f"no configuration {name!r}"})
            return
        if scope["path"] == "/switch":
            _switch(name)
            await _answer(send, 200, {"current": name})
            return
        profiler = _apps[name].profiler
        stats = getattr(profiler, "stats", None)
        await _answer(
            send, 200, {"mode": getattr(profiler, "mode", None), **(stats() if stats else {})}
        )
        return
    if scope["type"] == "lifespan":
        # The lifespan is the server's, not a configuration's: the profilers start on switch.
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                _apps[_current[0]]._runtime.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
    await _apps[_current[0]](scope, receive, send)
