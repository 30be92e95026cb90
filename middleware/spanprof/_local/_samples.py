"""Profile samples by span id: what the embedded receiver got, ready for a flame graph or pprof.

Every upload of the profiler is split by the ``span_id`` label of its samples. A span's flame
graph and pprof are built only from the samples labelled with that span id; samples without a
span id (startup, background work, the server's own loop) are counted but not kept.
"""

from __future__ import annotations

import gzip
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .._profiling._encoders._pprof import ProfileBuilder
from .._profiling._window import Frame
from ._receiver import ReceivedPush

__all__ = ["SampleStore", "SpanProfile"]

_CPU_TYPE = ("cpu", "nanoseconds")
_DEFAULT_PERIOD_NS = 10_000_000


@dataclass
class SpanProfile:
    """The samples of one span id, merged by stack (leaf first)."""

    span_id: str
    trace_id: str = ""
    span_name: str = ""
    service: str = ""
    total_ns: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    stacks: dict[tuple[Frame, ...], int] = field(default_factory=dict)


@dataclass
class _Totals:
    pushes: int = 0
    samples_ns: int = 0
    labelled_ns: int = 0
    double_labelled_ns: int = 0
    services: set[str] = field(default_factory=set)


def _node(name: str, filename: str) -> dict[str, Any]:
    return {"name": name, "file": filename, "value": 0, "children": {}}


def _finish(node: dict[str, Any]) -> dict[str, Any]:
    children = sorted(node["children"].values(), key=lambda c: (-c["value"], c["name"]))
    node["children"] = [_finish(child) for child in children]
    return node


class SampleStore:
    """Keeps the samples of the most recent span ids, fed by ``PushReceiver(on_push=...)``.

    Arguments:
        max_spans: span ids kept (least recently updated dropped first).
        max_stacks_per_span: distinct stacks kept per span id (later ones folded into a
            ``[truncated]`` frame).
    """

    def __init__(self, *, max_spans: int = 5000, max_stacks_per_span: int = 2000) -> None:
        self._lock = threading.Lock()
        self._spans: OrderedDict[str, SpanProfile] = OrderedDict()
        self._max_spans = max_spans
        self._max_stacks = max_stacks_per_span
        self._period_ns = _DEFAULT_PERIOD_NS
        self._totals = _Totals()

    def ingest(self, push: ReceivedPush) -> None:
        """Split one accepted push by span id (the receiver's ``on_push`` callback)."""
        with self._lock:
            self._totals.pushes += 1
            for series in push.series:
                if series.label("__name__") not in (None, "process_cpu"):
                    continue  # memory profiles carry no labels
                service = series.label("service_name") or ""
                if service:
                    self._totals.services.add(service)
                for profile in series.profiles:
                    if profile.sample_types[:1] != (_CPU_TYPE,):
                        continue
                    if profile.period > 0:
                        self._period_ns = profile.period
                    for sample in profile.samples:
                        self._add(sample.stack, sample.value, sample.labels, service, push)

    def _add(
        self,
        stack: tuple[Frame, ...],
        value: int,
        labels: tuple[tuple[str, str], ...],
        service: str,
        push: ReceivedPush,
    ) -> None:
        totals = self._totals
        totals.samples_ns += value
        span_ids = [v for k, v in labels if k == "span_id"]
        if not span_ids:
            return
        totals.labelled_ns += value
        if len(set(span_ids)) > 1:
            totals.double_labelled_ns += value
        label_map = dict(labels)
        for span_id in dict.fromkeys(span_ids):
            profile = self._spans.get(span_id)
            if profile is None:
                profile = self._spans[span_id] = SpanProfile(
                    span_id,
                    trace_id=label_map.get("trace_id", ""),
                    span_name=label_map.get("span_name", ""),
                    service=service,
                    first_seen=push.received_at,
                )
                while len(self._spans) > self._max_spans:
                    self._spans.popitem(last=False)
            else:
                self._spans.move_to_end(span_id)
            profile.last_seen = push.received_at
            profile.total_ns += value
            key = stack
            if key not in profile.stacks and len(profile.stacks) >= self._max_stacks:
                key = (Frame("[truncated]", "", 0),)
            profile.stacks[key] = profile.stacks.get(key, 0) + value

    # -- queries ---------------------------------------------------------------------------------

    def span(self, span_id: str) -> SpanProfile | None:
        """A copy of the samples of ``span_id``, if any arrived."""
        with self._lock:
            profile = self._spans.get(span_id)
            if profile is None:
                return None
            return SpanProfile(
                profile.span_id,
                profile.trace_id,
                profile.span_name,
                profile.service,
                profile.total_ns,
                profile.first_seen,
                profile.last_seen,
                dict(profile.stacks),
            )

    def sample_total(self, span_id: str) -> int:
        """CPU nanoseconds received for ``span_id`` (0 when none yet)."""
        with self._lock:
            profile = self._spans.get(span_id)
            return profile.total_ns if profile is not None else 0

    def status(self) -> dict[str, Any]:
        """Counters for the page's status line and for tests."""
        with self._lock:
            totals = self._totals
            return {
                "pushes": totals.pushes,
                "samples_ns": totals.samples_ns,
                "labelled_ns": totals.labelled_ns,
                "double_labelled_ns": totals.double_labelled_ns,
                "spans_with_samples": len(self._spans),
                "services": sorted(totals.services),
                "period_ns": self._period_ns,
            }

    def flamegraph(self, span_id: str) -> dict[str, Any]:
        """The span's samples as a d3-flame-graph tree (``name``, ``value``, ``children``).

        Values are CPU nanoseconds; the root is named after the span. A span without samples
        yet gets a root with value 0 and no children.
        """
        profile = self.span(span_id)
        root = _node(f"span {span_id}", "")
        if profile is None:
            return _finish(root)
        root["name"] = profile.span_name or root["name"]
        for stack, value in profile.stacks.items():
            root["value"] += value
            node = root
            for frame in reversed(stack):  # root first
                key = (frame.function, frame.filename)
                child = node["children"].get(key)
                if child is None:
                    child = node["children"][key] = _node(frame.function, frame.filename)
                child["value"] += value
                node = child
        return _finish(root)

    def pprof(self, span_id: str) -> bytes | None:
        """A gzip-compressed pprof of the span's samples, labelled like the originals."""
        profile = self.span(span_id)
        if profile is None:
            return None
        with self._lock:
            period = self._period_ns
        builder = ProfileBuilder(
            (_CPU_TYPE,),
            _CPU_TYPE,
            period,
            comments=(f"spanprof local mode: samples of span {span_id}",),
            default_sample_type=_CPU_TYPE[0],
        )
        labels = [("span_id", span_id)]
        if profile.trace_id:
            labels.append(("trace_id", profile.trace_id))
        if profile.span_name:
            labels.append(("span_name", profile.span_name))
        for stack, value in profile.stacks.items():
            builder.add(stack, value, labels)
        # The uploads arrive once a second; the span ran within the second before the first.
        start = max(profile.first_seen - 1.0, 0.0)
        raw = builder.build(
            time_nanos=int(start * 1e9),
            duration_nanos=int(max(profile.last_seen - start, 0.0) * 1e9),
        )
        return gzip.compress(raw, mtime=0)
