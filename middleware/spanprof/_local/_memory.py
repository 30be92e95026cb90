"""Memory samples by span id and by route: allocated per request, and what is in use now.

A memory series (``__name__=memory``, pushed by the profiler or decoded from OTLP memory
profiles into the same shape) carries four values per (stack, labels): ``alloc_objects``,
``alloc_space`` (allocated during the upload's window) and ``inuse_objects``, ``inuse_space``
(still in use when the window ended). The two kinds add up differently:

- allocations are per window, so each span's (and each route side's) are summed over uploads;
- in-use memory is a snapshot: one series' latest upload replaces its previous one, whole
  (a series whose memory was all freed uploads an empty snapshot and shows nothing in use).
  A span's in-use memory is the sum over the latest snapshot of each series (each process).

Kept like the CPU samples: only samples with a ``span_id``, stacks cut and frames shared
(``_stacks``), at most ``max_spans`` span ids and ``max_series`` snapshots, and an estimate of
everything's bytes under ``max_bytes`` (past it the least recently updated span ids go first,
then the oldest snapshots). Route sides of allocations come from the samples' ``slo`` label;
in-use samples carry none (a snapshot is not held for a verdict), so ``inuse_sides`` sides them
by the span store's verdicts when asked.
"""

from __future__ import annotations

import gzip
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._logging import log_once
from .._profiling._encoders._memory import MEMORY_PERIOD_TYPE, MEMORY_SAMPLE_TYPES
from .._profiling._encoders._pprof import DEFAULT_MAX_DEPTH, ProfileBuilder
from .._profiling._encoders._push import PushSeries
from .._profiling._window import Frame
from ._compare import SIDES, SloComparison
from ._receiver import ReceivedPush
from ._stacks import MAX_NAME, TRUNCATED, FramePool, stack_cost

__all__ = ["MEMORY_KINDS", "MEMORY_UNITS", "MemoryStore"]

#: The memory profile kinds, as Pyroscope and pprof name the sample types, and their units.
MEMORY_UNITS = {
    "alloc_space": "bytes",
    "alloc_objects": "count",
    "inuse_space": "bytes",
    "inuse_objects": "count",
}
MEMORY_KINDS = tuple(MEMORY_UNITS)
# A span's memory pprof has the pushed profiles' types (Go's heap profile's) and, until a
# push says otherwise, the profiler's default period.
_DEFAULT_PERIOD = 512 * 1024
# Where each kind is in a kept row: [objects, bytes].
_ROW = {"alloc_objects": 0, "alloc_space": 1, "inuse_objects": 0, "inuse_space": 1}
_MAX_ID = 64
_MAX_SERIES_LABELS = 32
# CPython sizes, rounded up: a span's record, a row's two-int list, a snapshot's record.
_SPAN_OVERHEAD = 1000
_ROW_OVERHEAD = 120
_SNAPSHOT_OVERHEAD = 2000

_Stack = tuple[Frame, ...]


@dataclass
class _Span:
    """One span id's memory rows, merged by stack (leaf first): ``[objects, bytes]``."""

    span_name: str = ""
    slo: str | None = None
    stacks: dict[_Stack, list[int]] = field(default_factory=dict)
    #: The rows added up: ``[objects, bytes]``.
    total: list[int] = field(default_factory=lambda: [0, 0])
    cost: int = 0


@dataclass
class _Snapshot:
    """One series' latest in-use memory, by span id."""

    received_at: float
    spans: dict[str, _Span] = field(default_factory=dict)
    cost: int = _SNAPSHOT_OVERHEAD


@dataclass
class _Totals:
    pushes: int = 0
    alloc_bytes: int = 0
    labelled_alloc_bytes: int = 0
    evicted_spans: int = 0
    evicted_snapshots: int = 0
    malformed_samples: int = 0


def _series_key(series: PushSeries) -> tuple[tuple[str, str], ...]:
    """What tells one process's memory series from another's, bounded like every name."""
    labels = series.labels[:_MAX_SERIES_LABELS]
    return tuple((k[:MAX_NAME], v[:MAX_NAME]) for k, v in labels if k != "__delta__")


def _position(sample_types: tuple[tuple[str, str], ...], kind: str) -> int:
    """Where ``kind`` is among a profile's values (-1: not there)."""
    for index, (name, _unit) in enumerate(sample_types):
        if name == kind:
            return index
    return -1


class MemoryStore:
    """Keeps memory samples per span id and per route, fed with every push by ``SampleStore``.

    Arguments:
        max_spans: span ids whose allocations are kept (least recently updated dropped first),
            and span ids kept per in-use snapshot.
        max_stacks_per_span: distinct stacks kept per span id (later ones folded into a
            ``[truncated]`` frame), in the allocations and in each snapshot.
        max_depth: frames kept per stack (see ``FramePool.keep``).
        max_series: in-use snapshots kept, one per series (least recently updated dropped).
        max_bytes: estimated memory of everything kept but the route comparisons.
        comparison_bytes: estimated bytes of each route comparison's stacks (allocated bytes,
            allocated objects).
    """

    def __init__(
        self,
        *,
        max_spans: int = 5000,
        max_stacks_per_span: int = 2000,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_series: int = 16,
        max_bytes: int = 16 * 1024 * 1024,
        comparison_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._lock = threading.Lock()
        self._frames = FramePool(max_depth)
        self._alloc: OrderedDict[str, _Span] = OrderedDict()
        self._alloc_bytes = 0
        self._snapshots: OrderedDict[tuple[tuple[str, str], ...], _Snapshot] = OrderedDict()
        self._snapshot_bytes = 0
        self._max_spans = max_spans
        self._max_stacks = max_stacks_per_span
        self._max_series = max_series
        self._max_bytes = max_bytes
        self._totals = _Totals()
        # The memory profiles' sampling period (mean bytes between samples), as last pushed.
        self._period = _DEFAULT_PERIOD
        self._comparisons = {
            kind: SloComparison(max_bytes=comparison_bytes, unit=MEMORY_UNITS[kind])
            for kind in ("alloc_space", "alloc_objects")
        }

    # -- ingest ------------------------------------------------------------------------------

    def ingest(self, push: ReceivedPush) -> None:
        """Keep the memory series of ``push`` (other series are not memory: ignored)."""
        memory = [s for s in push.series if s.label("__name__") == "memory"]
        if not memory:
            return
        with self._lock:
            self._totals.pushes += 1
            # Built whole before it replaces the previous snapshot: a window's in-use memory
            # comes in several profiles (slices), all in this one push.
            fresh: dict[tuple[tuple[str, str], ...], _Snapshot] = {}
            for series in memory:
                key = _series_key(series)
                snapshot = fresh.get(key)
                if snapshot is None:
                    snapshot = fresh[key] = _Snapshot(push.received_at)
                self._add_series(series, snapshot)
            for key, snapshot in fresh.items():
                previous = self._snapshots.pop(key, None)
                if previous is not None:
                    self._snapshot_bytes -= previous.cost
                self._snapshots[key] = snapshot
                self._snapshot_bytes += snapshot.cost
                while len(self._snapshots) > self._max_series:
                    self._evict_snapshot()
            self._enforce_bytes()

    def _add_series(self, series: PushSeries, snapshot: _Snapshot) -> None:
        totals = self._totals
        for profile in series.profiles:
            if profile.period > 0:
                self._period = profile.period
            types = profile.sample_types
            ao, ab = _position(types, "alloc_objects"), _position(types, "alloc_space")
            io, ib = _position(types, "inuse_objects"), _position(types, "inuse_space")
            for sample in profile.samples:
                values = sample.values
                count = len(values)
                # Values that do not line up with the types cannot be told apart.
                if count != len(types):
                    totals.malformed_samples += 1
                    log_once(
                        "local:malformed-memory-sample",
                        f"spanprof dev: skipped a memory sample with {count} values for "
                        f"{len(types)} sample types (counted as malformed_samples)",
                        exc_info=False,
                    )
                    continue
                # Negative values mean nothing here (a hostile push): they count as zero.
                alloc = (
                    max(values[ao], 0) if 0 <= ao < count else 0,
                    max(values[ab], 0) if 0 <= ab < count else 0,
                )
                inuse = (
                    max(values[io], 0) if 0 <= io < count else 0,
                    max(values[ib], 0) if 0 <= ib < count else 0,
                )
                if not (any(alloc) or any(inuse)):
                    continue
                totals.alloc_bytes += alloc[1]
                span_ids = [v for k, v in sample.labels if k == "span_id" and len(v) <= _MAX_ID]
                if not span_ids:
                    continue
                totals.labelled_alloc_bytes += alloc[1]
                labels = dict(sample.labels)
                span_name = labels.get("span_name", "")[:MAX_NAME]
                slo = labels.get("slo")
                kept = self._frames.keep(sample.stack)
                if any(alloc):
                    if span_name:
                        for index, kind in enumerate(("alloc_objects", "alloc_space")):
                            if alloc[index]:
                                self._comparisons[kind].add(kept, alloc[index], span_name, slo)
                    for span_id in dict.fromkeys(span_ids):
                        self._add_alloc(span_id, span_name, kept, alloc)
                if any(inuse):
                    for span_id in dict.fromkeys(span_ids):
                        self._add_inuse(snapshot, span_id, span_name, slo, kept, inuse)

    def _add_alloc(
        self, span_id: str, span_name: str, stack: _Stack, values: tuple[int, int]
    ) -> None:
        span = self._alloc.get(span_id)
        if span is None:
            span = self._alloc[span_id] = _Span(span_name)
            self._charge_alloc(span, _SPAN_OVERHEAD + len(span_id) + len(span_name))
            while len(self._alloc) > self._max_spans:
                self._evict_span()
        else:
            self._alloc.move_to_end(span_id)
        cost = _merge(span, stack, values, self._max_stacks)
        if cost:
            self._charge_alloc(span, cost)

    def _charge_alloc(self, span: _Span, cost: int) -> None:
        span.cost += cost
        self._alloc_bytes += cost

    def _add_inuse(
        self,
        snapshot: _Snapshot,
        span_id: str,
        span_name: str,
        slo: str | None,
        stack: _Stack,
        values: tuple[int, int],
    ) -> None:
        span = snapshot.spans.get(span_id)
        if span is None:
            if len(snapshot.spans) >= self._max_spans:
                return  # a snapshot of more spans than the store keeps: the rest are not shown
            span = snapshot.spans[span_id] = _Span(span_name, slo if slo in SIDES else None)
            snapshot.cost += _SPAN_OVERHEAD + len(span_id) + len(span_name)
        snapshot.cost += _merge(span, stack, values, self._max_stacks)

    def _evict_span(self) -> None:
        _span_id, span = self._alloc.popitem(last=False)
        self._alloc_bytes -= span.cost
        self._totals.evicted_spans += 1

    def _evict_snapshot(self) -> None:
        _key, snapshot = self._snapshots.popitem(last=False)
        self._snapshot_bytes -= snapshot.cost
        self._totals.evicted_snapshots += 1

    def _kept_bytes(self) -> int:
        return self._alloc_bytes + self._snapshot_bytes + self._frames.bytes

    def _enforce_bytes(self) -> None:
        """Past ``max_bytes``, drop the oldest span ids, then the oldest snapshots, to 3/4."""
        if self._kept_bytes() <= self._max_bytes:
            return
        target = self._max_bytes * 3 // 4
        while True:
            # Frames of dropped stacks stay counted until compacted: compact, then re-check.
            self._frames.compact(self._all_stacks())
            if self._kept_bytes() <= target or not (self._alloc or self._snapshots):
                return
            while self._alloc and self._kept_bytes() > target:
                self._evict_span()
            if not self._alloc and self._snapshots and self._kept_bytes() > target:
                self._evict_snapshot()

    def _all_stacks(self) -> Iterable[_Stack]:
        for span in self._alloc.values():
            yield from span.stacks
        for snapshot in self._snapshots.values():
            for span in snapshot.spans.values():
                yield from span.stacks

    # -- queries -----------------------------------------------------------------------------

    def allocated_bytes(self, span_id: str) -> int:
        """Bytes ``span_id`` allocated, from the memory profiles received (0 when none)."""
        with self._lock:
            span = self._alloc.get(span_id)
            return span.total[1] if span is not None else 0

    def stacks(self, span_id: str, kind: str) -> dict[_Stack, int]:
        """``span_id``'s stacks with their ``kind`` value (one of ``MEMORY_KINDS``).

        Allocations since the span's first upload; in-use memory from the latest snapshot of
        every series, added up.
        """
        position = _ROW[kind]
        out: dict[_Stack, int] = {}
        with self._lock:
            if kind.startswith("alloc_"):
                spans = [self._alloc.get(span_id)]
            else:
                spans = [snapshot.spans.get(span_id) for snapshot in self._snapshots.values()]
            for span in spans:
                if span is None:
                    continue
                for stack, row in span.stacks.items():
                    if row[position]:
                        out[stack] = out.get(stack, 0) + row[position]
        return out

    def pprof(self, span_id: str, kind: str, labels: Sequence[tuple[str, str]]) -> bytes | None:
        """``span_id``'s memory as a gzip-compressed pprof, the way Go heap profiles come.

        Four sample types: ``alloc_objects`` and ``alloc_space`` (since the span's first
        upload), ``inuse_objects`` and ``inuse_space`` (the latest snapshots); period type
        ``space/bytes``; ``kind`` (one of ``MEMORY_KINDS``) is the type a viewer shows first.
        Every sample carries ``labels``. ``None`` when nothing of the span was received.
        """
        rows: dict[_Stack, list[int]] = {}
        with self._lock:
            alloc = self._alloc.get(span_id)
            sources = [(0, alloc)] + [
                (2, snapshot.spans.get(span_id)) for snapshot in self._snapshots.values()
            ]
            for offset, span in sources:
                if span is None:
                    continue
                for stack, (objects, size) in span.stacks.items():
                    row = rows.get(stack)
                    if row is None:
                        row = rows[stack] = [0, 0, 0, 0]
                    row[offset] += objects
                    row[offset + 1] += size
            period = self._period
        if not rows:
            return None
        builder = ProfileBuilder(
            MEMORY_SAMPLE_TYPES,
            MEMORY_PERIOD_TYPE,
            period,
            comments=(f"spanprof local mode: memory of span {span_id}",),
            default_sample_type=kind,
        )
        for stack, row in rows.items():
            builder.add(stack, row, labels)
        return gzip.compress(builder.build(), mtime=0)

    def inuse_at(self) -> float | None:
        """When the newest in-use snapshot arrived (Unix seconds), if any did."""
        with self._lock:
            times = [snapshot.received_at for snapshot in self._snapshots.values()]
        return max(times) if times else None

    def comparison(self, kind: str) -> SloComparison:
        """The breach-vs-ok comparison of the allocations (``alloc_space``/``alloc_objects``)."""
        return self._comparisons[kind]

    def inuse_routes(self) -> list[str]:
        """The routes (``span_name``) with memory in use in a snapshot, by name."""
        with self._lock:
            return sorted(
                {
                    span.span_name
                    for snapshot in self._snapshots.values()
                    for span in snapshot.spans.values()
                    if span.span_name
                }
            )

    def inuse_sides(
        self, route: str, kind: str, verdict: Callable[[str], bool | None]
    ) -> dict[str, dict[_Stack, int]] | None:
        """``route``'s in-use memory by side: its ``slo`` label, else ``verdict(span_id)``.

        ``verdict`` says whether a span breached (``None``: not known, not counted). ``None``
        when no snapshot holds memory of ``route``.
        """
        position = _ROW[kind]
        with self._lock:
            rows = [
                (span_id, span.slo, dict(span.stacks))
                for snapshot in self._snapshots.values()
                for span_id, span in snapshot.spans.items()
                if span.span_name == route
            ]
        if not rows:
            return None
        sides: dict[str, dict[_Stack, int]] = {side: {} for side in SIDES}
        for span_id, slo, stacks in rows:
            if slo is None:
                breached = verdict(span_id)
                if breached is None:
                    continue
                slo = SIDES[0] if breached else SIDES[1]
            side = sides[slo]
            for stack, row in stacks.items():
                if row[position]:
                    side[stack] = side.get(stack, 0) + row[position]
        return sides

    def status(self) -> dict[str, Any]:
        """Counters for the page's status line and for tests."""
        with self._lock:
            totals = self._totals
            return {
                "pushes": totals.pushes,
                "alloc_bytes": totals.alloc_bytes,
                "labelled_alloc_bytes": totals.labelled_alloc_bytes,
                "spans_with_allocations": len(self._alloc),
                "inuse_snapshots": len(self._snapshots),
                "inuse_bytes": sum(
                    span.total[1]
                    for snapshot in self._snapshots.values()
                    for span in snapshot.spans.values()
                ),
                "evicted_spans": totals.evicted_spans,
                "evicted_snapshots": totals.evicted_snapshots,
                "malformed_samples": totals.malformed_samples,
                "kept_bytes": self._kept_bytes(),
            }


def _merge(span: _Span, stack: _Stack, values: tuple[int, int], max_stacks: int) -> int:
    """Add ``values`` to ``span``'s row of ``stack``; the bytes that added (new rows)."""
    stacks = span.stacks
    row = stacks.get(stack)
    cost = 0
    if row is None:
        if len(stacks) >= max_stacks:
            stack = TRUNCATED
            row = stacks.get(stack)
        if row is None:
            row = stacks[stack] = [0, 0]
            cost = stack_cost(stack) + _ROW_OVERHEAD
    row[0] += values[0]
    row[1] += values[1]
    span.total[0] += values[0]
    span.total[1] += values[1]
    return cost
