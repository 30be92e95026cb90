"""``make demo``: the sample services in local mode, with traffic, and a page to look at.

```sh
python -m sample_app.demo                 # until Ctrl-C
python -m sample_app.demo --duration 30   # stops by itself
```

One process runs the FastAPI service (under ``ProfilingMiddleware``, served by uvicorn), the
Flask inventory service it calls (under ``WSGIProfilingMiddleware``, in background threads),
the embedded profile receiver, the span store and the local page; a second process sends
traffic. Open the printed URL and click a red dot or a breach: its flame graph is built only
from the CPU samples labelled with that request's span id.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from spanprof._local import LocalMode
from spanprof._local._slo import policy_from

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROUTE_SLO = "/checkout=0.25,/ws/echo=5"


def _provider(service_name: str) -> TracerProvider:
    return TracerProvider(resource=Resource.create({"service.name": service_name}))


def _wait_ready(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


class _Traffic:
    """The traffic generator in its own process, started once the app answers."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def start_when_ready(self, health_url: str) -> None:
        def run() -> None:
            if not _wait_ready(health_url, 30.0):
                print(f"\nspanprof demo: {health_url} did not answer; no traffic", file=sys.stderr)
                return
            with self._lock:
                if self._stopped:
                    return
                self.process = subprocess.Popen(self.argv, cwd=ROOT)
            # 0: it reached its bounds; Ctrl-C (130) or stop() (SIGTERM) end the demo anyway.
            if self.process.wait() == 0 and not self._stopped:
                print("spanprof demo: traffic done; the page stays up until Ctrl-C", flush=True)

        threading.Thread(target=run, name="spanprof-demo-traffic", daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo until Ctrl-C or ``--duration``."""
    parser = argparse.ArgumentParser(prog="python -m sample_app.demo", description=__doc__)
    parser.add_argument("--port", type=int, default=8000, help="FastAPI service port")
    parser.add_argument("--ui-port", type=int, default=8001, help="local page port")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--requests", type=int, default=100_000, help="traffic: request bound")
    parser.add_argument("--concurrency", type=int, default=4, help="traffic: concurrent clients")
    parser.add_argument("--slo", help="default SLO seconds (default SPANPROF_SLO_SECONDS, 0.5)")
    parser.add_argument(
        "--route-slo",
        help=f"per-route SLOs (default SPANPROF_ROUTE_SLO, else '{DEFAULT_ROUTE_SLO}')",
    )
    args = parser.parse_args(argv)
    route_slo = args.route_slo
    if route_slo is None and not os.environ.get("SPANPROF_ROUTE_SLO"):
        route_slo = DEFAULT_ROUTE_SLO
    try:
        policy = policy_from(os.environ, slo=args.slo, route_slo=route_slo)
    except ValueError as exc:
        parser.error(str(exc))

    local = LocalMode(
        port=args.port, ui_port=args.ui_port, policy=policy, service_name="sample-fastapi"
    )
    try:
        local.start()
    except OSError as exc:
        print(f"spanprof demo: cannot listen on port {args.ui_port}: {exc}", file=sys.stderr)
        return 1
    traffic: _Traffic | None = None
    try:
        # Two services, two service names, one span store (and one profiler: one process).
        fastapi_provider = _provider("sample-fastapi")
        trace.set_tracer_provider(fastapi_provider)
        local.install_tracing(fastapi_provider)
        flask_provider = _provider("sample-flask")
        local.install_tracing(flask_provider)

        from sample_app import fastapi_service, flask_service

        inventory = flask_service.create_app(profiler=None, tracer_provider=flask_provider)
        flask_url = local.serve_in_thread(inventory)
        app = fastapi_service.create_app(flask_url=flask_url)

        traffic_seconds = args.duration if args.duration is not None else 3600.0
        traffic = _Traffic(
            [
                sys.executable,
                "-m",
                "sample_app.traffic",
                f"--base-url={local.app_url}",
                f"--requests={args.requests}",
                f"--duration={traffic_seconds}",
                f"--concurrency={args.concurrency}",
            ]
        )
        routes = ", ".join(f"{route} {seconds:g} s" for route, seconds in policy.routes.items())
        print(f"spanprof demo: FastAPI service {local.app_url} -> Flask service {flask_url}")
        print(f"spanprof demo: SLO {policy.default:g} s ({routes}); Ctrl-C stops")
        print(f"spanprof demo: open {local.ui_url} and click a red dot or a breach", flush=True)
        traffic.start_when_ready(f"{local.app_url}/health")
        if args.duration is not None:
            stopping = traffic

            def stop() -> None:
                stopping.stop()  # first the clients, so no request meets a closing server
                local.request_stop()

            timer = threading.Timer(args.duration, stop)
            timer.daemon = True
            timer.start()
        local.serve(app, "asgi")
    finally:
        if traffic is not None:
            traffic.stop()
        local.stop()
    print("spanprof demo: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
