"""Greenlets: exact labels across greenlet switches, and gevent greenlets inherit them.

Under gevent (gunicorn's gevent worker, uWSGI's ``--gevent``) each request runs in its own
greenlet and all of a worker's greenlets share one OS thread, while the profiler keys labels by
OS thread. A greenlet switch is not an asyncio handle: the label engine does not see it, so the
labels of the request that switched out would stay on the thread's samples. ``greenlet.settrace``
reports every switch on the switching thread, with the target greenlet already running (its
context is the current one), so the hook pushes the target's labels there.

gevent starts every greenlet with an empty context (greenlet >= 1.0 gives each greenlet its own
``gr_context``). A gevent spawn callback gives a greenlet started by labelled code a context
holding those labels, as asyncio tasks inherit the labels of the code that created them. Only
spanprof's labels are carried over; other context variables keep gevent's semantics. Raw
``greenlet.greenlet`` objects (and eventlet's) are switched exactly but start unlabelled.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable
from typing import Any

from .._logging import log_once
from ._engine import apply, check_native_thread_state
from ._labelset import LABELS

__all__ = [
    "greenlets_in_use",
    "install_greenlet_hooks",
    "install_greenlet_labels",
    "uninstall_greenlet_labels",
]

_Trace = Callable[[str, Any], Any]

_lock = threading.Lock()
# Every tracer this module installed, on any thread: uninstalling deactivates them all.
_tracers: list[_SwitchTracer] = []
_spawn_hooked = False


class _SwitchTracer:
    """A ``greenlet.settrace`` callback: push the switched-to greenlet's labels, then chain."""

    __slots__ = ("active", "previous")

    def __init__(self, previous: _Trace | None) -> None:
        self.previous = previous
        self.active = True

    def __call__(self, event: str, args: Any) -> Any:
        # The target greenlet is current here and so is its context: LABELS.get() is its labels.
        if self.active and (event == "switch" or event == "throw"):
            apply(LABELS.get())
        previous = self.previous
        if previous is not None:
            return previous(event, args)
        return None


def _inherit_labels(glet: Any) -> None:
    """gevent spawn callback: runs in the starting greenlet, before ``glet`` first runs."""
    try:
        labels = LABELS.get()
        if not labels or glet.gr_context is not None:
            return
        # The child's first context, not a change of ours: nothing to reset.
        context = contextvars.Context()
        context.run(LABELS.set, labels)
        glet.gr_context = context
    except Exception:  # never fail a spawn: the child then starts unlabelled
        log_once(
            "greenlet-inherit",
            "spanprof: could not pass labels to a new greenlet; it runs unlabelled (logged once)",
        )


def greenlets_in_use() -> bool:
    """Whether requests here run in greenlets: gevent patched ``threading``, or the caller runs
    in a greenlet other than its thread's main one (uWSGI's ``--gevent``, eventlet).

    Only modules already imported are consulted: nothing is imported for this.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return True
    greenlet = sys.modules.get("greenlet")
    return greenlet is not None and greenlet.getcurrent().parent is not None


def install_greenlet_labels() -> None:
    """Keep profile labels exact across greenlet switches on the calling thread.

    The middlewares call it themselves when their profiler starts in a process that runs
    greenlets (``greenlets_in_use``); calling it explicitly stays possible and harmless.

    Call it in the thread that runs the greenlets (under gevent, the main thread of each worker;
    calling it in a gunicorn or uWSGI master before the fork also works, the hook survives
    it). Any ``greenlet.settrace`` callback already installed keeps being called. Also makes
    greenlets spawned by gevent inherit the labels of the code that started them. Installing
    again on the same thread does nothing.

    ```python
    # wsgi.py, served by gunicorn -k gevent
    spanprof.install_greenlet_labels()
    application = spanprof.WSGIProfilingMiddleware(get_wsgi_application())
    ```
    """
    install_greenlet_hooks()


def install_greenlet_hooks() -> bool:
    """``install_greenlet_labels``; ``True`` if it put anything in place that was not (the
    calling thread's tracer, gevent's spawn callback), for whoever must later take it out."""
    import greenlet

    global _spawn_hooked
    check_native_thread_state()
    installed = False
    with _lock:
        current = greenlet.gettrace()
        if isinstance(current, _SwitchTracer):
            installed = not current.active
            current.active = True
        else:
            tracer = _SwitchTracer(current)
            greenlet.settrace(tracer)
            _tracers.append(tracer)
            installed = True
        if not _spawn_hooked:
            try:
                from gevent import Greenlet
            except ImportError:  # plain greenlet (or eventlet): switches only
                pass
            else:
                Greenlet.add_spawn_callback(_inherit_labels)
                _spawn_hooked = True
                installed = True
    return installed


def uninstall_greenlet_labels() -> None:
    """Stop applying labels on greenlet switches (every thread) and stop gevent inheritance.

    On the calling thread the previous ``greenlet.settrace`` callback is restored if spanprof's
    is still the current one; elsewhere spanprof's callback only forwards to its predecessor.
    """
    import greenlet

    global _spawn_hooked
    with _lock:
        for tracer in _tracers:
            tracer.active = False
        current = greenlet.gettrace()
        if isinstance(current, _SwitchTracer):
            greenlet.settrace(current.previous)
            _tracers.remove(current)
        if _spawn_hooked:
            from gevent import Greenlet

            Greenlet.remove_spawn_callback(_inherit_labels)
            _spawn_hooked = False
