"""WSGIProfilingMiddleware: one server span per request and exact labels, Flask and Django."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from wsgiref.handlers import SimpleHandler
from wsgiref.util import FileWrapper, setup_testing_defaults
from wsgiref.validate import validator

import httpx
import pytest
from flask import Blueprint, Flask, Response
from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import spanprof
from spanprof import (
    RecorderBackend,
    WSGIProfilingMiddleware,
    current_labels,
    install_greenlet_labels,
    profile_labels,
    uninstall_greenlet_labels,
)
from spanprof._profiling._runtime import ProfilerRuntime

from .conftest import histogram_points, require
from .e2e import django_project
from .e2e.django_project import snapshot

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment


def flask_app(*, propagate: bool = False) -> Flask:
    """A small Flask app whose views report the labels they ran with."""
    app = Flask("spanprof_tests")
    app.config["PROPAGATE_EXCEPTIONS"] = propagate

    @app.get("/items/<int:item_id>")
    def item(item_id: int) -> dict[str, Any]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pooled = pool.submit(snapshot).result()
        return {**snapshot(), "pool": pooled}

    @app.get("/stream")
    def stream() -> Response:
        def body() -> Iterator[str]:
            for _ in range(3):
                yield json.dumps(snapshot()) + "\n"

        return Response(body(), mimetype="application/x-ndjson")

    @app.get("/boom")
    def boom() -> str:
        raise RuntimeError("view failed")

    @app.post("/post-only")
    def post_only() -> str:
        return "posted"

    @app.get("/spawn")
    def spawn() -> dict[str, Any]:
        import gevent

        child = gevent.spawn(snapshot).get()
        return {**snapshot(), "child": child}

    api = Blueprint("api", __name__, url_prefix="/api")

    @api.get("/users/<int:pk>")
    def user(pk: int) -> dict[str, Any]:
        return snapshot()

    app.register_blueprint(api)
    return app


def wrap_flask(app: Flask, tracer_provider: TracerProvider, **options: Any) -> Flask:
    """The README recipe: wrap ``app.wsgi_app``."""
    options = {"profiler": None, "environ": {}, **options}
    app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, tracer_provider=tracer_provider, **options
    )
    return app


@pytest.fixture(scope="module")
def django_settings() -> None:
    """Django configured for this process (settings are process-global)."""
    django_project.configure()


def client(app: WSGIApplication) -> httpx.Client:
    return httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://test")


def server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


def ids_of(span: ReadableSpan) -> dict[str, str]:
    assert span.context is not None
    return {
        "span_id": format(span.context.span_id, "016x"),
        "trace_id": format(span.context.trace_id, "032x"),
    }


def assert_nothing_leaked(recorder: RecorderBackend) -> None:
    assert recorder.labelled_threads() == {}
    assert current_labels() == {}


def test_flask_request_gets_one_server_span_and_its_labels(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """The view and its thread-pool job run with the server span's ids and the rule template."""
    app = wrap_flask(flask_app(), tracer_provider)
    with client(app) as http:
        body = http.get("/items/42?secret=hunter2").json()
    assert len(span_exporter.get_finished_spans()) == 1
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /items/<int:item_id>"
    assert span.attributes is not None
    assert span.attributes["http.route"] == "/items/<int:item_id>"
    expected = {**ids_of(span), "span_name": "GET /items/<int:item_id>"}
    assert span.attributes["pyroscope.profile.id"] == expected["span_id"]
    for where in (body, body["pool"]):
        assert where["labels"] == expected
        assert where["thread"] == expected
    assert span.status.status_code is StatusCode.UNSET
    assert_nothing_leaked(recorder)


def test_django_request_gets_one_server_span_and_its_labels(
    django_settings: None,
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A Django view and its thread-pool job run with the span's ids and the resolver route."""
    app = django_project.django_application(
        profiler=None, tracer_provider=tracer_provider, environ={}
    )
    with client(app) as http:
        body = http.get("/items/7/").json()
    (span,) = span_exporter.get_finished_spans()
    assert span.kind is SpanKind.SERVER
    assert span.name == "GET /items/<int:item_id>/"
    assert span.attributes is not None
    assert span.attributes["http.route"] == "/items/<int:item_id>/"
    expected = {**ids_of(span), "span_name": "GET /items/<int:item_id>/"}
    for where in (body, body["pool"]):
        assert where["labels"] == expected
        assert where["thread"] == expected
    assert_nothing_leaked(recorder)


@pytest.mark.parametrize("framework", ["flask", "django"])
def test_streamed_body_runs_with_the_labels(
    framework: str,
    django_settings: None,
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A generator body runs the app's code after the call returned: still labelled."""
    if framework == "flask":
        app: WSGIApplication = wrap_flask(flask_app(), tracer_provider)
        path = "/stream"
    else:
        app = django_project.django_application(
            profiler=None, tracer_provider=tracer_provider, environ={}
        )
        path = "/stream/"
    with client(app) as http:
        lines = http.get(path).text.splitlines()
    (span,) = server_spans(span_exporter)
    expected = {**ids_of(span), "span_name": span.name}
    assert len(lines) >= 2
    for line in lines:
        chunk = json.loads(line)
        assert chunk["labels"] == expected
        assert chunk["thread"] == expected
    assert_nothing_leaked(recorder)


@pytest.mark.parametrize(
    ("framework", "method", "path", "name", "route"),
    [
        ("flask", "GET", "/api/users/7", "GET /api/users/<int:pk>", "/api/users/<int:pk>"),
        ("flask", "GET", "/nowhere/123", "GET <unmatched>", None),
        ("flask", "GET", "/post-only", "GET /post-only", "/post-only"),
        ("flask", "BREW", "/items/1", "_OTHER /items/<int:item_id>", "/items/<int:item_id>"),
        ("django", "GET", "/api/users/7/", "GET /api/users/<int:pk>/", "/api/users/<int:pk>/"),
        (
            "django",
            "GET",
            "/archive/2024/",
            "GET /archive/(?P<year>[0-9]{4})/$",
            "/archive/(?P<year>[0-9]{4})/$",
        ),
        ("django", "GET", "/nowhere/123/", "GET <unmatched>", None),
    ],
)
def test_span_name_is_the_route_template_never_the_raw_path(
    django_settings: None,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    framework: str,
    method: str,
    path: str,
    name: str,
    route: str | None,
) -> None:
    """Blueprints, includes, regex routes, 404s, 405s and odd methods all get bounded names."""
    if framework == "flask":
        app: WSGIApplication = wrap_flask(flask_app(), tracer_provider)
    else:
        app = django_project.django_application(
            profiler=None, tracer_provider=tracer_provider, environ={}
        )
    with client(app) as http:
        http.request(method, path)
    (span,) = server_spans(span_exporter)
    assert span.name == name
    assert span.attributes is not None
    assert span.attributes.get("http.route") == route


def test_django_request_for_the_script_name_prefix_itself_is_named_as_its_root(
    django_settings: None, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Under SCRIPT_NAME "/app", a request for "/app" has an empty PATH_INFO: Django routes it
    as "/", and the span and labels are named after the route Django serves."""
    from django.http import HttpRequest, JsonResponse
    from django.test.utils import override_settings
    from django.urls import path

    def home(request: HttpRequest) -> JsonResponse:
        return JsonResponse(snapshot())

    urlconf = types.ModuleType("spanprof_script_name_urls")
    urlconf.urlpatterns = [path("", home)]  # type: ignore[attr-defined]
    app = django_project.django_application(
        profiler=None, tracer_provider=tracer_provider, environ={}
    )
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Callable[[bytes], None]:
        statuses.append(status)
        return lambda data: None

    # Built by hand: an HTTP client's URL always has a path, so PATH_INFO is never empty.
    environ: dict[str, Any] = {"QUERY_STRING": "", "SCRIPT_NAME": "/app", "PATH_INFO": ""}
    setup_testing_defaults(environ)
    with override_settings(ROOT_URLCONF=urlconf):
        body = b"".join(app(environ, start_response))
    assert statuses == ["200 OK"]
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /"
    assert json.loads(body)["labels"]["span_name"] == "GET /"


def test_routes_are_found_through_wrapping_middleware(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Behind ProxyFix and a closure, the middleware still finds the Flask app's routes."""
    from werkzeug.middleware.proxy_fix import ProxyFix

    app = flask_app()
    inner = app.wsgi_app

    def decorated(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return inner(environ, start_response)

    app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        ProxyFix(decorated), profiler=None, tracer_provider=tracer_provider, environ={}
    )
    with client(app) as http:
        http.get("/api/users/3")
    assert [s.name for s in server_spans(span_exporter)] == ["GET /api/users/<int:pk>"]


# --- PEP 3333 through wsgiref's own server handler and validator ------------------------------


class TrackedBody:
    """A response body that counts how often it was closed, and what it was closed with."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self.closed = 0
        self.closed_with: dict[str, str] | None = None

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        return next(self._chunks)

    def close(self) -> None:
        self.closed += 1
        self.closed_with = dict(current_labels())


def _raw_app(kind: str, bodies: list[TrackedBody]) -> WSGIApplication:
    headers = [("Content-Type", "text/plain")]

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if kind == "raises":
            raise RuntimeError("app failed before responding")
        if kind == "exc_info":
            try:
                raise ValueError("handled")
            except ValueError:
                start_response("500 Internal Server Error", headers, sys.exc_info())
            body = TrackedBody([b"error"])
        elif kind == "write":
            write = start_response("200 OK", headers)
            write(b"written ")
            body = TrackedBody([b"returned"])
        elif kind == "list":
            start_response("200 OK", headers)
            body = TrackedBody([b"a", b"b"])
        else:
            body = TrackedBody(_lazy_body(kind, start_response, headers))
        bodies.append(body)
        return body

    return app


def _lazy_body(kind: str, start_response: StartResponse, headers: Any) -> Iterator[bytes]:
    # start_response on the first iteration, as PEP 3333 allows.
    start_response("200 OK", headers)
    yield b"first "
    if kind == "raises_mid_body":
        raise RuntimeError("body failed")
    if kind == "exc_info_after_headers":
        try:
            raise ValueError("too late")
        except ValueError:
            start_response("500 Internal Server Error", headers, sys.exc_info())
    yield b"second"


def serve_once(app: WSGIApplication) -> tuple[bytes, str]:
    """One request through wsgiref's SimpleHandler (a PEP 3333 server)."""
    environ: dict[str, Any] = {"QUERY_STRING": "", "SCRIPT_NAME": "", "PATH_INFO": "/raw"}
    setup_testing_defaults(environ)
    out, err = io.BytesIO(), io.StringIO()
    handler = SimpleHandler(io.BytesIO(), out, err, environ, multithread=False)
    handler.run(app)
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("kind", "status", "error"),
    [
        ("list", "200", None),
        ("write", "200", None),
        ("generator", "200", None),
        ("exc_info", "500", None),
        ("raises", "500", "RuntimeError"),
        ("raises_mid_body", "200", "RuntimeError"),
        ("exc_info_after_headers", "200", "ValueError"),
    ],
)
def test_pep3333_conformance_and_close_always_called(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    kind: str,
    status: str,
    error: str | None,
) -> None:
    """Validated on both sides; the app's body is closed once, with labels; nothing leaks."""
    bodies: list[TrackedBody] = []
    middleware = WSGIProfilingMiddleware(
        validator(_raw_app(kind, bodies)),
        profiler=None,
        tracer_provider=tracer_provider,
        environ={},
    )
    output, errors = serve_once(validator(middleware))
    assert output.split(b" ", 2)[1].decode() == status
    (span,) = server_spans(span_exporter)
    assert span.name == "GET <unmatched>"
    events = [e for e in span.events if e.name == "exception"]
    if error is None:
        assert events == []
        assert "Traceback" not in errors
    else:
        assert span.status.status_code is StatusCode.ERROR
        assert events[0].attributes is not None
        assert events[0].attributes["exception.type"] == error
    if status == "500" or error is not None:
        assert span.status.status_code is StatusCode.ERROR
    for body in bodies:
        assert body.closed == 1
        assert body.closed_with == {**ids_of(span), "span_name": "GET <unmatched>"}
    assert_nothing_leaked(recorder)


def test_file_wrapper_is_handed_over_and_ends_at_close(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A wsgi.file_wrapper body reaches the server as is (sendfile); its close ends the span."""
    returned: list[Any] = []

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        body = environ["wsgi.file_wrapper"](io.BytesIO(b"file body"), 4)
        returned.append(body)
        return body  # type: ignore[no-any-return]

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    environ: dict[str, Any] = {"QUERY_STRING": "", "wsgi.file_wrapper": FileWrapper}
    setup_testing_defaults(environ)
    result = middleware(environ, lambda status, headers, exc_info=None: lambda data: None)
    assert result is returned[0]
    assert isinstance(result, FileWrapper)
    assert b"".join(result) == b"file body"
    assert span_exporter.get_finished_spans() == ()
    result.close()
    assert len(server_spans(span_exporter)) == 1


def test_a_servers_already_handled_sentinel_is_handed_back_as_is(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A websocket app under gunicorn's async workers returns ALREADY_HANDLED (it answered on
    the socket itself): the worker gets its own sentinel back, not a body to iterate, and the
    request's span ends."""
    # gunicorn ships no type information.
    already_handled = importlib.import_module("gunicorn.workers.base_async").ALREADY_HANDLED

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return already_handled  # type: ignore[no-any-return]

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    environ: dict[str, Any] = {"QUERY_STRING": ""}
    setup_testing_defaults(environ)
    result = middleware(environ, lambda status, headers, exc_info=None: lambda data: None)
    assert result is already_handled
    assert len(server_spans(span_exporter)) == 1


def test_exc_info_by_keyword_reaches_the_server(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """PEP 3333 names the parameter ``exc_info``: an app passing it by keyword sends its 500."""
    # Not through wsgiref's validator: it rejects keyword arguments, wsgiref's handler does not.

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        try:
            raise RuntimeError("handled by the app")
        except RuntimeError:
            start_response(
                "500 Internal Server Error",
                [("Content-Type", "text/plain"), ("Content-Length", "9")],
                exc_info=sys.exc_info(),  # type: ignore[call-arg]
            )
        return [b"app's 500"]

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    output, errors = serve_once(middleware)
    assert errors == ""
    assert output.startswith(b"HTTP/1.0 500 ")
    assert output.endswith(b"\r\n\r\napp's 500")
    (span,) = server_spans(span_exporter)
    assert span.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize(
    ("chunks", "content_length"), [([b"hello world"], b"11"), ([b"hello", b" world"], None)]
)
def test_the_server_sees_the_length_of_a_sized_body(
    tracer_provider: TracerProvider, chunks: list[bytes], content_length: bytes | None
) -> None:
    """wsgiref and waitress set Content-Length for a one-item body: spanprof keeps its len()."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return list(chunks)

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    output, errors = serve_once(middleware)
    assert errors == ""
    head, _, body = output.partition(b"\r\n\r\n")
    assert body == b"hello world"
    lengths = [line for line in head.split(b"\r\n") if line.startswith(b"Content-Length: ")]
    assert lengths == ([] if content_length is None else [b"Content-Length: " + content_length])


def test_an_unsized_body_stays_unsized(tracer_provider: TracerProvider) -> None:
    """A generator body has no len(): spanprof's wrapper offers none (waitress asks hasattr)."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterator[bytes]:
        start_response("200 OK", [])
        yield b"streamed"

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    environ: dict[str, Any] = {"QUERY_STRING": ""}
    setup_testing_defaults(environ)
    body = middleware(environ, lambda status, headers, exc_info=None: lambda data: None)
    assert not hasattr(body, "__len__")
    assert list(body) == [b"streamed"]


def test_labels_are_cleared_even_if_the_server_never_closes(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Labels are set only while app code runs: a server that skips close() leaks none."""
    seen: list[dict[str, str]] = []

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterator[bytes]:
        start_response("200 OK", [])
        for _ in range(3):
            seen.append(dict(recorder.thread_labels()))
            yield b"x"

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    environ: dict[str, Any] = {"QUERY_STRING": ""}
    setup_testing_defaults(environ)
    body = iter(middleware(environ, lambda status, headers, exc_info=None: lambda data: None))
    assert_nothing_leaked(recorder)
    next(body)
    assert_nothing_leaked(recorder)
    next(body)
    assert seen[0]["span_name"] == "GET <unmatched>"
    assert seen[0] == seen[1]
    assert_nothing_leaked(recorder)
    # The span ends only when the body is closed, which this server never does.
    assert span_exporter.get_finished_spans() == ()


def test_app_exception_propagates_with_span_ended_and_labels_cleared(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Flask propagating a view's exception: the exception reaches the server, the span ends."""
    app = wrap_flask(flask_app(propagate=True), tracer_provider)
    with client(app) as http, pytest.raises(RuntimeError, match="view failed"):
        http.get("/boom")
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /boom"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]
    assert_nothing_leaked(recorder)


class Unprintable(Exception):
    """An exception whose str() itself raises (a lazy message that hits a closed resource)."""

    def __str__(self) -> str:
        raise RuntimeError("no str for this exception")


@pytest.mark.parametrize("where", ["call", "body"])
def test_an_exception_whose_str_fails_propagates_and_ends_the_span(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    where: str,
) -> None:
    """The server gets the app's own exception; the span ends as an error; the duration counts."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterator[bytes]:
        if where == "call":
            raise Unprintable
        start_response("200 OK", [])

        def body() -> Iterator[bytes]:
            yield b"first"
            raise Unprintable

        return body()

    middleware = WSGIProfilingMiddleware(
        app,
        profiler=None,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        environ={},
    )
    environ: dict[str, Any] = {"QUERY_STRING": ""}
    setup_testing_defaults(environ)

    def serve() -> list[bytes]:
        body = middleware(environ, lambda status, headers, exc_info=None: lambda data: None)
        try:
            return list(body)
        finally:
            getattr(body, "close", lambda: None)()

    with pytest.raises(Unprintable):
        serve()
    (span,) = server_spans(span_exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "Unprintable"
    assert span.attributes is not None
    assert span.attributes["error.type"] == "Unprintable"
    (point,) = histogram_points(metric_reader, "http.server.request.duration")
    assert point.count == 1
    assert point.attributes is not None
    assert point.attributes["error.type"] == "Unprintable"
    assert_nothing_leaked(recorder)


class RaisingOnEnd(SpanProcessor):
    """A span processor whose on_end fails (the SDK lets it raise out of ``span.end()``)."""

    def on_end(self, span: ReadableSpan) -> None:
        raise KeyError("exporter queue")


def test_a_span_processor_raising_on_end_is_logged_once_and_the_body_completes(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ending the span after the last chunk fails: the server still sees the body end cleanly."""
    tracer_provider.add_span_processor(RaisingOnEnd())

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterator[bytes]:
        start_response("200 OK", [])
        yield b"first "
        yield b"last"

    def failing(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        raise LookupError("the app's own failure")

    served = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    broken = WSGIProfilingMiddleware(
        failing, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    environ: dict[str, Any] = {"QUERY_STRING": ""}
    setup_testing_defaults(environ)
    with caplog.at_level("WARNING", logger="spanprof"):
        for _ in range(2):
            body = served(dict(environ), lambda status, headers, exc_info=None: lambda data: None)
            assert list(body) == [b"first ", b"last"]
            getattr(body, "close", lambda: None)()
        with pytest.raises(LookupError, match="the app's own failure"):
            broken(dict(environ), lambda status, headers, exc_info=None: lambda data: None)
    # The in-memory exporter runs before the failing processor: every span did end.
    assert len(server_spans(span_exporter)) == 3
    assert len([r for r in caplog.records if "ending the request's span" in r.getMessage()]) == 1
    assert_nothing_leaked(recorder)


def test_handled_error_is_a_500_span(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Flask turning a view's exception into a 500: the span is an error, nothing leaks."""
    app = wrap_flask(flask_app(), tracer_provider)
    app.logger.disabled = True  # Flask logs the traceback of the handled error
    with client(app) as http:
        assert http.get("/boom").status_code == 500
    (span,) = server_spans(span_exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["http.status_code"] == 500
    assert_nothing_leaked(recorder)


def test_concurrent_threads_never_share_labels(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Eight server threads at once: every request sees only its own span, everywhere."""
    app = wrap_flask(flask_app(), tracer_provider)
    barrier = threading.Barrier(8)

    def one(i: int) -> dict[str, Any]:
        with client(app) as http:
            barrier.wait()
            body: dict[str, Any] = http.get(f"/items/{i}").json()
            return body

    with ThreadPoolExecutor(max_workers=8) as pool:
        bodies = list(pool.map(one, range(8)))
    span_ids = {ids_of(s)["span_id"] for s in server_spans(span_exporter)}
    assert len(span_ids) == 8
    assert {b["labels"]["span_id"] for b in bodies} == span_ids
    for body in bodies:
        own = body["labels"]
        assert body["thread"] == own
        assert body["pool"]["labels"] == own
        assert body["pool"]["thread"] == own
    assert_nothing_leaked(recorder)


# --- other instrumentation ----------------------------------------------------------------------


def test_existing_server_span_is_reused(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Inside OpenTelemetry's WSGI middleware, spanprof labels its span and opens none."""
    app = flask_app()
    app.wsgi_app = OpenTelemetryMiddleware(  # type: ignore[method-assign]
        WSGIProfilingMiddleware(
            app.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
        ),
        tracer_provider=tracer_provider,
    )
    with client(app) as http:
        body = http.get("/items/5").json()
    (span,) = span_exporter.get_finished_spans()
    assert span.kind is SpanKind.SERVER
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == "opentelemetry.instrumentation.wsgi"
    assert span.name == "GET /items/<int:item_id>"
    assert span.attributes is not None
    assert span.attributes["pyroscope.profile.id"] == body["labels"]["span_id"]
    assert body["labels"] == {**ids_of(span), "span_name": "GET /items/<int:item_id>"}
    assert body["thread"] == body["labels"]
    assert_nothing_leaked(recorder)


# --- duration histogram -------------------------------------------------------------------------


def test_duration_is_recorded_when_the_body_is_closed(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A slow streamed body counts in full and, past the SLO, leaves an exemplar on its span."""
    import time

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterator[bytes]:
        start_response("200 OK", [])
        for _ in range(3):
            time.sleep(0.03)
            yield b"chunk"

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    try:
        middleware = WSGIProfilingMiddleware(
            app,
            profiler=None,
            tracer_provider=tracer_provider,
            meter_provider=meters,
            slo_seconds=0.05,
            environ={},
        )
        with client(middleware) as http:
            assert http.get("/").content == b"chunk" * 3
        data = reader.get_metrics_data()
    finally:
        meters.shutdown()
    assert data is not None
    points = [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "http.server.request.duration"
        for point in metric.data.data_points
    ]
    (point,) = points
    assert isinstance(point, HistogramDataPoint)
    assert point.sum >= 0.09
    assert point.attributes is not None
    assert point.attributes["http.response.status_code"] == 200
    (span,) = server_spans(span_exporter)
    assert span.attributes is not None
    assert span.attributes["spanprof.slo.breached"] is True
    (exemplar,) = point.exemplars
    assert format(exemplar.span_id or 0, "016x") == ids_of(span)["span_id"]


# --- options ------------------------------------------------------------------------------------


def test_excluded_urls_are_neither_traced_nor_labelled(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """excluded_urls leaves matching requests alone."""
    app = wrap_flask(flask_app(), tracer_provider, excluded_urls="/items/.*,/health")
    with client(app) as http:
        body = http.get("/items/3").json()
        http.get("/api/users/1")
    assert body["labels"] == {}
    assert [s.name for s in span_exporter.get_finished_spans()] == ["GET /api/users/<int:pk>"]


def test_each_excluded_url_pattern_means_what_it_means_alone(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A leading (?i) is its own pattern's: excluded_urls are never compiled joined by "|"."""
    app = wrap_flask(flask_app(), tracer_provider, excluded_urls="(?i)/ITEMS/,/API/users")
    with client(app) as http:
        assert http.get("/items/3").json()["labels"] == {}
        assert http.get("/api/users/1").status_code == 200
    assert [s.name for s in server_spans(span_exporter)] == ["GET /api/users/<int:pk>"]


def test_trace_id_label_can_be_turned_off(tracer_provider: TracerProvider) -> None:
    """trace_id_label=False (or SPANPROF_TRACE_ID_LABEL=false) leaves trace_id out."""
    for options in ({"trace_id_label": False}, {"environ": {"SPANPROF_TRACE_ID_LABEL": "false"}}):
        app = wrap_flask(flask_app(), tracer_provider, **options)
        with client(app) as http:
            labels = http.get("/items/1").json()["labels"]
        assert set(labels) == {"span_id", "span_name"}


def test_route_resolver_names_other_apps(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A custom resolver names requests of apps spanprof cannot route itself."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        start_response("200 OK", [])
        return [json.dumps(dict(current_labels())).encode()]

    def resolver(environ: WSGIEnvironment) -> str | None:
        return "/orders/{id}" if environ["PATH_INFO"].startswith("/orders/") else None

    middleware = WSGIProfilingMiddleware(
        app, profiler=None, tracer_provider=tracer_provider, route_resolver=resolver, environ={}
    )
    with client(middleware) as http:
        labels = http.get("/orders/991").json()
        http.get("/elsewhere")
    assert labels["span_name"] == "GET /orders/{id}"
    assert [s.name for s in server_spans(span_exporter)] == ["GET /orders/{id}", "GET <unmatched>"]


def test_failing_route_resolver_is_logged_once_and_requests_still_served(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A resolver that raises names requests <unmatched>, logs once, fails nothing."""

    def broken(environ: WSGIEnvironment) -> str | None:
        raise KeyError("no route table")

    app = wrap_flask(flask_app(), tracer_provider, route_resolver=broken)
    with caplog.at_level("WARNING", logger="spanprof"), client(app) as http:
        assert [http.get("/items/1").status_code for _ in range(3)] == [200, 200, 200]
    assert {s.name for s in server_spans(span_exporter)} == {"GET <unmatched>"}
    assert len([r for r in caplog.records if "route template" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"profiler": "pyroscope"}, "profiler"),
        ({"route_resolver": "/items/<id>"}, "route_resolver"),
        ({"environ": {"SPANPROF_TRACE_ID_LABEL": "maybe"}}, "SPANPROF_TRACE_ID_LABEL"),
        ({"environ": {"PYROSCOPE_SERVER_ADDRESS": "pyroscope:4040"}}, "PYROSCOPE_SERVER_ADDRESS"),
        ({"slo_seconds": -1}, "slo_seconds"),
        ({"route_slos": {"items": 1.0}}, "route_slos"),
    ],
)
def test_bad_configuration_is_a_value_error_naming_the_setting(
    options: dict[str, Any], message: str
) -> None:
    """Misconfiguration fails at construction with a message naming what to change."""
    options = {"environ": {}, **options}
    with pytest.raises(ValueError, match=message):
        WSGIProfilingMiddleware(flask_app().wsgi_app, **options)


def test_non_callable_app_is_rejected() -> None:
    """Wrapping something that is not a WSGI app fails at once."""
    with pytest.raises(ValueError, match="app"):
        WSGIProfilingMiddleware("app:wsgi", profiler=None, environ={})  # type: ignore[arg-type]


def test_first_request_starts_the_profiler_once(tracer_provider: TracerProvider) -> None:
    """Nothing starts at construction; the first request starts the backend, once."""
    backend = RecorderBackend()
    app = wrap_flask(flask_app(), tracer_provider, profiler=backend)
    assert backend.started == 0
    assert spanprof.engine.installed_backend() is None
    try:
        with client(app) as http:
            bodies = [http.get("/items/1").json() for _ in range(3)]
        assert backend.started == 1
        assert spanprof.engine.installed_backend() is backend
        assert all(body["thread"] == body["labels"] for body in bodies)
    finally:
        spanprof.engine.uninstall_label_engine()


# --- greenlets ----------------------------------------------------------------------------------


def _gevent() -> Any:
    try:
        import gevent
    except ImportError:
        gevent = None
    require(gevent is not None, "gevent not installed")
    return gevent


def _interleaved_requests(gevent: Any, recorder: RecorderBackend) -> list[str]:
    """Four 'requests' and their spawned children switching at every step; the mismatches."""
    mismatches: list[str] = []

    def check(where: str) -> None:
        if recorder.thread_labels() != current_labels():
            mismatches.append(where)

    def child(n: int) -> dict[str, str]:
        for _ in range(3):
            check(f"child {n}")
            gevent.sleep(0)
        return dict(current_labels())

    def request(n: int) -> tuple[dict[str, str], dict[str, str]]:
        with profile_labels(request=str(n)):
            spawned = gevent.spawn(child, n)
            for _ in range(3):
                check(f"request {n}")
                gevent.sleep(0)
            return dict(current_labels()), spawned.get()

    requests = [gevent.spawn(request, n) for n in range(4)]
    gevent.joinall(requests, raise_error=True)
    for own, inherited in (g.value for g in requests):
        if inherited != own:
            mismatches.append(f"child of {own} ran with {inherited}")
    check("main")
    return mismatches


def test_greenlet_switches_keep_labels_exact_and_children_inherit(
    recorder: RecorderBackend,
) -> None:
    """With the hook, each greenlet runs under its own labels; gevent children inherit them."""
    gevent = _gevent()
    install_greenlet_labels()
    try:
        assert _interleaved_requests(gevent, recorder) == []
    finally:
        uninstall_greenlet_labels()
    assert_nothing_leaked(recorder)


def test_greenlet_switches_leak_labels_without_the_hook(recorder: RecorderBackend) -> None:
    """Without the hook, greenlets on one thread run under each other's labels (the bug)."""
    gevent = _gevent()
    assert _interleaved_requests(gevent, recorder) != []


def test_greenlet_hook_chains_and_restores_the_previous_trace_function() -> None:
    """An existing greenlet.settrace callback keeps being called, and is restored on uninstall."""
    gevent = _gevent()
    import greenlet

    events: list[str] = []

    def previous(event: str, args: Any) -> None:
        events.append(event)

    greenlet.settrace(previous)
    try:
        install_greenlet_labels()
        install_greenlet_labels()  # idempotent: one hook, still chained once
        gevent.spawn(gevent.sleep, 0).join()
        assert "switch" in events
        count = len(events)
        uninstall_greenlet_labels()
        assert greenlet.gettrace() is previous
        gevent.spawn(gevent.sleep, 0).join()
        assert len(events) > count
    finally:
        uninstall_greenlet_labels()
        greenlet.settrace(None)


def test_a_stopped_runtime_takes_out_the_greenlet_hooks_it_installed() -> None:
    """A runtime started in a greenlet follows greenlet switches; stopped, it leaves no tracer
    and no spawn callback behind, but keeps the hooks the app installed itself."""
    gevent = _gevent()
    import greenlet

    def inherited_after_stop() -> dict[str, str]:
        with spanprof.profile_labels(tenant="acme"):
            return dict(gevent.spawn(lambda: dict(spanprof.current_labels())).get())

    runtime = ProfilerRuntime(RecorderBackend())
    gevent.spawn(runtime.start).get()  # in a greenlet: greenlets_in_use()
    try:
        assert greenlet.gettrace() is not None
        assert inherited_after_stop() == {"tenant": "acme"}
    finally:
        runtime.stop()
    assert greenlet.gettrace() is None
    assert inherited_after_stop() == {}

    install_greenlet_labels()  # the app's own: a runtime's stop leaves it
    try:
        runtime = ProfilerRuntime(RecorderBackend())
        gevent.spawn(runtime.start).get()
        runtime.stop()
        assert greenlet.gettrace() is not None
        assert inherited_after_stop() == {"tenant": "acme"}
    finally:
        uninstall_greenlet_labels()
    assert greenlet.gettrace() is None


def test_greenlet_spawned_by_a_request_runs_with_its_labels(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A view that spawns a gevent greenlet: the greenlet carries the request's labels."""
    _gevent()
    app = wrap_flask(flask_app(), tracer_provider)
    install_greenlet_labels()
    try:
        with client(app) as http:
            body = http.get("/spawn").json()
    finally:
        uninstall_greenlet_labels()
    (span,) = server_spans(span_exporter)
    expected = {**ids_of(span), "span_name": "GET /spawn"}
    assert body["labels"] == expected
    assert body["child"]["labels"] == expected
    assert body["child"]["thread"] == expected
    assert_nothing_leaked(recorder)


_GEVENT_FIRST_REQUESTS = """
import spanprof  # before patching, as with gunicorn's --preload: the runtime's lock is a real one
from spanprof._profiling._runtime import ProfilerRuntime

class Yielding(spanprof.RecorderBackend):
    def start(self):
        import gevent
        gevent.sleep(0.05)  # starting yields, like the exact backend starting its uploader
        super().start()

runtime = ProfilerRuntime(Yielding())

from gevent import monkey
monkey.patch_all()
import gevent

greenlets = [gevent.spawn(runtime.ensure_started) for _ in range(2)]
gevent.joinall(greenlets, timeout=10)
print("started", runtime.backend.started, all(g.ready() for g in greenlets))
"""


def test_two_first_requests_in_greenlets_do_not_deadlock(tmp_path: Path) -> None:
    """Under gevent with a preloaded app, a second first request waits without blocking the
    worker's one thread while the first starts the profiler (it hung the worker for good)."""
    require(importlib.util.find_spec("gevent") is not None, "gevent is not installed")
    script = tmp_path / "first_requests.py"
    script.write_text(_GEVENT_FIRST_REQUESTS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "started 1 True", (proc.stdout, proc.stderr)
