"""The ``spanprof`` command: ``spanprof dev module:app`` runs an app in local mode."""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence

from .._config import redact_url
from .._env import env_value
from ._mode import LocalMode, import_app
from ._slo import SloPolicy, policy_from

__all__ = ["main"]

_DESCRIPTION = """\
Run a web app wrapped by spanprof's ProfilingMiddleware (ASGI) or WSGIProfilingMiddleware
(WSGI) with everything in one process: an embedded profile receiver, the spans kept in memory,
and a local page listing SLO breaches, each with its own flame graph, trace and pprof file.
"""


def _port(text: str) -> int:
    """A TCP port number, refused by argparse (exit 2, usage shown) when out of range."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {port}")
    return port


def _duration(text: str) -> float:
    """Seconds to run, refused by argparse (exit 2, usage shown) unless finite and >= 0."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds, 0 or more, got {text!r}"
        )
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spanprof", description="spanprof tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dev = commands.add_parser(
        "dev",
        help="run an app with the local profile, trace and SLO-breach page",
        description=_DESCRIPTION,
    )
    dev.add_argument("app", help="the app as module:attribute, e.g. myservice.main:app")
    dev.add_argument("--factory", action="store_true", help="call module:attribute to get the app")
    dev.add_argument("--host", default="127.0.0.1", help="app host (default 127.0.0.1)")
    dev.add_argument("--port", type=_port, default=8000, help="app port (default 8000)")
    dev.add_argument(
        "--ui-host",
        default="127.0.0.1",
        help="page host (default 127.0.0.1; anything else shows your profiles, traces and "
        "request URLs to whoever can reach that address)",
    )
    dev.add_argument("--ui-port", type=_port, default=8001, help="page port (default 8001)")
    dev.add_argument(
        "--slo",
        metavar="SECONDS",
        help="latency SLO of every route (default SPANPROF_SLO_SECONDS, else 0.5)",
    )
    dev.add_argument(
        "--route-slo",
        metavar="ROUTE=SECONDS,...",
        help="per-route SLOs by route template, e.g. '/checkout=0.25,/search=1' "
        "(default SPANPROF_ROUTE_SLO)",
    )
    dev.add_argument(
        "--interface",
        choices=("auto", "asgi", "wsgi"),
        default="auto",
        help="how to serve the app (default: detect)",
    )
    dev.add_argument("--app-dir", default=".", help="directory to import the app from")
    dev.add_argument(
        "--service-name",
        help=(
            "service name for profiles and spans (default: OTEL_SERVICE_NAME, else the app's "
            "module; PYROSCOPE_APPLICATION_NAME still wins for profiles)"
        ),
    )
    dev.add_argument(
        "--duration", type=_duration, metavar="SECONDS", help="stop by itself after SECONDS"
    )
    return parser


def _describe(policy: SloPolicy) -> str:
    routes = ", ".join(f"{route} {seconds:g} s" for route, seconds in policy.routes.items())
    return f"SLO {policy.default:g} s" + (f" ({routes})" if routes else "")


def _exposure_warning(local: LocalMode) -> str | None:
    """What to tell the developer when the page listens beyond loopback."""
    ui = local.ui
    if ui.loopback_only:
        return None
    where = "every interface" if ui.wildcard else ui.host
    return (
        f"spanprof dev: WARNING: the local page listens on {where} (--ui-host {ui.host}), not "
        "only on loopback: anyone who can reach it reads your profiles, traces and request "
        "URLs, with no authentication. Use --ui-host 127.0.0.1 unless you mean it."
    )


def service_name(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The service the page's profiles and spans are named after when the app names none.

    ``OTEL_SERVICE_NAME`` before the module name: the app's spans already carry it, and the
    profiles must carry the same name for the span-to-profile link to find them.
    """
    chosen: str = args.service_name or env_value(environ, "OTEL_SERVICE_NAME").strip()
    return chosen or str(args.app).partition(":")[0]


def dev(args: argparse.Namespace) -> int:
    """``spanprof dev``: serve the app in local mode until Ctrl-C (or ``--duration``)."""
    try:
        policy = policy_from(os.environ, slo=args.slo, route_slo=args.route_slo)
    except ValueError as exc:
        print(f"spanprof dev: --slo/--route-slo: {exc}", file=sys.stderr)
        return 2
    local = LocalMode(
        host=args.host,
        port=args.port,
        ui_host=args.ui_host,
        ui_port=args.ui_port,
        policy=policy,
        service_name=service_name(args, os.environ),
    )
    configured = env_value(os.environ, "PYROSCOPE_SERVER_ADDRESS").strip()
    if configured:
        # Redacted like every other place the address is shown: it may carry user:password.
        print(
            f"spanprof dev: profiles go to the local page, not to {redact_url(configured)}",
            flush=True,
        )
    try:
        local.start()
    except OSError as exc:
        print(f"spanprof dev: cannot listen for the page: {exc}", file=sys.stderr)
        return 1
    warning = _exposure_warning(local)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    try:
        try:
            app = import_app(args.app, factory=args.factory, app_dir=args.app_dir)
        except (ImportError, ValueError) as exc:
            print(f"spanprof dev: cannot import {args.app}: {exc}", file=sys.stderr)
            return 1
        try:
            local.listen(app, args.interface)
        except OSError as exc:
            print(
                f"spanprof dev: cannot listen for the app on {args.host}:{args.port}: {exc}",
                file=sys.stderr,
            )
            return 1
        except ValueError as exc:
            print(f"spanprof dev: cannot serve {args.app}: {exc}", file=sys.stderr)
            return 1
        local.install_tracing()
        print(f"spanprof dev: app        {local.app_url}  ({args.app})", flush=True)
        listening = (
            f"  (listening on {local.ui.host}: every interface)" if local.ui.wildcard else ""
        )
        print(f"spanprof dev: local page {local.ui_url}{listening}", flush=True)
        print(
            f"spanprof dev: {_describe(policy)}; profiles uploaded every second; Ctrl-C stops",
            flush=True,
        )
        if args.duration is not None:
            timer = threading.Timer(args.duration, local.request_stop)
            timer.daemon = True
            timer.start()
        local.serve(app, args.interface)
    finally:
        local.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spanprof`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "dev":
        return dev(args)
    return 2  # pragma: no cover - argparse rejects unknown commands
