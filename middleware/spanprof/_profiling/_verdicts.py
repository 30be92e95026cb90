"""The SLO verdicts of ended spans, written once per request and read by every hold.

A request's span ends with one verdict, and both the CPU and the memory hold (``SloHold``) label
that span's samples with it. Each hold takes its windows on its own exporter's clock, so they
cannot share one pair of "this upload, the one before" dicts. Requests write one dict store into
the current *generation*; a hold that takes a window seals the current generation and looks
verdicts up in every generation sealed since its take before last: the two uploads' worth of
verdicts each hold kept in dicts of its own before, at one store per request instead of one per
hold (a method call on the request path, about 1,100 instructions).

Bounded: a generation holds at most ``max_verdicts`` (more are counted and forgotten), and at
most ``MAX_GENERATIONS`` are kept; a reader that stops taking loses the oldest, whose spans'
samples then go out unlabelled after waiting their uploads, as they would without a verdict.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["MAX_GENERATIONS", "Lookup", "VerdictReader", "Verdicts"]

#: Sealed generations kept at most: two readers taking in turn need four, and their clocks
#: drift.
MAX_GENERATIONS = 6

#: ``lookup(span_id)``: ``(True, verdict)`` for an ended span, ``(False, None)`` otherwise.
Lookup = Callable[[str], tuple[bool, "bool | None"]]


class Verdicts:
    """Ended spans' verdicts: ``True`` breached, ``False`` ok, ``None`` none (a websocket).

    ``record`` is called by the request path (any thread, no lock); readers (``reader()``)
    take them at their own pace.
    """

    def __init__(self, *, max_verdicts: int = 262144) -> None:
        self.max_verdicts = max_verdicts
        # Written by requests; a reader swaps in a new one under the lock. A request that read
        # the old one just before writes into the sealed generation, which every reader still
        # looks in at its next take: the verdict is late by one upload, never lost.
        self.current: dict[str, bool | None] = {}
        self.dropped = 0
        self._lock = threading.Lock()
        self._sealed: list[tuple[int, dict[str, bool | None]]] = []  # oldest first
        self._number = 0  # the current generation's
        self._readers: list[VerdictReader] = []

    def record(self, span_id: str, breached: bool | None) -> None:
        """The span ``span_id`` ended with ``breached``."""
        current = self.current
        if len(current) < self.max_verdicts:
            current[span_id] = breached
        else:
            self.dropped += 1

    def ended(self, span_id: str) -> bool:
        """Whether ``span_id`` ended recently: its verdict is still kept (a few uploads)."""
        if span_id in self.current:
            return True
        # A reader replaces or appends to the list under its lock: read a snapshot.
        return any(span_id in verdicts for _, verdicts in tuple(self._sealed))

    def reader(self) -> VerdictReader:
        """A new reader, which sees every verdict recorded from now on."""
        with self._lock:
            reader = VerdictReader(self, self._number - 1)
            self._readers.append(reader)
            return reader

    def _rotate(self, reader: VerdictReader) -> Lookup:
        with self._lock:
            sealed = self._number
            self._sealed.append((sealed, self.current))
            self.current = {}
            self._number += 1
            since = reader.marks[0]
            dicts = [d for n, d in reversed(self._sealed) if n > since]  # newest first
            reader.marks = (reader.marks[1], sealed)
            # What no reader will look in at its next take goes.
            oldest = min(r.marks[0] for r in self._readers)
            kept = [(n, d) for n, d in self._sealed if n > oldest]
            self._sealed = kept[-MAX_GENERATIONS:]

        def lookup(span_id: str) -> tuple[bool, bool | None]:
            for verdicts in dicts:
                if span_id in verdicts:
                    return True, verdicts[span_id]
            return False, None

        return lookup


class VerdictReader:
    """One hold's view of ``Verdicts``: what ended since its take before last."""

    __slots__ = ("_verdicts", "marks")

    def __init__(self, verdicts: Verdicts, start: int) -> None:
        self._verdicts = verdicts
        # The generations sealed at this reader's take before last and at its last take: at
        # its next take it looks in those after the first.
        self.marks = (start, start)

    def rotate(self) -> Lookup:
        """Seal what was recorded until now; a lookup over this take's and the last one's."""
        return self._verdicts._rotate(self)
