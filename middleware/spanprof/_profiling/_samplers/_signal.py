"""The exact sampler: one signal handler reads every thread's stack and labels at one instant.

pyroscope-io reads stacks first and thread tags ~0.2 ms later, so on an event loop that switches
requests every few hundred microseconds its samples carry whoever ran *after* the stack was read.
Here a ``SIGPROF`` timer counting the process's CPU time runs a Python handler in the main thread,
between two bytecodes of whatever the main thread was running, and that handler reads:

- the main thread's stack (the interrupted frame) and the labels of the context it runs in
  (``LABELS.get()`` inside the handler *is* the running task's, or callback's, labels: the handler
  runs in the interrupted code's context, which cannot move while the handler runs), so an event
  loop in the main thread needs no per-switch hook at all;
- every other thread's stack (``sys._current_frames()``) and the labels the label engine last
  pushed for it through ``set_thread_labels`` (thread-pool jobs push at start and end). The
  handler can lose the GIL halfway (another thread's forced switch), so each thread's label
  changes bump a version around them, and a thread whose version moved between the stack
  snapshot and the label read is left for the next tick. (With the CPU clock, only once the
  other threads have used 20 µs of CPU since the last such walk: the process's clock less the
  main thread's says so for one clock read, where the walk is most of a tick's cost.)

Weights are CPU time, per thread: each sample weighs the thread's own CPU clock advance since
the previous tick (an ``ITIMER_PROF`` tick says "the process used 10 ms", not which thread did).
A thread whose leaf frame is a known blocking wait (``Condition.wait``, a selector's
``select``...) is not running now: the CPU it used since the last tick goes to the stack it was
seen running at the previous tick (same labels), else to the frames that called the wait; the
main thread's goes to its previous tick's sample or is dropped (counted), never to the idle
loop's empty labels.

Other threads are seen only when the main thread gets the GIL, so a thread-pool job shorter
than the GIL switch interval (5 ms) often runs entirely between two looks. The label engine's
pushes close such gaps: when a worker's labels change (a job starts or ends), the CPU it used
since the last tick is booked under the labels it ran with, on the stack it was seen running,
else on the job's entry (the pool's frames plus the job's function). One job's CPU never lands
on the next job's labels, and every labelled job's CPU is counted.

With ``clock="wall"`` a ``CLOCK_MONOTONIC`` timer (``SIGALRM``) samples every thread, blocked or
not, weighted by wall time.

The timer is a POSIX timer directed at the main thread (``_timer``), not ``setitimer``'s
process-directed signal: a busy thread never takes the tick for itself while the main thread
sleeps through it, and no thread blocks the signal (or passes a blocked mask to subprocesses).
``stop()`` may run in any thread; off the main thread, the previous handler is put back by the
main thread itself, the next time it runs Python code (a signal wakes it for that).

The handler leaves the garbage collector alone: on CPython >= 3.12 a collection only ever starts
between bytecodes, never inside ``sys._current_frames()``; before 3.12 it is kept off for that
one call only, atomically where the C extension is built (see ``_current_frames``).

Every table the handler writes is interned as it goes (frame ids, stack ids, one counter per
``(stack, labels)``), so the exporter only swaps a window out and encodes it in small steps.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import contextvars
import functools
import gc
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import BuiltinMethodType, CodeType, FrameType
from typing import Any

from ..._labels._engine import run_labelled
from ..._labels._labelset import EMPTY, LABELS, LabelSet
from ..._labels._native import cproxy
from .._window import StackTables, Window
from ._timer import CLOCK_MONOTONIC, CLOCK_PROCESS_CPUTIME_ID, ThreadTimer

try:
    from ._alloc import ignore_leaf as _ignore_leaf_allocations
    from ._alloc import ignore_thread as _ignore_allocations
except ImportError:  # built without a compiler: no allocation sampling to keep out of

    def _ignore_allocations(ignore: bool, /) -> bool:
        return False

    def _ignore_leaf_allocations(code: CodeType | None, /) -> None:
        pass


_c_current_frames_gc_off: Callable[[], dict[int, FrameType]] | None = (
    None if cproxy is None else cproxy.current_frames_gc_off
)


# What _alloc.stack_frame_ids returns for a stack: its frame ids, or (some frames not interned
# yet) a list holding each such frame's (code, lasti, line) in its place.
_FrameIds = tuple[int, ...] | list[int | tuple[CodeType, int, int]]
_StackKey = Callable[[FrameType, int], bytes | None]
_StackFrameIds = Callable[[FrameType, int, dict[tuple[int, int], int]], _FrameIds | None]


def _find_stack_readers() -> tuple[_StackKey | None, _StackFrameIds | None]:
    """``_alloc.stack_key`` and ``stack_frame_ids`` where they read this interpreter's frames
    (both read them alike: one probe answers for both), else ``None`` for each."""
    try:
        from . import _alloc
    except ImportError:  # not built
        return None, None
    stack_key: _StackKey | None = getattr(_alloc, "stack_key", None)
    if stack_key is None:  # built before it existed
        return None, None
    try:
        stack_key(sys._getframe(), 1)
    except RuntimeError:  # a frame layout _alloc does not know
        return None, None
    frame_ids: _StackFrameIds | None = getattr(_alloc, "stack_frame_ids", None)
    return stack_key, frame_ids


_c_stack_key, _c_stack_frame_ids = _find_stack_readers()

__all__ = [
    "CLOCKS",
    "Sampler",
    "SamplerUnavailable",
    "SignalInUse",
    "in_main_os_thread",
    "os_thread_ident",
    "platform_reason",
    "signal_for",
    "thread_cpu_clock",
    "unavailable_reason",
]

#: Sampling clocks: on-CPU time (``SIGPROF``) or wall time (``SIGALRM``).
CLOCKS = ("cpu", "wall")

# Deepest stack kept (leaf side); deeper recursion would make a single tick expensive.
MAX_DEPTH = 256
# Interned frames/stacks are shared by consecutive windows until they grow past this.
MAX_TABLE_SIZE = 100_000
# In-flight spans whose CPU is counted for their span attribute.
_MAX_SPANS = 65536
# Stack ids cached by their C stack key (see _stack_id); cleared when full.
_MAX_KEYED = 16384
# Bytes of one frame in a C stack key: its code's address and its instruction offset.
_KEY_FRAME_BYTES = 16
# Stall durations kept for percentiles.
_STALL_RING = 4096
_PRUNE_EVERY = 64
# Other threads' CPU since the last walk of them (the process's clock less the main thread's)
# below which a CPU-clock tick does not walk them: their stacks, clocks and labels would cost
# most of the handler (a dozen microseconds for three idle threads, cold) for nothing to book.
# Their clocks are read at the next walk, which books what they used meanwhile: at most this
# much of their CPU waits for a walk, and a thread whose labels changed meanwhile has that
# booked by its boundaries.
_OTHERS_QUIET_NS = 20_000

# Modules whose frames are the waiting machinery above a blocked thread's own code.
_WAIT_MODULES = frozenset(
    {"threading", "queue", "selectors", "socket", "ssl", "subprocess", "concurrent.futures._base"}
)
_RUN_LABELLED = run_labelled.__code__

# A stack captured on a worker thread, interned later by the handler: (code, lasti, line), leaf
# first; lasti -1 marks a function's entry (a job not yet started).
_RawStack = tuple[tuple[CodeType, int, int], ...]

_CO_ASYNC = 0x0080 | 0x0100 | 0x0200  # CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR


class SignalInUse(RuntimeError):
    """The sampler's signal (or its interval timer) already belongs to someone else."""


class SamplerUnavailable(RuntimeError):
    """This process cannot be sampled exactly (wrong thread, platform or build)."""


def _current_frames_gc_off() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the collector off for that call (CPython < 3.12).

    gh-106883: a collection started while ``sys._current_frames()`` holds the runtime's thread
    list lock can free a ``threading.local`` whose cleanup takes that lock again: a deadlock.
    The C version turns the collector off and back on without running any bytecode in between,
    so no other thread can see (or change) the collector's state meanwhile; this fallback has
    that window for two calls.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


if sys.version_info >= (3, 12):
    # Collections start only at the eval breaker, never inside the call: nothing to do.
    _current_frames: Callable[[], dict[int, FrameType]] = sys._current_frames
elif _c_current_frames_gc_off is not None:
    _current_frames = _c_current_frames_gc_off
else:
    _current_frames = _current_frames_gc_off


def signal_for(clock: str) -> tuple[int, int]:
    """``(signal number, interval timer)`` the sampler uses for ``clock``."""
    if clock == "cpu":
        return signal.SIGPROF, signal.ITIMER_PROF
    if clock == "wall":
        return signal.SIGALRM, signal.ITIMER_REAL
    raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")


def thread_cpu_clock(native_id: int) -> int:
    """The Linux CPU-time clock id of thread ``native_id`` (a TID).

    Built from the TID rather than with ``time.pthread_getcpuclockid(ident)``: for a thread that
    has exited, a stale ``pthread_t`` may crash, while a stale TID only makes ``clock_gettime``
    fail with ``EINVAL``. Same encoding as glibc (``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``).
    """
    return ((~native_id) << 3) | 6


def os_thread_ident() -> Callable[[], int]:
    """The function that tells the calling OS thread's ident (``sys._current_frames`` keys).

    gevent's monkey patching turns ``threading.get_ident`` into the current greenlet's id; every
    greenlet of a worker runs in one OS thread, the one the signal handler runs in.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None:
        original: Callable[[], int] = monkey.get_original("_thread", "get_ident")
        return original
    return _thread.get_ident


def in_main_os_thread() -> bool:
    """Whether the caller runs in the process's main OS thread, where signal handlers run.

    Asked of the OS (on Linux the main thread's TID is the pid): under gevent a greenlet of the
    main thread is a ``DummyThread`` to ``threading``, and CPython < 3.13 keeps the parent's
    ``main_thread().native_id`` after a fork.
    """
    return threading.get_native_id() == os.getpid()


def platform_reason() -> str | None:
    """Why this interpreter cannot run an exact sampler at all, or ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"it needs Linux per-thread CPU clocks (this is {sys.platform})"
    is_gil_enabled: Callable[[], bool] | None = getattr(sys, "_is_gil_enabled", None)
    if is_gil_enabled is not None and not is_gil_enabled():
        return "it needs the GIL to read stacks and labels at one instant (free-threaded build)"
    return None


def unavailable_reason() -> str | None:
    """Why the calling thread cannot start (or prepare) an exact sampler, or ``None``.

    A sampler ``prepare``-d in the main thread may then ``start`` in any thread.
    """
    reason = platform_reason()
    if reason is not None:
        return reason
    if not in_main_os_thread():
        return (
            "it must start in the main thread, where Python runs signal handlers, but it was "
            f"started in thread {threading.current_thread().name!r} (an event loop outside the "
            "main thread?)"
        )
    return None


def _thread_cpu_ns(native_id: int) -> int:
    """CPU time of thread ``native_id`` so far (0 if it cannot be read)."""
    try:
        return time.clock_gettime_ns(thread_cpu_clock(native_id))
    except OSError:
        return 0


def _quiet_wakeup_fd() -> int:
    """Keep the sampler's ticks from flooding a signal wakeup fd nobody reads (main thread).

    Python writes one byte per signal to the fd ``signal.set_wakeup_fd`` names, and by default
    reports every write to a full buffer as an "Exception ignored" traceback. gunicorn's
    gthread and gevent workers set that fd to a pipe they never read: after 65,536 ticks (11
    minutes of CPU at 100 Hz) every tick would print one. The fd stays where it is; only the
    warning goes (trio configures its own fd so). An event loop running here reads its fd
    (and dispatches ``add_signal_handler`` callbacks from the bytes): it is left alone, since
    there is no getter and the fd is unset for the instant between the two calls.

    Returns the fd whose warning ``_restore_wakeup_warning`` puts back at stop, or -1.
    """
    if _loop_running_here():
        return -1
    with contextlib.suppress(ValueError, OSError):
        fd = signal.set_wakeup_fd(-1)
        if fd != -1:
            signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
            # trio's own fd is quiet already: it is not the sampler's to make warn.
            return -1 if _in_trio_run() else fd
    return -1


def _restore_wakeup_warning(fd: int) -> None:
    """Let ``fd`` warn about a full buffer again, as before ``_quiet_wakeup_fd`` (main thread).

    Only while ``fd`` is still the wakeup fd: swapped for itself, it is never unset. Another fd
    set since then (or none) is put back, with Python's default, since its setter's choice
    cannot be read back. With an event loop running here nothing is touched (see
    ``_quiet_wakeup_fd``): the fd is most likely the loop's, set with its own choice.
    """
    if _loop_running_here():
        return
    with contextlib.suppress(ValueError, OSError):
        current = signal.set_wakeup_fd(fd)
        if current != fd:
            signal.set_wakeup_fd(current)


def _loop_running_here() -> bool:
    asyncio: Any = sys.modules.get("asyncio")
    return asyncio is not None and asyncio._get_running_loop() is not None


def _in_trio_run() -> bool:
    # Only a completely imported trio can be running (see the label engine's _attach_trio).
    current_token = getattr(sys.modules.get("trio.lowlevel"), "current_trio_token", None)
    if current_token is None:
        return False
    try:
        current_token()
    except RuntimeError:
        return False
    return True


def _blocking_codes() -> dict[int, CodeType]:
    """Code objects whose frame, as a thread's leaf, means the thread waits instead of runs.

    Only modules already imported are consulted: nothing is imported for this. The list is read
    at ``start``, which servers reach with their event loop (and so its I/O module) imported.
    """
    candidates: list[tuple[str, str]] = [
        ("threading", "Condition.wait"),
        ("threading", "Thread.join"),
        ("threading", "Thread._wait_for_tstate_lock"),
        ("concurrent.futures.thread", "_worker"),  # blocked in SimpleQueue.get (C)
        # Each selector that overrides select has a code object of its own: Linux's default
        # (EpollSelector, asyncio's) is not _PollLikeSelector.select.
        ("selectors", "SelectSelector.select"),
        ("selectors", "_PollLikeSelector.select"),
        ("selectors", "EpollSelector.select"),
        ("selectors", "DevpollSelector.select"),
        ("selectors", "KqueueSelector.select"),
        # trio's run loop waits for I/O here.
        ("trio._core._io_epoll", "EpollIOManager.get_events"),
        ("trio._core._io_kqueue", "KqueueIOManager.get_events"),
        ("socket", "socket.accept"),
        ("socket", "SocketIO.readinto"),
        ("ssl", "SSLSocket.read"),
        ("ssl", "SSLSocket.recv_into"),
        ("subprocess", "Popen._try_wait"),
        ("asyncio.runners", "Runner.run"),  # a compiled loop waiting in run_until_complete
        ("asyncio.runners", "run"),
        ("multiprocessing.connection", "Connection._recv"),
    ]
    codes: dict[int, CodeType] = {}
    for module_name, path in candidates:
        obj: Any = sys.modules.get(module_name)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        code = getattr(obj, "__code__", None)
        if isinstance(code, CodeType):
            codes[id(code)] = code
    return codes


def _loop_driver_code(frame: FrameType | None) -> CodeType | None:
    """The Python frame that called into a compiled event loop running ``frame``'s task.

    Walks outward past the task's coroutine frames: the first plain frame below them is whoever
    called ``run_until_complete`` of a loop written in C (uvloop). When such a loop waits for
    I/O, that frame is the main thread's leaf.
    """
    seen_coroutine = False
    depth = 0
    while frame is not None and depth < 1000:
        is_coroutine = bool(frame.f_code.co_flags & _CO_ASYNC)
        if is_coroutine:
            seen_coroutine = True
        elif seen_coroutine:
            return frame.f_code
        frame = frame.f_back
        depth += 1
    return None


class _ThreadState:
    """What the handler knows about one non-main thread (handler-owned)."""

    __slots__ = (
        "clock",
        "job_frames",
        "job_labels",
        "last",
        "last_labels",
        "last_stack",
        "last_tick",
        "last_top_lasti",
        "tables",
        "thread",
        "waiting_in",
    )

    def __init__(self, thread: object, clock: int, last: int) -> None:
        self.thread = thread
        self.clock = clock
        self.last = last
        # The stack this thread was last seen running, under which labels, at which tick.
        self.last_stack = -1
        self.last_labels: LabelSet | None = None
        self.last_tick = -1
        self.tables: StackTables | None = None
        # The blocking frame it waited in at the last look (same object: it never left it), and
        # in wall mode the waiting leaf whose stack is last_stack.
        self.waiting_in: FrameType | None = None
        self.last_top_lasti: tuple[FrameType, int] | None = None
        # Where the current labelled job started (see Sampler.set_thread_labels).
        self.job_frames: _RawStack | None = None
        self.job_labels: LabelSet | None = None


class _PerThread(threading.local):
    ready: bool = False
    clock: int = 0

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], _RawStack] = {}


def _percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


class Sampler:
    """Signal-driven sampler of every thread's stack and labels (see the module docstring).

    Arguments:
        sample_rate: timer ticks per second of process CPU (``clock="cpu"``) or of wall time.
        clock: ``"cpu"`` (``SIGPROF``/``ITIMER_PROF``, on-CPU samples weighted by each thread's
            CPU time) or ``"wall"`` (``SIGALRM``/``ITIMER_REAL``, every thread weighted by wall
            time, waiting included).

    ``start`` and ``stop`` must run in the main thread. ``set_thread_labels`` is the label
    engine's hook; ``take_window`` hands the samples collected so far to an exporter thread.
    """

    def __init__(self, *, sample_rate: int = 100, clock: str = "cpu") -> None:
        self.signum, self.timer = signal_for(clock)
        if not 1 <= sample_rate <= 1000:
            raise ValueError(f"sample_rate: expected 1..1000 per second, got {sample_rate}")
        self.clock = clock
        self.sample_rate = sample_rate
        self.interval = 1.0 / sample_rate
        self._wall = clock == "wall"
        self._clock_id = CLOCK_MONOTONIC if self._wall else CLOCK_PROCESS_CPUTIME_ID
        self._directed: ThreadTimer | None = None
        self._running = False
        self._busy = False
        self._previous_handler: Any = signal.SIG_DFL
        # Stopped off the main thread: the main thread's next handler run restores the handler.
        self._restore_pending = False
        # The process that prepared or started it (0: neither yet).
        self._pid = 0
        # The first tick turns off the wakeup fd's full-buffer warning (see _quiet_wakeup_fd).
        self._quiet_wakeup = False
        # The fd it was turned off for, turned back on when the handler goes (-1: none).
        self._quieted_fd = -1
        self._main_ident = 0
        self._ident: Callable[[], int] = _thread.get_ident
        self._main_last = 0
        # The process's and the main thread's CPU clocks at the last walk (see _others_ran).
        self._process_at_walk = 0
        self._main_at_walk = 0
        self._last_prune = 0
        self._main_sample: tuple[int, LabelSet, StackTables, int] | None = None
        self._blocking: dict[int, CodeType] = {}
        self._main_idle: dict[int, CodeType] = {}
        self._window = Window(time.time_ns(), StackTables())
        self._states: dict[int, _ThreadState] = {}
        self._labels: dict[int, LabelSet] = {}
        # Per thread, bumped before and after each label change (see _sample_threads).
        self._versions: dict[int, int] = {}
        # Bounded in case the main thread cannot run the handler for a long while.
        self._boundaries: collections.deque[
            tuple[int, int, int, LabelSet, LabelSet, _RawStack | None]
        ] = collections.deque(maxlen=65536)
        self._local = _PerThread()
        self._random = random.Random()
        # Linux checks CPU timers on scheduler ticks (4 ms at HZ=250): an interval that short is
        # already quantised to whole ticks, and jittering it would only lower the rate.
        self._jitter = clock == "wall" or self.interval >= 0.008
        self._interval_ns = round(self.interval * 1e9)
        self._min_arm_ns = self._interval_ns // 5
        # When the armed timer is due, on its clock (see _on_signal).
        self._due_at = 0
        self._entries: dict[int, tuple[_RawStack, int, StackTables]] = {}
        # Stack ids by _alloc.stack_key, for self._keyed_tables only.
        self._keyed: dict[bytes, int] = {}
        self._keyed_tables: StackTables | None = None
        # The frame ids of a stack's callers by its key's callers part (the key less its leaf's
        # _KEY_FRAME_BYTES), for self._keyed_tables only.
        self._callers: dict[bytes, tuple[int, ...]] = {}
        # Wall and CPU time of the last handler runs: how long the main thread was held up.
        self._stalls = [0] * _STALL_RING
        self._stall_cpu = [0] * _STALL_RING
        self._stall_count = 0
        self._stall_max = 0
        # span_id -> CPU booked on its samples (see span_cpu_ns).
        self._span_ns: dict[str, int] = {}
        self.span_resets = 0
        #: Whether a span already ended (its CPU taken): set by the owner that ends spans.
        #: Samples booked after that (a pool job's last slice, a background task) would make an
        #: entry nobody takes again.
        self.span_ended: Callable[[str], bool] | None = None
        self.span_late_ns = 0
        self.ticks = 0
        self.handler_cpu_ns = 0
        self.samples = 0
        self.reentered = 0
        self.inconsistent = 0
        self.errors = 0
        self.last_error: BaseException | None = None
        # Where CPU went, in nanoseconds: samples of running stacks; CPU of threads seen
        # waiting, booked on their previous sample or their callers; worker CPU booked at
        # label changes; and what was dropped because no stack could be named for it.
        self.sampled_ns = 0
        self.max_weight_ns = 0
        self.carried_ns = 0
        self.carried_main_ns = 0
        self.boundary_ns = 0
        self.idle_ns = 0
        self.unsampled_ns = 0

    # --- lifecycle (main thread) ----------------------------------------------------------------

    @property
    def ident(self) -> Callable[[], int]:
        """How this sampler tells threads apart (the OS thread's ident, whatever gevent patched)."""
        return self._ident

    @property
    def main_ident(self) -> int:
        """The ident of the thread the handler runs in (whose labels it reads from its context)."""
        return self._main_ident

    @property
    def running(self) -> bool:
        """Whether the timer is armed in this process."""
        return self._running and self._pid == os.getpid()

    @property
    def prepared(self) -> bool:
        """Whether this sampler's handler is installed in this process (``prepare``, ``start``).

        Inherited over a fork: the child's main thread is the thread that forked.
        """
        return bool(signal.getsignal(self.signum) == self._on_signal)

    def prepare(self) -> None:
        """Install the signal handler, idle, so that ``start`` may then run in any thread.

        Main thread only (``signal.signal`` works nowhere else). A threaded server builds the
        app (and spanprof's WSGI middleware, which calls this) in the main thread, then serves
        requests on pool threads: the first one starts the sampler from there. The handler does
        nothing until the timer is armed; ``stop`` removes it. Raises like ``start``.
        """
        if self.prepared:
            return
        reason = unavailable_reason()
        if reason is not None:
            raise SamplerUnavailable(reason)
        current = self._check_signal()
        owner = _sampler_of(current)
        if owner is not None and owner.running:
            raise SignalInUse(
                f"another exact sampler handles {signal.Signals(self.signum).name} in this "
                "process already"
            )
        self._adopt(current)
        self._ident = os_thread_ident()
        self._main_ident = self._ident()
        self._pid = os.getpid()
        self._install_handler()

    def _install_handler(self) -> None:
        # Main thread only. The allocation sampler leaves the handler's frame out first, so that
        # no tick runs before it does.
        _ignore_leaf_allocations(_HANDLER_CODE)
        signal.signal(self.signum, self._on_signal)

    def _check_signal(self) -> Any:
        # The signal's current handler, if the sampler may take it over; else SignalInUse.
        name = signal.Signals(self.signum).name
        current = signal.getsignal(self.signum)
        if not (current == signal.SIG_DFL or _is_sampler_handler(current)):
            raise SignalInUse(
                f"spanprof's exact profiler needs {name} (clock={self.clock!r}), but {name} "
                f"already has a handler ({current!r}); another profiler or library uses it. "
                "Remove that handler, or use SPANPROF_PROFILER=pyroscope"
            )
        if signal.getitimer(self.timer) != (0.0, 0.0):
            raise SignalInUse(
                f"spanprof's exact profiler needs the {name} interval timer, but it is already "
                "armed by someone else; use SPANPROF_PROFILER=pyroscope"
            )
        return current

    def _adopt(self, current: Any) -> None:
        # What this sampler puts back when it stops.
        owner = _sampler_of(current)
        if owner is self:
            return
        if owner is not None:
            # A sampler's handler is still installed (stopped off the main thread, or before a
            # fork): what it would have put back is what this one puts back.
            self._previous_handler = owner._previous_handler
            owner._restore_pending = False
        else:
            self._previous_handler = current

    def start(self) -> None:
        """Install the signal handler (unless ``prepare`` did) and arm the timer.

        In the main thread, or in any thread once ``prepare`` ran in the main thread of this
        process (or of the parent it was forked from). Raises ``SamplerUnavailable`` when this
        thread/process cannot be sampled exactly and ``SignalInUse`` when the signal already
        has another handler or the timer is armed.
        """
        pid = os.getpid()
        if self._running and self._pid == pid:
            return
        if self._pid != pid:
            # Forked from the process that prepared or ran it: no timer came over, and that
            # process's samples are its own to send.
            self._running = False
            self._directed = None
            self._window = Window(time.time_ns(), StackTables())
            self._span_ns.clear()
            self._entries.clear()
        in_main = in_main_os_thread()
        if in_main:
            reason = unavailable_reason()
        else:
            reason = platform_reason()
            if reason is None and not self.prepared:
                reason = (
                    f"{unavailable_reason()}, and no handler was prepared there (a WSGI "
                    "middleware built in the main thread, at import, prepares one)"
                )
        if reason is not None:
            raise SamplerUnavailable(reason)
        current = self._check_signal()
        self._ident = os_thread_ident()
        if in_main:
            self._main_ident = self._ident()
            main_native = threading.get_native_id()
        else:
            # Prepared there: the handler runs in the main thread, whose TID is the pid.
            main = threading.main_thread()
            if main.ident is None or not main.is_alive():
                raise SamplerUnavailable("the main thread, which runs the handler, has exited")
            self._main_ident = main.ident
            main_native = pid
        # A restart begins like the label engine's install: every thread from empty labels.
        self._labels.clear()
        self._versions.clear()
        self._boundaries.clear()
        self._states.clear()
        self._process_at_walk = 0  # the first tick walks every thread
        self._main_sample = None
        self._blocking = _blocking_codes()
        self._main_idle = dict(self._blocking)
        if in_main:
            driver = _loop_driver_code(sys._getframe(1))
            if driver is not None and not _is_python_loop_running():
                self._main_idle[id(driver)] = driver
            self._main_last = self._now_main()
        else:
            self._main_last = time.perf_counter_ns() if self._wall else _thread_cpu_ns(main_native)
        self._adopt(current)
        try:
            directed = ThreadTimer(self._clock_id, self.signum, main_native)
        except OSError as exc:
            raise SamplerUnavailable(
                f"it needs a timer that signals the main thread (timer_create): {exc}"
            ) from exc
        self._restore_pending = False
        # In the main thread now; else at the first tick, which runs there.
        self._quiet_wakeup = not in_main
        if in_main:
            self._quieted_fd = _quiet_wakeup_fd()
        try:
            if in_main:
                self._install_handler()
            self._pid = pid
            self._directed = directed
            self._running = True
            # Armed last. Re-armed with a random interval after each tick; the period is a
            # fallback.
            self._due_at = time.clock_gettime_ns(self._clock_id) + self._interval_ns
            if not directed.arm(self.interval, self.interval):
                raise SamplerUnavailable("timer_settime refused to arm the sampler's timer")
        except BaseException:
            # Nothing stays behind: no timer, and the handler that was there before (prepared
            # elsewhere: it stays, idle, until stop() removes it).
            self._running = False
            self._directed = None
            directed.delete()
            if in_main and signal.getsignal(self.signum) == self._on_signal:
                signal.signal(self.signum, signal.SIG_IGN)
                signal.signal(self.signum, self._previous_handler)
            if in_main:
                self._restore_wakeup()
            raise

    def stop(self) -> None:
        """Disarm the timer and restore the previous handler (also one ``prepare`` installed).

        In the main thread the handler is restored at once. In another thread (a shutdown
        thread, an atexit hook run elsewhere) ``signal.signal`` is not allowed: the timer is
        deleted at once, and the main thread restores the handler itself when it next runs
        Python code, woken by one more signal sent to it alone and marked due with
        ``_thread.interrupt_main`` (a tick still queued there can swallow the signal).
        """
        if not self.running:
            self._running = False
            self._directed = None
            if self.prepared:
                self._release()
            return
        self._running = False
        directed, self._directed = self._directed, None
        if directed is not None:
            directed.delete()
        # Label changes since the last tick still belong in the last window.
        self._busy = True
        try:
            self._drain_boundaries(self._window)
        finally:
            self._busy = False
        self._release()

    def _release(self) -> None:
        # The timer is gone: put the previous handler back, or have the main thread do it.
        if in_main_os_thread():
            self._restore_handler()
            return
        self._restore_pending = True
        main = threading.main_thread().ident if self._pid != os.getpid() else self._main_ident
        # OSError/ValueError: the main thread is gone, and nobody will run handlers any more.
        with contextlib.suppress(OSError, ValueError, TypeError):
            signal.pthread_kill(main or 0, self.signum)
        # The kill wakes a main thread blocked in a system call, but since Linux 6.13 it is lost
        # when a tick is still queued there: the deleted timer's signal stays pending, the kill
        # merges into it, and the kernel drops both at delivery. interrupt_main marks the
        # handler as due without a signal, which nothing drops. Second, so that the handler
        # cannot restore SIG_DFL before the kill is sent: once sent, the kill is pending, and
        # the SIG_IGN step of _restore_handler discards it. If the handler already ran, ours
        # is gone and there is nothing to mark.
        if signal.getsignal(self.signum) == self._on_signal:
            with contextlib.suppress(ValueError, RuntimeError):
                _thread.interrupt_main(signal.Signals(self.signum))

    def _restore_wakeup(self) -> None:
        # Main thread only: no more ticks, so the app's own full-buffer warning comes back.
        fd, self._quieted_fd = self._quieted_fd, -1
        if fd != -1:
            _restore_wakeup_warning(fd)

    @property
    def restore_pending(self) -> bool:
        """Whether the main thread has yet to put the previous handler back (see ``stop``)."""
        return self._restore_pending

    def _restore_handler(self) -> None:
        # Main thread only. The timer is gone, so no tick can follow; SIG_IGN first discards a
        # signal generated before it went, which the default action (terminate) would turn
        # into a crash.
        self._restore_pending = False
        self._restore_wakeup()
        if signal.getsignal(self.signum) != self._on_signal:
            return  # someone installed another handler meanwhile: theirs stays
        signal.signal(self.signum, signal.SIG_IGN)
        signal.signal(self.signum, self._previous_handler)
        _ignore_leaf_allocations(None)

    # --- the label engine's hook (any thread) ---------------------------------------------------

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """Record the calling thread's labels; book its CPU since the last tick to ``previous``.

        The main thread is skipped: its labels are read from its context at sample time.
        """
        ident = self._ident()
        if ident == self._main_ident:
            return
        local = self._local
        if not local.ready:
            self._prepare_thread(local)
        now = time.perf_counter_ns() if self._wall else time.thread_time_ns()
        entry = _job_entry(sys._getframe(1), local.entries) if current else None
        labels = self._labels
        recorded = labels.get(ident, EMPTY)
        if previous is not recorded and previous == recorded:
            # The engine pushes nothing on a switch to an equal set, yet keeps that object as
            # the thread's labels and names it as `previous` here next: the handler matches the
            # object it recorded by identity, and would drop the thread's CPU since its last
            # look.
            previous = recorded
        # Odd while changing: a tick that looked at this thread meanwhile discards what it saw.
        versions = self._versions
        version = versions.get(ident, 0)
        versions[ident] = version + 1
        self._boundaries.append((ident, local.clock, now, previous, current, entry))
        if current:
            labels[ident] = current
        else:
            labels.pop(ident, None)
        versions[ident] = version + 2

    def _prepare_thread(self, local: _PerThread) -> None:
        # No signal mask to set: the timer signals the main thread only (see _timer).
        local.clock = thread_cpu_clock(threading.get_native_id())
        local.ready = True

    # --- the exporter's side (another thread) ---------------------------------------------------

    def take_window(self) -> Window:
        """Swap in a new window and return the finished one (no handler writes it any more)."""
        old = self._window
        tables = old.tables if len(old.tables) < MAX_TABLE_SIZE else StackTables()
        self._window = Window(time.time_ns(), tables)
        # A handler that read the old window before the swap may still be adding to it (it can
        # be preempted mid-tick); it finishes within microseconds once it gets the GIL back.
        deadline = time.monotonic() + 1.0
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.0002)
        old.end_ns = time.time_ns()
        return old

    def stats(self) -> dict[str, float]:
        """Counters, where CPU was booked (ms) and handler-stall percentiles (µs) since start."""
        count = min(self._stall_count, _STALL_RING)
        stalls = sorted(self._stalls[:count])
        stalls_cpu = sorted(self._stall_cpu[:count])
        return {
            "ticks": self.ticks,
            "samples": self.samples,
            "reentered": self.reentered,
            "inconsistent": self.inconsistent,
            "errors": self.errors,
            "span_cpu_resets": self.span_resets,
            "span_cpu_late_ms": self.span_late_ns / 1e6,
            "sampled_ms": self.sampled_ns / 1e6,
            "max_sample_ms": self.max_weight_ns / 1e6,
            "carried_ms": self.carried_ns / 1e6,
            "carried_main_ms": self.carried_main_ns / 1e6,
            "boundary_ms": self.boundary_ns / 1e6,
            "idle_dropped_ms": self.idle_ns / 1e6,
            "unsampled_ms": self.unsampled_ns / 1e6,
            "stall_p50_us": _percentile(stalls, 0.50) / 1e3,
            "stall_p99_us": _percentile(stalls, 0.99) / 1e3,
            "stall_max_us": self._stall_max / 1e3,
            "stall_cpu_p99_us": _percentile(stalls_cpu, 0.99) / 1e3,
            "handler_cpu_ms": self.handler_cpu_ns / 1e6,
        }

    # --- the signal handler (main thread) -------------------------------------------------------

    def _now_main(self) -> int:
        return time.perf_counter_ns() if self._wall else time.thread_time_ns()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._restore_pending and not self._running:
            self._restore_handler()
            return
        if self._busy or not self._running:
            # A tick that arrives while the previous one runs (handlers can nest) is skipped.
            if self._running:
                self.reentered += 1
            return
        self._busy = True
        # The handler runs in the interrupted request's context: what it allocates is the
        # sampler's own work, and must not land in that request's memory profile.
        ignoring = _ignore_allocations(True)
        try:
            self._handle(frame)
        except Exception as exc:  # never raise into the interrupted application code
            self.errors += 1
            self.last_error = exc
        finally:
            # Whatever happened above (a KeyboardInterrupt included): the next tick runs, and
            # the thread's allocations are sampled again.
            self._busy = False
            _ignore_allocations(ignoring)

    def _handle(self, frame: FrameType | None) -> None:
        if self._quiet_wakeup:
            self._quiet_wakeup = False
            self._quieted_fd = _quiet_wakeup_fd()
        started = time.perf_counter_ns()
        cpu_started = time.thread_time_ns()
        # The process's CPU clock, read once a tick: on Linux it is a system call (about 1 µs
        # here, as the thread's clock above is), and both the walk check and the re-arm below
        # need it.
        process_started = 0 if self._wall else time.clock_gettime_ns(CLOCK_PROCESS_CPUTIME_ID)
        # The collector is left alone (it is the application's; see the module docstring):
        # only sys._current_frames() needs it off, on CPython < 3.12 (see _current_frames).
        try:
            self._tick(frame, cpu_started, process_started)
        except Exception as exc:  # the accounting below still runs
            self.errors += 1
            self.last_error = exc
        finally:
            cpu_ended = time.thread_time_ns()
            if not self._wall:
                # The handler's own CPU is nobody's sample.
                self._main_last = cpu_ended
            stall = time.perf_counter_ns() - started
            slot = self._stall_count % _STALL_RING
            self._stalls[slot] = stall
            self._stall_cpu[slot] = cpu_ended - cpu_started
            self.handler_cpu_ns += cpu_ended - cpu_started
            self._stall_count += 1
            if stall > self._stall_max:
                self._stall_max = stall
            directed = self._directed
            if self._jitter and self._running and directed is not None:
                # A fixed period can lock onto a periodic workload (a round robin of equal
                # steps) and keep sampling the same few phases of it: draw each next interval.
                # Less the time this tick waited for its handler (the main thread waits for the
                # GIL when a busy thread holds it), so that waiting does not lower the rate.
                # On the CPU clock, now is the process's clock at the start plus this handler's
                # own CPU: other threads' CPU meanwhile is left out, and the next tick's
                # lateness takes it back.
                now = (
                    time.clock_gettime_ns(self._clock_id)
                    if self._wall
                    else process_started + cpu_ended - cpu_started
                )
                late = max(0, now - self._due_at)
                value = max(
                    self._min_arm_ns,
                    round(self._interval_ns * (0.5 + self._random.random())) - late,
                )
                self._due_at = now + value
                directed.arm(value / 1e9, self.interval)

    def _tick(self, frame: FrameType | None, cpu_now: int, process_now: int) -> None:
        self.ticks += 1
        tick = self.ticks
        window = self._window
        tables = window.tables
        wall = self._wall
        now = time.perf_counter_ns() if wall else cpu_now
        others = self._drain_boundaries(window) if self._boundaries else 0
        if wall or self._others_ran(cpu_now, process_now):
            others += self._sample_threads(window, tick, now)
        # The main thread: its own frame and the labels of the context it is running.
        delta = now - self._main_last
        if wall:
            self._main_last = now
        if delta <= 0 or frame is None:
            return
        if wall:
            self._main_sample = self._sample_main(window, frame, tick, delta)
            return
        last = self._main_sample
        if id(frame.f_code) in self._main_idle:
            # Idle now: what it used since the last tick ran before it went idle.
            if last is not None and last[3] == tick - 1 and last[2] is tables:
                self._book(window, last[0], last[1], delta)
                self.carried_main_ns += delta
            else:
                self.idle_ns += delta
        elif others > delta and last is not None and last[3] == tick - 1 and last[2] is tables:
            # Other threads ran most of this interval, so the timer most likely expired while
            # one of them held the GIL, and the main thread is only resuming where that thread
            # preempted it: a point the GIL's switch interval ties to what the other thread
            # does, not a random one. Its CPU goes to its previous sample, taken while it ran.
            self._book(window, last[0], last[1], delta)
            self.carried_main_ns += delta
        else:
            self._main_sample = self._sample_main(window, frame, tick, delta)

    def _sample_main(
        self, window: Window, frame: FrameType, tick: int, delta: int
    ) -> tuple[int, LabelSet, StackTables, int]:
        # The handler runs in the interrupted code's context: these are the running task's
        # (or callback's) labels, read at the same instant as its stack.
        labels = LABELS.get()
        sid = self._stack_id(window.tables, frame)
        self._add(window, sid, labels, delta)
        return (sid, labels, window.tables, tick)

    def _others_ran(self, main_now: int, process_now: int) -> bool:
        """Whether threads other than the main one used CPU worth a walk since the last walk."""
        others = (process_now - self._process_at_walk) - (main_now - self._main_at_walk)
        if others < _OTHERS_QUIET_NS:
            return False
        self._process_at_walk = process_now
        self._main_at_walk = main_now
        return True

    def _sample_threads(self, window: Window, tick: int, wall_now: int) -> int:
        """Sample every other thread; return the CPU they used since the last tick."""
        tables = window.tables
        wall = self._wall
        # The handler can lose the GIL halfway through (another thread's forced switch), and a
        # worker may then finish its job and drop its labels before we read them: its frames,
        # read before, would get the wrong labels. A thread whose label version moved between
        # this copy and the read of its labels is left for the next tick.
        versions = self._versions
        versions_before = versions.copy()
        frames = _current_frames()  # gh-106883 before 3.12: see _current_frames
        # The main thread's entry is the stack running this handler, this frame included: kept
        # in a local, it would make a cycle (this frame, its locals, the dict, this frame) that
        # holds the interrupted stack's frames until the collector finds it, one per walk.
        frames.pop(self._main_ident, None)
        states = self._states
        labels_of = self._labels
        blocking = self._blocking
        # threading.enumerate() takes a lock the interrupted main thread may hold: read the
        # registry itself (a dict lookup is atomic under the GIL).
        active: dict[int, threading.Thread] = getattr(threading, "_active", {})
        used = 0
        for ident, top in frames.items():
            state = states.get(ident)
            if state is None or active.get(ident) is not state.thread:
                states[ident] = self._new_state(ident, wall_now)
                continue
            if top is state.waiting_in:
                # Still inside the same blocking call as at the last look: no CPU to read.
                if not wall:
                    continue
                now = wall_now
            elif wall:
                now = wall_now
            else:
                try:
                    now = time.clock_gettime_ns(state.clock)
                except OSError:  # the TID behind this ident exited: a new thread reuses it
                    states[ident] = self._new_state(ident, wall_now)
                    continue
            delta = now - state.last
            if delta <= 0:
                continue
            labels = labels_of.get(ident, EMPTY)
            version = versions.get(ident, 0)
            if version != versions_before.get(ident, 0) or version & 1:
                self.inconsistent += 1
                continue
            state.last = now
            used += delta
            is_waiting = id(top.f_code) in blocking
            state.waiting_in = top if is_waiting else None
            if wall or not is_waiting:
                if (
                    wall
                    and is_waiting
                    and state.last_top_lasti == (top, top.f_lasti)
                    and state.tables is tables
                ):
                    sid = state.last_stack
                else:
                    sid = self._stack_id(tables, top)
                    state.last_top_lasti = (top, top.f_lasti) if is_waiting else None
                self._add(window, sid, labels, delta)
                state.last_stack = sid
                state.last_labels = labels
                state.last_tick = tick
                state.tables = tables
                continue
            # Waiting now, but it used CPU since the last look: book it where it most likely ran.
            if (
                state.last_tick == tick - 1
                and state.last_labels is labels
                and state.tables is tables
            ):
                sid = state.last_stack
            else:
                sid = self._stack_id(tables, _callers_of_wait(top))
            self._book(window, sid, labels, delta)
            self.carried_ns += delta
        if tick - self._last_prune >= _PRUNE_EVERY:
            self._last_prune = tick
            for ident in [i for i in states if i not in frames]:
                del states[ident]
        return used

    def _new_state(self, ident: int, wall_now: int) -> _ThreadState:
        thread = _active_thread(ident)
        if self._wall:
            return _ThreadState(thread, 0, wall_now)
        native_id = getattr(thread, "native_id", None)
        if native_id is None:
            # Not a threading.Thread (or not started): no TID, so no CPU clock to weigh it by.
            return _ThreadState(thread, 0, 1 << 62)
        clock = thread_cpu_clock(native_id)
        try:
            last = time.clock_gettime_ns(clock)
        except OSError:
            last = 1 << 62
        return _ThreadState(thread, clock, last)

    def _drain_boundaries(self, window: Window) -> int:
        # A worker thread's labels changed at clock value `at`: what it used since the last tick
        # belongs to the labels it had, on the stack it was last seen running under them, else
        # on the entry of the job that had them.
        states = self._states
        tables = window.tables
        values = window.values
        boundaries = self._boundaries
        cpu = not self._wall
        booked = dropped = 0
        while boundaries:  # the handler is the only consumer
            ident, clock, at, previous, current, entry = boundaries.popleft()
            state = states.get(ident)
            if state is None or (cpu and state.clock != clock):
                state = states[ident] = _ThreadState(_active_thread(ident), clock, at)
            residual = at - state.last
            if residual > 0:
                state.last = at
                if state.last_labels is previous and state.tables is tables:
                    sid = state.last_stack
                elif state.job_labels is previous and state.job_frames is not None:
                    sid = self._entry_stack_id(tables, state.job_frames)
                else:
                    sid = -1
                if sid >= 0:
                    key = (sid, previous)
                    values[key] = values.get(key, 0) + residual
                    booked += residual
                    if previous:
                        self._credit(previous, residual)
                else:
                    dropped += residual
            state.last_stack = -1
            state.last_top_lasti = None  # names last_stack: forgotten with it
            state.last_labels = None
            state.job_frames = entry
            state.job_labels = current
        self.boundary_ns += booked
        self.unsampled_ns += dropped
        return booked + dropped

    def _add(self, window: Window, sid: int, labels: LabelSet, weight: int) -> None:
        key = (sid, labels)
        values = window.values
        values[key] = values.get(key, 0) + weight
        self.samples += 1
        self.sampled_ns += weight
        if weight > self.max_weight_ns:
            self.max_weight_ns = weight
        if labels:
            self._credit(labels, weight)

    def _book(self, window: Window, sid: int, labels: LabelSet, weight: int) -> None:
        key = (sid, labels)
        values = window.values
        values[key] = values.get(key, 0) + weight
        if labels:
            self._credit(labels, weight)

    def _credit(self, labels: LabelSet, weight: int) -> None:
        # The CPU each in-flight span's samples account for, read (and dropped) when it ends.
        span_id = labels.get("span_id")
        if span_id is not None:
            spans = self._span_ns
            if span_id in spans:
                spans[span_id] += weight
                return
            ended = self.span_ended
            if ended is not None and ended(span_id):
                # Booked after its span ended and took its CPU: kept, it would stay for good,
                # and fill the table until a reset cost the spans in flight their CPU.
                self.span_late_ns += weight
            elif len(spans) < _MAX_SPANS:
                spans[span_id] = weight
            else:
                # Spans nobody ended (a request path that never reported back): start over.
                spans.clear()
                spans[span_id] = weight
                self.span_resets += 1

    def span_cpu_ns(self, span_id: str) -> int:
        """The CPU booked on ``span_id``'s samples so far, forgotten from then on."""
        return self._span_ns.pop(span_id, 0)

    def span_cpu_taker(self) -> Callable[[str, int], int]:
        """``take(span_id, 0)``: ``span_cpu_ns`` as one C call (no Python frame), for the
        request path. Good for this sampler's life: the dict it pops from is never replaced."""
        return self._span_ns.pop

    def _stack_id(self, tables: StackTables, frame: FrameType | None) -> int:
        stack_key = _c_stack_key
        if stack_key is None or frame is None:
            return self._walk(tables, frame)
        # The handler's costliest step was this walk in Python (about 0.25 µs a frame, and
        # request stacks run 50 deep): the C key names the same stack at a fraction of that.
        # A key holds code addresses, which stay the same code's while `tables` keeps the code
        # objects it interned (it never lets one go), so the cache is only good for `tables`.
        key = stack_key(frame, MAX_DEPTH)
        if key is None:  # a frame that has returned (never one the handler reads)
            return self._walk(tables, frame)
        keyed = self._keyed
        if self._keyed_tables is not tables:
            keyed.clear()
            self._callers.clear()
            self._keyed_tables = tables
        sid = keyed.get(key)
        if sid is None:
            sid = tables.stack_of(self._new_stack_ids(tables, frame, key))
            if len(keyed) >= _MAX_KEYED:
                keyed.clear()
            keyed[key] = sid
        return sid

    def _new_stack_ids(self, tables: StackTables, frame: FrameType, key: bytes) -> tuple[int, ...]:
        # A key the cache has not seen is most often a new instruction under callers it has
        # (the leaf moves on every tick; call sites do not): their frame ids are kept by the
        # key's callers part, so only the leaf is looked up. Else the whole stack is.
        callers_key = key[_KEY_FRAME_BYTES:]
        callers = self._callers.get(callers_key)
        if callers is None:
            ids = self._frame_ids(tables, frame)
            if len(self._callers) >= _MAX_KEYED:
                self._callers.clear()
            self._callers[callers_key] = ids[1:]
            return ids
        leaf_key = (id(frame.f_code), frame.f_lasti)
        fid = tables.frame_ids.get(leaf_key)
        if fid is None:
            fid = tables.add_frame(leaf_key, frame)
        return (fid, *callers)

    def _walk(self, tables: StackTables, frame: FrameType | None) -> int:
        return tables.stack_of(self._frame_ids(tables, frame))

    def _frame_ids(self, tables: StackTables, frame: FrameType | None) -> tuple[int, ...]:
        frame_ids = _c_stack_frame_ids
        if frame_ids is not None and frame is not None:
            # In C the walk costs a dictionary lookup a frame, where f_back in Python makes a
            # frame object for each caller that has none yet.
            found = frame_ids(frame, MAX_DEPTH, tables.frame_ids)
            if type(found) is tuple:
                return found
            if found is not None:
                raw = tables.raw_frame
                return tuple(fid if isinstance(fid, int) else raw(*fid) for fid in found)
        return self._frame_ids_python(tables, frame)

    def _frame_ids_python(self, tables: StackTables, frame: FrameType | None) -> tuple[int, ...]:
        ids: list[int] = []
        append = ids.append
        get = tables.frame_ids.get
        depth = 0
        while frame is not None and depth < MAX_DEPTH:
            key = (id(frame.f_code), frame.f_lasti)
            fid = get(key)
            if fid is None:
                fid = tables.add_frame(key, frame)
            append(fid)
            frame = frame.f_back
            depth += 1
        return tuple(ids)

    def _entry_stack_id(self, tables: StackTables, raw: _RawStack) -> int:
        # Keyed by identity: _job_entry returns the same tuple for the same stack, and hashing
        # its code objects would cost more than interning them.
        hit = self._entries.get(id(raw))
        if hit is not None and hit[0] is raw and hit[2] is tables:
            return hit[1]
        sid = tables.stack_of(tuple(tables.raw_frame(c, lasti, line) for c, lasti, line in raw))
        if len(self._entries) >= 4096:
            self._entries.clear()
        self._entries[id(raw)] = (raw, sid, tables)
        return sid


def _job_entry(frame: FrameType | None, cache: dict[tuple[int, ...], _RawStack]) -> _RawStack:
    """Where a labelled job starts on this thread: its function on top of the pool's frames.

    ``frame`` is the engine's frame that pushed the labels; spanprof's own frames are skipped.
    When the engine runs a job (``run_labelled``), the job's function becomes the leaf. A pool
    thread starts the same kinds of job from the same place over and over: ``cache`` (per
    thread) hands back the same tuple for the same stack, so the handler interns it once.
    """
    fn_code: CodeType | None = None
    probe = frame
    depth = 0
    while probe is not None and depth < 6:
        if probe.f_code is _RUN_LABELLED:
            locals_ = probe.f_locals
            fn = _job_function(locals_.get("fn"), locals_.get("args", ()))
            code = getattr(fn, "__code__", None)
            fn_code = code if isinstance(code, CodeType) else None
            frame = probe
            break
        probe = probe.f_back
        depth += 1
    else:
        # Labels pushed by other code (a labels block on this thread): start at that code.
        while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(
            "spanprof."
        ):
            frame = frame.f_back
    key: list[int] = [id(fn_code)]
    current = frame
    depth = 0
    while current is not None and depth < MAX_DEPTH:
        key += (id(current.f_code), current.f_lasti)
        current = current.f_back
        depth += 1
    cache_key = tuple(key)
    raw = cache.get(cache_key)
    if raw is not None:
        return raw
    entries: list[tuple[CodeType, int, int]] = []
    if fn_code is not None:
        entries.append((fn_code, -1, fn_code.co_firstlineno))
    depth = 0
    while frame is not None and depth < MAX_DEPTH:
        code = frame.f_code
        entries.append((code, frame.f_lasti, frame.f_lineno or code.co_firstlineno))
        frame = frame.f_back
        depth += 1
    if len(cache) >= 256:
        cache.clear()
    raw = cache[cache_key] = tuple(entries)
    return raw


def _job_function(fn: Any, args: tuple[Any, ...]) -> Any:
    """The function a job calls as ``fn(*args)`` runs, past partials and ``Context.run``.

    ``asyncio.to_thread`` submits ``functools.partial(context.run, func, *args)``: the job's
    own function is the first argument of a method of a ``contextvars.Context``.
    """
    for _ in range(8):  # bounded: the job runs in the worker that pays for this unwrap
        if isinstance(fn, functools.partial):
            if fn.args:
                args = fn.args  # the first argument is all that is read below
            fn = fn.func
        elif (
            isinstance(fn, BuiltinMethodType)
            and isinstance(fn.__self__, contextvars.Context)
            and args
        ):
            fn, args = args[0], args[1:]
        else:
            break
    return fn


def _callers_of_wait(frame: FrameType) -> FrameType | None:
    """The first frame below a blocked thread's waiting machinery (its own code).

    A thread with no code of its own (``Thread(target=event.wait)``) ran only the machinery
    that started it: its root frame, not the wait it is blocked in, which is never a sample.
    """
    current: FrameType | None = frame
    root = frame
    while current is not None and current.f_globals.get("__name__") in _WAIT_MODULES:
        root = current
        current = current.f_back
    return current if current is not None else root


def _active_thread(ident: int) -> threading.Thread | None:
    # Not threading.enumerate(): see Sampler._tick.
    active: dict[int, threading.Thread] = getattr(threading, "_active", {})
    return active.get(ident)


#: The signal handler's code. The interpreter runs pending work (a due collection, whose
#: finalizers may allocate) at the handler's entry and after its last call, outside the
#: thread's ignore guard: the allocation sampler leaves out what is allocated there.
_HANDLER_CODE = Sampler._on_signal.__code__


def _is_sampler_handler(handler: object) -> bool:
    return isinstance(getattr(handler, "__self__", None), Sampler)


def _sampler_of(handler: object) -> Sampler | None:
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, Sampler) else None


def _is_python_loop_running() -> bool:
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return isinstance(loop, asyncio.BaseEventLoop)
