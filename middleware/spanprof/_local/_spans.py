"""An in-memory span store: recent finished spans, by trace, and the server spans' latencies.

``SpanStore`` is an OpenTelemetry SDK ``SpanProcessor``: add it to the app's tracer provider and
every finished span lands here. Everything is bounded (oldest dropped first), so a local session
can run for hours.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanKind

from ._slo import SloPolicy, judge

__all__ = ["SpanRecord", "SpanStore"]

# Attributes the page shows; the rest stay out of the JSON to keep it small.
_SHOWN_ATTRIBUTES = (
    "http.route",
    "http.request.method",
    "http.method",
    "http.response.status_code",
    "http.status_code",
    "url.path",
    "http.target",
    "url.full",
    "http.url",
    "server.address",
    "pyroscope.profile.id",
    "spanprof.slo.breached",
    "spanprof.slo.threshold_s",
)


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One finished span, reduced to what the page needs."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: str
    service: str
    start_ns: int
    end_ns: int
    status: str
    attributes: tuple[tuple[str, Any], ...]
    route: str | None
    breached: bool
    threshold_s: float | None
    verdict_source: str | None

    @property
    def duration_s(self) -> float:
        """Span duration in seconds."""
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def is_server(self) -> bool:
        """Whether this is a SERVER span (one request)."""
        return self.kind == "SERVER"

    def status_code(self) -> int | None:
        """The HTTP response status, if recorded."""
        for key, value in self.attributes:
            if key in ("http.response.status_code", "http.status_code") and isinstance(value, int):
                return value
        return None

    def to_json(self) -> dict[str, Any]:
        """JSON for the APIs."""
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "kind": self.kind,
            "service": self.service,
            "start": self.start_ns / 1e9,
            "duration_s": self.duration_s,
            "status": self.status,
            "status_code": self.status_code(),
            "route": self.route,
            "breached": self.breached,
            "threshold_s": self.threshold_s,
            "verdict_source": self.verdict_source,
            "attributes": dict(self.attributes),
        }


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


class SpanStore(SpanProcessor):
    """Keeps recent finished spans in memory and judges server spans against an SLO policy.

    Arguments:
        policy: the SLO thresholds applied to server spans without a verdict of their own.
        max_traces: traces kept (oldest trace dropped first).
        max_spans_per_trace: spans kept per trace (later ones dropped).
        max_requests: server spans kept for the latency plot.
        max_breaches: breaching server spans kept for the breach list.
    """

    def __init__(
        self,
        policy: SloPolicy | None = None,
        *,
        max_traces: int = 4096,
        max_spans_per_trace: int = 512,
        max_requests: int = 20_000,
        max_breaches: int = 500,
    ) -> None:
        self.policy = policy if policy is not None else SloPolicy()
        self._lock = threading.Lock()
        self._traces: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        self._max_traces = max_traces
        self._max_spans_per_trace = max_spans_per_trace
        self._requests: deque[SpanRecord] = deque(maxlen=max_requests)
        self._breaches: deque[SpanRecord] = deque(maxlen=max_breaches)
        self._spans_seen = 0

    # -- SpanProcessor -------------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do until the span ends."""

    def on_end(self, span: ReadableSpan) -> None:
        """Record a finished span (runs on whichever thread ended it)."""
        record = self._record(span)
        if record is None:
            return
        with self._lock:
            self._spans_seen += 1
            spans = self._traces.get(record.trace_id)
            if spans is None:
                spans = self._traces[record.trace_id] = []
                while len(self._traces) > self._max_traces:
                    self._traces.popitem(last=False)
            if len(spans) < self._max_spans_per_trace:
                spans.append(record)
            if record.is_server:
                self._requests.append(record)
                if record.breached:
                    self._breaches.append(record)

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Spans are stored synchronously: always flushed."""
        return True

    def _record(self, span: ReadableSpan) -> SpanRecord | None:
        ctx = span.context
        if ctx is None or not ctx.is_valid or span.start_time is None or span.end_time is None:
            return None
        attributes = dict(span.attributes or {})
        kind = span.kind.name if isinstance(span.kind, SpanKind) else str(span.kind)
        route = attributes.get("http.route")
        route = route if isinstance(route, str) else None
        duration_s = (span.end_time - span.start_time) / 1e9
        breached = False
        threshold: float | None = None
        source: str | None = None
        if kind == "SERVER":
            breached, threshold, source = judge(self.policy, route, duration_s, attributes)
        service = span.resource.attributes.get("service.name", "")
        return SpanRecord(
            trace_id=_hex(ctx.trace_id, 32),
            span_id=_hex(ctx.span_id, 16),
            parent_id=_hex(span.parent.span_id, 16) if span.parent is not None else None,
            name=span.name,
            kind=kind,
            service=str(service),
            start_ns=span.start_time,
            end_ns=span.end_time,
            status=span.status.status_code.name,
            attributes=tuple((k, attributes[k]) for k in _SHOWN_ATTRIBUTES if k in attributes),
            route=route,
            breached=breached,
            threshold_s=threshold,
            verdict_source=source,
        )

    # -- queries ---------------------------------------------------------------------------------

    @property
    def spans_seen(self) -> int:
        """Finished spans recorded since start."""
        with self._lock:
            return self._spans_seen

    def requests(self, *, since: float = 0.0, limit: int = 5000) -> list[SpanRecord]:
        """Server spans that started at or after ``since`` (Unix seconds), oldest first."""
        with self._lock:
            records = [r for r in self._requests if r.start_ns / 1e9 >= since]
        return records[-limit:]

    def breaches(self, *, limit: int = 200) -> list[SpanRecord]:
        """Breaching server spans, newest first."""
        with self._lock:
            records = list(self._breaches)
        records.reverse()
        return records[:limit]

    def request_count(self) -> int:
        """Server spans currently kept."""
        with self._lock:
            return len(self._requests)

    def breach_count(self) -> int:
        """Breaching server spans currently kept."""
        with self._lock:
            return len(self._breaches)

    def trace(self, trace_id: str) -> list[SpanRecord]:
        """The kept spans of ``trace_id``, by start time."""
        with self._lock:
            spans = list(self._traces.get(trace_id, ()))
        spans.sort(key=lambda r: (r.start_ns, r.end_ns))
        return spans

    def span(self, span_id: str) -> SpanRecord | None:
        """A kept server span by id (breaches first: that is what the page asks for)."""
        with self._lock:
            for record in reversed(self._breaches):
                if record.span_id == span_id:
                    return record
            for record in reversed(self._requests):
                if record.span_id == span_id:
                    return record
        return None
