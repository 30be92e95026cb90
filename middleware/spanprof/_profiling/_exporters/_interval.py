"""The thread every exporter runs: one window per interval, retries in between, a bounded flush.

``IntervalExporter`` owns the thread, the queue of encoded windows waiting for their endpoint
(at most ``max_pending``: the oldest is dropped, and counted, to make room), the retries with
exponential back-off and the shutdown budget; an exporter (``Pusher``, ``OtlpExporter``) says
how a window is encoded (``_encode``) and posted (``_post``), and how its messages read
(``Wording``). No exception ends the thread: an unexpected one is logged once and counted
(``errors``), and the next interval's window is taken as usual, so the sampler's window never
grows past one interval.
"""

from __future__ import annotations

import collections
import http.client
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..._logging import log_once
from .._window import Window
from ._fanout import run_thread_init
from ._http import Answer, Poster
from ._steps import StepTimer

__all__ = ["IntervalExporter", "Outcome", "Payload", "Wording"]

#: What a post came to: sent, worth another try later, or refused for good.
Outcome = Literal["ok", "retry", "reject"]


@dataclass(frozen=True)
class Wording:
    """How an exporter's log lines name things."""

    #: ``log_once`` keys start with this.
    key: str
    #: What is encoded ("a profile window"), plural ("profile windows").
    window: str
    windows: str
    #: One post ("a profile upload").
    post: str
    #: What sending is called ("pushing profiles", in "... to URL failed").
    sending: str
    #: The thread ("uploader"), and the far side ("server").
    sender: str
    peer: str
    #: The stats() key of the drop counter.
    dropped_key: str


@dataclass
class Payload:
    """One encoded window waiting for its endpoint, and how often it was tried."""

    body: bytes
    attempts: int = 0


class IntervalExporter:
    """The export thread's loop; subclasses call ``_init_interval`` and fill in the hooks."""

    #: The thread's name (in thread dumps and py-spy).
    thread_name = "spanprof-exporter"

    wording = Wording(
        key="export",
        window="a profile window",
        windows="profile windows",
        post="a profile export",
        sending="exporting profiles",
        sender="exporter",
        peer="endpoint",
        dropped_key="dropped",
    )
    url: str
    _poster: Poster

    def _init_interval(
        self,
        *,
        upload_interval: float,
        timeout: float,
        flush_timeout: float,
        max_pending: int,
        backoff_initial: float,
        backoff_max: float,
    ) -> None:
        self.upload_interval = upload_interval
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        self.max_pending = max_pending
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.uploads = 0
        self.failures = 0
        self.retries = 0
        self.dropped = 0
        self.rejected = 0
        self.errors = 0
        self.empty_windows = 0
        self.bytes_sent = 0
        self.last_status: int | None = None
        self._steps = StepTimer()
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
        self._cut(self._stop_deadline)
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
            self._drop(len(self._queue), f"the {self.wording.peer} did not answer before shutdown")
            self._queue.clear()
        self._poster.close()
        self._finish()

    # --- one interval -------------------------------------------------------------------------

    def _export(self) -> None:
        collect = self._collect
        if collect is None:
            return
        wording = self.wording
        try:
            window = collect()
            # A memory window may hold in-use memory only: len() counts both.
            if not window:
                self.empty_windows += 1
                return
            body = self._encode(window)
        except Exception:
            log_once(
                f"{wording.key}-encode",
                f"spanprof: encoding {wording.window} failed; it was dropped (logged once)",
            )
            self.dropped += 1
            return
        if len(self._queue) >= self.max_pending:
            self._queue.popleft()
            self._drop(1, f"{self.max_pending} windows already wait for the {wording.peer}")
        self._queue.append(Payload(body))

    def _send_pending(self, *, deadline: float | None) -> None:
        """Send what is queued; with ``deadline`` (the flush), retries wait until then."""
        wording = self.wording
        while self._queue:
            payload = self._queue[0]
            try:
                outcome, detail, wait = self._post(payload.body)
            except Exception as exc:
                # Not the network's fault: sending the same bytes again would fail the same way.
                self._unexpected()
                self._queue.popleft()
                self._drop(1, f"sending failed unexpectedly ({type(exc).__name__}: {exc})")
                continue
            if outcome == "ok":
                self._queue.popleft()
                self.uploads += 1
                self.bytes_sent += len(payload.body)
                continue
            if outcome == "reject":
                self._queue.popleft()
                self.rejected += 1
                self._rejected(detail)
                continue
            self.failures += 1
            payload.attempts += 1
            # The exponent is capped: an idle process retries its one window for as long as the
            # endpoint is away, and 2 ** 1024 overflows a float (past backoff_max long before).
            doublings = min(payload.attempts - 1, 64)
            delay = min(self.backoff_max, self.backoff_initial * 2**doublings)
            delay *= random.uniform(0.8, 1.2)
            if wait is not None:
                delay = max(delay, wait)
            log_once(
                f"{wording.key}-failed",
                f"spanprof: {wording.sending} to {self.url} failed ({detail}); retrying with "
                f"back-off, keeping at most {self.max_pending} windows (logged once)",
                exc_info=False,
            )
            if deadline is None:
                self._retry_at = time.monotonic() + delay
                self.retries += 1
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (wait is not None and remaining <= delay):
                # Shutting down: a retry the endpoint asks us to delay past the budget is lost.
                return
            self.retries += 1
            time.sleep(min(delay, remaining))

    def _post_http(self, body: bytes) -> Answer | str:
        """Post ``body`` under one deadline (``timeout``, cut by ``stop()``): the answer, or
        why none came (a detail for the retry's log line)."""
        deadline = min(time.monotonic() + self.timeout, self._stop_deadline)
        try:
            answer = self._poster.post(body, deadline)
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                return f"no answer within {self.timeout:g} s ({exc or 'timeout'})"
            return f"{type(exc).__name__}: {exc}"
        self.last_status = answer.status
        return answer

    def _unexpected(self) -> None:
        self.errors += 1
        self._poster.close()
        log_once(
            f"{self.wording.key}-error",
            f"spanprof: {self.wording.sending} to {self.url} failed unexpectedly; the "
            f"{self.wording.sender} goes on with the next window (logged once)",
        )

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        log_once(
            f"{self.wording.key}-dropped",
            f"spanprof: dropped {self.wording.windows} because {why}; see "
            f"stats()['{self.wording.dropped_key}'] (logged once)",
            exc_info=False,
        )

    def _rejected(self, detail: str) -> None:
        log_once(
            f"{self.wording.key}-rejected-{detail}",
            f"spanprof: {self.url} rejected {self.wording.post} ({detail}); it was dropped "
            "(logged once)",
            exc_info=False,
        )

    # --- what an exporter fills in --------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The exporter's counters (each exporter names its own keys)."""
        raise NotImplementedError

    def _encode(self, window: Window) -> bytes:
        """The body that carries ``window``, encoded in timed steps (``self._steps``)."""
        raise NotImplementedError

    def _post(self, body: bytes) -> tuple[Outcome, str, float | None]:
        """Post ``body`` once: what came of it, a detail for the log, and how long the
        endpoint asked to wait before another try (``None``: it did not say)."""
        raise NotImplementedError

    def _cut(self, deadline: float) -> None:
        """From ``stop()``: no post in flight may outlast ``deadline`` (monotonic)."""
        self._poster.cut(deadline)

    def _finish(self) -> None:
        """Last thing the thread does (an exporter's own transport to close)."""
