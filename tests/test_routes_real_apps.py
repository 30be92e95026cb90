"""Route names on real application layouts: the span, ``http.route`` and the label agree."""

from __future__ import annotations

import asyncio
import importlib.util
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI
from flask import Flask
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Mount, Route, Router
from werkzeug.test import EnvironBuilder

import spanprof
from spanprof import ProfilingMiddleware, WSGIProfilingMiddleware

from .conftest import histogram_points, require

ASGIApp = Callable[..., Any]

# Features of newer FastAPI releases (tools/route_matrix.py also runs this file on the oldest).
needs_fastapi_telemetry = pytest.mark.skipif(
    importlib.util.find_spec("fastapi.telemetry") is None,
    reason="this FastAPI has no built-in telemetry",
)
needs_fastapi_frontend = pytest.mark.skipif(
    not hasattr(FastAPI, "frontend"), reason="this FastAPI has no frontend()"
)


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


def scope_of(span: ReadableSpan) -> str | None:
    """The name of the instrumentation that made ``span``."""
    return span.instrumentation_scope.name if span.instrumentation_scope else None


def route_of(span: ReadableSpan) -> Any:
    return (span.attributes or {}).get("http.route")


def test_non_ascii_route_keeps_its_text_in_the_span_name(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """``/киртест``: span name and ``http.route`` keep the text; only the label is sanitized."""
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
    app = subdomain_flask_app(tracer_provider)
    environ = EnvironBuilder(path="/profile", headers=[("Host", "10.0.0.7")]).get_environ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spanprof.flask_route_resolver(app)(environ) == "/profile"
    environ = EnvironBuilder(path="/profile", headers=[("Host", "bob.example.com")]).get_environ()
    assert spanprof.flask_route_resolver(app)(environ) == "/profile"
    environ = EnvironBuilder(path="/nowhere", headers=[("Host", "bob.example.com")]).get_environ()
    assert spanprof.flask_route_resolver(app)(environ) is None


# URL converters are app code (often a database lookup): the framework runs them, once.


def _converter_flask_app(tracer_provider: TracerProvider, calls: list[tuple[str, bool]]) -> Flask:
    """``/users/<user:u>``, whose converter records each call and whether an app context
    was there, and ``/items/<item:it>``, whose converter needs ``current_app``."""
    from flask import current_app, has_app_context
    from werkzeug.routing import BaseConverter

    class UserConverter(BaseConverter):
        def to_python(self, value: str) -> dict[str, str]:
            calls.append((value, has_app_context()))
            return {"id": value}

    class ItemConverter(BaseConverter):
        def to_python(self, value: str) -> str:
            items: dict[str, str] = current_app.config["ITEMS"]  # like Item.query.get(value)
            return items[value]

    app = Flask("spanprof_converters")
    app.config["ITEMS"] = {"a": "apple"}
    app.url_map.converters["user"] = UserConverter
    app.url_map.converters["item"] = ItemConverter

    @app.get("/users/<user:u>")
    def user(u: dict[str, str]) -> dict[str, Any]:
        return {**_labels(), "id": u["id"]}

    @app.get("/items/<item:it>")
    def item(it: str) -> dict[str, Any]:
        return {**_labels(), "item": it}

    app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    return app


def test_flask_converters_run_once_per_request_and_by_flask(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Naming the route runs no converter: Flask's own match is the only call."""
    calls: list[tuple[str, bool]] = []
    app = _converter_flask_app(tracer_provider, calls)
    with app.test_client().get("/users/42") as response:
        body = response.get_json()
    assert calls == [("42", True)]
    assert body == {"span_name": "GET /users/<user:u>", "id": "42"}
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /users/<user:u>"


def test_flask_converter_needing_the_app_context_names_its_route(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """A converter using ``current_app`` (or a DB session): named, no resolver warning."""
    app = _converter_flask_app(tracer_provider, [])
    with caplog.at_level("WARNING", logger="spanprof"), app.test_client() as http:
        with http.get("/items/a") as response:
            body = response.get_json()
        with http.get("/items/a") as response:
            assert response.status_code == 200
    assert body == {"span_name": "GET /items/<item:it>", "item": "apple"}
    assert [s.name for s in server_spans(span_exporter)] == ["GET /items/<item:it>"] * 2
    assert [r.getMessage() for r in caplog.records if r.name.startswith("spanprof")] == []


def test_flask_rules_added_after_the_resolver_was_built_are_matched() -> None:
    """Rules added once the resolver matched requests (imports that register blueprints
    after the middleware was built, before Flask's first request) are matched."""
    app = Flask("spanprof_late_rules")
    resolve = spanprof.flask_route_resolver(app)
    later = EnvironBuilder(path="/later/1").get_environ()
    assert resolve(later) is None
    app.add_url_rule("/later/<int:n>", "later", _labels)
    assert resolve(later) == "/later/<int:n>"
    app.url_map.add(app.url_rule_class("/last/<path:p>", endpoint="last"))
    assert resolve(EnvironBuilder(path="/last/a/b").get_environ()) == "/last/<path:p>"
    app.url_map.add(app.url_rule_class("/also/<int:n>", endpoint="later"))  # a known endpoint
    assert resolve(EnvironBuilder(path="/also/2").get_environ()) == "/also/<int:n>"


def test_flask_builtin_converters_still_decide_the_match(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """werkzeug's own converters (pure werkzeug code) still reject and redirect as Flask does:
    ``<int(min=1)>`` answers 404 for 0, and a value equal to another rule's default
    redirects there; a user converter's value is matched by its regex only."""
    app = _converter_flask_app(tracer_provider, [])
    app.add_url_rule("/pages/<int(min=1):n>", "pages", lambda n: _labels())

    def listing(page: int) -> dict[str, Any]:
        return _labels()

    app.add_url_rule("/list/", "listing", listing, defaults={"page": 1})
    app.add_url_rule("/list/<int:page>", "listing", listing)
    http = app.test_client()
    statuses = []
    for path in ("/pages/0", "/pages/2", "/list/1", "/list/2"):
        with http.get(path) as response:
            statuses.append(response.status_code)
    assert statuses == [404, 200, 308, 200]
    assert [s.name for s in server_spans(span_exporter)] == [
        "GET <unmatched>",
        "GET /pages/<int(min=1):n>",
        "GET <unmatched>",
        "GET /list/<int:page>",
    ]


class _RecordingConverter:
    """A Django converter that, like a database lookup, works only inside a request."""

    regex = "[0-9]+"
    in_request = False
    calls: ClassVar[list[bool]] = []

    def to_python(self, value: str) -> int:
        type(self).calls.append(type(self).in_request)
        if not type(self).in_request:
            raise RuntimeError("no database connection outside a request")
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


def test_django_converters_run_once_per_request_and_by_django(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    fresh_log_once: None,
) -> None:
    """Naming a Django request runs no ``register_converter`` converter: Django's is the
    only call, inside the request, and the route is named with no resolver warning."""
    require(importlib.util.find_spec("django") is not None, "django is not installed")
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.signals import request_finished, request_started
    from django.http import HttpRequest, JsonResponse
    from django.test.utils import override_settings
    from django.urls import include, path, register_converter
    from django.urls.converters import get_converters

    from .e2e import django_project

    django_project.configure()
    if "spanprof_acct" not in get_converters():
        register_converter(_RecordingConverter, "spanprof_acct")

    def view(request: HttpRequest, **kwargs: Any) -> JsonResponse:
        return JsonResponse(_labels())

    urlconf = types.ModuleType("spanprof_converter_urls")
    accounts = [path("<spanprof_acct:a>/", view)]
    urlconf.urlpatterns = [  # type: ignore[attr-defined]
        path("orgs/<int:org>/acct/", include(accounts)),
        path("acct/<spanprof_acct:a>/", view),
    ]

    def started(**kwargs: Any) -> None:
        _RecordingConverter.in_request = True

    def finished(**kwargs: Any) -> None:
        _RecordingConverter.in_request = False

    _RecordingConverter.calls.clear()
    request_started.connect(started)
    request_finished.connect(finished)
    app = WSGIProfilingMiddleware(
        WSGIHandler(), profiler=None, tracer_provider=tracer_provider, environ={}
    )
    try:
        with (
            override_settings(ROOT_URLCONF=urlconf),
            caplog.at_level("WARNING", logger="spanprof"),
            httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as http,
        ):
            bodies = [http.get(p).json() for p in ("/acct/7/", "/orgs/3/acct/8/")]
    finally:
        request_started.disconnect(started)
        request_finished.disconnect(finished)
    names = ["GET /acct/<spanprof_acct:a>/", "GET /orgs/<int:org>/acct/<spanprof_acct:a>/"]
    assert _RecordingConverter.calls == [True, True]
    assert [s.name for s in server_spans(span_exporter)] == names
    assert bodies == [{"span_name": name} for name in names]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("spanprof")] == []


I18N_CASES = [
    # (prefix_default_language, [(path, status, route or None)]): the languages alternate, as
    # the thread's active language is the previous request's when the next one is named.
    (
        True,
        [
            ("/fr/items/1/", 200, "/fr/items/<int:id>/"),
            ("/en/items/2/", 200, "/en/items/<int:id>/"),
            ("/fr/shop/cart/", 200, "/fr/shop/cart/"),
            ("/items/4/", 302, None),  # LocaleMiddleware redirects to /en/items/4/
        ],
    ),
    (
        False,
        [
            ("/fr/items/1/", 200, "/fr/items/<int:id>/"),
            ("/items/2/", 200, "/items/<int:id>/"),
            ("/fr/shop/cart/", 200, "/fr/shop/cart/"),
            ("/en/items/4/", 404, None),  # the default language has no prefix
            ("/shop/cart/", 200, "/shop/cart/"),
        ],
    ),
]


@pytest.mark.parametrize(("prefix_default_language", "requests"), I18N_CASES)
def test_django_i18n_patterns_are_named_in_the_language_of_the_request(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    prefix_default_language: bool,
    requests: list[tuple[str, int, str | None]],
) -> None:
    """``i18n_patterns`` routes are named as Django's ``resolver_match.route`` names them for
    the request's language, never after the language of the thread's previous request."""
    require(importlib.util.find_spec("django") is not None, "django is not installed")
    from django.conf.urls.i18n import i18n_patterns
    from django.core.handlers.wsgi import WSGIHandler
    from django.http import HttpRequest, JsonResponse
    from django.test.utils import override_settings
    from django.urls import include, path
    from django.utils import translation

    from .e2e import django_project

    django_project.configure()

    def view(request: HttpRequest, **kwargs: Any) -> JsonResponse:
        assert request.resolver_match is not None
        return JsonResponse({**_labels(), "route": request.resolver_match.route})

    urlconf = types.ModuleType("spanprof_i18n_urls")
    urlconf.urlpatterns = i18n_patterns(  # type: ignore[attr-defined]
        path("items/<int:id>/", view),
        path("shop/", include([path("cart/", view)])),
        prefix_default_language=prefix_default_language,
    )
    bodies = []
    try:
        with override_settings(
            ROOT_URLCONF=urlconf,
            MIDDLEWARE=["django.middleware.locale.LocaleMiddleware"],
            LANGUAGE_CODE="en",
            LANGUAGES=[("en", "English"), ("fr", "French")],
        ):
            app = WSGIProfilingMiddleware(
                WSGIHandler(), profiler=None, tracer_provider=tracer_provider, environ={}
            )
            with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as http:
                for url, status, _ in requests:
                    response = http.get(url)
                    assert response.status_code == status, url
                    if status == 200:
                        bodies.append(response.json())
    finally:
        translation.deactivate()  # LocaleMiddleware leaves the last request's language active
    names = [f"GET {route or '<unmatched>'}" for _, _, route in requests]
    assert [s.name for s in server_spans(span_exporter)] == names
    # Django's own route for each request, with the leading "/" spanprof adds.
    assert bodies == [
        {"span_name": f"GET {route}", "route": route[1:]}
        for _, status, route in requests
        if route is not None
    ]


# FastAPI's "bigger applications" layout: routers in their own modules, included by the app.


def _labels() -> dict[str, Any]:
    return {"span_name": spanprof.current_labels().get("span_name")}


def bigger_fastapi_app(**options: Any) -> FastAPI:
    """``app.include_router(users.router)`` and ``include_router(items, prefix="/api")``."""
    app = FastAPI(**options)
    users = APIRouter(tags=["users"])

    @users.get("/users/me")
    def read_user_me() -> dict[str, Any]:
        return _labels()

    @users.get("/users/{username}")
    def read_user(username: str) -> dict[str, Any]:
        return _labels()

    items = APIRouter(prefix="/items")

    @items.get("/{item_id}")
    async def read_item(item_id: str) -> dict[str, Any]:
        return _labels()

    @items.put("/{item_id}")
    async def update_item(item_id: str) -> dict[str, Any]:
        return _labels()

    @items.get("/by-number/{number:int}")
    async def read_numbered(number: int) -> dict[str, Any]:
        return _labels()

    admin = APIRouter(prefix="/admin")

    @admin.get("/stats")
    async def stats() -> dict[str, Any]:
        return _labels()

    items.include_router(admin)  # nested: /api/items/admin/stats
    app.include_router(users)
    app.include_router(items, prefix="/api")

    @app.get("/")
    async def root() -> dict[str, Any]:
        return _labels()

    return app


BIGGER_APP_CASES = [
    ("/users/me", "/users/me"),
    ("/users/rick", "/users/{username}"),
    ("/api/items/plumbus", "/api/items/{item_id}"),
    ("/api/items/admin/stats", "/api/items/admin/stats"),
    ("/", "/"),
]


def test_fastapi_included_routers_are_named_from_their_routes(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """``include_router()`` routes (prefixed, nested) get their template, never <unmatched>."""
    app = ProfilingMiddleware(bigger_fastapi_app(), profiler=None, tracer_provider=tracer_provider)
    results = get_all(app, *(("test", path) for path, _ in BIGGER_APP_CASES))
    spans = server_spans(span_exporter)
    assert [s.name for s in spans] == [f"GET {t}" for _, t in BIGGER_APP_CASES]
    assert [route_of(s) for s in spans] == [t for _, t in BIGGER_APP_CASES]
    assert [r["body"] for r in results] == [{"span_name": f"GET {t}"} for _, t in BIGGER_APP_CASES]


def test_fastapi_included_route_partial_match_does_not_hide_a_later_full_match(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A POST to an included GET/PUT route is a 405 named after that route, not unmatched."""
    app = ProfilingMiddleware(bigger_fastapi_app(), profiler=None, tracer_provider=tracer_provider)

    async def main() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.post("/api/items/plumbus")).status_code

    assert asyncio.run(main()) == 405
    (span,) = server_spans(span_exporter)
    assert span.name == "POST /api/items/{item_id}"


def test_fastapi_included_routes_get_their_route_slo(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Per-route SLOs match included routes by their prefixed template."""
    app = ProfilingMiddleware(
        bigger_fastapi_app(),
        profiler=None,
        tracer_provider=tracer_provider,
        slo_seconds=60,
        route_slos={"/api/items/{item_id}": 1e-9},
        environ={},
    )
    get_all(app, ("test", "/api/items/plumbus"), ("test", "/users/me"))
    included, other = server_spans(span_exporter)
    assert (included.attributes or {}).get("spanprof.slo.threshold_s") == 1e-9
    assert (included.attributes or {}).get("spanprof.slo.breached") is True
    assert "spanprof.slo.breached" not in (other.attributes or {})


@needs_fastapi_telemetry
def test_fastapi_telemetry_and_spanprof_share_one_server_span_and_one_name(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """spanprof inside FastAPI's telemetry: one server span, FastAPI's name is the label too.

    FastAPI renames its span when the router picks the route (``path_format``: converters
    dropped), so the label is named the same way, and FastAPI's operation spans stay.
    """
    app = bigger_fastapi_app(telemetry={"tracer_provider": tracer_provider})
    app.add_middleware(ProfilingMiddleware, profiler=None, tracer_provider=tracer_provider)
    cases = [*BIGGER_APP_CASES, ("/api/items/by-number/7", "/api/items/by-number/{number}")]
    results = get_all(app, *(("test", path) for path, _ in cases))
    spans = server_spans(span_exporter)
    assert [s.name for s in spans] == [f"GET {t}" for _, t in cases]
    assert [route_of(s) for s in spans] == [t for _, t in cases]
    assert [r["body"] for r in results] == [{"span_name": f"GET {t}"} for _, t in cases]
    assert all(scope_of(s) == "fastapi" for s in spans)
    endpoints = [s for s in span_exporter.get_finished_spans() if s.name == "fastapi.endpoint"]
    assert len(endpoints) == len(cases)
    assert {s.parent.span_id for s in endpoints if s.parent} == {s.context.span_id for s in spans}


@needs_fastapi_telemetry
def test_spanprof_outside_fastapi_telemetry_keeps_one_server_span(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Wrapping a FastAPI app whose telemetry is on: spanprof's span is the only server span."""
    app = ProfilingMiddleware(
        bigger_fastapi_app(telemetry={"tracer_provider": tracer_provider}),
        profiler=None,
        tracer_provider=tracer_provider,
    )
    results = get_all(app, ("test", "/users/me"), ("test", "/api/items/plumbus"))
    spans = server_spans(span_exporter)
    assert [s.name for s in spans] == ["GET /users/me", "GET /api/items/{item_id}"]
    assert all(scope_of(s) != "fastapi" for s in spans)
    assert [r["body"]["span_name"] for r in results] == [s.name for s in spans]


@needs_fastapi_telemetry
@pytest.mark.parametrize("sampled", [True, False])
def test_fastapi_telemetry_names_mounts_and_the_label_follows(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter, sampled: bool
) -> None:
    """Mounted apps under FastAPI's telemetry: a FastAPI sub-app's route names the request, a
    Starlette sub-app only its mount (FastAPI's rule), and the label is that same name.

    Sampled out, FastAPI's span is no SDK span and has no kind: it is still the one FastAPI
    put in the scope (the request was named by spanprof's own template, converters and all:
    two label series and two http.route series for one route)."""
    if not sampled:
        tracer_provider = TracerProvider(sampler=ALWAYS_OFF)
    app = FastAPI(telemetry={"tracer_provider": tracer_provider})
    v2 = FastAPI()

    @v2.get("/items/{item_id:int}")
    async def item(item_id: int) -> dict[str, Any]:
        return _labels()

    app.mount("/v2", v2)
    app.mount("/legacy", Starlette(routes=[Route("/items/{item_id}", label_view)]))
    app.add_middleware(ProfilingMiddleware, profiler=None, tracer_provider=tracer_provider)
    results = get_all(app, ("test", "/v2/items/7"), ("test", "/legacy/items/7"))
    names = ["GET /v2/items/{item_id}", "GET /legacy/{path}"]
    assert [s.name for s in server_spans(span_exporter)] == (names if sampled else [])
    assert [r["body"] for r in results] == [{"span_name": name} for name in names]


def frontend_app(build: Path, **options: Any) -> FastAPI:
    """The bigger app plus ``frontend()`` builds: app-level, and in an included router."""
    (build / "index.html").write_text("<html></html>")
    (build / "app.js").write_text("1")
    app = bigger_fastapi_app(**options)
    app.frontend("/", directory=build)
    docs = APIRouter()
    docs.frontend("/docs-site", directory=build)
    app.include_router(docs, prefix="/help")
    return app


FRONTEND_CASES = [
    ("/app.js", "GET /{path}"),
    ("/help/docs-site/app.js", "GET /help/docs-site/{path}"),
    ("/api/items/plumbus/", "GET <unmatched>"),  # a slash redirect, not the frontend
    ("/users/me", "GET /users/me"),
]


@needs_fastapi_frontend
def test_fastapi_frontend_routes_are_named(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    """``frontend()`` builds are named after their path, as FastAPI's telemetry names them."""
    wrapped = ProfilingMiddleware(
        frontend_app(tmp_path), profiler=None, tracer_provider=tracer_provider
    )
    results = get_all(wrapped, *(("test", path) for path, _ in FRONTEND_CASES))
    assert [s.name for s in server_spans(span_exporter)] == [name for _, name in FRONTEND_CASES]
    assert [r["status"] for r in results] == [200, 200, 307, 200]


@needs_fastapi_telemetry
@needs_fastapi_frontend
def test_fastapi_frontend_inside_fastapi_telemetry_labels_agree(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    """Frontend requests under FastAPI's telemetry: its span name is the label, one span."""
    seen: list[Any] = []

    def capture() -> None:
        seen.append(spanprof.current_labels().get("span_name"))

    app = frontend_app(
        tmp_path, telemetry={"tracer_provider": tracer_provider}, dependencies=[Depends(capture)]
    )
    app.add_middleware(ProfilingMiddleware, profiler=None, tracer_provider=tracer_provider)
    cases = [case for case in FRONTEND_CASES if "<unmatched>" not in case[1]]
    get_all(app, *(("test", path) for path, _ in cases))
    assert [s.name for s in server_spans(span_exporter)] == [name for _, name in cases]
    assert seen == [name for _, name in cases]


# Starlette routing beyond a flat route list.


def test_host_and_subdomain_routes_are_named_from_the_routes_below_them(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """``Host("api.example.com")`` and ``Host("{sub}.example.com")`` route by the Host header."""
    api = Router([Route("/users/{user_id}", label_view)])
    tenants = Starlette(routes=[Mount("/v1", routes=[Route("/reports/{day}", label_view)])])
    app = Starlette(
        routes=[
            Host("api.example.com", api),
            Host("{tenant}.example.com", tenants),
            Route("/users/{user_id}", label_view),
        ]
    )
    results = get_all(
        ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider),
        ("api.example.com", "/users/1"),
        ("acme.example.com:8443", "/v1/reports/monday"),
        ("api.example.com", "/v1/reports/monday"),  # served by the api host's router: a 404
        ("other.org", "/users/2"),
    )
    names = ["GET /users/{user_id}", "GET /v1/reports/{day}", "GET <unmatched>"]
    names.append("GET /users/{user_id}")
    assert [s.name for s in server_spans(span_exporter)] == names
    assert [r["status"] for r in results] == [200, 200, 404, 200]
    assert results[1]["body"] == {"span_name": "GET /v1/reports/{day}"}


def test_a_bare_route_or_router_served_as_the_app_is_named(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A ``Route`` or ``Router`` passed as the app (no Starlette application around it)."""
    for bare in (Route("/only/{x}", label_view), Router([Route("/only/{x}", label_view)])):
        results = get_all(
            ProfilingMiddleware(bare, profiler=None, tracer_provider=tracer_provider),
            ("test", "/only/1"),
        )
        assert results[0]["body"] == {"span_name": "GET /only/{x}"}
    assert [s.name for s in server_spans(span_exporter)] == ["GET /only/{x}"] * 2


def test_routes_changed_after_the_first_request_are_seen(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Routes added, inserted or replaced in place after requests were served are matched."""
    app = Starlette(routes=[Route("/a", label_view), Route("/b", label_view)])
    wrapped = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    get_all(wrapped, ("test", "/a"))
    app.add_route("/later/{x}", label_view)
    get_all(wrapped, ("test", "/later/1"))
    app.router.routes[1] = Route("/replaced/{y}", label_view)  # same list, same length
    results = get_all(wrapped, ("test", "/replaced/2"))
    assert results[0]["body"] == {"span_name": "GET /replaced/{y}"}
    names = ["GET /a", "GET /later/{x}", "GET /replaced/{y}"]
    assert [s.name for s in server_spans(span_exporter)] == names


def test_fastapi_routes_added_after_the_first_request_are_seen(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A router included after start-up, and a route added to an included router later."""
    app = bigger_fastapi_app()
    wrapped = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    get_all(wrapped, ("test", "/users/me"))
    late = APIRouter(prefix="/late")

    @late.get("/{thing}")
    async def thing(thing: str) -> dict[str, Any]:
        return _labels()

    app.include_router(late)
    (first,) = get_all(wrapped, ("test", "/late/x"))
    assert first["body"] == {"span_name": "GET /late/{thing}"}

    async def other(other: str) -> dict[str, Any]:
        return _labels()

    late.add_api_route("/later/{other}", other, methods=["GET"])
    # FastAPI >= 0.137 serves routes added to an included router; older releases copied the
    # routes at include time and answer 404: either way the name follows what is served.
    (second,) = get_all(wrapped, ("test", "/late/later/y"))
    if second["status"] == 200:
        assert second["body"] == {"span_name": "GET /late/later/{other}"}
        assert server_spans(span_exporter)[-1].name == "GET /late/later/{other}"
    else:
        assert second["status"] == 404
        assert server_spans(span_exporter)[-1].name == "GET <unmatched>"


def test_routes_are_found_behind_middleware_that_wraps_the_app(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """``ProfilingMiddleware(GZipMiddleware(app))``: the routes are the wrapped app's."""
    from starlette.middleware.gzip import GZipMiddleware

    app = GZipMiddleware(Starlette(routes=[Route("/items/{item_id}", label_view)]))
    results = get_all(
        ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider),
        ("test", "/items/1"),
    )
    assert results[0]["body"] == {"span_name": "GET /items/{item_id}"}


def test_route_tables_stay_bounded() -> None:
    """Thousands of short-lived routers never grow the compiled-table cache without bound."""
    from spanprof._web import _routes

    scope = {"type": "http", "method": "GET", "path": "/x", "root_path": "", "headers": []}
    for _ in range(3 * _routes._MAX_TABLES):
        router = Router([Route("/x", label_view)])
        assert _routes.starlette_route_template(scope, router) == "/x"
        assert _routes.starlette_route_template(scope, Route("/x", label_view)) == "/x"
    assert len(_routes._tables) <= _routes._MAX_TABLES
    assert len(_routes._singles) <= _routes._MAX_TABLES


# Nested spanprof layers: a mounted sub-app with its own middleware.


def test_nested_spanprof_middleware_leaves_the_outer_request_alone(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Sub-apps with their own ProfilingMiddleware at /v1 and /v2: the outer names stay full."""

    def versioned() -> ProfilingMiddleware:
        sub = Starlette(routes=[Route("/items/{item_id}", label_view)])
        return ProfilingMiddleware(sub, profiler=None, tracer_provider=tracer_provider)

    app = Starlette(routes=[Mount("/v1", app=versioned()), Mount("/v2", app=versioned())])
    wrapped = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    results = get_all(wrapped, ("test", "/v1/items/1"), ("test", "/v2/items/2"))
    names = ["GET /v1/items/{item_id}", "GET /v2/items/{item_id}"]
    spans = server_spans(span_exporter)
    assert [s.name for s in spans] == names
    assert [route_of(s) for s in spans] == [name.removeprefix("GET ") for name in names]
    assert len(span_exporter.get_finished_spans()) == 2  # the inner layers add no span
    assert [r["body"] for r in results] == [{"span_name": name} for name in names]


def test_flask_with_its_own_middleware_mounted_in_an_asgi_app_keeps_the_outer_name(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A Flask app (WSGIProfilingMiddleware) mounted under ProfilingMiddleware: one request.

    The outer span keeps its own template and ids; the Flask view runs with its labels.
    """
    from asgiref.wsgi import WsgiToAsgi

    flask = Flask("spanprof_mounted")

    @flask.get("/items/<int:item_id>")
    def item(item_id: int) -> dict[str, Any]:
        labels = spanprof.current_labels()
        return {"span_name": labels.get("span_name"), "span_id": labels.get("span_id")}

    flask.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        flask.wsgi_app, profiler=None, tracer_provider=tracer_provider, environ={}
    )
    legacy = WsgiToAsgi(flask)  # type: ignore[no-untyped-call]  # asgiref ships no annotations
    app = Starlette(routes=[Mount("/legacy", app=legacy)])
    wrapped = ProfilingMiddleware(app, profiler=None, tracer_provider=tracer_provider)
    (result,) = get_all(wrapped, ("test", "/legacy/items/7"))
    (span,) = server_spans(span_exporter)
    assert span.name == "GET /legacy/{path:path}"
    assert len(span_exporter.get_finished_spans()) == 1
    assert result["body"] == {
        "span_name": "GET /legacy/{path:path}",
        "span_id": format(span.context.span_id if span.context else 0, "016x"),
    }


def test_nested_layers_leave_a_sampled_out_outer_request_alone(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """A sampled-out request's span is not an SDK span and has no kind: a sub-app's layer
    (ASGI, or Flask's WSGI one) must still see that the outer layer owns the request. It
    opened a second span, relabelled the request and timed it a second time."""
    from asgiref.wsgi import WsgiToAsgi

    sampled_out = TracerProvider(sampler=ALWAYS_OFF)
    flask = Flask("spanprof_mounted_sampled_out")

    @flask.get("/items/<int:item_id>")
    def flask_item(item_id: int) -> dict[str, Any]:
        return {"span_name": spanprof.current_labels().get("span_name")}

    flask.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
        flask.wsgi_app,
        profiler=None,
        tracer_provider=sampled_out,
        meter_provider=meter_provider,
        environ={},
    )
    sub = ProfilingMiddleware(
        Starlette(routes=[Route("/items/{item_id}", label_view)]),
        profiler=None,
        tracer_provider=sampled_out,
        meter_provider=meter_provider,
    )
    legacy = WsgiToAsgi(flask)  # type: ignore[no-untyped-call]  # asgiref ships no annotations
    app = Starlette(routes=[Mount("/v1", app=sub), Mount("/legacy", app=legacy)])
    wrapped = ProfilingMiddleware(
        app, profiler=None, tracer_provider=sampled_out, meter_provider=meter_provider
    )
    results = get_all(wrapped, ("test", "/v1/items/1"), ("test", "/legacy/items/7"))
    names = ["GET /v1/items/{item_id}", "GET /legacy/{path:path}"]
    assert [r["body"] for r in results] == [{"span_name": name} for name in names]
    points = histogram_points(metric_reader, "http.server.request.duration")
    routes = sorted((str((p.attributes or {}).get("http.route")), p.count) for p in points)
    assert routes == [("/legacy/{path:path}", 1), ("/v1/items/{item_id}", 1)]


def test_a_nested_layer_never_starts_its_profiler_for_the_outer_ones_requests() -> None:
    """A sub-app's layer with a profiler of its own passes the outer layer's requests through
    untouched: starting its backend there took the label engine from the outer profiler."""
    from spanprof.engine import installed_backend, uninstall_label_engine

    outer, inner = spanprof.RecorderBackend(), spanprof.RecorderBackend()
    sub = ProfilingMiddleware(
        Starlette(routes=[Route("/items/{item_id}", label_view)]), profiler=inner
    )
    app = Starlette(routes=[Route("/home", label_view), Mount("/sub", app=sub)])
    try:
        results = get_all(
            ProfilingMiddleware(app, profiler=outer), ("test", "/home"), ("test", "/sub/items/1")
        )
        # No SDK here: no span ids in the labels to tell, the outer request in progress does.
        assert [r["body"] for r in results] == [
            {"span_name": "GET /home"},
            {"span_name": "GET /sub/items/{item_id}"},
        ]
        assert installed_backend() is outer
        assert (outer.started, inner.started) == (1, 0)
    finally:
        uninstall_label_engine()
