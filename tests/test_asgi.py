"""ProfilingMiddleware: one server span per request, labelled with its ids and route template."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.websockets import WebSocket

import spanprof
from spanprof import ProfilingMiddleware, RecorderBackend, current_labels
from spanprof._labels._engine import attach_loop
from spanprof._web._routes import starlette_route_template

from .asgi_driver import lifespan, websocket_session
from .conftest import run_on


def _snapshot(recorder: RecorderBackend | None) -> dict[str, Any]:
    return {
        "labels": dict(current_labels()),
        "thread": dict(recorder.thread_labels()) if recorder else None,
    }


def build_app(recorder: RecorderBackend | None = None) -> Starlette:
    async def item(request: Request) -> Response:
        await asyncio.sleep(0)
        snap = _snapshot(recorder)
        snap["child"] = await asyncio.create_task(_child(recorder))
        snap["pool"] = await run_in_threadpool(_snapshot, recorder)
        return JSONResponse(snap)

    async def boom(request: Request) -> Response:
        raise RuntimeError("handler failed")

    def sync_endpoint(request: Request) -> Response:
        return JSONResponse(_snapshot(recorder))

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json(_snapshot(recorder))
        await websocket.close()

    api = [Route("/users/{user_id:int}", item)]
    return Starlette(
        routes=[
            Route("/items/{item_id}", item),
            Route("/boom", boom),
            Route("/sync", sync_endpoint),
            Route("/post-only", item, methods=["POST"]),
            Mount("/api", routes=api),
            WebSocketRoute("/ws/{room}", ws),
        ]
    )


async def _child(recorder: RecorderBackend | None) -> dict[str, Any]:
    await asyncio.sleep(0)
    return _snapshot(recorder)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
    )


def _server_spans(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


def test_request_gets_one_server_span_and_its_labels(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    loop_kind: str,
) -> None:
    """Handler, child task and thread pool all run with the server span's ids and template."""
    app = ProfilingMiddleware(build_app(recorder), profiler=None, tracer_provider=tracer_provider)

    async def main() -> dict[str, Any]:
        async with _client(app) as client:
            response = await client.get("/items/42?secret=hunter2")
            assert response.status_code == 200
            body: dict[str, Any] = response.json()
            return body

    body = run_on(loop_kind, main)
    spans = _server_spans(span_exporter)
    assert len(spans) == 1
    span = spans[0]
    assert span.name == "GET /items/{item_id}"
    assert span.attributes is not None
    assert span.attributes["http.route"] == "/items/{item_id}"
    expected = {
        "span_id": format(span.context.span_id, "016x"),
        "trace_id": format(span.context.trace_id, "032x"),
        "span_name": "GET /items/{item_id}",
    }
    assert span.attributes["pyroscope.profile.id"] == expected["span_id"]
    for where in (body, body["child"], body["pool"]):
        assert where["labels"] == expected
        assert where["thread"] == expected
    assert len(span_exporter.get_finished_spans()) == 1  # no send/receive child spans
    assert recorder.labelled_threads() == {}
    assert current_labels() == {}


def test_concurrent_requests_never_share_labels(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    loop_kind: str,
) -> None:
    """Sixteen overlapping requests each see only their own span id, everywhere."""
    app = ProfilingMiddleware(build_app(recorder), profiler=None, tracer_provider=tracer_provider)

    async def main() -> list[dict[str, Any]]:
        # A server attaches the engine to its loop at lifespan startup, before creating request
        # tasks; this test creates them itself.
        attach_loop()
        async with _client(app) as client:
            responses = await asyncio.gather(*(client.get(f"/items/{i}") for i in range(16)))
            return [r.json() for r in responses]

    bodies = run_on(loop_kind, main)
    span_ids = {format(s.context.span_id, "016x") for s in _server_spans(span_exporter)}
    assert len(span_ids) == 16
    seen = set()
    for body in bodies:
        own = body["labels"]["span_id"]
        seen.add(own)
        for where in (body, body["child"], body["pool"]):
            assert where["labels"]["span_id"] == own
            assert where["thread"]["span_id"] == own
    assert seen == span_ids
    assert recorder.labelled_threads() == {}


@pytest.mark.parametrize(
    ("method", "path", "name", "route"),
    [
        ("GET", "/api/users/7", "GET /api/users/{user_id:int}", "/api/users/{user_id:int}"),
        ("GET", "/nowhere/123", "GET <unmatched>", None),
        ("GET", "/post-only", "GET /post-only", "/post-only"),
        ("BREW", "/items/1", "_OTHER /items/{item_id}", "/items/{item_id}"),
    ],
)
def test_span_name_is_the_route_template_never_the_raw_path(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    method: str,
    path: str,
    name: str,
    route: str | None,
) -> None:
    """Mounts, unmatched paths, 405s and odd methods all get bounded names."""
    app = ProfilingMiddleware(build_app(), profiler=None, tracer_provider=tracer_provider)

    async def main() -> None:
        async with _client(app) as client:
            await client.request(method, path)

    asyncio.run(main())
    (span,) = _server_spans(span_exporter)
    assert span.name == name
    assert span.attributes is not None
    assert span.attributes.get("http.route") == route


def test_labels_reset_when_the_handler_raises(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A failing handler still ends its span and leaves no labels on any thread."""
    app = ProfilingMiddleware(build_app(recorder), profiler=None, tracer_provider=tracer_provider)

    async def main() -> int:
        async with _client(app) as client:
            response = await client.get("/boom")
            return response.status_code

    assert asyncio.run(main()) == 500
    (span,) = _server_spans(span_exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert recorder.labelled_threads() == {}
    assert current_labels() == {}


def test_labels_reset_when_the_request_is_cancelled(
    recorder: RecorderBackend, tracer_provider: TracerProvider, loop_kind: str
) -> None:
    """Cancelling a request mid-handler (client gone, timeout) clears its labels."""
    entered = asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await asyncio.sleep(30)
        return PlainTextResponse("never")

    app = ProfilingMiddleware(
        Starlette(routes=[Route("/slow", slow)]), profiler=None, tracer_provider=tracer_provider
    )

    async def main() -> None:
        attach_loop()
        await asyncio.create_task(scenario())

    async def scenario() -> None:
        nonlocal entered
        entered = asyncio.Event()
        scope = {
            "type": "http",
            "method": "GET",
            "path": "/slow",
            "raw_path": b"/slow",
            "query_string": b"",
            "headers": [],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("test", 80),
            "client": ("127.0.0.1", 1234),
            "root_path": "",
        }

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            return None

        task = asyncio.create_task(app(scope, receive, send))
        await entered.wait()
        assert recorder.thread_labels() == {}  # this (test) task has no labels
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_on(loop_kind, main)
    assert recorder.labelled_threads() == {}


def test_sync_endpoints_and_websockets_are_labelled(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Starlette's threadpool endpoints and websocket sessions carry their labels."""
    app = ProfilingMiddleware(build_app(recorder), profiler=None, tracer_provider=tracer_provider)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with _client(app) as client:
            body: dict[str, Any] = (await client.get("/sync")).json()
        messages = await websocket_session(app, "/ws/lobby")
        ws_body: dict[str, Any] = json.loads(messages[0]["text"])
        return body, ws_body

    body, ws_body = asyncio.run(main())
    spans = {s.name: s for s in _server_spans(span_exporter)}
    assert set(spans) == {"GET /sync", "WEBSOCKET /ws/{room}"}
    assert body["thread"] == body["labels"]
    assert body["labels"]["span_id"] == format(spans["GET /sync"].context.span_id, "016x")
    assert ws_body["labels"]["span_name"] == "WEBSOCKET /ws/{room}"
    ws_span = spans["WEBSOCKET /ws/{room}"]
    assert ws_body["labels"]["span_id"] == format(ws_span.context.span_id, "016x")
    assert ws_body["thread"] == ws_body["labels"]


def test_existing_server_span_is_reused(
    recorder: RecorderBackend, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Under another instrumentation's server span, spanprof opens no second span."""
    app = ProfilingMiddleware(build_app(recorder), profiler=None, tracer_provider=tracer_provider)
    tracer = tracer_provider.get_tracer("outer")

    async def outer(scope: Any, receive: Any, send: Any) -> None:
        with tracer.start_as_current_span("GET", kind=SpanKind.SERVER):
            await app(scope, receive, send)

    async def main() -> dict[str, Any]:
        async with _client(outer) as client:
            body: dict[str, Any] = (await client.get("/items/5")).json()
            return body

    body = asyncio.run(main())
    spans = span_exporter.get_finished_spans()
    assert len(spans) == 1
    (span,) = spans
    assert span.name == "GET /items/{item_id}"
    assert span.attributes is not None
    assert span.attributes["pyroscope.profile.id"] == body["labels"]["span_id"]
    assert body["labels"]["span_id"] == format(span.context.span_id, "016x")


def test_trace_id_label_can_be_turned_off(tracer_provider: TracerProvider) -> None:
    """trace_id_label=False (or SPANPROF_TRACE_ID_LABEL=false) leaves trace_id out."""
    for app in (
        ProfilingMiddleware(
            build_app(), profiler=None, tracer_provider=tracer_provider, trace_id_label=False
        ),
        ProfilingMiddleware(
            build_app(),
            profiler=None,
            tracer_provider=tracer_provider,
            environ={"SPANPROF_TRACE_ID_LABEL": "false"},
        ),
    ):

        async def main(app: Any = app) -> dict[str, Any]:
            async with _client(app) as client:
                body: dict[str, Any] = (await client.get("/items/1")).json()
                return body

        labels = asyncio.run(main())["labels"]
        assert set(labels) == {"span_id", "span_name"}


def test_lifespan_starts_and_stops_the_profiler(tracer_provider: TracerProvider) -> None:
    """The backend starts at lifespan startup and is shut down (flushed) at shutdown."""
    backend = RecorderBackend()
    app = ProfilingMiddleware(build_app(), profiler=backend, tracer_provider=tracer_provider)

    async def main() -> None:
        async with lifespan(app):
            assert backend.started == 1
            assert spanprof.engine.installed_backend() is backend
            async with _client(app) as client:
                assert (await client.get("/items/1")).status_code == 200
            assert backend.started == 1
            assert backend.stopped == 0
        assert backend.stopped == 1
        assert spanprof.engine.installed_backend() is None

    try:
        asyncio.run(main())
    finally:
        spanprof.engine.uninstall_label_engine()


def test_first_request_starts_the_profiler_without_lifespan(
    tracer_provider: TracerProvider,
) -> None:
    """Servers that run no lifespan get the profiler started by the first request."""
    backend = RecorderBackend()
    app = ProfilingMiddleware(build_app(backend), profiler=backend, tracer_provider=tracer_provider)

    async def main() -> dict[str, Any]:
        async with _client(app) as client:
            body: dict[str, Any] = (await client.get("/items/1")).json()
            return body

    try:
        body = asyncio.run(main())
        assert backend.started == 1
        assert body["thread"] == body["labels"]
    finally:
        spanprof.engine.uninstall_label_engine()


def test_failing_backend_start_never_fails_requests(
    tracer_provider: TracerProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend whose start raises is logged once; requests are served normally."""

    class Broken(RecorderBackend):
        def start(self) -> None:
            raise ConnectionError("no profiler")

    app = ProfilingMiddleware(build_app(), profiler=Broken(), tracer_provider=tracer_provider)

    async def main() -> list[int]:
        async with _client(app) as client:
            return [(await client.get("/items/1")).status_code for _ in range(3)]

    with caplog.at_level("WARNING", logger="spanprof"):
        assert asyncio.run(main()) == [200, 200, 200]
    assert len([r for r in caplog.records if "failed to start" in r.getMessage()]) == 1
    assert spanprof.engine.installed_backend() is None


def test_non_http_scopes_pass_through(tracer_provider: TracerProvider) -> None:
    """Scope types other than http, websocket and lifespan reach the app untouched."""
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        assert trace.get_current_span().get_span_context().is_valid is False

    app = ProfilingMiddleware(inner, profiler=None, tracer_provider=tracer_provider)

    async def noop_receive() -> dict[str, Any]:
        return {}

    async def noop_send(message: Any) -> None:
        return None

    asyncio.run(app({"type": "custom"}, noop_receive, noop_send))
    assert seen == ["custom"]


def _counted(
    inner: Starlette, calls: list[str], tracer_provider: TracerProvider, **options: Any
) -> ProfilingMiddleware:
    """``inner`` under the middleware, appending each HTTP request's path to ``calls``."""

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append(scope["path"])
        await inner(scope, receive, send)

    return ProfilingMiddleware(
        counting,
        profiler=None,
        tracer_provider=tracer_provider,
        route_resolver=lambda scope: starlette_route_template(scope, inner),
        **options,
    )


def test_excluded_urls_are_neither_traced_nor_labelled(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """excluded_urls leaves matching requests alone, and their failures are not retried."""
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider, excluded_urls="/items/.*,/boom")

    async def main() -> tuple[dict[str, Any], int, int]:
        async with _client(app) as client:
            body = (await client.get("/items/3")).json()
            failed = (await client.get("/boom")).status_code
            traced = (await client.get("/api/users/1")).status_code
        return body, failed, traced

    body, failed, traced = asyncio.run(main())
    assert body["labels"] == {}
    assert body["thread"] == {}
    assert (failed, traced) == (500, 200)
    assert calls == ["/items/3", "/boom", "/api/users/1"]
    assert [s.name for s in _server_spans(span_exporter)] == ["GET /api/users/{user_id:int}"]


@pytest.mark.parametrize("excluded", ["/items/.*,", "/items/.*, ", ",/items/.*,,", " , "])
def test_a_blank_excluded_url_item_excludes_nothing(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    excluded: str,
) -> None:
    """A stray comma in excluded_urls is ignored; it used to exclude every request."""
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider, excluded_urls=excluded)

    async def main() -> dict[str, Any]:
        async with _client(app) as client:
            await client.get("/items/3")
            return dict((await client.get("/api/users/1")).json())

    body = asyncio.run(main())
    assert body["labels"]["span_name"] == "GET /api/users/{user_id:int}"
    names = [s.name for s in _server_spans(span_exporter)]
    expected = ["GET /api/users/{user_id:int}"]
    if excluded.strip(" ,") == "":
        expected.insert(0, "GET /items/{item_id}")
    assert names == expected


@pytest.mark.parametrize(
    ("excluded", "excluded_paths", "traced_paths"),
    [
        # A leading inline flag is the first pattern's alone, not every pattern's.
        ("(?i)/ITEMS/,/API/users", ["/items/3"], ["/api/users/1"]),
        # ... and it is no error in a later pattern.
        ("/boom,(?i)/ITEMS/", ["/boom", "/items/3"], ["/api/users/1"]),
        # Two patterns may each name a group alike.
        ("(?P<p>/items/),(?P<p>/boom)", ["/items/3", "/boom"], ["/api/users/1"]),
    ],
)
def test_each_excluded_url_pattern_means_what_it_means_alone(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    excluded: str,
    excluded_paths: list[str],
    traced_paths: list[str],
) -> None:
    """excluded_urls patterns are matched one by one, never compiled joined by "|"."""
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider, excluded_urls=excluded)

    async def main() -> None:
        async with _client(app) as client:
            for path in excluded_paths + traced_paths:
                await client.get(path)

    asyncio.run(main())
    assert calls == excluded_paths + traced_paths
    assert [s.name for s in _server_spans(span_exporter)] == ["GET /api/users/{user_id:int}"]


@pytest.mark.parametrize(
    ("excluded", "message"),
    [
        ("/health|", "'/health\\|' matches every URL"),
        (".*", "matches every URL"),
        # Found in every full URL, "http://host/path": the empty string is not enough a probe.
        ("/", "'/' matches every URL"),
        ("/health,http", "'http' matches every URL"),
        (".+", "'\\.\\+' matches every URL"),
        ("/ok,(", "not a valid regular expression"),
        ("*", "not a valid regular expression"),
        # Not an re.error: compiling raises OverflowError.
        ("/ok,a{4294967296}", "not a valid regular expression"),
    ],
)
def test_an_excluded_url_pattern_that_cannot_work_is_refused(excluded: str, message: str) -> None:
    """A pattern matching every URL, or no regex at all, raises ValueError naming the option."""
    with pytest.raises(ValueError, match=rf"excluded_urls: .*{message}"):
        ProfilingMiddleware(_app_noop, profiler=None, excluded_urls=excluded, environ={})


def test_an_excluded_url_pattern_anchored_to_the_root_page_is_accepted(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """The every-URL check refuses "/", not what excludes the root page alone: "/$"."""
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider, excluded_urls="healthz,/$")

    async def main() -> None:
        async with _client(app) as client:
            await client.get("/")
            await client.get("/api/users/1")

    asyncio.run(main())
    assert calls == ["/", "/api/users/1"]
    assert [s.name for s in _server_spans(span_exporter)] == ["GET /api/users/{user_id:int}"]


@pytest.mark.parametrize(
    ("excluded", "excluded_paths", "traced_paths"),
    [
        # A pattern on the query string, as the README's URL `http://host/path?query` allows.
        ("[?&]probe=1", ["/items/3?probe=1", "/api/users/1?a=2&probe=1"], ["/items/3?a=1"]),
        # The end of a URL with a query is the query's end, not the path's.
        ("/items/3$", ["/items/3"], ["/items/3?page=2", "/api/users/1"]),
    ],
)
def test_excluded_url_patterns_are_searched_in_the_url_with_its_query(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    excluded: str,
    excluded_paths: list[str],
    traced_paths: list[str],
) -> None:
    """excluded_urls are searched in `http://host/path?query` (README), as in the WSGI
    middleware: ASGI used to search OTel's URL, which ends at the path."""
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider, excluded_urls=excluded)

    async def main() -> None:
        async with _client(app) as client:
            for path in excluded_paths + traced_paths:
                await client.get(path)

    asyncio.run(main())
    assert len(calls) == len(excluded_paths + traced_paths)
    assert len(_server_spans(span_exporter)) == len(traced_paths)


async def _app_noop(scope: Any, receive: Any, send: Any) -> None:
    return None


def test_a_failure_to_label_never_fails_the_request(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """If building the labels raises, the request runs unlabelled, once, and it is logged once."""
    from spanprof._web import _asgi

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("labels broke")

    monkeypatch.setattr(_asgi, "request_labels", broken)
    calls: list[str] = []
    app = _counted(build_app(recorder), calls, tracer_provider)

    async def main() -> list[dict[str, Any]]:
        async with _client(app) as client:
            return [(await client.get(f"/items/{i}")).json() for i in range(2)]

    with caplog.at_level("WARNING", logger="spanprof"):
        bodies = asyncio.run(main())
    assert [b["labels"] for b in bodies] == [{}, {}]
    assert calls == ["/items/0", "/items/1"]
    assert len(_server_spans(span_exporter)) == 2
    assert len([r for r in caplog.records if "labelling a request" in r.getMessage()]) == 1


def _pipelined_scope(path: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    """A GET of ``path`` as uvicorn's h11 protocol scopes it, with ``headers`` after Host."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers], "server": ("testserver", 80),
        "client": ("127.0.0.1", 5000), "root_path": "",
    }  # fmt: skip


def _pipelined(app: Any, first: dict[str, Any], second: dict[str, Any]) -> list[dict[str, Any]]:
    """Serve ``first``, then ``second`` as uvicorn's h11 protocol starts a pipelined request:
    its task made inside ``first``'s last send, in a copy of that send's context. The bodies,
    decoded."""

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def main() -> list[dict[str, Any]]:
        bodies: list[bytes] = []
        inherited: list[contextvars.Context] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message.get("body", b""))
                if not message.get("more_body"):
                    inherited.append(contextvars.copy_context())

        await app(first, receive, send)
        loop = asyncio.get_running_loop()
        await inherited[0].run(loop.create_task, app(second, receive, send))
        return [json.loads(body) for body in bodies if body]

    return asyncio.run(main())


@pytest.mark.parametrize("first_sampled", [True, False])
def test_a_pipelined_request_started_from_the_previous_ones_send_gets_its_own_span(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter, first_sampled: bool
) -> None:
    """uvicorn's h11 protocol starts the next pipelined request's task from inside the previous
    request's last send, so it inherits that request's context, ended server span included.
    It must get a span of its own (10 pipelined requests gave 1 span), labels its own too, in
    the trace its own traceparent names. A sampled-out first request leaves a span that never
    looks ended (not an SDK span): the second request was an INTERNAL child in its trace."""
    app = ProfilingMiddleware(build_app(), profiler=None, tracer_provider=tracer_provider)
    first_trace, second_trace = (
        "0af7651916cd43dd8448eb211c80319c",
        "4bf92f3577b34da6a3ce929d0e0e4736",
    )

    def scope(path: str, trace_id: str, sampled: bool) -> dict[str, Any]:
        traceparent = f"00-{trace_id}-b7ad6b7169203331-{'01' if sampled else '00'}"
        return _pipelined_scope(path, (b"traceparent", traceparent.encode()))

    first, second = _pipelined(
        app, scope("/items/1", first_trace, first_sampled), scope("/items/2", second_trace, True)
    )
    spans = _server_spans(span_exporter)
    assert len(span_exporter.get_finished_spans()) == len(spans)  # no INTERNAL spans
    assert [format(s.context.trace_id, "032x") for s in spans] == (
        [first_trace, second_trace] if first_sampled else [second_trace]
    )
    assert second["labels"]["span_id"] == format(spans[-1].context.span_id, "016x")
    assert second["labels"]["trace_id"] == second_trace
    assert first["labels"]["span_id"] != second["labels"]["span_id"]


def test_a_pipelined_excluded_request_does_not_run_with_the_previous_requests_labels(
    recorder: RecorderBackend,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """The next pipelined request inherits the previous one's context (uvicorn's h11 protocol
    starts its task inside the previous request's last send). An excluded one ran there: its
    code (and its children's) carried the previous request's span_id, and its OTel spans were
    children of the previous request's ended span."""
    app = ProfilingMiddleware(
        build_app(recorder),
        profiler=None,
        tracer_provider=tracer_provider,
        excluded_urls="/items/health",
    )
    first, excluded = _pipelined(
        app, _pipelined_scope("/items/1"), _pipelined_scope("/items/health")
    )
    assert first["labels"]["span_name"] == "GET /items/{item_id}"
    for snapshot in (excluded, excluded["child"], excluded["pool"]):
        assert snapshot["labels"] == {}
        assert snapshot["thread"] == {}
    assert [s.name for s in _server_spans(span_exporter)] == ["GET /items/{item_id}"]
