"""From a server span to the request's label set, and back: the span learns its profile id."""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind

from .._labels._labelset import LABELS, LabelSet
from ._routes import span_name_label

__all__ = [
    "PROFILE_ID_ATTRIBUTE",
    "annotate_span",
    "is_ended_span",
    "is_labelled_span",
    "is_server_span",
    "request_labels",
]

# Grafana's Tempo "trace to profiles" link appears on spans that carry this attribute.
PROFILE_ID_ATTRIBUTE = "pyroscope.profile.id"


def is_server_span(span: Span) -> bool:
    """Whether ``span`` is a valid SERVER span another instrumentation already made current.

    An ended span is not: uvicorn's h11 protocol starts a pipelined request's task from inside
    the previous request's last ``send``, so the new task inherits that request's context and
    its server span, which has ended by the time the new request runs (an SDK span then has an
    ``end_time``).
    """
    return (
        span.get_span_context().is_valid
        and getattr(span, "kind", None) is SpanKind.SERVER
        and getattr(span, "end_time", None) is None
    )


def is_ended_span(span: Span) -> bool:
    """Whether ``span`` (an SDK span) has ended: it is left in a context only by mistake."""
    return getattr(span, "end_time", None) is not None


def is_labelled_span(span: Span) -> bool:
    """Whether the labels in effect are ``span``'s own: spanprof already handles its request.

    True inside a spanprof middleware's request (ASGI or WSGI, also across the thread pool
    a WSGI app mounted in an ASGI app runs in), so a second spanprof layer below it (a mounted
    sub-app with its own middleware) can leave the request, its name and its labels alone.
    """
    span_id = LABELS.get().get("span_id")
    return (
        span_id is not None and span_id == span.get_span_context().span_id.to_bytes(8, "big").hex()
    )


def request_labels(span: Span, name: str, *, with_trace_id: bool) -> LabelSet:
    """The request's labels: the enclosing ones plus ``span_id``, ``trace_id``, ``span_name``.

    ``name`` is the span's name; the label carries its sanitized form.
    """
    ctx = span.get_span_context()
    own: dict[str, str] = {"span_name": span_name_label(name)}
    if ctx.is_valid:
        # The same zero-padded lowercase hex as format(id, "016x"), at half the cost.
        own["span_id"] = ctx.span_id.to_bytes(8, "big").hex()
        if with_trace_id:
            own["trace_id"] = ctx.trace_id.to_bytes(16, "big").hex()
    enclosing = LABELS.get()
    if enclosing:
        own = {**enclosing, **own}
    return LabelSet._adopt(own)


def annotate_span(span: Span, labels: LabelSet, template: str | None = None) -> None:
    """Link the span to its profile and name its route."""
    if not span.is_recording():
        return
    # One set_attribute per attribute: the SDK's set_attributes validates its dict argument as
    # a whole first (an ABC isinstance chain), which costs more than a second call.
    span_id = labels.get("span_id")
    if span_id is not None:
        span.set_attribute(PROFILE_ID_ATTRIBUTE, span_id)
    if template is not None:
        span.set_attribute("http.route", template)
