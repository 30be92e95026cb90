"""Each request's span end reaches the profiler with its SLO verdict; the span gets its CPU."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from spanprof import ProfilingMiddleware, RecorderBackend, WSGIProfilingMiddleware
from spanprof._labels._backend import SpanUsage, span_usage
from spanprof._labels._engine import uninstall_label_engine
from spanprof._labels._labelset import LABELS
from spanprof._profiling._runtime import stop_started

from .conftest import histogram_points

CPU_NS = 1_234_567


@pytest.fixture(autouse=True)
def _stop_the_profilers_started() -> Iterator[None]:
    """Each middleware here starts its backend and the label engine on its first request:
    stopped after each test, so that the next test (or file) finds no engine installed (the
    runtime may be gone by then: the engine outlives it)."""
    try:
        yield
    finally:
        stop_started()
        uninstall_label_engine()


class _EndingBackend(RecorderBackend):
    """A recorder that also takes span ends, as the exact backend does."""

    def __init__(
        self, *, fail: bool = False, cpu_ns: int = CPU_NS, alloc_bytes: int | None = None
    ) -> None:
        super().__init__()
        self.ended: list[tuple[str, bool | None]] = []
        self.fail = fail
        self.cpu_ns = cpu_ns
        self.alloc_bytes = alloc_bytes

    def end_span(self, span_id: str, breached: bool | None) -> SpanUsage | None:
        if self.fail:
            raise RuntimeError("injected")
        self.ended.append((span_id, breached))
        return SpanUsage(self.cpu_ns, self.alloc_bytes)


async def _sleepy(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("sleep", "0")))
    return PlainTextResponse(LABELS.get().get("span_id", ""))


async def _stream(request: Request) -> Response:
    async def body() -> Any:
        for _ in range(2):
            await asyncio.sleep(0.03)
            yield b"chunk"

    return StreamingResponse(body())


async def _fail(request: Request) -> Response:
    raise ValueError("nope")


def _server_spans(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    return {format(s.context.span_id, "016x"): s for s in spans if s.context is not None}


def _check(
    backend: _EndingBackend,
    exporter: InMemorySpanExporter,
    reader: InMemoryMetricReader,
    requests: int,
) -> None:
    spans = _server_spans(exporter)
    assert len(spans) == requests
    # Once per request, with the verdict the span itself carries.
    assert sorted(span_id for span_id, _ in backend.ended) == sorted(spans)
    for span_id, breached in backend.ended:
        attributes = spans[span_id].attributes or {}
        assert breached is bool(attributes.get("spanprof.slo.breached", False)), span_id
        assert attributes["spanprof.cpu_time_s"] == pytest.approx(CPU_NS / 1e9)
        # Only a backend sampling allocations reports them, and only when some were sampled.
        assert attributes.get("spanprof.alloc_bytes") == (backend.alloc_bytes or None)
    points = histogram_points(reader, "http.server.request.cpu_time")
    assert sum(p.count for p in points) == requests
    assert sum(p.sum for p in points) == pytest.approx(requests * CPU_NS / 1e9)


@pytest.mark.parametrize("alloc_bytes", [123_456, 0])
def test_asgi_tells_the_profiler_each_verdict_while_the_span_is_open(
    alloc_bytes: int,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Fast, slow, streamed and failing requests: one end_span each, verdict as on the span."""
    backend = _EndingBackend(alloc_bytes=alloc_bytes)
    app = ProfilingMiddleware(
        Starlette(routes=[Route("/s", _sleepy), Route("/stream", _stream), Route("/fail", _fail)]),
        profiler=backend,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        slo_seconds=0.05,
        environ={},
    )
    paths = ["/s", "/s?sleep=0.08", "/stream", "/fail", "/s", "/s?sleep=0.06"]

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get(path)).status_code for path in paths]

    assert asyncio.run(main()) == [200, 200, 200, 500, 200, 200]
    assert sum(1 for _, breached in backend.ended if breached) == 3
    _check(backend, span_exporter, metric_reader, len(paths))


def test_a_reused_server_span_a_raising_app_left_gets_its_verdict_once(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Under an outer OpenTelemetry middleware (or FastAPI's telemetry) spanprof labels that
    middleware's span. An app that raises sends no response through spanprof (the error page
    goes out further out): the profiler was told no verdict, so a slow failing request's
    samples left the hold without `slo`, while the span and the exemplar said breached."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.metrics import NoOpMeterProvider

    async def failing(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.08 if scope["path"] == "/slow" else 0)
        raise RuntimeError("the app failed")

    backend = _EndingBackend()
    inner = ProfilingMiddleware(
        failing,
        profiler=backend,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        slo_seconds=0.05,
        environ={},
    )
    app = OpenTelemetryMiddleware(
        inner, tracer_provider=tracer_provider, meter_provider=NoOpMeterProvider()
    )

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get(path)).status_code for path in ("/slow", "/fast")]

    assert asyncio.run(main()) == [500, 500]
    assert [breached for _, breached in backend.ended] == [True, False]
    _check(backend, span_exporter, metric_reader, 2)


def test_wsgi_tells_the_profiler_each_verdict_while_the_span_is_open(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """The WSGI shim does the same for fast and slow requests."""
    backend = _EndingBackend()

    def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("QUERY_STRING") == "slow":
            time.sleep(0.08)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    app = WSGIProfilingMiddleware(
        wsgi_app,
        profiler=backend,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        slo_seconds=0.05,
        environ={},
    )
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as client:
        for path in ["/a", "/a?slow", "/a"]:
            assert client.get(path).status_code == 200
    assert [breached for _, breached in backend.ended] == [False, True, False]
    _check(backend, span_exporter, metric_reader, 3)


def test_a_failing_end_span_never_reaches_the_request(
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The profiler raising on a span end: responses unchanged, one log line."""
    backend = _EndingBackend(fail=True)
    app = ProfilingMiddleware(
        Starlette(routes=[Route("/s", _sleepy)]),
        profiler=backend,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        environ={},
    )

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get("/s")).status_code for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="spanprof"):
        assert asyncio.run(main()) == [200, 200, 200]
    failures = [r for r in caplog.records if "SLO verdict" in r.getMessage()]
    assert len(failures) == 1


def test_requests_without_samples_record_no_cpu_time(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """No sample landed in the request: neither its span nor the CPU histogram records CPU.

    An attribute on every short request would cost the SDK a lock and a value check each.
    """
    backend = _EndingBackend(cpu_ns=0)
    app = ProfilingMiddleware(
        Starlette(routes=[Route("/s", _sleepy)]),
        profiler=backend,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        environ={},
    )

    async def main() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/s")).status_code

    assert asyncio.run(main()) == 200
    (span,) = _server_spans(span_exporter).values()
    assert "spanprof.cpu_time_s" not in (span.attributes or {})
    assert histogram_points(metric_reader, "http.server.request.cpu_time") == []
    assert (
        sum(p.count for p in histogram_points(metric_reader, "http.server.request.duration")) == 1
    )


@pytest.mark.parametrize(
    ("cpu_ns", "alloc_bytes"), [(0, None), (0, 0), (7, None), (0, 512), (7, 512)]
)
def test_span_usage_makes_what_the_named_tuple_makes(cpu_ns: int, alloc_bytes: int | None) -> None:
    """The request path's cheap constructor gives the same value, of the same type."""
    usage = span_usage(cpu_ns, alloc_bytes)
    assert type(usage) is SpanUsage
    assert usage == SpanUsage(cpu_ns, alloc_bytes)
    assert (usage.cpu_ns, usage.alloc_bytes) == (cpu_ns, alloc_bytes)
