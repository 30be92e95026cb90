"""spanprof's own failures: logged once per kind, never raised into the application."""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["log_once", "logger", "reset_log_once"]

logger = logging.getLogger("spanprof")

_seen: set[str] = set()
_lock = threading.Lock()


def log_once(
    key: str, message: str, *, exc_info: bool = True, level: int = logging.WARNING
) -> None:
    """Log ``message`` the first time ``key`` is seen in this process, and never again.

    A broken profiler endpoint or backend fails on every request; one log line says so without
    turning the application's log into a flood.
    """
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    # Outside an except block there is no traceback to show: logging would print
    # "NoneType: None" under the message.
    logger.log(level, message, exc_info=exc_info and sys.exc_info()[1] is not None)


def reset_log_once() -> None:
    """Forget which failures were logged (for tests, and after fork)."""
    with _lock:
        _seen.clear()
