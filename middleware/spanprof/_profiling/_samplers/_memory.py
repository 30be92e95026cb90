"""The allocation sampler: memory profiles whose samples carry the allocating span's labels.

``_alloc`` (C) hooks CPython's object allocator and samples about one block per
``sample_bytes`` allocated (exponentially distributed gaps, so a block of ``s`` bytes is sampled
with probability ``1 - exp(-s / sample_bytes)``). Each sample records the block's Python stack
and the labels of the context that allocated it: ``LABELS`` read inside the hook, so a request's
allocations are its own whichever task, child task or pool thread made them, at no per-switch
cost. Sampled blocks stay in a bounded table until freed, so the memory each span still holds
is known too.

The hook only fills preallocated buffers. ``MemorySampler`` turns them into Python objects
outside it, on its own thread every ``drain_interval`` seconds (and whenever a window is taken):
``_alloc.drain`` scales every sample by the inverse of its sampling probability (the unbiased
estimate of what was allocated) and hands over the samples of blocks already freed one per
stack and label set; the sampler interns stacks in ``StackTables``, adds the estimates up per
``(stack, labels)``, and keeps the in-use estimate up to date as sampled blocks are freed.
``take_window`` hands the exporter a ``MemoryWindow``: the interval's allocations and a snapshot
of what is in use.
"""

from __future__ import annotations

import os
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any

from ..._labels._labelset import EMPTY, LABELS, LabelSet
from ..._logging import log_once
from ..._process import current_pid
from .._window import MemoryWindow, StackTables
from ._signal import in_main_os_thread

try:
    from . import _alloc
except ImportError:  # built without a compiler, or an interpreter that cannot load it
    _alloc = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_SAMPLE_BYTES",
    "MemorySampler",
    "MemorySamplerUnavailable",
    "ignore_profiler_thread",
    "memory_unavailable_reason",
]

#: The mean number of bytes between two samples (pyroscope-io's and Go's default too).
DEFAULT_SAMPLE_BYTES = 512 * 1024

# Interned stacks are dropped (live ones re-interned) past this many frames and stacks.
_MAX_TABLE_SIZE = 100_000

_Key = tuple[int, LabelSet]

# The longest stretch a drain holds the GIL for before letting other threads run.
_SLICE_NS = 500_000

# The sampler whose hooks are installed in this process, for the fork handler; and whether
# that handler is registered (once, by the first start()).
_sampling: weakref.ref[MemorySampler] | None = None
_fork_handler_registered = False


def _after_fork_in_child() -> None:
    """A forked child inherits the hooks but not the drain thread: take the hooks out.

    A child that never starts a sampler of its own (a multiprocessing worker, a helper
    process) would otherwise pay for sampling and fill buffers nobody drains; one that does
    starts afresh (``MemorySampler.start`` after a fork). Runs with the GIL, before any other
    thread exists in the child.
    """
    global _sampling
    sampler = _sampling() if _sampling is not None else None
    _sampling = None
    if sampler is None or _alloc is None:
        return
    try:
        _alloc.stop()
    except Exception:  # never fail the application's fork
        log_once("memory-fork", "spanprof: the allocator hooks stayed on in a forked child")
    # A drain may have held the lock in the parent's thread at the fork: that thread is gone.
    sampler._lock = threading.Lock()
    sampler._thread = None


class MemorySamplerUnavailable(RuntimeError):
    """Allocation sampling cannot run in this process (the message says why)."""


def memory_unavailable_reason() -> str | None:
    """Why allocation sampling cannot run in this interpreter, or ``None`` when it can."""
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return (
            "this is a free-threaded CPython build: its allocator runs in many threads at once "
            "without the GIL, which the sampler's tables rely on"
        )
    if _alloc is None:
        return (
            "its C extension (spanprof._profiling._samplers._alloc) is not built; reinstall "
            "spanprof with a C compiler and Python headers present"
        )
    return _alloc.unsupported()


class MemorySampler:
    """Samples allocations by bytes and keeps per-``(stack, labels)`` estimates.

    Arguments:
        sample_bytes: mean bytes allocated between two samples (default 512 KiB).
        max_samples: samples kept between two drains; more are dropped and counted.
        max_tracked: sampled blocks tracked until freed (for in-use memory); beyond that a
            sample still counts as allocated but not as in use (counted as ``untracked``).
        max_frames: frames kept per stack, leaf first.
        drain_interval: seconds between two drains of the C buffers.
        mem_domain: also sample ``PyMem_Malloc`` (lists' and dicts' arrays; on 3.12+ only).
        seed: the sampler's random seed (0: from the clock).
        filter_bits: size of the free path's filter of tracked addresses, in bits (0: by
            ``max_tracked``). Tests make it small, so that tracked addresses share bits.
    """

    def __init__(
        self,
        *,
        sample_bytes: int = DEFAULT_SAMPLE_BYTES,
        max_samples: int = 8192,
        max_tracked: int = 65536,
        max_frames: int = 128,
        drain_interval: float = 0.25,
        mem_domain: bool = True,
        seed: int = 0,
        filter_bits: int = 0,
    ) -> None:
        if not 1 <= sample_bytes <= 1 << 40:
            raise ValueError(f"alloc_sample_bytes: expected 1 to 2**40 bytes, got {sample_bytes}")
        self.sample_bytes = sample_bytes
        self.max_samples = max_samples
        self.max_tracked = max_tracked
        self.max_frames = max_frames
        self.drain_interval = drain_interval
        self.mem_domain = mem_domain
        self.seed = seed
        self.filter_bits = filter_bits
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._tables = StackTables()
        # (lastis, code ids) -> stack id, for self._tables.
        self._stack_ids: dict[bytes, int] = {}
        self._started_ns = time.time_ns()
        # Objects and bytes allocated since the last window, per key: one dict, so that a
        # sample costs one lookup (a key's hash calls LabelSet.__hash__, a Python method).
        self._allocated: dict[_Key, list[float]] = {}
        # Sampled blocks not yet freed: id -> (key, objects, bytes); and their sums per key.
        self._live: dict[int, tuple[_Key, float, float]] = {}
        self._inuse: dict[_Key, list[float]] = {}
        self.drains = 0
        self.drain_errors = 0
        self.max_drain_ns = 0
        self._last_stats: dict[str, float] = {}

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this sampler's hooks sample in this process."""
        return self._pid == os.getpid()

    def start(self) -> None:
        """Install the allocator hooks and start the drain thread.

        Raises ``MemorySamplerUnavailable`` when this process cannot sample allocations.
        """
        reason = memory_unavailable_reason()
        if reason is not None or _alloc is None:
            raise MemorySamplerUnavailable(reason or "no allocator hook")
        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                return
            if self._pid is not None:
                # Forked from a sampling parent: its hooks are here, its drain thread is not.
                _alloc.stop()
                self._reset()
            try:
                _alloc.start(
                    LABELS,
                    float(self.sample_bytes),
                    self.max_samples,
                    self.max_tracked,
                    self.max_frames,
                    self.mem_domain,
                    self.seed,
                    LabelSet,
                    "span_id",
                    self.filter_bits,
                )
            except RuntimeError as exc:
                raise MemorySamplerUnavailable(str(exc)) from exc
            # A new C session tracks no block yet: the blocks an earlier session tracked (before
            # a stop() in this process) left with its table, and their frees will never be
            # reported, so their in-use estimates would stay for good. The stack tables stay:
            # they hold their code objects (their keys stay valid), and the allocations not yet
            # in a window point into them.
            self._live.clear()
            self._inuse.clear()
            self._pid = pid
            self._started_ns = time.time_ns()
            _set_sampling(self)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="spanprof-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and put the previous allocator back (the samples stay for a window)."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(5.0)
        with self._lock:
            if self._pid != os.getpid() or _alloc is None:
                return
            ignoring = _alloc.ignore_thread(True)
            try:
                self._drain_locked()
            finally:
                _alloc.ignore_thread(ignoring)
            self._last_stats = self._stats_locked()
            _set_sampling(None)
            if not _alloc.stop():
                log_once(
                    "memory-hook-stuck",
                    "spanprof: another allocator hook (tracemalloc?) was installed after the "
                    "memory sampler's; its hooks stay in place, idle, so that one keeps working",
                    exc_info=False,
                )
            self._pid = None

    def _reset(self) -> None:
        self._tables = StackTables()
        self._stack_ids.clear()
        self._allocated.clear()
        self._live.clear()
        self._inuse.clear()

    def _run(self) -> None:
        ignore_profiler_thread()
        while not self._stop.wait(self.drain_interval):
            try:
                self.drain()
            except Exception:  # out of memory mid-drain, say: the next drain goes on
                self.drain_errors += 1
                log_once(
                    "memory-drain-failed",
                    "spanprof: a drain of the memory sampler failed; the next one goes on "
                    "(logged once)",
                )

    # --- per span ------------------------------------------------------------------------------

    def span_alloc_bytes(self, span_id: str) -> int | None:
        """The bytes ``span_id``'s sampled allocations stand for, forgotten from then on.

        Counted by the hook at each sample, so what the span allocated since the last drain is
        in; ``None`` when this sampler does not run in this process.
        """
        take = self.span_bytes_taker()
        return None if take is None else take(span_id)

    def span_bytes_taker(self) -> Callable[[str], int] | None:
        """``span_alloc_bytes``'s function, while this sampler runs in this process.

        For the request path, which asks once per request: it checks that this sampler runs
        here once, when it starts, and drops the function when it stops. ``None`` when this
        sampler does not run in this process.
        """
        if _alloc is None or self._pid != current_pid():
            return None
        return _alloc.take_span

    # --- drains and windows ---------------------------------------------------------------------

    # The ignore flag is per OS thread. Under gevent a drain runs in a greenlet of the OS thread
    # that runs the application's greenlets, and waiting for the lock or time.sleep() (both
    # patched: even a failed non-blocking acquire sleeps) switches to them: they would run with
    # the flag set, and nothing they allocate would be sampled. So the flag is set only once the
    # lock is held, and never across a switch (_drain_locked clears it around its sleep). The
    # lock is taken by a plain call, before anything else: on 3.10 `with` allocates (its bound
    # __exit__), which would then be sampled as the caller's.

    def drain(self) -> None:
        """Move the C buffers' samples and frees into the estimates."""
        self._lock.acquire()
        try:
            ignoring = _ignore_thread(True)
            try:
                if self._pid == os.getpid():
                    self._drain_locked()
            finally:
                _ignore_thread(ignoring)
        finally:
            self._lock.release()

    def take_window(self) -> MemoryWindow:
        """The allocations since the last window, and what is in use now."""
        self._lock.acquire()
        try:
            # What building the window allocates is the sampler's own work, not the
            # application's.
            ignoring = _ignore_thread(True)
            try:
                return self._take_window_locked()
            finally:
                _ignore_thread(ignoring)
        finally:
            self._lock.release()

    def _take_window_locked(self) -> MemoryWindow:
        if self._pid == os.getpid():
            self._drain_locked()
        now = time.time_ns()
        window = MemoryWindow(
            self._started_ns,
            self._tables,
            values={k: round(v[1]) for k, v in self._allocated.items()},
            end_ns=now,
            alloc_objects={k: round(v[0]) for k, v in self._allocated.items()},
            inuse={k: (round(v[0]), round(v[1])) for k, v in self._inuse.items()},
        )
        self._allocated = {}
        self._started_ns = now
        if len(self._tables) > _MAX_TABLE_SIZE:
            self._reintern_live()
        return window

    def _drain_locked(self) -> None:
        # Called with the calling thread's allocations ignored (drain, take_window, stop).
        if _alloc is None:
            return
        started = time.perf_counter_ns()
        stack_ids = self._stack_ids
        try:
            # Stacks interned already come as their keys alone (most samples: a few call sites
            # allocate most of the bytes), without tuples of their frames to build and collect.
            samples, freed = _alloc.drain(stack_ids)
        except MemoryError:
            self.drain_errors += 1
            return
        # Blocks freed before this drain saw them (asyncio's 256 KiB read buffer, shrunk as soon
        # as it is read, is one on about every other response) come untracked, those of one
        # stack and label set as one sample: never in use at a window, they skip the in-use
        # estimate, and the C side has summed their estimates.
        tables = self._tables
        allocated = self._allocated
        live = self._live
        inuse = self._inuse
        # The frees first: they are of samples earlier drains handed over (those of this drain's
        # own samples came as untracked samples), and a failure below (out of memory while
        # interning) must not lose them, or their blocks would stay in use for good.
        forget = live.pop
        for sample_id in freed:
            entry = forget(sample_id, None)
            if entry is None:
                continue
            key, objects, nbytes = entry
            held = inuse[key]
            held[2] -= 1
            if held[2] <= 0:
                del inuse[key]
            else:
                held[0] -= objects
                held[1] -= nbytes
        deadline = started + _SLICE_NS
        for first in range(0, len(samples), 32):
            if first and time.perf_counter_ns() > deadline:
                # A burst of samples is turned into estimates in slices: the application's
                # threads get the GIL in between (this lock keeps other drains out). Under
                # gevent the sleep switches to the application's greenlets, on this OS thread:
                # they run with its allocations sampled again.
                ignoring = _ignore_thread(False)
                try:
                    time.sleep(0)
                finally:
                    _ignore_thread(ignoring)
                deadline = time.perf_counter_ns() + _SLICE_NS
            for (
                sample_id,
                _,
                tracked,
                labels,
                codes,
                lastis,
                _,
                stack_key,
                objects,
                nbytes,
            ) in samples[first : first + 32]:
                if labels.__class__ is not LabelSet:  # isinstance() goes through ABCMeta
                    labels = labels if isinstance(labels, LabelSet) else EMPTY
                sid = stack_ids.get(stack_key)
                if sid is None:
                    if codes is None or lastis is None:  # named known, so never: for mypy
                        continue
                    sid = stack_ids[stack_key] = _intern(tables, codes, lastis)
                key = (sid, labels)
                counts = allocated.get(key)
                if counts is None:
                    allocated[key] = [objects, nbytes]
                else:
                    counts[0] += objects
                    counts[1] += nbytes
                if tracked:
                    live[sample_id] = (key, objects, nbytes)
                    total = inuse.get(key)
                    if total is None:
                        inuse[key] = [objects, nbytes, 1]
                    else:
                        total[0] += objects
                        total[1] += nbytes
                        total[2] += 1
        if _alloc.check_hooks():
            self._cut_off_locked()
        self.drains += 1
        took = time.perf_counter_ns() - started
        if took > self.max_drain_ns:
            self.max_drain_ns = took

    def _cut_off_locked(self) -> None:
        # The hooks were cut out of the allocator chain: no frees of the tracked blocks will
        # be seen, so their in-use estimates would stay for good.
        self._live.clear()
        self._inuse.clear()
        # Logging may wait for a lock, which under gevent switches to other greenlets: not
        # with the thread's allocations ignored (see drain).
        ignoring = _ignore_thread(False)
        try:
            log_once(
                "memory-hooks-cut-off",
                "spanprof: the memory sampler's allocator hooks were taken out from under it "
                "(tracemalloc started before the sampler and stopped since puts back the "
                "allocators it saved): allocations are no longer sampled; memory profiles "
                "resume when the sampler is restarted",
                exc_info=False,
            )
        finally:
            _ignore_thread(ignoring)

    def _reintern_live(self) -> None:
        # Start new tables, carrying over only the stacks that live samples still point at.
        old = self._tables
        new = StackTables()
        moved: dict[int, int] = {}

        def move(sid: int) -> int:
            new_sid = moved.get(sid)
            if new_sid is None:
                fids = []
                for frame in old.stacks[sid]:
                    fids.append(len(new.frames))
                    new.frames.append(frame)
                new_sid = moved[sid] = new.add_stack(tuple(fids))
            return new_sid

        self._live = {
            i: ((move(key[0]), key[1]), objects, nbytes)
            for i, (key, objects, nbytes) in self._live.items()
        }
        self._inuse = {(move(key[0]), key[1]): total for key, total in self._inuse.items()}
        self._tables = new
        self._stack_ids = {}

    # --- counters -------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Hook counters (samples, dropped, untracked, tracked...) and the drains' cost."""
        with self._lock:
            if self._pid != os.getpid():
                return dict(self._last_stats)
            return self._stats_locked()

    def _stats_locked(self) -> dict[str, float]:
        raw: dict[str, Any] = _alloc.stats() if _alloc is not None else {}
        return {
            **{k: float(v) for k, v in raw.items() if k not in ("active", "stuck")},
            "live": float(len(self._live)),
            "drains": float(self.drains),
            "drain_errors": float(self.drain_errors),
            "max_drain_us": self.max_drain_ns / 1e3,
        }


def _intern(tables: StackTables, codes: tuple[CodeType, ...], lastis: tuple[int, ...]) -> int:
    ids: list[int] = []
    frame_ids = tables.frame_ids
    line_of = _alloc.addr2line if _alloc is not None else _first_line
    for code, lasti in zip(codes, lastis, strict=True):
        fid = frame_ids.get((id(code), lasti))
        if fid is None:
            fid = tables.raw_frame(code, lasti, line_of(code, lasti))
        ids.append(fid)
    return tables.stack_of(tuple(ids))


def _set_sampling(sampler: MemorySampler | None) -> None:
    """Make ``sampler`` (``None``: none) the one whose hooks a forked child takes out."""
    global _sampling, _fork_handler_registered
    _sampling = None if sampler is None else weakref.ref(sampler)
    if sampler is not None and not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_registered = True


def ignore_profiler_thread() -> None:
    """Leave the calling thread's allocations unsampled from now on: it is one of the
    profiler's own threads (drain, upload), whose work is nobody's memory.

    Under gevent such a "thread" is a greenlet of the main OS thread, which runs the
    application (and the CPU sampler's signal handler): that thread is left alone.
    """
    if _alloc is None:
        return
    # Ignored first, by the C call itself: the check below allocates (two ints), and so does a
    # Python call on 3.10 (its frame); a sample of either would be the profiler's own.
    previous = _alloc.ignore_thread(True)
    if in_main_os_thread():
        _alloc.ignore_thread(previous)


def _ignore_thread(ignore: bool) -> bool:
    """Leave the calling thread's allocations unsampled (or not); the previous setting."""
    return _alloc.ignore_thread(ignore) if _alloc is not None else False


def _first_line(code: CodeType, lasti: int) -> int:
    return code.co_firstlineno
