"""The sample Flask inventory service, under ``WSGIProfilingMiddleware``.

The FastAPI service's ``/checkout`` calls ``GET /inventory/<sku>`` here with the trace context
in its headers, so one trace spans both services. Now and then a lookup reconciles the stock
ledger for a long time (``SAMPLE_FLASK_SLOW_SHARE``, default 0.05): the checkout that waited
for it breaches its SLO, and the trace shows where the time went.

Run it with ``gunicorn sample_app.flask_service:app`` (profiles and spans go where the
``PYROSCOPE_*`` and ``OTEL_*`` variables say) or ``spanprof dev sample_app.flask_service:app``.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from flask import Flask, jsonify
from flask.typing import ResponseReturnValue
from opentelemetry.sdk.trace import TracerProvider

from spanprof import FROM_ENV, FromEnv, ProfilerBackend, WSGIProfilingMiddleware

from .telemetry import setup_telemetry

__all__ = ["app", "create_app", "lookup_stock", "reconcile_ledger"]

SERVICE_NAME = "sample-flask"


def lookup_stock(sku: str, warehouses: int = 12) -> dict[str, int]:
    """Stock per warehouse, from a hash chain per warehouse (a few ms of CPU)."""
    stock: dict[str, int] = {}
    for index in range(warehouses):
        digest = f"{sku}/{index}".encode()
        for _ in range(300):
            digest = hashlib.sha1(digest).digest()
        stock[f"wh-{index:02d}"] = digest[0] % 50
    return stock


def reconcile_ledger(sku: str, seconds: float) -> int:
    """The occasional slow path: replay the ledger for ``seconds`` of this thread's CPU."""
    rng = random.Random(sku)
    balance = 0
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        for _ in range(2000):
            balance += rng.randrange(-5, 6)
    return balance


def create_app(
    *,
    profiler: ProfilerBackend | FromEnv | None = FROM_ENV,
    tracer_provider: TracerProvider | None = None,
    slow_share: float | None = None,
    environ: Mapping[str, str] = os.environ,
) -> WSGIProfilingMiddleware:
    """The Flask app wrapped by ``WSGIProfilingMiddleware`` (SLOs from ``SPANPROF_*``).

    ``profiler`` and ``tracer_provider`` go to the middleware: the demo serves this app in the
    FastAPI service's process, where that service's profiler already runs.
    """
    if tracer_provider is None:
        setup_telemetry(SERVICE_NAME, environ)
    share = (
        slow_share
        if slow_share is not None
        else float(environ.get("SAMPLE_FLASK_SLOW_SHARE", "0.05"))
    )
    flask_app = Flask("sample_app.flask_service")

    @flask_app.get("/inventory/<sku>")
    def inventory(sku: str) -> ResponseReturnValue:
        stock = lookup_stock(sku)
        body: dict[str, Any] = {"sku": sku, "stock": stock, "total": sum(stock.values())}
        if random.random() < share:
            body["ledger"] = reconcile_ledger(sku, random.uniform(0.15, 0.3))
        return jsonify(body)

    @flask_app.get("/health")
    def health() -> ResponseReturnValue:
        return jsonify(status="ok")

    return WSGIProfilingMiddleware(flask_app, profiler=profiler, tracer_provider=tracer_provider)


app = create_app()
