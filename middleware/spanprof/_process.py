"""This process's id, read without a system call each time: the request path asks per request.

``os.getpid()`` is a system call (glibc stopped caching it), about 0.16 µs here, and the
per-request checks "did this process start the profiler, or is it a forked child of one that
did" asked it twice per request. The id is read once and read again in every forked child by an
``os.register_at_fork`` handler, which ``os.fork`` and C servers that fork the way CPython asks
(``PyOS_AfterFork_Child``: gunicorn, uWSGI, multiprocessing) run before any code of the child's.
"""

from __future__ import annotations

import os

__all__ = ["cached_pid", "current_pid"]

#: This process's id once ``current_pid`` has read it, else 0. The hottest caller reads it in
#: place (``cached_pid or current_pid()``), a module attribute instead of a Python frame.
cached_pid = 0
_registered = False


def current_pid() -> int:
    """``os.getpid()``, cached across calls and refreshed after each fork."""
    pid = cached_pid
    if pid:
        return pid
    return _first_read()


def _first_read() -> int:
    global cached_pid, _registered
    # No lock: a fork while a thread held it would leave the child's first read waiting for
    # good. Two threads racing here register the handler twice, which is harmless.
    if not _registered:
        # Registered on first use rather than at import: importing spanprof changes nothing.
        os.register_at_fork(after_in_child=_forked)
        _registered = True
    cached_pid = os.getpid()
    return cached_pid


def _forked() -> None:
    global cached_pid
    cached_pid = os.getpid()
