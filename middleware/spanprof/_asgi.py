"""``ProfilingMiddleware``: one server span per request, and its labels on every sample."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.trace import TracerProvider

from ._backend import ProfilerBackend
from ._duration import DurationRecorder
from ._engine import attach_loop, sync
from ._labelset import LABELS
from ._logging import log_once
from ._prometheus import PrometheusMetrics
from ._routes import UNMATCHED, known_method, span_name, starlette_route_template
from ._settings import FROM_ENV, MiddlewareSettings
from ._spanlabels import annotate_span, is_server_span, request_labels
from ._types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["FROM_ENV", "ProfilingMiddleware"]


class _Request:
    """What the outer layer hands the labelled layer through the OpenTelemetry middleware."""

    __slots__ = ("entered", "name", "scope", "template")

    def __init__(self, name: str, template: str | None, scope: Scope) -> None:
        self.name = name
        self.template = template
        # The app always gets the server's scope, even when OTel was shown a sanitized copy.
        self.scope = scope
        self.entered = False


_REQUEST: ContextVar[_Request | None] = ContextVar("spanprof.request", default=None)


def _span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    # http.route is set once, with pyroscope.profile.id, in annotate_span: OTel's ASGI
    # middleware sets every start attribute a second time, so passing it here costs double.
    request = _REQUEST.get()
    return (request.name if request is not None else UNMATCHED), {}


def _sanitized(scope: Scope) -> Scope:
    """A copy of ``scope`` without headers OTel's ASGI getter cannot decode.

    It decodes every header name and value with ``unicode_escape`` on each lookup, so one
    stray backslash in any header (``traceparent: \\x80\\``) raises before the app runs.
    """
    headers = [
        (name, value)
        for name, value in scope.get("headers", ())
        if b"\\" not in name and b"\\" not in value
    ]
    return {**scope, "headers": headers}


class _Labelled:
    """Runs inside the server span: label the request, call the app, record its duration."""

    def __init__(self, app: ASGIApp, *, with_trace_id: bool, durations: DurationRecorder) -> None:
        self.app = app
        self.with_trace_id = with_trace_id
        self.durations = durations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = _REQUEST.get()
        if request is None:  # called without the outer layer: nothing to label with
            await self.app(scope, receive, send)
            return
        request.entered = True
        name, template, scope = request.name, request.template, request.scope
        span = trace.get_current_span()
        labels = request_labels(span, name, with_trace_id=self.with_trace_id)
        annotate_span(span, labels, template)
        if scope["type"] != "http":
            token = LABELS.set(labels)
            sync()
            try:
                await self.app(scope, receive, send)
            finally:
                LABELS.reset(token)
                sync()
            return

        durations = self.durations
        status_code: int | None = None
        finished: float | None = None
        breached: bool | None = None
        start = time.perf_counter()

        async def send_and_time(message: Message) -> None:
            nonlocal status_code, finished, breached
            kind = message["type"]
            if kind == "http.response.start":
                status_code = message["status"]
            elif kind == "http.response.body" and not message.get("more_body", False):
                # The last chunk of the body, streaming or not: the response is complete, and
                # the server span ends as this message goes out, so mark it now.
                finished = time.perf_counter()
                breached = durations.mark(span, template, finished - start)
            await send(message)

        failure: BaseException | None = None
        token = LABELS.set(labels)
        sync()
        try:
            await self.app(scope, receive, send_and_time)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            LABELS.reset(token)
            sync()
            end = time.perf_counter() if finished is None else finished
            durations.record(
                end - start,
                method=known_method(scope.get("method", "")),
                route=template,
                scheme=scope.get("scheme"),
                status_code=status_code,
                exc=failure,
                span=span,
                breached=breached,
            )


class ProfilingMiddleware:
    """ASGI middleware: a server span per request and exact profile labels for its code.

    Every ``http`` and ``websocket`` request gets one SERVER span (through OpenTelemetry's ASGI
    instrumentation, or the server span another instrumentation already made current) and runs
    with the labels ``span_id``, ``trace_id`` and ``span_name`` (``GET /items/{item_id}``). Child
    tasks and thread-pool work inherit them, and the label engine keeps the profiler's
    per-thread labels equal to them whenever the request's code runs.

    ```python
    app = FastAPI()
    app.add_middleware(spanprof.ProfilingMiddleware)  # PYROSCOPE_SERVER_ADDRESS=http://...:4040
    ```

    Arguments:
        app: the ASGI application.
        profiler: a ``ProfilerBackend``; default: ``PyroscopeBackend.from_env()`` (no profiler
            when ``PYROSCOPE_SERVER_ADDRESS`` is unset); ``None``: labels without a profiler.
            It is started at lifespan startup (after fork) or on the first request, and shut
            down (last window flushed) at lifespan shutdown.
        tracer_provider: the OpenTelemetry tracer provider (default: the global one).
        trace_id_label: label samples with ``trace_id`` too (default ``True``, or
            ``SPANPROF_TRACE_ID_LABEL``); turn off for Pyroscope servers older than 2.0.3,
            where ``trace_id`` becomes a series label.
        route_resolver: ``scope -> template or None`` for non-Starlette apps; default: match
            the Starlette/FastAPI routes of the app.
        excluded_urls: comma-separated URL patterns to leave untraced (OpenTelemetry syntax).
        meter_provider: where the ``http.server.request.duration`` histogram is recorded
            (default: the global provider). OTel's own ASGI metrics are not recorded, so there
            is exactly one duration stream.
        slo_seconds: the latency SLO of every route (default 0.5, or ``SPANPROF_SLO_SECONDS``).
            Slower requests get an exemplar with their span's ids and the span attributes
            ``spanprof.slo.breached`` and ``spanprof.slo.threshold_s``.
        route_slos: per-route SLOs by template, e.g. ``{"/checkout": 0.25}`` (or
            ``SPANPROF_ROUTE_SLO="/checkout=0.25,/search=1"``).
        prometheus: also record the histogram (with exemplars) in this ``PrometheusMetrics``.
        environ: the environment to read settings from (default ``os.environ``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        profiler: ProfilerBackend | None = FROM_ENV,
        tracer_provider: TracerProvider | None = None,
        trace_id_label: bool | None = None,
        route_resolver: Callable[[Scope], str | None] | None = None,
        excluded_urls: str | None = None,
        meter_provider: MeterProvider | None = None,
        slo_seconds: float | None = None,
        route_slos: Mapping[str, float] | None = None,
        prometheus: PrometheusMetrics | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        settings = MiddlewareSettings.build(
            profiler=profiler,
            trace_id_label=trace_id_label,
            meter_provider=meter_provider,
            slo_seconds=slo_seconds,
            route_slos=route_slos,
            prometheus=prometheus,
            environ=environ,
        )
        self._runtime = settings.runtime
        self._resolve = route_resolver
        self._labelled = _Labelled(
            app, with_trace_id=settings.with_trace_id, durations=settings.durations
        )
        self._traced = OpenTelemetryMiddleware(
            self._labelled,
            excluded_urls=excluded_urls,
            default_span_details=_span_details,
            tracer_provider=tracer_provider,
            # spanprof records its own request-duration histogram; OTel's would duplicate it.
            meter_provider=NoOpMeterProvider(),
            exclude_spans=["receive", "send"],
        )

    @property
    def profiler(self) -> ProfilerBackend | None:
        """The backend this middleware starts and stops."""
        return self._runtime.backend

    def _template(self, scope: Scope) -> str | None:
        try:
            if self._resolve is not None:
                return self._resolve(scope)
            return starlette_route_template(scope, self.app)
        except Exception:
            log_once(
                "route-resolver",
                "spanprof: resolving the route template failed; requests are named "
                f"'{UNMATCHED}' (logged once)",
            )
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            if kind == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        self._runtime.ensure_started()
        attach_loop()
        template = self._template(scope)
        method = scope.get("method", "") if kind == "http" else "WEBSOCKET"
        name = span_name(method, template if template is not None else UNMATCHED)
        current = trace.get_current_span()
        reused = is_server_span(current)
        if reused and template is not None and current.is_recording():
            # FastAPIInstrumentor or opentelemetry-instrument already opened the server span.
            current.update_name(name)
        request = _Request(name, template, scope)
        token = _REQUEST.set(request)
        try:
            if reused:
                await self._labelled(scope, receive, send)
                return
            try:
                await self._traced(scope, receive, send)
            except Exception:
                if request.entered:
                    raise  # the app's own failure
                # OpenTelemetry failed before the app ran (undecodable trace headers): the
                # request must not. Retry with the headers it cannot read left out.
                log_once(
                    "otel-asgi-headers",
                    "spanprof: OpenTelemetry's ASGI middleware failed on this request's "
                    "headers; served it with those headers hidden from tracing (logged once)",
                )
                await self._traced(_sanitized(scope), receive, send)
        finally:
            _REQUEST.reset(token)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self._runtime

        async def lifespan_receive() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.startup":
                # Lifespan startup runs in each worker after any fork: the right moment.
                runtime.start()
                attach_loop()
            return message

        async def lifespan_send(message: Message) -> None:
            if message.get("type") in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                runtime.stop()
            await send(message)

        await self.app(scope, lifespan_receive, lifespan_send)
