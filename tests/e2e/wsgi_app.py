"""The end-to-end Flask app: each request burns CPU in its own marker function.

Served by a real gunicorn (tests/test_e2e_gunicorn.py) or uWSGI in subprocesses; the profiler
comes from the PYROSCOPE_* environment and starts on each worker's first request. A request
burns in the view, in a thread-pool job, in a gevent greenlet it spawns (E2E_GREENLETS=1) and in
its streamed body, then reports the labels it saw and the worker's pid.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

if os.environ.get("E2E_WITHOUT_AGENT") == "1":
    # Fault injection: `import pyroscope` fails, as where pyroscope-io is not installed (3.15).
    sys.modules["pyroscope"] = None  # type: ignore[assignment]
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flask import Flask, Response
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from spanprof import (
    PyroscopeBackend,
    WSGIProfilingMiddleware,
    current_labels,
    install_greenlet_labels,
)

from .markers import MARKERS

STEP = float(os.environ.get("E2E_STEP_SECONDS", "0.015"))
# Each burn is this many steps of STEP seconds, yielding to other greenlets in between.
REPEAT = int(os.environ.get("E2E_REPEAT", "1"))
GREENLETS = os.environ.get("E2E_GREENLETS") == "1"
# The README's quickstart as it stands: no profiler= option, no install_greenlet_labels().
DEFAULTS = os.environ.get("E2E_DEFAULTS") == "1"


def backend_from_env() -> PyroscopeBackend | None:
    """The PYROSCOPE_* backend, reporting each sample's pid so workers can be told apart."""
    base = PyroscopeBackend.from_env()
    if base is None:
        return None
    return PyroscopeBackend(
        server_address=base.server_address,
        application_name=base.application_name,
        upload_interval=base.upload_interval,
        extra_options={"report_pid": True},
    )


def _pool_job(marker: Any) -> dict[str, str]:
    for _ in range(REPEAT):
        marker(2 * STEP)
    return dict(current_labels())


def _greenlet_job(marker: Any) -> dict[str, str]:
    for _ in range(2 * REPEAT):
        marker(STEP)
        time.sleep(0)  # gevent's sleep once patched: other greenlets run in between
    return dict(current_labels())


def create_app() -> Flask:
    """The Flask app, its ``wsgi_app`` wrapped as the README recipe says."""
    app = Flask(__name__)

    @app.get("/burn/<int:index>")
    def burn(index: int) -> Response:
        marker = MARKERS[index]
        for _ in range(3 * REPEAT):
            marker(STEP)
            time.sleep(0)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pooled = pool.submit(_pool_job, marker).result()
        spawned = None
        if GREENLETS:
            import gevent

            spawned = gevent.spawn(_greenlet_job, marker).get()
        labels = dict(current_labels())

        def body() -> Iterator[bytes]:
            for _ in range(2 * REPEAT):
                marker(STEP)
                time.sleep(0)
                yield b" "
            report = {
                "labels": labels,
                "pool": pooled,
                "greenlet": spawned,
                "body": dict(current_labels()),
                "pid": os.getpid(),
            }
            yield json.dumps(report).encode() + b"\n"

        return Response(body(), mimetype="application/json")

    @app.get("/health")
    def health() -> str:
        return "ok"

    if DEFAULTS:
        app.wsgi_app = WSGIProfilingMiddleware(app.wsgi_app)  # type: ignore[method-assign]
    else:
        app.wsgi_app = WSGIProfilingMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, profiler=backend_from_env()
        )
    return app


trace.set_tracer_provider(TracerProvider())
if DEFAULTS:
    # The start-up line that says which profiler runs is INFO: show it in the server log.
    logging.basicConfig()
    logging.getLogger("spanprof").setLevel(logging.INFO)
if GREENLETS and not DEFAULTS:
    # Here at import: in the master under preload_app; the hook survives the fork.
    install_greenlet_labels()
app = create_app()
