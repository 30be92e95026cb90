"""Profile samples by span id: what the embedded receiver got, ready for a flame graph or pprof.

Every upload of the profiler is split by the ``span_id`` label of its samples. A span's flame
graph and pprof are built only from the samples labelled with that span id; samples without a
span id (startup, background work, the server's own loop) are counted but not kept. Memory
series are handed to a ``MemoryStore`` (``_memory``), which keeps them by span id its own way.

Anything on the machine can push here, so what is kept is bounded by bytes, not only by counts:
stacks deeper than ``max_depth`` keep their leaf and root ends around a marker frame, names are
cut at ``MAX_NAME`` characters, frames are shared between stacks, and the oldest span ids go
first once the estimate passes ``max_bytes``.
"""

from __future__ import annotations

import gzip
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .._logging import log_once
from .._profiling._encoders._pprof import DEFAULT_MAX_DEPTH, ProfileBuilder
from .._profiling._window import Frame
from ._compare import SloComparison
from ._memory import MemoryStore
from ._receiver import ReceivedPush
from ._stacks import MAX_NAME, TRUNCATED, FramePool, flame_tree, stack_cost

__all__ = ["SampleStore", "SpanProfile"]

_CPU_TYPE = ("cpu", "nanoseconds")
_DEFAULT_PERIOD_NS = 10_000_000
_MAX_NAME = MAX_NAME
# A span id is 16 hex digits; anything much longer is not one of ours.
_MAX_ID = 64
_MAX_SERVICES = 64
_SPAN_OVERHEAD = 1000


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
    malformed_samples: int = 0
    services: set[str] = field(default_factory=set)


class SampleStore:
    """Keeps the samples of the most recent span ids, fed by ``PushReceiver(on_push=...)``.

    Arguments:
        max_spans: span ids kept (least recently updated dropped first).
        max_stacks_per_span: distinct stacks kept per span id (later ones folded into a
            ``[truncated]`` frame).
        max_depth: frames kept per stack; a deeper stack keeps its leaf and root ends and an
            ``[N frames elided]`` frame between them. The default is above what CPython's
            default recursion limit lets a program reach.
        max_bytes: estimated memory of everything kept; past it the least recently updated
            span ids are dropped (counted as ``evicted_spans`` in ``status()``).
        comparison: also fed every request sample with its ``span_name`` and ``slo`` labels
            (the breach-vs-ok comparison per route), with its own bound.
        memory: where the memory series go (default: a ``MemoryStore`` with its defaults and
            this store's ``max_depth``).
    """

    def __init__(
        self,
        *,
        max_spans: int = 5000,
        max_stacks_per_span: int = 2000,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_bytes: int = 64 * 1024 * 1024,
        comparison: SloComparison | None = None,
        memory: MemoryStore | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._comparison = comparison
        self._spans: OrderedDict[str, SpanProfile] = OrderedDict()
        self._max_spans = max_spans
        self._max_stacks = max_stacks_per_span
        self._max_bytes = max_bytes
        self._period_ns = _DEFAULT_PERIOD_NS
        self._totals = _Totals()
        # Every kept stack refers to these frames, so the frames of a thousand uploads of the
        # same code are stored once. Dropped spans leave theirs here until _enforce_bytes.
        self._frames = FramePool(max_depth)
        # Estimated bytes per span id (stacks and names), and their sum.
        self._span_bytes: dict[str, int] = {}
        self._stack_bytes = 0
        self._evicted = 0
        #: The memory samples (allocated and in use, per span and route).
        self.memory = memory if memory is not None else MemoryStore(max_depth=max_depth)

    def ingest(self, push: ReceivedPush) -> None:
        """Split one accepted push by span id (the receiver's ``on_push`` callback)."""
        with self._lock:
            self._totals.pushes += 1
            for series in push.series:
                name = series.label("__name__")
                if name not in (None, "process_cpu"):  # memory: see MemoryStore
                    continue
                service = (series.label("service_name") or "")[:_MAX_NAME]
                services = self._totals.services
                if service and (service in services or len(services) < _MAX_SERVICES):
                    services.add(service)
                for profile in series.profiles:
                    if profile.sample_types[:1] != (_CPU_TYPE,):
                        continue
                    if profile.period > 0:
                        self._period_ns = profile.period
                    width = len(profile.sample_types)
                    for sample in profile.samples:
                        # One value per sample type, or the sample means nothing; skipped,
                        # not raised, so the rest of the push is kept.
                        if len(sample.values) != width:
                            self._malformed(width, len(sample.values))
                            continue
                        self._add(sample.stack, sample.value, sample.labels, service, push)
            self._enforce_bytes()
        self.memory.ingest(push)

    def _malformed(self, expected: int, got: int) -> None:
        self._totals.malformed_samples += 1
        log_once(
            "local:malformed-cpu-sample",
            f"spanprof dev: skipped a CPU sample with {got} values for {expected} sample "
            "types (counted as malformed_samples)",
            exc_info=False,
        )

    def allocated_bytes(self, span_id: str) -> int:
        """Bytes ``span_id`` allocated, from the memory profiles received (0 when none)."""
        return self.memory.allocated_bytes(span_id)

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
        span_ids = [v for k, v in labels if k == "span_id" and len(v) <= _MAX_ID]
        if not span_ids:
            return
        totals.labelled_ns += value
        if len(set(span_ids)) > 1:
            totals.double_labelled_ns += value
        label_map = dict(labels)
        kept = self._frames.keep(stack)
        comparison = self._comparison
        span_name = label_map.get("span_name")
        if comparison is not None and span_name:
            comparison.add(kept, value, span_name[:_MAX_NAME], label_map.get("slo"))
        for span_id in dict.fromkeys(span_ids):
            profile = self._spans.get(span_id)
            if profile is None:
                profile = self._spans[span_id] = SpanProfile(
                    span_id,
                    trace_id=label_map.get("trace_id", "")[:_MAX_ID],
                    span_name=label_map.get("span_name", "")[:_MAX_NAME],
                    service=service,
                    first_seen=push.received_at,
                )
                self._charge(span_id, _SPAN_OVERHEAD + len(span_id) + len(profile.span_name))
                while len(self._spans) > self._max_spans:
                    self._evict_oldest()
            else:
                self._spans.move_to_end(span_id)
            profile.last_seen = push.received_at
            profile.total_ns += value
            # Each lookup hashes the whole stack again (tuples do not cache their hash).
            stacks = profile.stacks
            previous = stacks.get(kept)
            if previous is not None:
                stacks[kept] = previous + value
            elif len(stacks) < self._max_stacks:
                stacks[kept] = value
                self._charge(span_id, stack_cost(kept))
            else:
                if TRUNCATED not in stacks:
                    self._charge(span_id, stack_cost(TRUNCATED))
                stacks[TRUNCATED] = stacks.get(TRUNCATED, 0) + value

    def _charge(self, span_id: str, cost: int) -> None:
        self._span_bytes[span_id] = self._span_bytes.get(span_id, 0) + cost
        self._stack_bytes += cost

    def _evict_oldest(self) -> None:
        span_id, _profile = self._spans.popitem(last=False)
        self._stack_bytes -= self._span_bytes.pop(span_id, 0)
        self._evicted += 1

    def _enforce_bytes(self) -> None:
        """Past ``max_bytes``, drop the least recently updated spans down to three quarters.

        The slack makes the frame compaction (a walk over everything kept) happen once per
        quarter of the budget of new data, not on every upload of a full store.
        """
        if self._stack_bytes + self._frames.bytes <= self._max_bytes:
            return
        target = self._max_bytes * 3 // 4
        while True:
            # Frames of dropped spans stay counted until compacted: compact, then re-check.
            self._compact_frames()
            if not self._spans or self._stack_bytes + self._frames.bytes <= target:
                return
            while self._spans and self._stack_bytes + self._frames.bytes > target:
                self._evict_oldest()

    def _compact_frames(self) -> None:
        """Forget the shared frames no kept stack refers to any more."""
        self._frames.compact(stack for profile in self._spans.values() for stack in profile.stacks)

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
                "malformed_samples": totals.malformed_samples,
                "spans_with_samples": len(self._spans),
                "evicted_spans": self._evicted,
                "kept_bytes": self._stack_bytes + self._frames.bytes,
                "services": sorted(totals.services),
                "period_ns": self._period_ns,
            }

    def flamegraph(self, span_id: str) -> dict[str, Any]:
        """The span's samples as a d3-flame-graph tree (``name``, ``value``, ``children``).

        Values are CPU nanoseconds; the root is named after the span. A span without samples
        yet gets a root with value 0 and no children.
        """
        profile = self.span(span_id)
        if profile is None:
            return flame_tree(f"span {span_id}", ())
        return flame_tree(profile.span_name or f"span {span_id}", profile.stacks.items())

    def pprof(self, span_id: str, kind: str = "cpu") -> bytes | None:
        """A gzip-compressed pprof of the span's samples, labelled like the originals.

        ``kind`` ``cpu`` (default): its CPU samples; a memory kind (``alloc_space`` …): its
        memory profile with all four memory types, that one shown first (see
        ``MemoryStore.pprof``). ``None`` when no such sample of the span was received.
        """
        profile = self.span(span_id)
        if kind != "cpu":
            return self.memory.pprof(span_id, kind, _pprof_labels(span_id, profile))
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
        labels = _pprof_labels(span_id, profile)
        for stack, value in profile.stacks.items():
            builder.add(stack, value, labels)
        # The uploads arrive once a second; the span ran within the second before the first.
        start = max(profile.first_seen - 1.0, 0.0)
        raw = builder.build(
            time_nanos=int(start * 1e9),
            duration_nanos=int(max(profile.last_seen - start, 0.0) * 1e9),
        )
        return gzip.compress(raw, mtime=0)


def _pprof_labels(span_id: str, profile: SpanProfile | None) -> list[tuple[str, str]]:
    """``span_id``, and the trace id and span name its CPU samples (``profile``) carried."""
    labels = [("span_id", span_id)]
    if profile is not None and profile.trace_id:
        labels.append(("trace_id", profile.trace_id))
    if profile is not None and profile.span_name:
        labels.append(("span_name", profile.span_name))
    return labels
