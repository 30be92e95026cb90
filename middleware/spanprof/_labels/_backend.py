"""The profiler backend protocol: where the label engine sends each thread's labels."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from ._labelset import LabelSet

__all__ = [
    "EndsSpans",
    "PreparesInMainThread",
    "ProfilerBackend",
    "ReadsMainThreadContext",
    "SpanUsage",
    "span_usage",
]


@runtime_checkable
class ProfilerBackend(Protocol):
    """A profiler that attributes samples to labels.

    The label engine calls ``set_thread_labels`` **on the thread concerned**, only when that
    thread's label set changes, with the set it had and the set it has now. ``start`` runs once
    per process (after any fork) before the first label push; ``shutdown`` flushes and stops.

    Implementations must be cheap in ``set_thread_labels`` (it runs between asyncio task steps)
    and may raise: the engine logs a backend failure once and never lets it reach a request.

    A backend that reads the main thread's labels from the running context itself
    (``ExactBackend``) also implements ``ReadsMainThreadContext``.
    """

    def start(self) -> None:
        """Start profiling this process."""

    def shutdown(self) -> None:
        """Flush what was collected and stop profiling."""

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """The calling thread switched from ``previous`` labels to ``current`` labels."""


@runtime_checkable
class ReadsMainThreadContext(Protocol):
    """A backend that, while ``needs_step_hooks`` is ``False``, reads the labels of the main
    thread's running context at each sample itself.

    Event loops in the main thread then get no per-step hook (no uvloop or eager-task task
    factory), and the engine pushes nothing for that thread.
    """

    @property
    def needs_step_hooks(self) -> bool:
        """Whether main-thread event loops still need per-step label pushes."""


class SpanUsage(NamedTuple):
    """What a request's own samples account for when its span ends."""

    cpu_ns: int
    alloc_bytes: int | None = None


# The usage of a request none of whose samples landed (most short requests), with and without
# allocation sampling: one object each, shared.
_UNUSED = {None: SpanUsage(0, None), 0: SpanUsage(0, 0)}
_tuple_new = tuple.__new__


def span_usage(cpu_ns: int, alloc_bytes: int | None) -> SpanUsage:
    """``SpanUsage(cpu_ns, alloc_bytes)``, made the cheap way: the request path makes one.

    A named tuple's own call runs its ``__new__``, a Python function behind ``type.__call__``:
    about 3,000 instructions a request on CPython 3.11, 0.3% of a trivial one.
    """
    if not cpu_ns and not alloc_bytes:
        unused = _UNUSED.get(alloc_bytes)
        if unused is not None:
            return unused
    usage: SpanUsage = _tuple_new(SpanUsage, (cpu_ns, alloc_bytes))
    return usage


@runtime_checkable
class EndsSpans(Protocol):
    """A backend told when each request's span ends, with its SLO verdict.

    ``ExactBackend`` labels the span's samples ``slo=breached`` or ``slo=ok`` from the verdict
    (holding them until then) and returns the CPU they account for.
    """

    def end_span(self, span_id: str, breached: bool | None) -> SpanUsage | None:
        """The span ``span_id`` ends; ``breached`` is its verdict (``None``: not timed)."""


@runtime_checkable
class PreparesInMainThread(Protocol):
    """A backend with set-up that only the main thread can do, before ``start`` runs elsewhere.

    ``ExactBackend`` installs its signal handler there, so that a threaded WSGI server's first
    request can start it from a pool thread. ``WSGIProfilingMiddleware`` calls ``prepare``
    when it is built in the main thread.
    """

    def prepare(self) -> None:
        """Do the main thread's part of starting (idle until ``start``; undone by ``shutdown``)."""
