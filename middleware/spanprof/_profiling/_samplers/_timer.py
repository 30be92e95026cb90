"""A POSIX interval timer whose signal goes to one thread (Linux ``SIGEV_THREAD_ID``).

``setitimer(ITIMER_PROF)`` raises a process-directed ``SIGPROF``: the kernel hands it to
whichever thread was running when the process's CPU time ran out, usually a busy worker. Python
runs signal handlers only in the main thread, and a main thread blocked in a wait is not woken
by a signal another thread took (measured: 1-2 handler runs where 100-200 ticks were due). A
timer made with ``timer_create(CLOCK_PROCESS_CPUTIME_ID, SIGEV_THREAD_ID)`` counts the same
process CPU time but always signals the main thread: a wait there is interrupted (``EINTR``),
the handler runs, the wait resumes. No other thread is interrupted, and none has to block the
signal (blocked masks were inherited by the subprocesses those threads started). Go's profiler
uses the same mechanism.

``timer_create`` is not in the ``signal`` module, so it is called through ``ctypes``; the
``struct sigevent`` layout is the same in glibc and musl on every Linux architecture. The
signal handler re-arms the timer on every tick, which through ``ctypes`` took several
microseconds: where the samplers' C extension has ``timer_arm`` (64-bit Linux), ``arm`` goes
through it instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable


def _find_timer_arm() -> Callable[[int, int, int], bool] | None:
    """``_alloc.timer_arm``, or ``None`` where it is not built (then ``ctypes`` arms)."""
    try:
        from ._alloc import timer_arm
    except ImportError:  # not built, or not 64-bit Linux
        return None
    return timer_arm


_c_timer_arm = _find_timer_arm()

__all__ = ["CLOCK_MONOTONIC", "CLOCK_PROCESS_CPUTIME_ID", "ThreadTimer", "TimerUnavailable"]

CLOCK_MONOTONIC = 1
CLOCK_PROCESS_CPUTIME_ID = 2
_SIGEV_THREAD_ID = 4


class TimerUnavailable(OSError):
    """This platform or C library offers no thread-directed timer."""


class _Sigevent(ctypes.Structure):
    # union sigval; int signo; int notify; union { int _pad[...]; pid_t _tid; ... } (64 bytes)
    _fields_ = (
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("sigev_notify_thread_id", ctypes.c_int),
        ("_pad", ctypes.c_int * 11),
    )


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


# Loaded at the first timer, not at import, and kept: each load makes a CDLL with a function
# pointer class of its own, reference cycles the collector would find after every start.
_lib: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _load_libc()
    return _lib


def _load_libc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise TimerUnavailable(f"thread-directed timers need Linux (this is {sys.platform})")
    # glibc >= 2.34 and musl have timer_create in libc; older glibc in librt.
    for name in (None, ctypes.util.find_library("rt")):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.timer_create  # noqa: B018 (looked up to check that it exists)
        except (OSError, AttributeError):
            continue
        lib.timer_create.argtypes = (
            ctypes.c_int,
            ctypes.POINTER(_Sigevent),
            ctypes.POINTER(ctypes.c_void_p),
        )
        lib.timer_settime.argtypes = (
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        )
        lib.timer_delete.argtypes = (ctypes.c_void_p,)
        return lib
    raise TimerUnavailable("the C library has no timer_create")


def _split(seconds: float, spec: _Timespec) -> None:
    nanoseconds = max(0, round(seconds * 1e9))
    spec.tv_sec, spec.tv_nsec = divmod(nanoseconds, 1_000_000_000)


class ThreadTimer:
    """A timer on ``clock_id`` that sends ``signum`` to the thread with TID ``native_id``.

    ``arm`` and ``disarm`` may be called from any thread and from the signal handler; ``delete``
    frees it. In a forked child (which inherits no timers) every call does nothing: the id
    might name a timer the child made itself.
    """

    def __init__(self, clock_id: int, signum: int, native_id: int) -> None:
        self._lib = _libc()
        event = _Sigevent()
        event.sigev_signo = signum
        event.sigev_notify = _SIGEV_THREAD_ID
        event.sigev_notify_thread_id = native_id
        timer_id = ctypes.c_void_p()
        if self._lib.timer_create(clock_id, ctypes.byref(event), ctypes.byref(timer_id)) != 0:
            errno = ctypes.get_errno()
            raise TimerUnavailable(errno, f"timer_create: {os.strerror(errno)}")
        self._id = timer_id
        # c_void_p gives None for 0, the first timer id the kernel hands out.
        self._number = int(timer_id.value or 0)
        self._pid = os.getpid()
        self._spec = _Itimerspec()
        self._live = True

    @property
    def live(self) -> bool:
        """Whether the timer exists in this process (not deleted, not inherited over a fork)."""
        return self._live and self._pid == os.getpid()

    def arm(self, value: float, interval: float = 0.0) -> bool:
        """Fire after ``value`` seconds, then every ``interval`` seconds (0: once).

        ``False`` if the kernel refused (it never raises: the signal handler calls this).
        """
        if not self.live:
            return False
        if _c_timer_arm is not None:
            return _c_timer_arm(self._number, round(value * 1e9), round(interval * 1e9))
        spec = self._spec
        _split(value, spec.it_value)
        _split(interval, spec.it_interval)
        if spec.it_value.tv_sec == 0 and spec.it_value.tv_nsec == 0:
            spec.it_value.tv_nsec = 1  # zero would disarm it
        return int(self._lib.timer_settime(self._id, 0, ctypes.byref(spec), None)) == 0

    def disarm(self) -> None:
        """Stop firing (a signal already sent is still delivered)."""
        if not self.live:
            return
        spec = _Itimerspec()
        self._lib.timer_settime(self._id, 0, ctypes.byref(spec), None)

    def delete(self) -> None:
        """Disarm and free the timer."""
        if not self.live:
            return
        self._live = False
        self._lib.timer_delete(self._id)
