"""The thread every exporter runs: one window per interval, retries in between, a bounded flush.

``IntervalExporter`` owns the thread, the queue of encoded windows waiting for their endpoint
and the shutdown budget; an exporter (``Pusher``, ``OtlpExporter``) says how a window is
encoded (``_export``) and sent (``_send_pending``). No exception ends the thread: an
unexpected one goes to ``_unexpected`` (logged once, counted), and the next interval's window
is taken as usual, so the sampler's window never grows past one interval.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._window import Window
from ._fanout import run_thread_init
from ._http import Poster

__all__ = ["IntervalExporter", "Payload"]


@dataclass
class Payload:
    """One encoded window waiting for its endpoint, and how often it was tried."""

    body: bytes
    attempts: int = 0


class IntervalExporter:
    """The export thread's loop; subclasses call ``_init_interval`` and fill in the hooks."""

    #: The thread's name (in thread dumps and py-spy).
    thread_name = "spanprof-exporter"
    #: Why windows still waiting at shutdown were dropped, as the log line says it.
    gone_at_shutdown = "the endpoint did not answer before shutdown"

    upload_interval: float
    timeout: float
    flush_timeout: float
    backoff_max: float
    max_pending: int
    _poster: Poster

    def _init_interval(
        self, *, upload_interval: float, timeout: float, flush_timeout: float, backoff_max: float
    ) -> None:
        self.upload_interval = upload_interval
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        self.backoff_max = backoff_max
        self._queue: collections.deque[Payload] = collections.deque()
        self._retry_at = 0.0
        self._stop_deadline = float("inf")
        self._collect: Callable[[], Window] | None = None
        self._thread_init: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(
        self, collect: Callable[[], Window], thread_init: Callable[[], None] | None = None
    ) -> None:
        """Start the export thread; ``collect()`` hands over the samples of each interval.

        ``thread_init()``, if given, runs first in the thread (the exact backend keeps the
        thread's allocations out of the memory profile with it).
        """
        self._collect = collect
        self._thread_init = thread_init
        self._stop.clear()
        self._stop_deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Send the last window and whatever waits for a retry (within ``flush_timeout``)."""
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        # The flush, a post in flight included, has flush_timeout from now.
        self._stop_deadline = time.monotonic() + self.flush_timeout
        self._poster.cut(self._stop_deadline)
        self._stop.set()
        # The flush's posts time out within flush_timeout too (see _run).
        thread.join(2 * self.flush_timeout + 1.0)

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        run_thread_init(self._thread_init)
        next_upload = time.monotonic() + self.upload_interval
        while True:
            wake_at = next_upload
            if self._queue:
                wake_at = min(wake_at, self._retry_at)
            if self._stop.wait(max(0.0, wake_at - time.monotonic())):
                break
            now = time.monotonic()
            try:
                if now >= next_upload:
                    next_upload += self.upload_interval
                    if next_upload <= now:
                        next_upload = now + self.upload_interval
                    self._export()
                if self._queue and time.monotonic() >= self._retry_at:
                    self._send_pending(deadline=None)
            except Exception:
                # Whatever it was, the next interval's window is taken on time: the sampler's
                # window must not grow because its exporter died.
                self._unexpected()
                self._retry_at = time.monotonic() + self.backoff_max
        try:
            # The last window: no post may outlast the flush budget.
            self.timeout = min(self.timeout, self.flush_timeout)
            self._poster.close()
            self._export()
            self._send_pending(deadline=self._stop_deadline)
        except Exception:
            self._unexpected()
        if self._queue:
            self._drop(len(self._queue), self.gone_at_shutdown)
            self._queue.clear()
        self._poster.close()
        self._finish()

    # --- what an exporter fills in --------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The exporter's counters (each exporter names its own keys)."""
        raise NotImplementedError

    def _export(self) -> None:
        """Take the interval's window, encode it, queue it (``_enqueue``)."""
        raise NotImplementedError

    def _send_pending(self, *, deadline: float | None) -> None:
        """Send what is queued; ``deadline`` set: retries wait, until then (the flush)."""
        raise NotImplementedError

    def _unexpected(self) -> None:
        """An exception nobody expected escaped an export: count it, log it once."""
        raise NotImplementedError

    def _drop(self, count: int, why: str) -> None:
        """``count`` windows are lost because ``why``: count them, log it once."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Last thing the thread does (an exporter's own transport to close)."""
