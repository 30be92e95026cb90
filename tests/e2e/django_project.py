"""A one-module Django project: settings, URLconf, views and the WSGI ``application``.

Used in-process by tests/test_wsgi.py (``configure()``, then ``django_application()``) and,
through tests/e2e/django_wsgi.py, served by a real gunicorn in tests/test_e2e_gunicorn.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import include, path, re_path

import spanprof
from spanprof import RecorderBackend, WSGIProfilingMiddleware, current_labels

from .markers import MARKERS

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.015"))


def configure() -> None:
    """Configure Django for this process once (settings are process-global)."""
    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        SECRET_KEY="spanprof-tests-only",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        INSTALLED_APPS=[],
        MIDDLEWARE=[],
        USE_TZ=True,
        LOGGING_CONFIG=None,
    )
    import django

    django.setup()


def snapshot() -> dict[str, Any]:
    """The labels of the running code, and what the recorder backend has for this thread."""
    backend = spanprof.engine.installed_backend()
    thread = dict(backend.thread_labels()) if isinstance(backend, RecorderBackend) else None
    return {"labels": dict(current_labels()), "thread": thread}


def item(request: HttpRequest, item_id: int) -> HttpResponse:
    with ThreadPoolExecutor(max_workers=1) as pool:
        pooled = pool.submit(snapshot).result()
    return JsonResponse({**snapshot(), "pool": pooled})


def stream(request: HttpRequest) -> HttpResponse:
    def body() -> Iterator[bytes]:
        for _ in range(2):
            yield json.dumps(snapshot()).encode() + b"\n"

    return StreamingHttpResponse(body(), content_type="application/x-ndjson")


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("view failed")


def user(request: HttpRequest, pk: int) -> HttpResponse:
    return JsonResponse(snapshot())


def archive(request: HttpRequest, year: str) -> HttpResponse:
    return JsonResponse(snapshot())


def burn(request: HttpRequest, index: int) -> HttpResponse:
    """Burn CPU in this request's marker, in the view, a thread pool and the streamed body."""
    marker = MARKERS[index]
    for _ in range(3):
        marker(STEP)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(marker, 2 * STEP).result()
    labels = dict(current_labels())

    def body() -> Iterator[bytes]:
        for _ in range(2):
            marker(STEP)
            yield b" "
        report = {"labels": labels, "body": dict(current_labels()), "pid": os.getpid()}
        yield json.dumps(report).encode() + b"\n"

    return StreamingHttpResponse(body(), content_type="application/json")


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"ok")


api = [path("users/<int:pk>/", user)]

urlpatterns = [
    path("items/<int:item_id>/", item),
    path("stream/", stream),
    path("boom/", boom),
    path("api/", include(api)),
    re_path(r"^archive/(?P<year>[0-9]{4})/$", archive),
    path("burn/<int:index>/", burn),
    path("health/", health),
]


def django_application(**options: Any) -> WSGIProfilingMiddleware:
    """Django's WSGI handler wrapped in the middleware (``configure()`` first)."""
    from django.core.wsgi import get_wsgi_application

    return WSGIProfilingMiddleware(get_wsgi_application(), **options)
