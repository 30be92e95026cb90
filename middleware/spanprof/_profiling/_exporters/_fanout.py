"""One sampler, several exporters: every exporter sees every sample exactly once.

Each exporter runs its own thread and asks for a window once per upload interval. The first to
ask takes the sampler's window and leaves it for the others; an exporter that finds windows left
for it takes those instead of draining the sampler, so with equal intervals each interval's
window is taken once and read by all. A stuck exporter's backlog is merged into one window (same
stack tables) or, past ``max_backlog``, its oldest window is dropped and counted. Merged memory
windows add their allocations up and keep the newer in-use snapshot.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..._logging import log_once
from .._window import MemoryWindow, Window

__all__ = ["WindowExporter", "WindowFanout", "run_thread_init", "stop_all"]

_K = TypeVar("_K")


class WindowExporter(Protocol):
    """What the exact backend needs of an exporter (``Pusher``, ``OtlpExporter``)."""

    def start(
        self, collect: Callable[[], Window], thread_init: Callable[[], None] | None = None
    ) -> None: ...

    def stop(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


def run_thread_init(thread_init: Callable[[], None] | None) -> None:
    """Run an exporter's ``thread_init`` first thing in its thread: a failure is logged once
    and the thread goes on (it only loses what the init would have set up)."""
    if thread_init is None:
        return
    try:
        thread_init()
    except Exception:
        log_once("exporter-thread-init", "spanprof: an export thread's setup failed")


def _sum(first: dict[_K, int], second: dict[_K, int]) -> dict[_K, int]:
    total = dict(first)
    for key, value in second.items():
        total[key] = total.get(key, 0) + value
    return total


def _merge(first: Window, second: Window) -> Window:
    """``first`` and the window taken after it, as one."""
    values = _sum(first.values, second.values)
    end_ns = max(first.end_ns, second.end_ns)
    foreign = {**first.foreign, **second.foreign}  # their ids are unique in the process
    if isinstance(first, MemoryWindow) and isinstance(second, MemoryWindow):
        # Allocations add up; what is in use is a snapshot at the end: the newer one.
        return MemoryWindow(
            first.start_ns,
            first.tables,
            values,
            end_ns,
            foreign,
            alloc_objects=_sum(first.alloc_objects, second.alloc_objects),
            inuse=second.inuse,
        )
    return Window(first.start_ns, first.tables, values, end_ns, foreign)


class WindowFanout:
    """Hands each of ``consumers`` exporters every window ``take_window`` returns.

    ``collector(i)`` is what exporter ``i`` calls instead of ``take_window``. Windows are shared,
    never copied: exporters only read them.
    """

    def __init__(
        self, take_window: Callable[[], Window], consumers: int, *, max_backlog: int = 8
    ) -> None:
        self._take = take_window
        self._lock = threading.Lock()
        self._backlogs: list[collections.deque[Window]] = [
            collections.deque() for _ in range(consumers)
        ]
        self.max_backlog = max_backlog
        self.dropped = 0

    def collector(self, index: int) -> Callable[[], Window]:
        """The ``collect`` callable of exporter ``index`` (``take_window`` itself when alone)."""
        if len(self._backlogs) == 1:
            return self._take
        return lambda: self._collect(index)

    def _collect(self, index: int) -> Window:
        with self._lock:
            backlog = self._backlogs[index]
            if not backlog:
                window = self._take()
                for i, other in enumerate(self._backlogs):
                    if i != index:
                        self._leave(other, window)
                return window
            window = backlog.popleft()
            # Whatever else waits (a stuck exporter's backlog) goes out together, when it can.
            while backlog and backlog[0].tables is window.tables:
                window = _merge(window, backlog.popleft())
            return window

    def _leave(self, backlog: collections.deque[Window], window: Window) -> None:
        if backlog and backlog[-1].tables is window.tables and len(backlog) >= 2:
            # Keep the backlog short: a stuck exporter gets one merged window per table swap.
            backlog.append(_merge(backlog.pop(), window))
        else:
            backlog.append(window)
        while len(backlog) > self.max_backlog:
            backlog.popleft()
            self.dropped += 1


def stop_all(exporters: list[WindowExporter]) -> None:
    """Stop (and flush) every exporter at once: shutdown waits for the slowest, not the sum."""
    if len(exporters) == 1:
        exporters[0].stop()
        return
    threads = [
        threading.Thread(target=exporter.stop, name="spanprof-exporter-stop", daemon=True)
        for exporter in exporters
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
