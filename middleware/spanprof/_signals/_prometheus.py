"""The request-duration histogram for Prometheus, with OpenMetrics exemplars (extra ``prometheus``).

Prometheus stores exemplars only from the OpenMetrics exposition format, which
``prometheus_client`` writes when the scraper sends ``Accept: application/openmetrics-text``
(Prometheus does, with ``--enable-feature=exemplar-storage``).

Exemplars carry the trace and span ids of breaching requests, and OpenTelemetry continues the
trace a client sends in ``traceparent``: whoever can read ``/metrics`` sees trace ids, some of
them chosen by clients. Serve it where only the scraper reaches it (see the README).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span

from .._types import ASGIApp, Receive, Scope, Send
from ._duration import DURATION_BUCKETS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["PrometheusMetrics"]

_LABELS = ("http_request_method", "http_route", "http_response_status_code", "error_type")


class PrometheusMetrics:
    """``http_server_request_duration_seconds`` in a ``prometheus_client`` registry.

    Pass it to the middleware and add its endpoint as a route (a ``Mount`` would answer
    ``/metrics`` with a redirect to ``/metrics/``)::

        metrics = spanprof.PrometheusMetrics()
        app.add_middleware(spanprof.ProfilingMiddleware, prometheus=metrics)
        app.add_route("/metrics", metrics.asgi_app())

    Requests that breach their SLO observe with an exemplar ``{trace_id, span_id}``; the others
    without one. Scrapes (route ``path``, or under it) are not observed: they would fill the
    histogram with the scraper's own requests.

    Arguments:
        registry: the registry to register the histogram in (default: a new one owned by this
            object; pass ``prometheus_client.REGISTRY`` to expose it with your other metrics).
        name: the metric name without the ``_seconds`` unit suffix.
        path: the route the endpoint is served at, kept out of the histogram (default
            ``/metrics``).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        name: str = "http_server_request_duration",
        path: str = "/metrics",
    ) -> None:
        if not path.startswith("/") or path.strip("/") == "":
            raise ValueError(f"path: expected a route like '/metrics', got {path!r}")
        try:
            import prometheus_client
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PrometheusMetrics needs prometheus_client: pip install 'spanprof[prometheus]'"
            ) from exc
        self.registry = prometheus_client.CollectorRegistry() if registry is None else registry
        self._histogram = prometheus_client.Histogram(
            name,
            "Duration of HTTP server requests.",
            labelnames=_LABELS,
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.path = path.rstrip("/")

    def _is_scrape(self, route: str) -> bool:
        # Under the path too: a Mount("/metrics") names its route "/metrics/{path:path}".
        return route == self.path or route.startswith(self.path + "/")

    def observe(self, seconds: float, attributes: dict[str, Any], breached: Span | None) -> None:
        """Observe one request; ``breached`` is its server span when it breached its SLO."""
        route = str(attributes.get("http.route", ""))
        if self._is_scrape(route):
            return
        child = self._histogram.labels(
            str(attributes.get("http.request.method", "")),
            route,
            str(attributes.get("http.response.status_code", "")),
            str(attributes.get("error.type", "")),
        )
        exemplar = None
        if breached is not None:
            ctx = breached.get_span_context()
            # A sampled-out span is never exported: its exemplar would point at no trace, and
            # would replace the bucket's one exemplar (a sampled breach's, perhaps).
            if ctx.is_valid and ctx.trace_flags.sampled:
                exemplar = {
                    "trace_id": format(ctx.trace_id, "032x"),
                    "span_id": format(ctx.span_id, "016x"),
                }
        child.observe(max(seconds, 0.0), exemplar)

    def asgi_app(self) -> ASGIApp:
        """An ASGI app serving the registry (OpenMetrics when the scraper asks for it).

        An object rather than a function, so that Starlette's ``Route``/``add_route`` serves it
        as an ASGI app at exactly its path instead of calling it as a request handler.
        """
        from prometheus_client import make_asgi_app

        return _Endpoint(make_asgi_app(self.registry))


class _Endpoint:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)
