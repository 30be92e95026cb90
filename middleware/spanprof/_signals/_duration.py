"""Response → duration → exemplar: the request-duration histogram with SLO-breach exemplars.

The SDK's exemplar filter is provider-wide, so spanprof does not touch it. Instead it decides
per measurement which context it records with: a breaching request records with its server
span's context (the default ``TraceBasedExemplarFilter`` keeps an exemplar with its ids); a
request within its SLO records with a context holding ``INVALID_SPAN``, which the filter
rejects (an empty ``Context()`` would not: the SDK falls back to the current context).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import metrics
from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import INVALID_SPAN, Span, set_span_in_context

from .._logging import log_once
from .._version import __version__
from ._slo import SloPolicy

__all__ = [
    "BREACH_ATTRIBUTE",
    "CPU_TIME_BUCKETS",
    "DURATION_BUCKETS",
    "THRESHOLD_ATTRIBUTE",
    "DurationRecorder",
    "error_type",
]

# OTel HTTP semantic conventions' advice for http.server.request.duration.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

# CPU a request's own samples account for: at 100 Hz, 10 ms is one sample.
CPU_TIME_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

BREACH_ATTRIBUTE = "spanprof.slo.breached"
THRESHOLD_ATTRIBUTE = "spanprof.slo.threshold_s"
# A request within its SLO is marked ``false`` only past this share of its threshold: a reader
# comparing span durations with the threshold (local mode) then takes the middleware's verdict
# on every request whose span could end past the threshold (the span ends after the last body
# message, the verdict is taken before it), and the short ones carry no attribute at all.
NEAR_THRESHOLD = 0.5

_NO_EXEMPLAR: Context = set_span_in_context(INVALID_SPAN)

BreachSink = Callable[[float, dict[str, Any], Span | None], None]


def error_type(status_code: int | None, exc: BaseException | None) -> str | None:
    """``error.type``: the exception's class, else a 5xx status, else nothing."""
    if exc is not None:
        return type(exc).__qualname__
    if status_code is None:
        return "incomplete"
    if status_code >= 500:
        return str(status_code)
    return None


_MAX_ATTRIBUTE_SETS = 4096


def _attributes(
    method: str, route: str | None, scheme: str | None, status: int | None, failure: str | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {"http.request.method": method}
    if route is not None:
        attributes["http.route"] = route
    if scheme:
        attributes["url.scheme"] = scheme
    if status is not None:
        attributes["http.response.status_code"] = status
    if failure is not None:
        attributes["error.type"] = failure
    return attributes


class DurationRecorder:
    """Records one ``http.server.request.duration`` measurement per request.

    With the exact profiler it also records ``http.server.request.cpu_time``: the CPU (s) the
    request's own profile samples account for, with the same attributes, for every request at
    least one sample landed in. A request with no sample records nothing there: at 100 Hz most
    short requests have none, and a second histogram record on each of them would cost as much
    as the duration's own (about 8 µs, docs/benchmarks.md).

    Arguments:
        meter_provider: where the histogram lives (default: the global provider).
        slo: the thresholds deciding which requests leave an exemplar.
        extra_sinks: more recorders (e.g. the Prometheus histogram) called with
            ``(seconds, attributes, span_if_breached)``.
    """

    def __init__(
        self,
        *,
        meter_provider: MeterProvider | None,
        slo: SloPolicy,
        extra_sinks: tuple[BreachSink, ...] = (),
    ) -> None:
        meter = metrics.get_meter("spanprof", __version__, meter_provider)
        self._histogram = meter.create_histogram(
            "http.server.request.duration",
            unit="s",
            description="Duration of HTTP server requests.",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self._cpu_histogram = meter.create_histogram(
            "http.server.request.cpu_time",
            unit="s",
            description="CPU time of HTTP server requests, from their profile samples.",
            explicit_bucket_boundaries_advisory=list(CPU_TIME_BUCKETS),
        )
        self.slo = slo
        self._sinks = extra_sinks
        # The attribute dicts repeat (methods x routes x statuses): build each once. Shared
        # dicts are never mutated, by us or by the SDK, which keys aggregations by their items.
        self._attributes: dict[tuple[Any, ...], dict[str, Any]] = {}

    def mark(self, span: Span, route: str | None, seconds: float) -> bool:
        """Tell the span whether it breached its SLO; returns whether it did. Never raises.

        A breaching span gets ``spanprof.slo.breached`` and ``spanprof.slo.threshold_s``; one
        within its SLO gets ``spanprof.slo.breached=false`` past ``NEAR_THRESHOLD`` of it, and
        nothing below. Call it before the last body message is sent: OpenTelemetry's ASGI
        middleware ends the server span as that message goes out, and an ended span takes no
        attributes.
        """
        threshold = self.slo.threshold(route)
        breached = seconds > threshold
        if breached or seconds > threshold * NEAR_THRESHOLD:
            try:
                if span.is_recording():
                    span.set_attribute(BREACH_ATTRIBUTE, breached)
                    if breached:
                        span.set_attribute(THRESHOLD_ATTRIBUTE, threshold)
            except Exception:  # a span that refuses attributes: the verdict still stands
                log_once(
                    "slo-mark",
                    "spanprof: the span refused its SLO attributes; the request and its "
                    "duration are unaffected (logged once)",
                )
        return breached

    def record(
        self,
        seconds: float,
        *,
        method: str,
        route: str | None,
        scheme: str | None,
        status_code: int | None,
        exc: BaseException | None,
        span: Span,
        breached: bool | None = None,
        cpu_seconds: float | None = None,
    ) -> None:
        """Record one request; mark and exemplify it if it breached its SLO. Never raises.

        ``breached`` is what ``mark`` returned if the caller already marked the span;
        ``cpu_seconds`` what its samples account for (``None`` or 0: not recorded).
        """
        try:
            failure = error_type(status_code, exc)
            key = (method, route, scheme, status_code, failure)
            attributes = self._attributes.get(key)
            if attributes is None:
                attributes = _attributes(method, route, scheme, status_code, failure)
                if len(self._attributes) >= _MAX_ATTRIBUTE_SETS:
                    self._attributes.clear()
                self._attributes[key] = attributes
            if breached is None:
                breached = self.mark(span, route, seconds)
            context = set_span_in_context(span) if breached else _NO_EXEMPLAR
            self._histogram.record(max(seconds, 0.0), attributes, context=context)
            if cpu_seconds:
                self._cpu_histogram.record(cpu_seconds, attributes, context=context)
            for sink in self._sinks:
                sink(seconds, attributes, span if breached else None)
        except Exception:
            log_once(
                "duration-record",
                "spanprof: recording the request duration failed; the request is unaffected "
                "(logged once)",
            )
