"""The middlewares never change what an app does: how it is called, how often, what it serves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from wsgiref.util import setup_testing_defaults

import pytest
from opentelemetry.instrumentation.utils import suppress_http_instrumentation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer
from opentelemetry.trace import TracerProvider as APITracerProvider
from starlette.endpoints import HTTPEndpoint, WebSocketEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from spanprof import ProfilingMiddleware, RecorderBackend, WSGIProfilingMiddleware, current_labels
from spanprof._labels import _engine

from .asgi_driver import websocket_session
from .conftest import run_on
from .e2e.server import free_port
from .exporting import log_messages

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment


def _scope(path: str = "/", headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers if headers is not None else [(b"host", b"test")],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }


async def _call(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one request through ``app``; the messages it sent (even if it raised)."""
    messages: list[dict[str, Any]] = []
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        messages.append(dict(message))

    try:
        await app(scope, receive, send)
    except RuntimeError as exc:
        messages.append({"type": "raised", "error": str(exc)})
    return messages


def _server_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


# --- 6: class-based ASGI apps ---------------------------------------------------------------


class _Endpoint(HTTPEndpoint):
    async def get(self, request: Request) -> Response:
        return JSONResponse(dict(current_labels()))


class _Socket(WebSocketEndpoint):
    encoding = "text"

    async def on_connect(self, websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json(dict(current_labels()))
        await websocket.close()


def test_an_http_endpoint_class_is_called_as_the_server_calls_it(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """An ``HTTPEndpoint`` subclass as the app (ASGI3 by ``__await__``) serves, labelled."""
    app = ProfilingMiddleware(_Endpoint, profiler=None, tracer_provider=tracer_provider)
    messages = asyncio.run(_call(app, _scope()))
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["status"] == 200
    (span,) = _server_spans(span_exporter)
    assert json.loads(messages[1]["body"])["span_id"] == format(span.context.span_id, "016x")


def test_a_websocket_endpoint_class_is_called_as_the_server_calls_it(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A ``WebSocketEndpoint`` subclass as the app accepts, sends with its span's labels."""
    app = ProfilingMiddleware(_Socket, profiler=None, tracer_provider=tracer_provider)
    sent = asyncio.run(websocket_session(app, "/ws"))
    (span,) = _server_spans(span_exporter)
    assert len(sent) == 1
    assert json.loads(sent[0]["text"])["span_id"] == format(span.context.span_id, "016x")


# --- 8: never run the app twice ---------------------------------------------------------------


def test_a_failing_app_under_suppressed_instrumentation_runs_once(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Under ``suppress_http_instrumentation()`` OTel makes no span: a failure is not retried."""
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 500, "headers": []})
        message = await receive()
        assert message["type"] == "http.request"  # a second run would see http.disconnect
        raise RuntimeError("app failed")

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)

    async def main() -> list[dict[str, Any]]:
        with suppress_http_instrumentation():
            return await _call(middleware, _scope("/x"))

    messages = asyncio.run(main())
    assert calls == ["/x"]
    assert [m["type"] for m in messages] == ["http.response.start", "raised"]
    assert messages[1]["error"] == "app failed"
    assert span_exporter.get_finished_spans() == ()


def test_undecodable_headers_still_run_the_app_once(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """The retry for headers OTel cannot read stays: OTel fails first, the app runs once."""
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        raise RuntimeError("app failed")

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    messages = asyncio.run(_call(middleware, _scope("/y", [(b"traceparent", b"\x80\\")])))
    assert calls == ["/y"]
    assert messages == [{"type": "raised", "error": "app failed"}]
    assert len(_server_spans(span_exporter)) == 1


# --- 9: the SLO verdict reaches the span on every path ---------------------------------------


@pytest.mark.parametrize("ending", ["raises", "returns-without-body", "raises-after-start"])
def test_a_slow_request_that_does_not_complete_is_marked_breached(
    ending: str, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A slow app that raises or returns early still gets ``spanprof.slo.breached``."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if ending == "raises-after-start":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.03)
        if ending != "returns-without-body":
            raise RuntimeError("slow and failed")

    middleware = ProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, slo_seconds=0.01
    )
    asyncio.run(_call(middleware, _scope()))
    (span,) = _server_spans(span_exporter)
    assert span.attributes is not None
    assert span.attributes.get("spanprof.slo.breached") is True
    assert span.attributes.get("spanprof.slo.threshold_s") == 0.01


# --- 7: WSGI bodies the server never closes ---------------------------------------------------


def _environ(**overrides: str) -> dict[str, Any]:
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    environ.update(overrides)
    return environ


def _durations(reader: InMemoryMetricReader) -> list[HistogramDataPoint]:
    data = reader.get_metrics_data()
    if data is None:
        return []
    return [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "http.server.request.duration"
        for point in metric.data.data_points
        if isinstance(point, HistogramDataPoint)
    ]


@pytest.mark.parametrize("body_kind", ["list", "generator"])
def test_a_wsgi_body_read_to_the_end_but_never_closed_ends_its_request(
    body_kind: str, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """The span ends and the duration is recorded once the body is exhausted, without close()."""
    seen: list[dict[str, str]] = []

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        if body_kind == "list":
            return [b"a", b"b"]

        def body() -> Iterator[bytes]:
            for chunk in (b"a", b"b"):
                seen.append(dict(current_labels()))
                yield chunk

        return body()

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    try:
        middleware = WSGIProfilingMiddleware(
            app, profiler=None, tracer_provider=tracer_provider, meter_provider=meters, environ={}
        )
        body = middleware(_environ(), lambda status, headers, exc_info=None: lambda data: None)
        assert b"".join(body) == b"ab"  # a server that never calls close()
        (span,) = _server_spans(span_exporter)
        (point,) = _durations(reader)
    finally:
        meters.shutdown()
    assert point.count == 1
    assert point.attributes is not None
    assert point.attributes["http.response.status_code"] == 200
    if body_kind == "generator":  # every next() still ran with the request's labels
        assert [labels["span_id"] for labels in seen] == [format(span.context.span_id, "016x")] * 2
    assert current_labels() == {}


def test_werkzeugs_test_client_ends_every_span(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Under werkzeug's test client (which does not close bodies) every request's span ends."""
    from flask import Flask, Response

    flask = Flask("transparency")

    @flask.get("/stream")
    def stream() -> Response:
        return Response(iter([b"x", b"y"]))

    @flask.get("/plain")
    def plain() -> str:
        return "ok"

    flask.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        flask.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    client = flask.test_client()
    for _ in range(5):
        assert client.get("/stream").data == b"xy"
        assert client.get("/plain").data == b"ok"
    spans = _server_spans(span_exporter)
    assert sorted(s.name for s in spans) == ["GET /plain"] * 5 + ["GET /stream"] * 5


# --- 10: a span that cannot be set up never fails the request --------------------------------


def test_a_wsgi_request_whose_span_cannot_be_set_up_is_served_unlabelled(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``Host: example.com:abc`` (SERVER_PORT "abc" under gunicorn on a unix socket): 200, once."""
    calls: list[dict[str, str]] = []

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        calls.append(dict(current_labels()))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"served"]

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        statuses.append(status)
        return lambda data: None

    for _ in range(2):
        environ = _environ(HTTP_HOST="example.com:abc", SERVER_PORT="abc")
        body = middleware(environ, start_response)
        assert b"".join(body) == b"served"
    assert statuses == ["200 OK", "200 OK"]
    assert calls == [{}, {}]
    assert span_exporter.get_finished_spans() == ()
    logged = [r for r in caplog.records if "span failed" in r.getMessage()]
    assert len(logged) == 1


# --- 11: uvloop without lifespan: the request that hooks the loop is labelled too ------------


@pytest.mark.parametrize("proxy", ["c", "python"])
def test_the_request_that_hooks_a_uvloop_loop_runs_every_step_with_its_labels(
    proxy: str,
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No lifespan: the first request's task predates the task factory; its steps still sync."""
    if proxy == "python":
        monkeypatch.setattr(_engine, "_CLabelledCoroutine", None)
    steps: dict[str, list[tuple[str | None, str | None]]] = {}
    second_started = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        mine = steps.setdefault(path, [])
        if path == "/first":
            await second_started.wait()
        else:
            second_started.set()
        for _ in range(5):
            await asyncio.sleep(0)
            # What the profiler would attach to a sample now, against the request's own span.
            mine.append((recorder.thread_labels().get("span_id"), current_labels().get("span_id")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)

    async def main() -> None:
        # As a server does: a task per request, the first created before any hook exists.
        first = asyncio.get_running_loop().create_task(_call(middleware, _scope("/first")))
        await asyncio.sleep(0)  # the first request hooks the loop
        second = asyncio.get_running_loop().create_task(_call(middleware, _scope("/second")))
        await asyncio.gather(first, second)

    run_on("uvloop", main)
    assert set(steps) == {"/first", "/second"}
    for path, seen in steps.items():
        assert len(seen) == 5
        assert all(thread == own and own is not None for thread, own in seen), (path, seen)


def test_uvicorn_on_uvloop_without_lifespan_labels_its_first_request_too(
    tracer_provider: TracerProvider,
) -> None:
    """A real uvicorn (uvloop, ``--lifespan off``) on loopback: every step of both requests."""
    import httpx
    import uvicorn

    backend = RecorderBackend()
    steps: dict[str, list[bool]] = {}
    second_started: list[asyncio.Event] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if not second_started:
            second_started.append(asyncio.Event())
        path = scope["path"]
        mine = steps.setdefault(path, [])
        if path == "/first":
            await asyncio.wait_for(second_started[0].wait(), 5)
        else:
            second_started[0].set()
        for _ in range(5):
            await asyncio.sleep(0.001)
            own = current_labels().get("span_id")
            mine.append(own is not None and backend.thread_labels().get("span_id") == own)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = ProfilingMiddleware(app, profiler=backend, tracer_provider=tracer_provider)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            middleware,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            lifespan="off",
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started

        def get(path: str) -> int:
            return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code

        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(get, "/first")
            time.sleep(0.2)  # the first request hooks the loop before the second arrives
            second = pool.submit(get, "/second")
            assert (first.result(), second.result()) == (200, 200)
    finally:
        server.should_exit = True
        thread.join(10)
        _engine.uninstall_label_engine()
    assert steps == {"/first": [True] * 5, "/second": [True] * 5}


# --- 12: OpenTelemetry failing around an ASGI app never fails its request ---------------------


async def _exchange(app: Any, scope: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """Run one request through ``app``: the messages it sent and what it raised (or None)."""
    try:
        return await _call(app, scope), None
    except BaseException as exc:
        return [], exc


class _FailingProcessor(SpanProcessor):
    """A span processor that raises where the SDK does not catch it (fault injection)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.where == "on_start":
            raise KeyError("tenant")

    def on_end(self, span: Any) -> None:
        if self.where == "on_end":
            raise KeyError("exporter queue")


def _failing_provider(where: str, exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(_FailingProcessor(where))
    return provider


class _DownTracer(Tracer):
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer down")

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer down")


class _DownProvider(APITracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Tracer:
        return _DownTracer()


def _serving_app(seen: list[Any]) -> Any:
    """An app that answers ``ok`` and notes the scope it got and whether a send raised."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        seen.append("sent")

    return app


@pytest.mark.parametrize(
    ("query", "headers"),
    [
        (b"q=caf\xe9", [(b"host", b"test")]),  # uvicorn with httptools passes the byte through
        (b"", [(b"host", b"test"), (b"traceparent", b"\x80\\")]),
    ],
    ids=["query-string", "header"],
)
def test_a_request_otel_cannot_decode_is_traced_and_the_app_gets_the_servers_scope(
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """OTel is shown a decodable copy; the app runs once, on the very scope the server made."""
    seen: list[Any] = []
    middleware = ProfilingMiddleware(
        _serving_app(seen), profiler=None, tracer_provider=tracer_provider
    )
    scope = {**_scope("/search", headers), "query_string": query}
    original = {**scope, "headers": list(headers)}
    messages, raised = asyncio.run(_exchange(middleware, scope))
    assert raised is None
    assert [(m["type"], m.get("status"), m.get("body")) for m in messages] == [
        ("http.response.start", 200, None),
        ("http.response.body", None, b"ok"),
    ]
    assert seen == [scope, "sent"]
    assert seen[0] is scope
    assert {k: v for k, v in scope.items() if k != "fastapi.telemetry"} == original
    (span,) = _server_spans(span_exporter)
    assert span.attributes is not None
    if query:  # what OTel makes of the query a client percent-encoded
        assert span.attributes["http.url"] == "http://test/search?q=caf\ufffd"
    assert len(log_messages(caplog, "cannot decode")) == 1


@pytest.mark.parametrize("failure", ["on_start", "tracer"])
def test_otel_failing_before_the_app_serves_the_request_untraced_once(
    failure: str,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """A span processor's ``on_start`` (the SDK lets it raise) or a broken tracer: 200, once."""
    seen: list[Any] = []
    provider: APITracerProvider = (
        _failing_provider("on_start", span_exporter) if failure == "on_start" else _DownProvider()
    )
    middleware = ProfilingMiddleware(_serving_app(seen), profiler=None, tracer_provider=provider)
    for _ in range(2):
        messages, raised = asyncio.run(_exchange(middleware, _scope()))
        assert raised is None
        assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert [s if s == "sent" else "scope" for s in seen] == ["scope", "sent"] * 2
    assert len(log_messages(caplog, "served untraced")) == 1
    assert current_labels() == {}


@pytest.mark.parametrize("ending", ["completes", "raises"])
def test_a_span_refusing_the_slo_mark_keeps_the_response_and_the_apps_exception(
    ending: str,
    tracer_provider: TracerProvider,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """``spanprof.slo.*`` refused by the span (set in the app's last send, or as it raises)."""
    real = tracer_provider.get_tracer("picky")

    class Picky:
        def __init__(self, span: Any) -> None:
            self._span = span

        def __getattr__(self, name: str) -> Any:
            return getattr(self._span, name)

        def set_attribute(self, key: str, value: Any) -> None:
            if key.startswith("spanprof.slo"):
                raise TypeError("attribute limit reached")
            self._span.set_attribute(key, value)

    class PickyTracer(Tracer):
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            return Picky(real.start_span(*args, **kwargs))

        def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
            return real.start_as_current_span(*args, **kwargs)

    class PickyProvider(APITracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Tracer:
            return PickyTracer()

    own = ValueError("the app's own")
    sends: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.03)
        if ending == "raises":
            raise own
        await send({"type": "http.response.body", "body": b"ok"})
        sends.append("returned")

    middleware = ProfilingMiddleware(
        app, profiler=None, tracer_provider=PickyProvider(), slo_seconds=0.01
    )
    messages, raised = asyncio.run(_exchange(middleware, _scope()))
    if ending == "raises":
        assert raised is own
    else:
        assert raised is None
        assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
        assert sends == ["returned"]
    assert len(log_messages(caplog, "SLO")) == 1


@pytest.mark.parametrize("ending", ["completes", "returns-early", "raises"])
def test_a_span_processor_failing_on_end_never_reaches_the_app_or_the_server(
    ending: str,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """``on_end`` raising (in the app's last send, or after the app left): nothing changes."""
    own = ValueError("the app's own")
    sends: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if ending == "raises":
            raise own
        if ending == "completes":
            await send({"type": "http.response.body", "body": b"ok"})
        sends.append("returned")  # the app's send never raised

    provider = _failing_provider("on_end", span_exporter)
    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=provider)
    for _ in range(2):
        messages, raised = asyncio.run(_exchange(middleware, _scope()))
        if ending == "raises":
            assert raised is own
            assert raised.__context__ is None
        else:
            assert raised is None
            assert messages[0]["type"] == "http.response.start"
    if ending == "completes":
        assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert sends == ([] if ending == "raises" else ["returned"] * 2)
    assert len(_server_spans(span_exporter)) == 2
    assert len(log_messages(caplog, "OpenTelemetry")) == 1
    assert current_labels() == {}


def test_an_app_exception_whose_str_raises_propagates_unchanged(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """OTel's ``use_span`` formats the exception for the span's status: the app's still wins."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

    own = Unprintable()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise own

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    _, raised = asyncio.run(_exchange(middleware, _scope()))
    assert raised is own
    assert raised.__context__ is None
    assert len(_server_spans(span_exporter)) == 1


def test_captured_response_headers_otel_cannot_decode_keep_the_response(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTel decodes captured response headers with ``unicode_escape``: a backslash raises."""
    monkeypatch.setenv(
        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE", "content-type,x-file"
    )
    headers = [
        (b"content-type", b"application/pdf"),
        (b"x-file", "D:\\x\\r\xe9sum\xe9.pdf".encode("latin-1")),
    ]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": list(headers)})
        await send({"type": "http.response.body", "body": b"pdf"})

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    messages, raised = asyncio.run(_exchange(middleware, _scope()))
    assert raised is None
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["headers"] == headers
    (span,) = _server_spans(span_exporter)
    assert span.attributes is not None
    assert span.attributes["http.response.header.content_type"] == ("application/pdf",)


def test_the_servers_send_failing_on_the_last_body_still_reaches_the_app(
    tracer_provider: TracerProvider,
) -> None:
    """Only OTel's own failure after the message went out is caught: a gone client is not."""
    seen: list[BaseException] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await send({"type": "http.response.body", "body": b"ok"})
        except OSError as exc:
            seen.append(exc)
            raise

    gone = OSError("client gone")

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            raise gone

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    middleware = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    with pytest.raises(OSError) as raised:
        asyncio.run(middleware(_scope(), receive, send))
    assert raised.value is gone
    assert seen == [gone]


def test_request_headers_otel_cannot_decode_for_capture_leave_one_server_span(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """Capturing request headers, OTel decodes every one of them after it started the server
    span: one it cannot decode ended that span in error (OTel's UnicodeDecodeError on it), and
    the retry traced the request in a second SERVER span."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST", "x-request-id")
    headers = [
        (b"host", b"test"),
        (b"x-request-id", b"r-1"),
        (b"x-file", "D:\\x\\r\xe9sum\xe9.pdf".encode("latin-1")),
    ]
    seen: list[Any] = []
    middleware = ProfilingMiddleware(
        _serving_app(seen), profiler=None, tracer_provider=tracer_provider
    )
    scope = _scope("/", list(headers))
    messages, raised = asyncio.run(_exchange(middleware, scope))
    assert raised is None
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert seen == [scope, "sent"]
    assert seen[0] is scope
    assert scope["headers"] == headers
    (span,) = _server_spans(span_exporter)
    assert span.status.status_code is StatusCode.UNSET
    assert span.events == ()
    assert span.attributes is not None
    assert span.attributes["http.request.header.x_request_id"] == ("r-1",)
    assert len(log_messages(caplog, "cannot decode")) == 1
