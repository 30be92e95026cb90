"""An in-memory profiler backend that records which labels each thread runs with."""

from __future__ import annotations

import threading
from collections import deque

from ._labelset import EMPTY, LabelSet

__all__ = ["RecorderBackend"]


class RecorderBackend:
    """A profiler backend for tests: remembers each thread's current labels and every switch.

    Plug it into the label engine (or a middleware's ``profiler=`` option) and ask, from any
    code, which labels the profiler would attach to a sample taken right now::

        with spanprof.testing.record_labels() as recorder:
            ...
            assert recorder.thread_labels() == spanprof.current_labels()

    Arguments:
        max_switches: how many label switches to keep in ``switches`` (oldest dropped first).
    """

    def __init__(self, *, max_switches: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._threads: dict[int, LabelSet] = {}
        self.switches: deque[tuple[int, LabelSet]] = deque(maxlen=max_switches)
        self.started = 0
        self.stopped = 0

    def start(self) -> None:
        """Count a start."""
        with self._lock:
            self.started += 1

    def shutdown(self) -> None:
        """Count a shutdown."""
        with self._lock:
            self.stopped += 1

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """Record that the calling thread now runs with ``current``."""
        ident = threading.get_ident()
        with self._lock:
            if current:
                self._threads[ident] = current
            else:
                self._threads.pop(ident, None)
            self.switches.append((ident, current))

    def thread_labels(self, thread_id: int | None = None) -> LabelSet:
        """The labels a sample of ``thread_id`` (default: the calling thread) would carry now."""
        ident = threading.get_ident() if thread_id is None else thread_id
        with self._lock:
            return self._threads.get(ident, EMPTY)

    def labelled_threads(self) -> dict[int, LabelSet]:
        """Every thread that currently carries labels; empty when nothing leaked."""
        with self._lock:
            return dict(self._threads)

    @property
    def labels_seen(self) -> list[LabelSet]:
        """Every distinct non-empty label set any thread switched to, in first-seen order."""
        with self._lock:
            switches = list(self.switches)
        return list(dict.fromkeys(labels for _, labels in switches if labels))

    def clear(self) -> None:
        """Forget recorded switches and thread labels."""
        with self._lock:
            self._threads.clear()
            self.switches.clear()
