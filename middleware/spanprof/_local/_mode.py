"""``LocalMode``: an app, its profiles, its spans and a page about them, in one process.

The pieces: a ``PushReceiver`` on loopback that the app's profiler uploads to every second, a
``SampleStore`` that splits those uploads by span id (the memory ones in its ``MemoryStore``),
a ``SpanStore`` span processor on the app's tracer provider, and a ``UiServer`` for the page.
``LocalMode`` wires them, points the profiler at the receiver through the ``PYROSCOPE_*``
environment (before the app's middleware reads it), and serves the app with uvicorn (ASGI) or
a threaded ``wsgiref`` server (WSGI).
"""

from __future__ import annotations

import importlib
import inspect
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from .._env import env_value
from .._logging import logger
from .._profiling._runtime import stop_started
from ._compare import SloComparison
from ._loopback import url_host
from ._memory import MemoryStore
from ._receiver import PushReceiver, ReceivedPush
from ._samples import SampleStore
from ._slo import SloPolicy, policy_env, policy_from
from ._spans import SpanStore
from ._ui import UiServer

__all__ = ["LocalMode", "detect_interface", "import_app"]

UPLOAD_INTERVAL_SECONDS = 1
# Anything on the machine (any web page the developer visits) can reach the receiver, so its
# limits are set for one app's one-second uploads (kilobytes to hundreds of kilobytes), not for
# a shared server: a decoded push costs up to ~25 times its inflated size, and the whole
# process should stay within ~150 MiB of its idle size under any input.
_MAX_PUSH_BYTES = 2 * 1024 * 1024
_MAX_INFLATED_PUSH_BYTES = 2 * 1024 * 1024
_MAX_SAMPLE_BYTES = 24 * 1024 * 1024
_MAX_SPAN_BYTES = 16 * 1024 * 1024
# Memory profiles: each span's allocations and each process's in-use snapshot, plus two route
# comparisons (allocated bytes, objects) of their own.
_MAX_MEMORY_BYTES = 16 * 1024 * 1024
_MAX_MEMORY_COMPARISON_BYTES = 4 * 1024 * 1024


def import_app(spec: str, *, factory: bool = False, app_dir: str | None = ".") -> Any:
    """The object ``module:attribute`` names (called when ``factory``), like uvicorn does."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"app: expected 'module:attribute', got {spec!r}")
    if app_dir is not None:
        path = os.path.abspath(app_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"app: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if factory:
        target = target()
    return target


def detect_interface(app: Any) -> str:
    """``"asgi"`` when ``app`` (or its ``__call__``) is a coroutine function, else ``"wsgi"``."""
    if inspect.iscoroutinefunction(app):
        return "asgi"
    # An instance (FastAPI, a middleware) is ASGI when its class's __call__ is async.
    call = getattr(type(app), "__call__", None)  # noqa: B004
    if call is not None and inspect.iscoroutinefunction(call):
        return "asgi"
    if not callable(app):
        raise ValueError(f"app: {app!r} is not callable (neither ASGI nor WSGI)")
    return "wsgi"


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


def _wsgi_server_class(host: str) -> type[_ThreadingWSGIServer]:
    # wsgiref's server is AF_INET: an IPv6 host ("::1") fails with "Address family for
    # hostname not supported", where the ASGI socket and the page bind it.
    return _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return  # local mode prints its own summary; access logs drown the URL


class LocalMode:
    """Run an app with an embedded profile receiver, in-memory spans and a local page.

    ```python
    with LocalMode(port=8000, ui_port=8001) as local:
        app = import_app("myapp:app")   # after start(): the middleware reads PYROSCOPE_*
        local.install_tracing()
        local.serve(app)                # until Ctrl-C or request_stop()
    ```

    Arguments:
        host, port: where the app listens (loopback by default).
        ui_host, ui_port: where the page listens (loopback by default; port 0 picks one).
        policy: SLO thresholds (default: from ``SPANPROF_SLO_SECONDS``/``SPANPROF_ROUTE_SLO``).
        service_name: ``service_name`` of the profiles and ``service.name`` of the spans when
            the app sets neither (default ``OTEL_SERVICE_NAME``, else ``spanprof-dev``).
        environ: the environment to configure (default ``os.environ``); restored by ``stop``.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        ui_host: str = "127.0.0.1",
        ui_port: int = 8001,
        policy: SloPolicy | None = None,
        service_name: str | None = None,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self.environ: MutableMapping[str, str] = os.environ if environ is None else environ
        self.host = host
        self.port = port
        self.policy = policy if policy is not None else policy_from(self.environ)
        self.service_name = (
            service_name or self.environ.get("OTEL_SERVICE_NAME", "").strip() or "spanprof-dev"
        )
        self.spans = SpanStore(self.policy, max_bytes=_MAX_SPAN_BYTES)
        self.comparison = SloComparison()
        self.samples = SampleStore(
            max_bytes=_MAX_SAMPLE_BYTES,
            comparison=self.comparison,
            memory=MemoryStore(
                max_bytes=_MAX_MEMORY_BYTES, comparison_bytes=_MAX_MEMORY_COMPARISON_BYTES
            ),
        )
        self.receiver = PushReceiver(
            on_push=self._on_push,
            max_body_bytes=_MAX_PUSH_BYTES,
            max_inflated_bytes=_MAX_INFLATED_PUSH_BYTES,
        )
        self.ui = UiServer(
            self.spans,
            self.samples,
            status=self._status,
            host=ui_host,
            port=ui_port,
            comparison=self.comparison,
        )
        self._errors: deque[str] = deque(maxlen=50)
        self._saved_env: dict[str, str | None] = {}
        self._stop_hooks: list[Callable[[], None]] = []
        self._companions: list[Callable[[], None]] = []
        self._started = False
        self._started_at = time.monotonic()
        self._stop_lock = threading.Lock()
        # Set by request_stop: a hook registered later (serve not yet serving) runs at once.
        self._stop_requested = False
        self.interface: str | None = None
        # What ``listen`` bound, for ``serve`` to take over.
        self._wsgi_server: WSGIServer | None = None
        self._asgi_socket: socket.socket | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LocalMode:
        """Start the receiver and the page; point the profiler and the SLO settings at them."""
        if self._started:
            return self
        with self._stop_lock:
            self._stop_requested = False
        self.receiver.start()
        try:
            self.ui.start()
        except BaseException:
            self.receiver.stop()
            raise
        self._started = True
        self._started_at = time.monotonic()
        env = {
            "PYROSCOPE_SERVER_ADDRESS": self.receiver.url,
            # Used when the app exports OTLP profiles (SPANPROF_PROFILES_EXPORTER=otlp).
            "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": self.receiver.url + "/v1development/profiles",
            "PYROSCOPE_UPLOAD_INTERVAL": str(UPLOAD_INTERVAL_SECONDS),
            **policy_env(self.policy),
        }
        if not env_value(self.environ, "PYROSCOPE_APPLICATION_NAME"):
            env["PYROSCOPE_APPLICATION_NAME"] = self.service_name
        if not env_value(self.environ, "SPANPROF_PROFILER"):
            # `auto` keeps pyroscope-io for threaded servers, and the page's WSGI server is one:
            # there the breach comparison would have no `slo` labels and memory no span labels.
            # The exact sampler attributes pool threads exactly too (docs/benchmarks.md,
            # gthread), and the app's middleware prepares it in the main thread at import.
            env["SPANPROF_PROFILER"] = "exact"
        clock = env_value(self.environ, "SPANPROF_PROFILE_CLOCK")
        if clock.strip().lower() == "wall":
            # The page shows CPU profiles (and memory): a wall-clock sampler's profiles are
            # wall profiles, which it would not show at all. Any other value is left for the
            # backend's own check, which names the variable.
            logger.warning(
                "spanprof dev: the page shows CPU profiles; SPANPROF_PROFILE_CLOCK=%s is set to "
                "cpu while it runs",
                clock,
            )
            env["SPANPROF_PROFILE_CLOCK"] = "cpu"
        for key, value in env.items():
            self._saved_env.setdefault(key, self.environ.get(key))
            self.environ[key] = value
        return self

    def install_tracing(self, provider: TracerProvider | None = None) -> TracerProvider:
        """Send finished spans to the page: to ``provider``, the app's, or a new global one.

        Call it after importing the app, so an app that sets up its own SDK tracer provider
        keeps it (and its exporters) and local mode only adds its span processor.
        """
        if provider is None:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):
                provider = current
            else:
                attributes = (
                    {}
                    if self.environ.get("OTEL_SERVICE_NAME")
                    else {"service.name": self.service_name}
                )
                provider = TracerProvider(resource=Resource.create(attributes))
                trace.set_tracer_provider(provider)
        provider.add_span_processor(self.spans)
        return provider

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when ``request_stop`` is called (e.g. stop a helper server), or now if
        it already was: a stop asked for before ``serve`` began serving is not lost."""
        with self._stop_lock:
            if not self._stop_requested:
                self._stop_hooks.append(hook)
                return
        hook()

    def listen(self, app: Any, interface: str = "auto") -> None:
        """Bind ``host:port`` for ``app`` now rather than in ``serve``.

        A port in use (``OSError``) then shows before anything says where the app answers;
        with port 0, ``port`` becomes the one bound.
        """
        kind = self._interface(app, interface)
        if kind == "wsgi":
            if self._wsgi_server is None:
                self._wsgi_server = make_server(
                    self.host,
                    self.port,
                    app,
                    server_class=_wsgi_server_class(self.host),
                    handler_class=_QuietHandler,
                )
                self.port = self._wsgi_server.server_port
        elif self._asgi_socket is None:
            # As uvicorn binds it (Config.bind_socket), which exits the process when it fails.
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
            except BaseException:
                sock.close()
                raise
            sock.set_inheritable(True)
            self._asgi_socket = sock
            self.port = sock.getsockname()[1]

    def serve(self, app: Any, interface: str = "auto") -> None:
        """Serve ``app`` on ``host:port`` until Ctrl-C or ``request_stop()``; blocks."""
        kind = self._interface(app, interface)
        self.interface = kind
        try:
            if kind == "asgi":
                self._serve_asgi(app)
            else:
                self._serve_wsgi(app)
        except KeyboardInterrupt:
            pass  # Ctrl-C: the server already shut down gracefully
        finally:
            self._flush_profiler()

    @staticmethod
    def _interface(app: Any, interface: str) -> str:
        kind = detect_interface(app) if interface == "auto" else interface
        if kind not in ("asgi", "wsgi"):
            raise ValueError(f"interface: expected 'auto', 'asgi' or 'wsgi', got {interface!r}")
        return kind

    def request_stop(self) -> None:
        """Ask ``serve`` to return (thread-safe, idempotent)."""
        with self._stop_lock:
            self._stop_requested = True
            hooks, self._stop_hooks = self._stop_hooks, []
        for hook in hooks:
            hook()

    def stop(self) -> None:
        """Stop the receiver and the page and restore the environment."""
        self.request_stop()
        companions, self._companions = self._companions, []
        for stop_companion in companions:
            stop_companion()
        # Bound by ``listen`` and never served: the port is released all the same.
        if self._wsgi_server is not None:
            self._wsgi_server.server_close()
            self._wsgi_server = None
        if self._asgi_socket is not None:
            self._asgi_socket.close()
            self._asgi_socket = None
        self.ui.stop()
        self.receiver.stop()
        for key, value in self._saved_env.items():
            if value is None:
                self.environ.pop(key, None)
            else:
                self.environ[key] = value
        self._saved_env.clear()
        self._started = False

    def __enter__(self) -> LocalMode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def app_url(self) -> str:
        """Where the app answers."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{url_host(host)}:{self.port}"

    @property
    def ui_url(self) -> str:
        """Where the page answers."""
        return self.ui.url

    # -- serving -----------------------------------------------------------------------------

    def _serve_asgi(self, app: Any) -> None:
        try:
            import uvicorn
        except ImportError:
            raise RuntimeError(
                "spanprof dev: serving an ASGI app needs uvicorn (pip install uvicorn)"
            ) from None
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            lifespan="auto",
            log_level="warning",
            access_log=False,
        )
        server = uvicorn.Server(config)

        def stop() -> None:
            server.should_exit = True

        self.on_stop(stop)
        sock, self._asgi_socket = self._asgi_socket, None
        server.run(sockets=None if sock is None else [sock])

    def _serve_wsgi(self, app: Any) -> None:
        self.listen(app, "wsgi")
        server, self._wsgi_server = self._wsgi_server, None
        assert server is not None

        def stop() -> None:
            # shutdown() waits for serve_forever to return: never from the serving thread.
            threading.Thread(target=server.shutdown, name="spanprof-dev-stop").start()

        self.on_stop(stop)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()

    def serve_in_thread(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve a second, WSGI app in background threads until ``stop``; returns its URL.

        For a companion service (the demo's Flask inventory service) that shares this process,
        its profiler and its span store.
        """
        if detect_interface(app) != "wsgi":
            raise ValueError("serve_in_thread: only WSGI apps can run beside the main app")
        server = make_server(
            host, port, app, server_class=_wsgi_server_class(host), handler_class=_QuietHandler
        )
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"spanprof-dev-wsgi:{server.server_port}",
            daemon=True,
        )
        thread.start()

        def stop() -> None:
            server.shutdown()
            server.server_close()

        self._companions.append(stop)
        return f"http://{url_host(host)}:{server.server_port}"

    def _flush_profiler(self) -> None:
        # ASGI lifespan shutdown already flushed; a WSGI server has no shutdown event, so send
        # the last window here, while the receiver still listens.
        stop_started()

    # -- receiver ------------------------------------------------------------------------------

    def _on_push(self, push: ReceivedPush) -> None:
        try:
            self.samples.ingest(push)
        finally:
            # The receiver keeps every push for tests; here the sample store is the memory,
            # and a push it failed on must not stay behind in the receiver either.
            self._errors.extend(self.receiver.errors)
            self.receiver.clear()

    def _status(self) -> dict[str, Any]:
        return {
            "app_url": self.app_url,
            "interface": self.interface,
            "receiver_url": self.receiver.url if self._started else None,
            "receiver_errors": [*self._errors, *self.receiver.errors][-20:],
            "upload_interval_s": UPLOAD_INTERVAL_SECONDS,
            "uptime_s": time.monotonic() - self._started_at,
        }
