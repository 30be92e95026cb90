"""``ProfilingMiddleware``: one server span per request, and its labels on every sample."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.instrumentation.asgi import get_host_port_url_tuple as _untyped_url_tuple
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace import INVALID_SPAN, Span

from .._labels._backend import ProfilerBackend, SpanUsage
from .._labels._engine import apply, attach_loop, run_steps_hooked, steps_hooked
from .._labels._labelset import EMPTY, LABELS, LabelSet
from .._logging import log_once
from .._profiling._runtime import ProfilerRuntime
from .._signals._duration import DurationRecorder
from .._types import ASGIApp, Message, Receive, Scope, Send
from ._options import ExcludedUrls, MiddlewareSettings, ProfilingOptions
from ._routes import (
    UNMATCHED,
    fastapi_telemetry_naming,
    known_method,
    resolved_template,
    span_name,
    starlette_route_template,
)
from ._spanlabels import (
    annotate_span,
    is_ended_span,
    is_labelled_span,
    is_server_span,
    request_labels,
)
from ._usage import end_span

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ProfilingMiddleware"]


class _Request:
    """One request's state, shared by the middleware's outer layer and OTel's request hook."""

    __slots__ = (
        "app_called",
        "app_failure",
        "breached",
        "finished",
        "labels_token",
        "name",
        "scope",
        "span",
        "span_id",
        "started",
        "status_code",
        "template",
        "usage",
    )

    def __init__(self, name: str, template: str | None, scope: Scope) -> None:
        self.name = name
        self.template = template
        # The app always gets the server's scope, even when OTel was shown a sanitized copy.
        self.scope = scope
        self.span: Span | None = None
        # The labels' span id: the profiler's key for this request's samples.
        self.span_id: str | None = None
        self.labels_token: Token[LabelSet] | None = None
        # Whether OTel's middleware reached the app: then its failure is the app's own, and
        # the request must never be served a second time.
        self.app_called = False
        # What the app raised: OTel may replace it on the way out (its use_span formats it,
        # its span's end may raise), and the app's own exception is the one that propagates.
        self.app_failure: BaseException | None = None
        self.status_code: int | None = None
        self.started = time.perf_counter()
        # When the response completed (or the app returned or raised) and whether that breached
        # the SLO: decided while OTel's server span is still open, which it ends on its way out.
        self.finished: float | None = None
        self.breached: bool | None = None
        # What the profiler counted for the request once told it ended (exact profiler only).
        self.usage: SpanUsage | None = None

    def conclude(
        self, finished: float, durations: DurationRecorder, runtime: ProfilerRuntime
    ) -> None:
        """The response is complete (or the app left): decide the verdict while the span is open.

        The SLO mark and the CPU the profiler counted go on the span; the profiler labels the
        request's samples with the verdict.
        """
        self.finished = finished
        span = self.span
        if span is not None:
            self.breached = durations.mark(span, self.template, finished - self.started)
            self.usage = end_span(runtime, span, self.span_id, self.breached)
            self.span_id = None  # told: never twice


# The URL OTel matches excluded_urls against: (host, port, url).
_host_port_url = cast(Callable[[Scope], tuple[str, Any, str]], _untyped_url_tuple)

_REQUEST: ContextVar[_Request | None] = ContextVar("spanprof.request", default=None)


def _span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    # http.route is set once, with pyroscope.profile.id, in annotate_span: OTel's ASGI
    # middleware sets every start attribute a second time, so passing it here costs double.
    request = _REQUEST.get()
    return (request.name if request is not None else UNMATCHED), {}


_NON_ASCII = re.compile(rb"[\x80-\xff]")


def _percent_encoded(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match[0][0]


def _decodable(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers OTel's ``unicode_escape`` decoding takes: those without a backslash."""
    return [(name, value) for name, value in headers if b"\\" not in name and b"\\" not in value]


def _sanitized(scope: Scope) -> Scope | None:
    """A copy of ``scope`` OTel's ASGI middleware can decode, or None if it has nothing to hide.

    OTel decodes every header name and value with ``unicode_escape`` on each lookup, so one
    stray backslash in any header (``traceparent: \\x80\\``) raises before the app runs; such
    headers are left out. It decodes the query string as UTF-8, which servers do not check
    (uvicorn with httptools passes ``?q=caf\\xe9`` through): its other bytes are
    percent-encoded, as a client should have sent them.
    """
    headers = list(scope.get("headers", ()))
    kept = _decodable(headers)
    query = scope.get("query_string")
    decodable = query
    if isinstance(query, bytes):
        try:
            query.decode("utf-8")
        except UnicodeDecodeError:
            decodable = _NON_ASCII.sub(_percent_encoded, query)
    if len(kept) == len(headers) and decodable is query:
        return None
    return {**scope, "headers": kept, "query_string": decodable}


def _timed_send(
    request: _Request,
    send: Send,
    durations: DurationRecorder,
    runtime: ProfilerRuntime,
    *,
    guarded: bool,
) -> Send:
    """``send`` that notes the status and decides the SLO verdict as the response completes.

    ``guarded``: ``send`` is spanprof's own OTel layer, which ends the server span right after
    the last body message went out; a span processor's ``on_end`` raising there is OTel's
    failure, not the app's, and must not reach the app (it would skip its background tasks).
    """

    async def send_and_time(message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            request.status_code = message["status"]
        elif (
            kind == "http.response.body"
            and not message.get("more_body", False)
            and request.finished is None
        ):
            # The last chunk of the body, streaming or not: the response is complete, and
            # OTel ends the server span once this message has gone out, so mark it now.
            request.conclude(time.perf_counter(), durations, runtime)
            if guarded:
                try:
                    await send(message)
                except Exception:
                    # OTel ends the span only after the server took the message: a span that
                    # ended here means the response went out and only its end failed. (A
                    # failure of the server's send leaves the span open, and reaches the app.)
                    span = request.span
                    if span is None or not is_ended_span(span):
                        raise
                    _log_otel_failure_after_app()
                return
        await send(message)

    return send_and_time


def _log_otel_failure_after_app() -> None:
    log_once(
        "otel-asgi-after-app",
        "spanprof: OpenTelemetry's ASGI middleware failed after the app ran (a span "
        "processor's on_end?); the request keeps the app's response and outcome (logged once)",
    )


def _settle(request: _Request, exc: Exception) -> BaseException | None:
    """OTel's middleware raised ``exc`` after the app ran: what the request raises, if anything.

    The app's own exception, even when OTel replaced it on its way out; nothing when the app
    returned and OTel failed after it.
    """
    own = request.app_failure
    request.app_failure = None  # the exception's traceback holds the request: no cycle
    if own is not exc:
        _log_otel_failure_after_app()
    return own


class _App:
    """What OpenTelemetry's middleware calls: the app, called exactly as the server calls it.

    OTel's middleware normalizes its app with asgiref's single-callable check, which takes any
    class for an ASGI2 app; servers take a class with ``__await__`` (Starlette's
    ``HTTPEndpoint``, ``WebSocketEndpoint``) for ASGI3. Handing OTel this layer instead keeps
    the app's own calling convention. The layer also gives the app the server's scope when OTel
    was shown a sanitized copy, tells the middleware that the app ran, and decides the SLO verdict
    when the app leaves, before OTel ends the server span (an ended span takes no attributes).
    """

    __slots__ = ("app", "durations", "runtime")

    def __init__(self, app: ASGIApp, durations: DurationRecorder, runtime: ProfilerRuntime) -> None:
        self.app = app
        self.durations = durations
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = _REQUEST.get()
        if request is None:  # not a request of this middleware's (never, in practice)
            await self.app(scope, receive, send)
            return
        request.app_called = True
        http = scope["type"] == "http"
        if http:
            # Outside OTel's send layer, so that what OTel raises as the response goes out
            # (its span's end) is caught before it reaches the app.
            send = _timed_send(request, send, self.durations, self.runtime, guarded=True)
        try:
            await self.app(request.scope, receive, send)
        except BaseException as exc:
            request.app_failure = exc
            raise
        finally:
            if request.finished is None and http:
                # The app returned or raised without completing the response: OTel ends the
                # span right after this, so mark it now.
                request.conclude(time.perf_counter(), self.durations, self.runtime)


class _Labeller:
    """Labels a request the moment its server span exists: OTel's ``server_request_hook``.

    Hooked into OpenTelemetry's middleware rather than layered around the app, it costs no
    extra coroutine per request. The middleware's outer layer resets the labels it sets, in
    the ``finally`` around OpenTelemetry's middleware (``_leave``).
    """

    def __init__(self, *, with_trace_id: bool) -> None:
        self.with_trace_id = with_trace_id

    def __call__(self, span: Span, scope: Scope) -> None:
        request = _REQUEST.get()
        if request is not None:
            self.enter(request, span)

    def enter(self, request: _Request, span: Span) -> None:
        """Label ``request`` with ``span``'s ids and link the span to its profile."""
        if request.labels_token is not None:  # already labelled: keep its first span's labels
            return
        request.span = span
        try:
            labels = request_labels(span, request.name, with_trace_id=self.with_trace_id)
            annotate_span(span, labels, request.template)
        except Exception:
            log_once(
                "asgi-labels",
                "spanprof: labelling a request failed; it runs unlabelled (logged once)",
            )
            return
        request.span_id = labels.get("span_id")
        request.labels_token = LABELS.set(labels)
        apply(labels)


def _leave(request: _Request) -> None:
    # Resets _Labeller.enter's set, on every exit path of the request.
    token = request.labels_token
    if token is not None:
        request.labels_token = None
        LABELS.reset(token)
        apply(LABELS.get())


def _log_otel_failure_before_app(sanitized: Scope | None) -> None:
    if sanitized is not None:
        log_once(
            "otel-asgi-undecodable",
            "spanprof: OpenTelemetry's ASGI middleware cannot decode this request's headers or "
            "query string; traced it with those hidden from OpenTelemetry, the app gets them "
            "as sent (logged once)",
        )
    else:
        log_once(
            "otel-asgi-untraced",
            "spanprof: OpenTelemetry's ASGI middleware failed before the app ran; the request "
            "is served untraced (logged once)",
        )


def _abandon(request: _Request, runtime: ProfilerRuntime) -> None:
    _leave(request)
    if request.span_id is not None:
        end_span(runtime, request.span, request.span_id, None)
        request.span_id = None
    request.span = None


def _guard_response_header_capture(traced: OpenTelemetryMiddleware) -> None:
    """OTel's capture of response headers must not lose the response it reads them from.

    With ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE`` set, OTel decodes every
    response header with ``unicode_escape`` inside the app's ``send``, before the message goes
    out: a latin-1 header holding a backslash (``filename="D:\\x\\résumé.pdf"``) raises and
    the response is lost. Headers it cannot decode are left out of what it captures; the
    server still gets the message as the app sent it. Installed only when the capture is on.
    """
    original = getattr(traced, "_set_server_span", None)
    if original is None:  # an OTel version without the method: nothing to guard
        return

    def set_server_span(
        server_span: Span, message: Message, status_code: Any, duration_attrs: Any
    ) -> None:
        try:
            original(server_span, message, status_code, duration_attrs)
        except Exception:
            log_once(
                "otel-asgi-response-headers",
                "spanprof: OpenTelemetry cannot decode a response header it was told to "
                "capture; it is left out of the span, the response is unchanged (logged once)",
            )
            headers = _decodable(message.get("headers", ()))
            # Not the headers after all: the span goes without them, the response still out.
            with contextlib.suppress(Exception):
                original(server_span, {**message, "headers": headers}, status_code, duration_attrs)

    traced._set_server_span = set_server_span  # type: ignore[method-assign]


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
        route_resolver: ``scope -> template or None`` for non-Starlette apps; default: match
            the Starlette/FastAPI routes of the app.
        **options: the options both middlewares share (``ProfilingOptions``): ``profiler``,
            ``tracer_provider``, ``trace_id_label``, ``excluded_urls``, ``meter_provider``,
            ``slo``, ``slo_seconds``, ``route_slos``, ``prometheus``, ``environ``. The
            profiler starts at lifespan startup (after fork) or on the first request, and
            shuts down (last window flushed) at lifespan shutdown. OTel's own ASGI metrics are
            not recorded, so there is exactly one duration stream.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        route_resolver: Callable[[Scope], str | None] | None = None,
        **options: Unpack[ProfilingOptions],
    ) -> None:
        self.app = app
        settings = MiddlewareSettings.build(
            "ProfilingMiddleware", options, route_resolver=route_resolver, resolves="scope"
        )
        self._runtime = settings.runtime
        self._durations = settings.durations
        self._resolve = route_resolver
        self._labeller = _Labeller(with_trace_id=settings.with_trace_id)
        # Checked here, not by OpenTelemetry: an excluded request must not reach the app
        # through OTel without a span, where its failure would look like OTel's own.
        self._excluded = settings.excluded
        tracer_provider = settings.tracer_provider

        # One instance for every request: _App hands the app the server's scope even when OTel
        # is shown a sanitized copy (the retry below).
        self._traced = OpenTelemetryMiddleware(
            _App(app, self._durations, self._runtime),
            default_span_details=_span_details,
            server_request_hook=self._labeller,
            tracer_provider=tracer_provider,
            # spanprof records its own request-duration histogram; OTel's would repeat it.
            meter_provider=NoOpMeterProvider(),
            exclude_spans=["receive", "send"],
        )

        if self._traced.http_capture_headers_server_response:
            _guard_response_header_capture(self._traced)
        # Capturing request headers, OTel decodes every one of them inside the server span it
        # already started: one it cannot decode fails that span (exported, with OTel's own
        # exception as its error) before the retry traces the request in a second one. Such
        # headers are hidden from OTel from the first attempt instead.
        self._sanitize_first = bool(self._traced.http_capture_headers_server_request)

    @property
    def profiler(self) -> ProfilerBackend | None:
        """The backend this middleware starts and stops."""
        return self._runtime.backend

    def _template(self, scope: Scope, fastapi_prefix: str | None = None) -> str | None:
        try:
            if self._resolve is not None:
                return resolved_template(self._resolve(scope))
            return starlette_route_template(scope, self.app, fastapi_prefix=fastapi_prefix)
        except Exception:
            log_once(
                "route-resolver",
                "spanprof: resolving the route template failed; requests are named "
                f"'{UNMATCHED}' (logged once)",
            )
            return None

    @staticmethod
    def _is_excluded(excluded: ExcludedUrls, scope: Scope) -> bool:
        try:
            url = _host_port_url(scope)[2]
            # OTel's URL ends at the path; the patterns are searched in the whole URL,
            # `http://host/path?query`, as the WSGI middleware's (wsgiref's request_uri) is.
            query = scope.get("query_string")
            if query:
                url += "?" + bytes(query).decode("latin-1")
            return bool(excluded.url_disabled(url))
        except Exception:  # an undecodable Host header: OTel copes with it (see _sanitized)
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            if kind == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        current = trace.get_current_span()
        inherited = _REQUEST.get()
        if is_ended_span(current) or (inherited is not None and inherited.finished is not None):
            # A pipelined request's task is started (by uvicorn's h11 protocol) from inside the
            # previous request's last send, and inherits its context: its span, its labels.
            # The request starts afresh from an empty context instead. A sampled-out span
            # never looks ended (it is not an SDK span): the previous response's end says it.
            # Checked before the exclusion: an excluded request must not run with them either.
            await self._afresh(scope, receive, send)
            return
        excluded = self._excluded
        if excluded is not None and self._is_excluded(excluded, scope):
            await self.app(scope, receive, send)
            return
        if inherited is not None or is_labelled_span(current):
            # An outer spanprof layer owns this request (this app is mounted in its app): it
            # keeps its name, labels and duration; renaming it to this app's template is wrong.
            # Its span may be sampled out, with no kind to tell, or a no-op one without an SDK:
            # its request in progress tells (the labels do for a WSGI layer around this one).
            await self.app(scope, receive, send)
            return
        self._runtime.ensure_started()
        attach_loop()
        if not steps_hooked():
            # This request's task predates the loop's label hooks (uvloop without lifespan:
            # the request that hooked it): handle it inside a coroutine proxy that syncs the
            # labels on each of its steps, as the hooks do for every later request.
            await run_steps_hooked(self(scope, receive, send))
            return
        method = scope.get("method", "") if kind == "http" else "WEBSOCKET"
        # Inside FastAPI's own telemetry, its server span is the request's: FastAPI renames it
        # when its router picks the route, so the request is named the way FastAPI names it.
        # (Its span is the one it put in the scope, sampled out or not.)
        fastapi = fastapi_telemetry_naming(scope, current) if "fastapi.telemetry" in scope else None
        reused = fastapi is not None or is_server_span(current)
        if fastapi is None:
            template = self._template(scope)
            name = span_name(method, template if template is not None else UNMATCHED)
        else:
            template = self._template(scope, fastapi[1])
            name = f"{fastapi[0]} {template if template is not None else UNMATCHED}"
        if "fastapi.telemetry" not in scope:
            # This request has its server span (spanprof's, or the one reused here): a FastAPI
            # app below must not open a second one, in a trace of its own. FastAPI's own mark
            # for "not mine to trace", as it sets for its excluded requests.
            scope["fastapi.telemetry"] = None
        if reused and template is not None and current.is_recording():
            # FastAPIInstrumentor or opentelemetry-instrument already opened the server span.
            current.update_name(name)
        request = _Request(name, template, scope)
        # One coroutine around OTel's for the whole request (each extra layer costs): timing and
        # labels here; the response's timing and the SLO mark on early exits in _App.
        durations = self._durations
        runtime = self._runtime
        timed = kind == "http"
        failure: BaseException | None = None
        token = _REQUEST.set(request)
        try:
            if reused:
                self._labeller.enter(request, current)
                if timed:
                    send = _timed_send(request, send, durations, runtime, guarded=False)
                await self.app(scope, receive, send)
            else:
                # The request as sent, then (if OTel failed before reaching the app) once more
                # with what OTel cannot decode hidden from it, then the app untraced.
                attempt: Scope | None = scope
                if self._sanitize_first:
                    hidden = _sanitized(scope)
                    if hidden is not None:
                        _log_otel_failure_before_app(hidden)
                        attempt = hidden
                while attempt is not None:
                    try:
                        await self._traced(attempt, receive, send)
                        return
                    except Exception as exc:
                        own = None
                        if request.app_called:
                            # Never serve a request twice. (Under OTel's
                            # suppress_http_instrumentation() the app runs without a span.)
                            own = _settle(request, exc)
                            if own is exc:
                                raise
                    # Raised outside the except block: the app's exception keeps its own context.
                    if own is not None:
                        raise own
                    if request.app_called:
                        return
                    retry = _sanitized(scope) if attempt is scope else None
                    _log_otel_failure_before_app(retry)
                    # A failed attempt may have labelled the request with a span OTel ended.
                    _abandon(request, runtime)
                    attempt = retry
                request.app_called = True
                if timed:
                    send = _timed_send(request, send, durations, runtime, guarded=False)
                await self.app(scope, receive, send)
        except BaseException as exc:
            failure = exc
            request.app_failure = None
            raise
        finally:
            _leave(request)
            _REQUEST.reset(token)
            if timed and request.finished is None and request.span is not None:
                # A reused server span the app left without completing a response (it raised:
                # Starlette's error page is sent outside this layer). The outer instrumentation
                # ends that span after this, so the verdict is still decided here, once, for the
                # span's mark, the exemplar and the samples' label alike.
                request.conclude(time.perf_counter(), durations, runtime)
            if request.span_id is not None:
                # Not concluded while the span was open (a websocket): its samples still leave
                # the hold.
                request.usage = end_span(runtime, request.span, request.span_id, request.breached)
            if timed:
                finished = request.finished
                end = time.perf_counter() if finished is None else finished
                durations.record(
                    end - request.started,
                    method=known_method(method),
                    route=template,
                    scheme=scope.get("scheme"),
                    status_code=request.status_code,
                    exc=failure,
                    span=request.span if request.span is not None else INVALID_SPAN,
                    breached=request.breached,
                    cpu_seconds=None if request.usage is None else request.usage.cpu_ns / 1e9,
                )

    async def _afresh(self, scope: Scope, receive: Receive, send: Send) -> None:
        otel_token = otel_context.attach(otel_context.Context())
        labels_token = LABELS.set(EMPTY)
        request_token = _REQUEST.set(None)
        try:
            apply(EMPTY)
            await self(scope, receive, send)
        finally:
            _REQUEST.reset(request_token)
            LABELS.reset(labels_token)
            otel_context.detach(otel_token)
            apply(LABELS.get())

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
