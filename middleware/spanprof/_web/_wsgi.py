"""``WSGIProfilingMiddleware``: one server span per request, and its labels on every sample.

A WSGI request runs in two parts: the app call, and the server iterating the returned body
(a generator body runs the app's code then) until it calls ``close()``. spanprof sets the
request's labels and OpenTelemetry context around each part (the call, every ``next()`` and
``close()``) and removes them after it, so the server's own work between chunks carries no
request labels, a server that never calls ``close()`` leaves no labels behind, and the request
ends (span, duration) when the body is exhausted or closed, whichever comes first, so
streaming bodies count in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.util import request_uri

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation._semconv import (
    _get_schema_url,
    _OpenTelemetrySemanticConventionStability,
    _OpenTelemetryStabilitySignalType,
    _StabilityMode,
)
from opentelemetry.instrumentation.wsgi import (
    add_response_attributes,
    collect_custom_request_headers_attributes,
    collect_custom_response_headers_attributes,
    collect_request_attributes,
    wsgi_getter,
)
from opentelemetry.propagate import extract
from opentelemetry.trace import SpanKind, Status, StatusCode

from .._labels._backend import ProfilerBackend
from .._labels._labelset import LabelSet
from .._labels._scope import labels_scope
from .._logging import log_once
from .._version import __version__
from ._options import MiddlewareSettings, ProfilingOptions
from ._routes import UNMATCHED, known_method, resolved_template, span_name
from ._spanlabels import annotate_span, is_labelled_span, is_server_span, request_labels
from ._usage import end_span
from ._wsgi_routes import WSGIRouteResolver, default_route_resolver

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from typing_extensions import Unpack

__all__ = ["WSGIProfilingMiddleware"]

_WriteCallable = Callable[[bytes], object]


class WSGIProfilingMiddleware:
    """WSGI middleware: a server span per request and exact profile labels for its code.

    Every request gets one SERVER span (or reuses the server span an outer instrumentation
    already made current) and runs with the labels ``span_id``, ``trace_id`` and
    ``span_name`` (``GET /items/<int:item_id>``) while the app is called and while its body is
    iterated and closed. Thread-pool work and (with ``install_greenlet_labels``) gevent
    greenlets it starts inherit them. The span ends, and the request duration is recorded, when
    the server has read the whole body or closed the response.

    ```python
    app = Flask(__name__)
    app.wsgi_app = spanprof.WSGIProfilingMiddleware(app.wsgi_app)

    application = spanprof.WSGIProfilingMiddleware(get_wsgi_application())  # Django wsgi.py
    ```

    The profiler starts on the first request a process serves, so under a pre-forking server
    (gunicorn, uWSGI, also with ``preload_app``) it starts in each worker after the fork, never
    in the master. Built in the main thread (as an app module imported by the server is), the
    middleware lets the exact profiler install its signal handler there, idle until then, so
    that threaded servers (gunicorn gthread, waitress), whose first request runs on a pool
    thread, are profiled exactly too.

    Arguments:
        app: the WSGI application (for Flask, ``app.wsgi_app``).
        route_resolver: ``environ -> template or None``; default: the routes of a Flask app
            (or its ``wsgi_app``) or of Django's ``WSGIHandler``; other apps are named
            ``<unmatched>`` without one.
        **options: the options both middlewares share (``ProfilingOptions``): ``profiler``,
            ``tracer_provider``, ``trace_id_label``, ``excluded_urls``, ``meter_provider``,
            ``slo``, ``slo_seconds``, ``route_slos``, ``prometheus``, ``environ``. The
            profiler starts on the first request of each process; its last window is flushed
            at exit.
    """

    def __init__(
        self,
        app: WSGIApplication,
        *,
        route_resolver: WSGIRouteResolver | None = None,
        **options: Unpack[ProfilingOptions],
    ) -> None:
        if not callable(app):
            raise ValueError(f"app: expected a WSGI application (a callable), got {app!r}")
        self.app = app
        settings = MiddlewareSettings.build(
            "WSGIProfilingMiddleware", options, route_resolver=route_resolver, resolves="environ"
        )
        self._runtime = settings.runtime
        # Built in the main thread (at import, as servers load apps): a threaded server's first
        # request may then start the exact sampler from a pool thread (see ExactBackend.prepare).
        self._runtime.prepare()
        self._with_trace_id = settings.with_trace_id
        self._durations = settings.durations
        tracer_provider = settings.tracer_provider
        self._resolve = (
            route_resolver if route_resolver is not None else default_route_resolver(app)
        )
        self._excluded = settings.excluded
        _OpenTelemetrySemanticConventionStability._initialize()  # type: ignore[no-untyped-call]
        self._semconv: _StabilityMode = (
            _OpenTelemetrySemanticConventionStability._get_opentelemetry_stability_opt_in_mode(
                _OpenTelemetryStabilitySignalType.HTTP
            )
        )
        self._tracer = trace.get_tracer(
            "spanprof.wsgi",
            __version__,
            tracer_provider,
            schema_url=_get_schema_url(self._semconv),
        )

    @property
    def profiler(self) -> ProfilerBackend | None:
        """The backend this middleware starts in each process."""
        return self._runtime.backend

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if self._excluded is not None and self._excluded.url_disabled(_request_url(environ)):
            return self.app(environ, start_response)
        if is_labelled_span(trace.get_current_span()):
            # An outer spanprof layer (ASGI or WSGI) owns this request: it keeps its name,
            # labels and duration, and its profiler runs. Its span may be sampled out, with no
            # kind to tell: the labels are what tell.
            return self.app(environ, start_response)
        # The first request of each process, after any fork, starts the profiler.
        self._runtime.ensure_started()
        try:
            request = self._begin(environ)
        except Exception:
            # OpenTelemetry's request attributes raise on some environs a real server builds
            # (gunicorn on a unix socket takes SERVER_PORT from the Host header: "abc"). The
            # request must not fail because its span could not be set up.
            log_once(
                "wsgi-span-setup",
                "spanprof: setting up this request's span failed; it is served unlabelled "
                "(logged once)",
            )
            return self.app(environ, start_response)
        return request.run(self.app, environ, start_response)

    def _template(self, environ: WSGIEnvironment) -> str | None:
        resolve = self._resolve
        if resolve is None:
            return None
        try:
            template = resolve(environ)
        except Exception:
            log_once(
                "wsgi-route-resolver",
                "spanprof: resolving the route template failed; requests are named "
                f"'{UNMATCHED}' (logged once)",
            )
            return None
        return resolved_template(template)

    def _begin(self, environ: WSGIEnvironment) -> _Request:
        started = time.perf_counter()
        template = self._template(environ)
        method = str(environ.get("REQUEST_METHOD") or "GET")
        name = span_name(method, template if template is not None else UNMATCHED)
        current = trace.get_current_span()
        attributes: dict[str, Any] = {}
        server_attributes = False  # whether the custom request-header attributes apply
        if is_server_span(current):
            # An outer instrumentation (OpenTelemetryMiddleware, opentelemetry-instrument)
            # already opened the server span: label that one, open no second span.
            span = current
            owns_span = False
            if template is not None and span.is_recording():
                span.update_name(name)
            ctx = otel_context.get_current()
        else:
            if current.get_span_context().is_valid:
                parent = otel_context.get_current()
                kind = SpanKind.INTERNAL
            else:
                parent = extract(environ, getter=wsgi_getter)
                kind = SpanKind.SERVER
            attributes = collect_request_attributes(environ, self._semconv)
            span = self._tracer.start_span(name, parent, kind=kind, attributes=attributes)
            owns_span = True
            server_attributes = kind is SpanKind.SERVER
            ctx = trace.set_span_in_context(span, parent)
        try:
            if server_attributes and span.is_recording():
                custom = collect_custom_request_headers_attributes(environ)
                if custom:
                    span.set_attributes(custom)
            labels = request_labels(span, name, with_trace_id=self._with_trace_id)
            annotate_span(span, labels, template)
        except BaseException:
            if owns_span:  # the request is served without it: leave no span open
                span.end()
            raise
        return _Request(
            self,
            span=span,
            owns_span=owns_span,
            context=ctx,
            labels=labels,
            method=method,
            template=template,
            scheme=environ.get("wsgi.url_scheme"),
            attributes=attributes,
            started=started,
        )

    def _request_ended(
        self,
        duration_s: float,
        method: str,
        template: str | None,
        status_code: int | None,
        error: BaseException | None,
        span: trace.Span,
        scheme: str | None = None,
        span_id: str | None = None,
    ) -> None:
        """The request is over (its body closed, or it failed): record its duration.

        Runs before spanprof ends the span, so the span can still take attributes: the SLO
        mark, and the CPU the profiler counted for it (which labels its samples with the
        verdict). Never raises.
        """
        durations = self._durations
        try:
            breached: bool | None = durations.mark(span, template, duration_s)
        except Exception:
            breached = None  # record() says so, once
        usage = end_span(self._runtime, span, span_id, breached)
        durations.record(
            duration_s,
            method=known_method(method),
            route=template,
            scheme=scheme,
            status_code=status_code,
            exc=error,
            span=span,
            breached=breached,
            cpu_seconds=None if usage is None else usage.cpu_ns / 1e9,
        )


def _request_url(environ: WSGIEnvironment) -> str:
    try:
        return request_uri(environ)
    except Exception:  # a malformed environ: match on the path alone
        return str(environ.get("PATH_INFO", ""))


class _Request:
    """One request's state, from the app call to ``close()`` (never kept on the middleware)."""

    __slots__ = (
        "attributes",
        "context",
        "error",
        "finished",
        "labels",
        "method",
        "middleware",
        "owns_span",
        "scheme",
        "span",
        "started",
        "status_code",
        "template",
    )

    def __init__(
        self,
        middleware: WSGIProfilingMiddleware,
        *,
        span: trace.Span,
        owns_span: bool,
        context: otel_context.Context,
        labels: LabelSet,
        method: str,
        template: str | None,
        scheme: str | None,
        attributes: dict[str, Any],
        started: float,
    ) -> None:
        self.middleware = middleware
        self.span = span
        self.owns_span = owns_span
        self.context = context
        self.labels = labels
        self.method = method
        self.template = template
        self.scheme = scheme
        self.attributes = attributes
        self.started = started
        self.status_code: int | None = None
        self.error: BaseException | None = None
        self.finished = False

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a part of the request (the app call, ``next``, ``close``) with its labels."""
        token = otel_context.attach(self.context)
        try:
            with labels_scope(self.labels):
                return fn(*args)
        except StopIteration:
            raise
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            otel_context.detach(token)

    def run(
        self, app: WSGIApplication, environ: WSGIEnvironment, start_response: StartResponse
    ) -> Iterable[bytes]:
        """Call the app; return its body wrapped so that iterating and closing stay labelled."""

        # Takes its arguments by the names servers give them (wsgiref, gunicorn and waitress
        # all accept exc_info= by keyword, as PEP 3333 names it) and hands them on positionally,
        # which every server accepts (uWSGI only that way).
        def labelled_start_response(
            status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
        ) -> _WriteCallable:
            self.response_started(status, headers)
            if exc_info is None:
                return start_response(status, headers)
            # With exc_info after the headers went out, the server re-raises: the app (and
            # spanprof's call) sees that exception.
            return start_response(status, headers, exc_info)

        result: Iterable[bytes] = self.call(app, environ, labelled_start_response)
        file_wrapper = environ.get("wsgi.file_wrapper")
        if isinstance(file_wrapper, type) and isinstance(result, file_wrapper):
            return self._hand_over_file(result)
        # Servers read len() of the body: wsgiref and waitress send Content-Length (keeping the
        # connection alive) for a one-item body. The server sees the app's own len(), and no
        # __len__ at all where the app's body has none (waitress tests hasattr, then calls it).
        if hasattr(type(result), "__len__"):
            return _SizedBody(result, self)
        if not hasattr(type(result), "__iter__"):
            # Not a body but a server's sentinel: the app answered on the socket itself (a
            # websocket under gunicorn's gevent or eventlet worker returns ALREADY_HANDLED), and
            # the server compares what it gets with its sentinel by identity.
            self.finish()
            return result
        return _Body(result, self)

    def _hand_over_file(self, result: Iterable[bytes]) -> Iterable[bytes]:
        # The server sends a file wrapper its own way (sendfile): pass it through untouched and
        # end the request when the server closes it.
        inner_close = getattr(result, "close", None)
        request = self

        def close() -> None:
            try:
                if inner_close is not None:
                    inner_close()
            finally:
                request.finish()

        try:
            setattr(result, "close", close)  # noqa: B010 - an instance attribute on any wrapper
        except (AttributeError, TypeError):  # a wrapper that takes no attributes: end now
            self.finish()
        return result

    def response_started(self, status: str, headers: list[tuple[str, str]]) -> None:
        """``start_response`` was called: remember the status, describe it on our span."""
        code, _, _ = status.partition(" ")
        try:
            self.status_code = int(code)
        except ValueError:
            self.status_code = None
        if not self.owns_span:
            return
        try:
            middleware = self.middleware
            add_response_attributes(
                self.span, status, headers, self.attributes, middleware._semconv
            )
            if self.span.is_recording() and getattr(self.span, "kind", None) is SpanKind.SERVER:
                custom = collect_custom_response_headers_attributes(headers)
                if custom:
                    self.span.set_attributes(custom)
        except Exception:
            log_once(
                "wsgi-response-attributes",
                "spanprof: describing the response on the span failed; the request is "
                "unaffected (logged once)",
            )

    def fail(self, exc: BaseException) -> None:
        """The app raised (in the call, the body or ``close``): record it, end the request."""
        if self.error is None:
            self.error = exc
            if self.owns_span:
                self._describe_error(exc)
        self.finish()

    def _describe_error(self, exc: BaseException) -> None:
        # Runs while the app's exception propagates: nothing here may replace it, or keep the
        # request from ending. The app's exception may not even print itself (a __str__ that
        # raises), and the SDK's record_exception calls str() on it.
        span = self.span
        try:
            if not span.is_recording():
                return
            span.set_attribute("error.type", type(exc).__qualname__)
            try:
                description = f"{type(exc).__name__}: {exc}"
            except Exception:
                description = type(exc).__name__
            span.set_status(Status(StatusCode.ERROR, description))
            span.record_exception(exc)
        except Exception:
            log_once(
                "wsgi-exception-event",
                "spanprof: recording the app's exception on the span failed; the exception "
                "reaches the server unchanged (logged once)",
            )

    def finish(self) -> None:
        """End the request once: record its duration, then end the span if it is ours."""
        if self.finished:
            return
        self.finished = True
        duration = time.perf_counter() - self.started
        self.middleware._request_ended(
            duration,
            self.method,
            self.template,
            self.status_code,
            self.error,
            self.span,
            self.scheme,
            self.labels.get("span_id"),
        )
        if self.owns_span:
            try:
                self.span.end()
            except Exception:
                # The SDK lets a span processor's on_end raise out of end(). finish() runs as
                # the body ends (inside the server's next(), turning StopIteration into a failed
                # body), in close() and while the app's exception propagates: never raise here.
                log_once(
                    "wsgi-span-end",
                    "spanprof: ending the request's span failed (a span processor raised); "
                    "the response is unaffected (logged once)",
                )


class _Body:
    """The app's response body, iterated and closed with the request's labels and context."""

    __slots__ = ("_closed", "_iterator", "_request", "_result")

    def __init__(self, result: Iterable[bytes], request: _Request) -> None:
        self._result = result
        self._request = request
        self._iterator: Iterator[bytes] | None = None
        self._closed = False

    def __iter__(self) -> _Body:
        return self

    def __next__(self) -> bytes:
        try:
            chunk: bytes = self._request.call(self._advance)
        except StopIteration:
            # The body is exhausted: the response is complete. End the request now, as
            # OpenTelemetry's WSGI middleware does, for servers that never call close() (the
            # app's close() still runs with the labels if it comes).
            self._request.finish()
            raise
        return chunk

    def _advance(self) -> bytes:
        iterator = self._iterator
        if iterator is None:
            iterator = self._iterator = iter(self._result)
        return next(iterator)

    def close(self) -> None:
        """Close the app's body (running its cleanup with the labels), then end the request."""
        if self._closed:
            return
        self._closed = True
        request = self._request
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                request.call(close)
        finally:
            request.finish()


class _SizedBody(_Body):
    """A body whose app iterable has a length: the server reads that length through it."""

    __slots__ = ()

    def __len__(self) -> int:
        # Built only for a result whose type has __len__. Not run with the request's labels: a
        # body's length is its container's count, asked by the server, not request code.
        return len(self._result)  # type: ignore[arg-type]
