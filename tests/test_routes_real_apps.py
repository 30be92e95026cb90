"""Route names on real application layouts: the span, ``http.route`` and the label agree."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from flask import Flask
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from werkzeug.test import EnvironBuilder

import spanprof
from spanprof import ProfilingMiddleware, WSGIProfilingMiddleware

ASGIApp = Callable[..., Any]


def label_view(request: Request) -> Response:
    """A Starlette endpoint answering with the ``span_name`` label it ran under."""
    return JSONResponse({"span_name": spanprof.current_labels().get("span_name")})


def get_all(app: ASGIApp, *requests: tuple[str, str]) -> list[dict[str, Any]]:
    """``(host, path)`` GETs through ``app``, in order: each response's status and body."""

    async def main() -> list[dict[str, Any]]:
        results = []
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for host, path in requests:
                response = await client.get(path, headers={"host": host})
                body = response.json() if response.status_code == 200 else None
                results.append({"status": response.status_code, "body": body})
        return results

    return asyncio.run(main())


def server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


def route_of(span: ReadableSpan) -> Any:
    return (span.attributes or {}).get("http.route")


def test_non_ascii_route_keeps_its_text_in_the_span_name(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """``/киртест``: span name and ``http.route`` keep the text; only the label is sanitized."""
    from starlette.routing import Route

    app = ProfilingMiddleware(
        Starlette(routes=[Route("/киртест", label_view)]),
        profiler=None,
        tracer_provider=tracer_provider,
    )
    (result,) = get_all(app, ("test", "/киртест"))
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /киртест"
    assert route_of(span) == "/киртест"
    assert result["body"] == {"span_name": "GET /_______"}


def test_non_ascii_flask_route_keeps_its_text_in_the_span_name(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """The WSGI middleware names a non-ASCII Flask rule the same way."""
    app = Flask("spanprof_routes")

    @app.get("/киртест")
    def cyrillic() -> dict[str, Any]:
        return {"span_name": spanprof.current_labels().get("span_name")}

    app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    # Flask's client, not httpx's: httpx puts the path into the environ undecoded (not as
    # PEP 3333's latin-1 string), which no WSGI app can route.
    with app.test_client().get("/киртест") as response:  # closing it ends the request
        body = response.get_json()
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /киртест"
    assert route_of(span) == "/киртест"
    assert body == {"span_name": "GET /_______"}


def subdomain_flask_app(tracer_provider: TracerProvider) -> Flask:
    """Flask with SERVER_NAME and subdomain matching: hosts outside it make werkzeug warn."""
    app = Flask("spanprof_subdomains", subdomain_matching=True)
    app.config["SERVER_NAME"] = "example.com"

    @app.get("/profile", subdomain="<user>")
    def profile(user: str) -> dict[str, Any]:
        return {"span_name": spanprof.current_labels().get("span_name")}

    app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    return app


def test_flask_resolver_adds_no_server_name_warning(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A host outside SERVER_NAME: werkzeug warns once (Flask's binding), not twice."""
    app = subdomain_flask_app(tracer_provider)
    client = app.test_client()
    with (
        pytest.warns(UserWarning, match="doesn't match configured") as warned,
        client.get("/profile", headers={"Host": "10.0.0.7"}) as response,
    ):
        assert response.status_code == 200
    assert len(warned) == 1
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /profile"


def test_flask_subdomain_route_is_named_under_warnings_as_errors(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """With the warning an error, spanprof still resolves the route Flask would pick."""
    from spanprof._wsgi_routes import flask_route_resolver

    app = subdomain_flask_app(tracer_provider)
    environ = EnvironBuilder(path="/profile", headers=[("Host", "10.0.0.7")]).get_environ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flask_route_resolver(app)(environ) == "/profile"
    environ = EnvironBuilder(path="/profile", headers=[("Host", "bob.example.com")]).get_environ()
    assert flask_route_resolver(app)(environ) == "/profile"
    environ = EnvironBuilder(path="/nowhere", headers=[("Host", "bob.example.com")]).get_environ()
    assert flask_route_resolver(app)(environ) is None
