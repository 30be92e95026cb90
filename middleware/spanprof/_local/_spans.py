"""An in-memory span store: recent finished spans, by trace, and the server spans' latencies.

``SpanStore`` is an OpenTelemetry SDK ``SpanProcessor``: add it to the app's tracer provider and
every finished span lands here. Everything is bounded (oldest dropped first), so a local session
can run for hours: by count, and by an estimate of the bytes kept, because a request's client
picks its trace id (``traceparent``) and its URL, and the app its attributes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanKind

from .._labels._labelset import sanitize_value
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
    "spanprof.cpu_time_s",
    "spanprof.alloc_bytes",
)

# Server span names whose requests are counted per SLO verdict (for the route comparison).
_MAX_ROUTES = 256


# Longer than any name or URL worth showing; the rest of a megabyte attribute is not kept.
_MAX_TEXT = 1024
# CPython sizes, rounded up: the record, its ids and attribute tuples, its slot in a container.
_RECORD_OVERHEAD = 1200
_TRACE_OVERHEAD = 300


def _text(value: str) -> str:
    return value if len(value) <= _MAX_TEXT else value[:_MAX_TEXT] + "…"


def _shown(value: Any) -> Any:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, tuple | list):
        # A sequence attribute: its first items, each cut.
        return tuple(_text(v) if isinstance(v, str) else v for v in value[:16])
    return value


def _cost(record: SpanRecord) -> int:
    """Estimated bytes one kept record holds."""
    size = _RECORD_OVERHEAD + len(record.name) + len(record.service) + len(record.route or "")
    for _key, value in record.attributes:
        items = value if isinstance(value, tuple) else (value,)
        size += 64 + sum(64 + len(v) if isinstance(v, str) else 32 for v in items)
    return size


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
        max_bytes: estimated bytes the traces may hold, and the server spans of the latency
            plot as much again; past it the oldest are dropped first (counted as
            ``evicted_traces`` and ``evicted_requests`` in ``counters()``).
    """

    def __init__(
        self,
        policy: SloPolicy | None = None,
        *,
        max_traces: int = 4096,
        max_spans_per_trace: int = 512,
        max_requests: int = 20_000,
        max_breaches: int = 500,
        max_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        self.policy = policy if policy is not None else SloPolicy()
        self._lock = threading.Lock()
        self._traces: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        self._max_traces = max_traces
        self._max_spans_per_trace = max_spans_per_trace
        self._max_requests = max_requests
        self._max_bytes = max_bytes
        # Breaches are few (max_breaches) and each record is cut to _MAX_TEXT per string:
        # bounded by count alone. Traces and requests are bounded by bytes as well.
        self._requests: deque[SpanRecord] = deque()
        self._breaches: deque[SpanRecord] = deque(maxlen=max_breaches)
        self._trace_bytes: dict[str, int] = {}
        self._traces_total = 0
        self._requests_total = 0
        self._evicted_traces = 0
        self._evicted_requests = 0
        self._spans_seen = 0
        # Server span name -> [breached, ok] requests since start.
        self._verdicts: dict[str, list[int]] = {}

    # -- SpanProcessor -------------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do until the span ends."""

    def on_end(self, span: ReadableSpan) -> None:
        """Record a finished span (runs on whichever thread ended it)."""
        record = self._record(span)
        if record is None:
            return
        cost = _cost(record)
        with self._lock:
            self._spans_seen += 1
            spans = self._traces.get(record.trace_id)
            if spans is None:
                spans = self._traces[record.trace_id] = []
                self._trace_bytes[record.trace_id] = _TRACE_OVERHEAD
                self._traces_total += _TRACE_OVERHEAD
            else:
                # A trace still growing is recent: evict by last update, not by first span.
                self._traces.move_to_end(record.trace_id)
            if len(spans) < self._max_spans_per_trace:
                spans.append(record)
                self._trace_bytes[record.trace_id] += cost
                self._traces_total += cost
            while len(self._traces) > 1 and (
                len(self._traces) > self._max_traces or self._traces_total > self._max_bytes
            ):
                dropped, _spans = self._traces.popitem(last=False)
                self._traces_total -= self._trace_bytes.pop(dropped)
                self._evicted_traces += 1
            if record.is_server:
                self._requests.append(record)
                self._requests_total += cost
                while len(self._requests) > 1 and (
                    len(self._requests) > self._max_requests
                    or self._requests_total > self._max_bytes
                ):
                    self._requests_total -= _cost(self._requests.popleft())
                    self._evicted_requests += 1
                if record.breached:
                    self._breaches.append(record)
                # The comparison's routes are the samples' ``span_name`` labels: the span name
                # sanitized (``,``, ``=``, quotes, non-ASCII replaced; cut to 256), keyed alike.
                name = sanitize_value(record.name)
                counts = self._verdicts.get(name)
                if counts is None and len(self._verdicts) < _MAX_ROUTES:
                    counts = self._verdicts[name] = [0, 0]
                if counts is not None:
                    counts[0 if record.breached else 1] += 1

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
            name=_text(span.name),
            kind=kind,
            service=_text(str(service)),
            start_ns=span.start_time,
            end_ns=span.end_time,
            status=span.status.status_code.name,
            attributes=tuple(
                (k, _shown(attributes[k])) for k in _SHOWN_ATTRIBUTES if k in attributes
            ),
            route=_text(route) if route is not None else None,
            breached=breached,
            threshold_s=threshold,
            verdict_source=source,
        )

    # -- queries ---------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """What is kept and what was dropped to keep it bounded, for the page."""
        with self._lock:
            return {
                "traces": len(self._traces),
                "kept_bytes": self._traces_total + self._requests_total,
                "evicted_traces": self._evicted_traces,
                "evicted_requests": self._evicted_requests,
            }

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

    def verdicts(self, name: str) -> dict[str, int]:
        """Requests served under ``name`` since start, by SLO verdict.

        ``name`` is a ``span_name`` profile label: the span name as the label carries it.
        """
        with self._lock:
            breached, ok = self._verdicts.get(name, (0, 0))
        return {"breached": breached, "ok": ok}

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
