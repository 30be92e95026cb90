"""Samples wait for their request's verdict: the ``slo`` label, known only when the span ends.

A request's CPU is sampled while it runs, but whether it breached its SLO is decided when its
response completes. ``SloHold`` sits between the sampler and the exporters: at each upload it
takes the sampler's window, labels every sample whose span has ended ``slo=breached`` or
``slo=ok``, and holds back the samples of spans still in flight. When such a span ends its held
samples go out, labelled, with the next upload; a span still running after ``max_windows``
uploads goes out without ``slo`` and is labelled nothing later. Samples without a ``span_id``
(background work) pass straight through.

Everything is bounded: the verdicts are kept for two uploads, the held samples up to
``max_held`` distinct (stack, labels) pairs (more pass through unlabelled, counted). Nothing is
lost or counted twice: every nanosecond the sampler booked leaves in exactly one upload.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from .._labels._labelset import LabelSet
from ._verdicts import Lookup, Verdicts
from ._window import Frame, MemoryWindow, StackTables, Window

__all__ = ["BREACHED", "OK", "SLO_LABEL", "SloHold"]

#: The label, and its two values.
SLO_LABEL = "slo"
BREACHED = "breached"
OK = "ok"

# Stacks held across a swap of the sampler's stack tables are carried as frames under ids
# below zero, unique in the process so that windows merged downstream never collide.
_foreign_ids = itertools.count(1)

_Key = tuple[int, LabelSet]
# id(labels) -> (labels, breached, labels with slo): one upload's labelled label sets.
_Labelled = dict[int, tuple[LabelSet, bool, LabelSet]]


class _Held:
    """The samples of one in-flight span, from the window (and tables) they were taken in."""

    __slots__ = ("age", "born", "objects", "tables", "values")

    def __init__(self, tables: StackTables, born: int) -> None:
        self.age = 0
        self.born = born
        self.tables = tables
        self.values: dict[_Key, int] = {}
        # Allocated objects, for memory windows (values are then allocated bytes).
        self.objects: dict[_Key, int] = {}


class SloHold:
    """Holds in-flight requests' samples until their span ends, then labels them with ``slo``.

    Arguments:
        take_window: the sampler's ``take_window``.
        max_windows: uploads a span's samples may wait for its verdict (default 2).
        max_held: distinct (stack, labels) pairs held at most; more pass through unlabelled.
        max_verdicts: verdicts kept per upload interval; more are forgotten (their samples go
            out unlabelled once they have waited ``max_windows`` uploads).
        verdicts: where the request path records verdicts, shared with other holds (the CPU
            and the memory one); one of its own by default, with ``max_verdicts``.

    ``end_span`` (or ``verdicts.record``) is called by the request path (any thread);
    ``take_window`` by the exporters.
    """

    def __init__(
        self,
        take_window: Callable[[], Window],
        *,
        max_windows: int = 2,
        max_held: int = 65536,
        max_verdicts: int = 262144,
        verdicts: Verdicts | None = None,
    ) -> None:
        if max_windows < 1:
            raise ValueError(f"max_windows: expected at least 1, got {max_windows}")
        self._take = take_window
        self.max_windows = max_windows
        self.max_held = max_held
        # A span that ended before an upload has every sample in that upload's window or,
        # booked late, in the next one: this hold looks verdicts up over its last two takes.
        self.verdicts = Verdicts(max_verdicts=max_verdicts) if verdicts is None else verdicts
        self._reader = self.verdicts.reader()
        self._held: dict[str, _Held] = {}
        self._held_keys = 0
        self._lock = threading.Lock()
        self._closing = False
        self.swapped_spans = 0
        self._takes = 0
        self.labelled_ns = 0
        self.released_ns = 0
        self.expired_ns = 0
        self.overflow_ns = 0
        self.held_peak = 0

    # --- the request's side -----------------------------------------------------------------

    def end_span(self, span_id: str, breached: bool | None) -> None:
        """The span ``span_id`` ended: ``breached`` is its SLO verdict (``None``: none)."""
        self.verdicts.record(span_id, breached)

    # --- the exporter's side ------------------------------------------------------------------

    def take_window(self) -> Window:
        """The sampler's next window, its ended spans' samples labelled, in-flight ones held."""
        with self._lock:  # exporters may ask from their own threads
            window = self._take()
            self._takes += 1
            memory = isinstance(window, MemoryWindow)
            out: Window
            if isinstance(window, MemoryWindow):
                # What is in use is a snapshot, not a delta: it is not held and gets no slo.
                out = MemoryWindow(
                    window.start_ns, window.tables, end_ns=window.end_ns, inuse=window.inuse
                )
                objects_in, objects = window.alloc_objects, out.alloc_objects
            else:
                out = Window(window.start_ns, window.tables, end_ns=window.end_ns)
                objects_in, objects = {}, {}
            # Rotate first: a verdict written from now on lands in what will be looked up next.
            verdict = self._reader.rotate()
            labelled: _Labelled = {}
            values = out.values
            # Closing: this is the last upload, so nothing waits any more.
            max_age = 0 if self._closing else self.max_windows

            def put(key: _Key, weight: int, count: int, ended: bool, breached: bool | None) -> None:
                sid, labels = key
                if ended and breached is not None:
                    labels = _with_verdict(labelled, labels, breached)
                    self.labelled_ns += weight
                key = (sid, labels)
                values[key] = values.get(key, 0) + weight
                if count:
                    objects[key] = objects.get(key, 0) + count

            # This upload's samples first: their keys are distinct, so each is one dict store.
            # A request keeps one label set object: decide once per object, not per sample.
            decisions: dict[int, LabelSet | _Held] = {}
            held_map = self._held
            for count, (key, weight) in enumerate(window.values.items()):
                labels = key[1]
                decision = decisions.get(id(labels))
                if decision is None:
                    decision = decisions[id(labels)] = self._decide(
                        labels, verdict, labelled, window.tables, max_age
                    )
                # One lookup (a key's hash calls LabelSet.__hash__, a Python method): None when
                # the key has no objects (CPU windows have none).
                found = objects_in.get(key) if memory else None
                allocated = 0 if found is None else found
                if isinstance(decision, LabelSet):
                    if decision is not labels:
                        self.labelled_ns += weight
                        key = (key[0], decision)
                    values[key] = weight
                    if found is not None:
                        objects[key] = found
                elif key in decision.values:  # held from an earlier upload too
                    decision.values[key] += weight
                    if allocated:
                        decision.objects[key] = decision.objects.get(key, 0) + allocated
                elif self._held_keys < self.max_held:
                    self._held_keys += 1
                    decision.values[key] = weight
                    if allocated:
                        decision.objects[key] = allocated
                else:  # full: let it go unlabelled
                    values[key] = weight
                    if found is not None:
                        objects[key] = found
                    self.overflow_ns += weight
                if count & 4095 == 4095:
                    time.sleep(0)  # a big window: let the application have the GIL
            # Samples held from earlier uploads: released once their span ended, or too old.
            for span_id in list(held_map):
                held = held_map[span_id]
                if held.born == self._takes:
                    continue  # held just now: it waits from the next upload on
                ended, breached = verdict(span_id)
                held.age += 1
                if not ended and held.age < max_age:
                    continue
                del held_map[span_id]
                self._held_keys -= len(held.values)
                for key, weight in held.values.items():
                    count = held.objects.get(key, 0)
                    if held.tables is not window.tables:
                        key = (_foreign(out, held.tables.stacks[key[0]]), key[1])
                    put(key, weight, count, ended, breached)
                    if ended:
                        self.released_ns += weight
                    else:
                        self.expired_ns += weight
            self.held_peak = max(self.held_peak, self._held_keys)
            return out

    def _decide(
        self,
        labels: LabelSet,
        verdict: Lookup,
        labelled: _Labelled,
        tables: StackTables,
        max_age: int,
    ) -> LabelSet | _Held:
        """Where a label set's samples go: these labels, the labelled ones, or a hold."""
        span_id = labels.get("span_id")
        if span_id is None:
            return labels
        ended, breached = verdict(span_id)
        if ended or not max_age:
            if breached is None:
                return labels
            return _with_verdict(labelled, labels, breached)
        pending = self._held.get(span_id)
        if pending is None:
            pending = self._held[span_id] = _Held(tables, self._takes)
        elif pending.tables is not tables:
            # Held across a table swap (one table per span): this upload's samples go now.
            self.swapped_spans += 1
            return labels
        return pending

    def close(self) -> None:
        """From now on every window carries everything: the exporters' last flush follows."""
        self._closing = True

    def stats(self) -> dict[str, float]:
        """What the hold labelled, released late, let go unlabelled, and holds now."""
        return {
            "slo_labelled_ms": self.labelled_ns / 1e6,
            "slo_released_ms": self.released_ns / 1e6,
            "slo_expired_ms": self.expired_ns / 1e6,
            "slo_overflow_ms": self.overflow_ns / 1e6,
            # Spans whose samples went out unlabelled because the sampler's stack tables were
            # reset while some of them were held.
            "slo_swapped_spans": self.swapped_spans,
            "slo_verdicts_dropped": self.verdicts.dropped,
            "slo_held_spans": len(self._held),
            "slo_held_samples": self._held_keys,
            "slo_held_peak": self.held_peak,
        }


def _with_verdict(cache: _Labelled, labels: LabelSet, breached: bool) -> LabelSet:
    """``labels`` plus ``slo``, made once per upload for each label set object and verdict."""
    # By the object's id, not its content: a content key hashes the label set, a Python call,
    # twice for every span. The entry keeps ``labels`` alive, so its id stays its own.
    entry = cache.get(id(labels))
    if entry is not None and entry[0] is labels and entry[1] is breached:
        return entry[2]
    merged = labels.merged({SLO_LABEL: BREACHED if breached else OK})
    cache[id(labels)] = (labels, breached, merged)
    return merged


def _foreign(window: Window, frames: tuple[Frame, ...]) -> int:
    sid = -next(_foreign_ids)
    window.foreign[sid] = frames
    return sid
