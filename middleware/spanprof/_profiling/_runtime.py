"""Profiler lifecycle per process: start once (after any fork), feed the engine, flush at exit."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from .. import _process
from .._labels._backend import EndsSpans, PreparesInMainThread, ProfilerBackend, SpanUsage
from .._labels._engine import (
    Mechanism,
    install_label_engine,
    installed_backend,
    uninstall_label_engine,
)
from .._labels._greenlets import (
    greenlets_in_use,
    install_greenlet_hooks,
    uninstall_greenlet_labels,
)
from .._logging import log_once, logger
from .._process import current_pid
from ._pyroscope import PyroscopeBackend
from ._samplers._signal import in_main_os_thread

__all__ = ["SHUTDOWN_TIMEOUT_SECONDS", "ProfilerRuntime", "stop_started"]

# A flush to an endpoint that accepts but never answers would otherwise hold the server's
# graceful shutdown hostage (measured: pyroscope-io's shutdown() blocks for good).
SHUTDOWN_TIMEOUT_SECONDS = 5.0


# Runtimes started in this process, for whoever must flush them without a server shutdown event
# (local mode under a WSGI server).
_started: weakref.WeakSet[ProfilerRuntime] = weakref.WeakSet()


def stop_started() -> None:
    """Stop (uninstall and flush) every runtime started in this process."""
    for runtime in list(_started):
        runtime.stop()


class ProfilerRuntime:
    """Starts ``backend`` and the label engine once per process; stops them on request.

    Remembers the pid it started in, so a worker forked after a start (gunicorn's
    ``preload_app``, a request served by a master) starts its own profiler instead of trusting
    the parent's, which the agent does not carry over a fork. ``mechanism`` is how the engine
    follows context switches (``install_label_engine``'s; ``None``: its default).
    """

    def __init__(
        self,
        backend: ProfilerBackend | None,
        *,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT_SECONDS,
        mechanism: Mechanism | None = None,
    ) -> None:
        self.backend = backend
        self.mechanism = mechanism
        self.shutdown_timeout = shutdown_timeout
        self._lock = threading.Lock()
        self._pid: int | None = None
        #: The backend's ``end_span`` (``EndsSpans``), looked up once, or ``None``: the request
        #: path (``_web._usage.end_span``) calls it itself, logging a failure with
        #: ``end_span_failed``, so that no frame of the runtime's stands between them.
        self.span_ender: Callable[[str, bool | None], SpanUsage | None] | None = (
            backend.end_span if isinstance(backend, EndsSpans) else None
        )

    @property
    def started(self) -> bool:
        """Whether the backend runs in this process."""
        return self._pid == current_pid()

    def ensure_started(self) -> None:
        """Start if this process has not started yet; cheap when it has."""
        # current_pid() read in place (its cache, else the call): the request path calls this
        # on every request, and a Python frame costs it about 1,000 instructions.
        if self.backend is not None and self._pid != (_process.cached_pid or current_pid()):
            self.start()

    def prepare(self) -> None:
        """In the main thread, let the backend prepare a later ``start`` from another thread.

        The WSGI middleware calls this when it is built; threaded servers build it in the main
        thread and start it on their first request, in a pool thread. Does nothing in other
        threads or for backends with nothing to prepare; failures are logged, not raised.
        """
        backend = self.backend
        if not isinstance(backend, PreparesInMainThread) or not in_main_os_thread():
            return
        try:
            backend.prepare()
        except Exception:
            log_once(
                f"backend-prepare-{id(backend)}",
                "spanprof: the profiler backend failed to prepare in the main thread; it may "
                "fall back when a pool thread starts it (logged once)",
            )

    def start(self) -> None:
        """Start the backend and install the label engine; failures are logged, not raised."""
        backend = self.backend
        if backend is None:
            return
        with _cooperatively(self._lock):
            pid = os.getpid()
            if self._pid == pid:
                return
            try:
                backend.start()
            except Exception:
                log_once(
                    f"backend-start-{id(backend)}",
                    "spanprof: the profiler backend failed to start; requests are served "
                    "without profiles (logged once)",
                )
            else:
                install_label_engine(backend, mechanism=self.mechanism)
                _started.add(self)
                _follow_greenlets()
                if isinstance(backend, PyroscopeBackend):
                    # The exact backend says what it runs itself; the agent asked for directly
                    # says nothing of its own.
                    logger.info(
                        "spanprof: profiling with pyroscope-io and the label engine (pid %d), as "
                        "configured; samples may carry the labels of whatever ran ~0.2 ms after "
                        "the stack was read, and carry no slo label (unset SPANPROF_PROFILER for "
                        "the exact sampler)",
                        pid,
                    )
            finally:
                # Set last: until the engine feeds the backend, other threads' first requests
                # wait in ensure_started() instead of setting labels nobody pushes.
                self._pid = pid

    def end_span_failed(self) -> None:
        """Log (once) that the backend's ``end_span`` raised."""
        log_once(
            f"backend-end-span-{id(self.backend)}",
            "spanprof: the profiler failed to take a request's SLO verdict; its samples go "
            "out without the slo label (logged once)",
        )

    def stop(self) -> None:
        """Uninstall the engine (if it feeds this backend) and flush the backend."""
        backend = self.backend
        if backend is None:
            return
        with _cooperatively(self._lock):
            if self._pid != os.getpid():
                return
            self._pid = None
            _started.discard(self)
            if installed_backend() is backend:
                uninstall_label_engine()
                _unfollow_greenlets()
        if not _call_with_timeout(backend.shutdown, self.shutdown_timeout):
            log_once(
                f"backend-shutdown-timeout-{id(backend)}",
                f"spanprof: the profiler did not flush within {self.shutdown_timeout:g} s "
                "(profile endpoint unreachable?); shutting down without it",
                exc_info=False,
            )


@contextlib.contextmanager
def _cooperatively(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock``, waiting for it in short sleeps rather than one blocking acquire.

    Under gevent with a preloaded app the lock was made before monkey patching: a real OS lock,
    shared by every greenlet of the worker's one thread. The first request holds it while the
    backend starts and yields (its upload "thread" is a greenlet); a second request blocking on
    it would block that thread, and with it the first request, for good. ``time.sleep`` yields
    to other greenlets there, and costs a thread a millisecond at most, once per process.
    """
    while not lock.acquire(blocking=False):
        time.sleep(0.001)
    try:
        yield
    finally:
        lock.release()


# Whether the greenlet hooks in place were put there by a runtime, not by the app's own
# install_greenlet_labels(): the runtime that uninstalls the engine they feed takes them out
# (whichever runtime installed them: the engine is one per process, and so are they).
_greenlet_hooks_installed = False


def _follow_greenlets() -> None:
    # Greenlets switch requests on one OS thread without the engine seeing it: follow the
    # switches (and let spawned greenlets inherit labels) with no call needed from the app.
    global _greenlet_hooks_installed
    try:
        if greenlets_in_use() and install_greenlet_hooks():
            _greenlet_hooks_installed = True
    except Exception:
        log_once(
            "greenlet-labels",
            "spanprof: could not follow greenlet switches; requests served by greenlets may "
            "carry each other's labels (logged once)",
        )


def _unfollow_greenlets() -> None:
    # A stopped runtime leaves no tracer pushing labels on every switch, and no spawn callback
    # copying them into every new greenlet's context.
    global _greenlet_hooks_installed
    if not _greenlet_hooks_installed:
        return
    _greenlet_hooks_installed = False
    try:
        uninstall_greenlet_labels()
    except Exception:
        log_once(
            "greenlet-labels-uninstall",
            "spanprof: could not remove the greenlet switch hooks (logged once)",
        )


def _call_with_timeout(call: Callable[[], None], timeout: float) -> bool:
    """Run ``call`` on a daemon thread; ``False`` if it did not return within ``timeout``."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        except Exception:
            log_once(
                f"backend-shutdown-{id(call)}",
                "spanprof: the profiler backend failed to shut down cleanly (logged once)",
            )
        finally:
            done.set()

    threading.Thread(target=run, name="spanprof-shutdown", daemon=True).start()
    return done.wait(timeout)
