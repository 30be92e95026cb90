"""The exact profiler: its sampler, its uploader and its backend, against real servers."""

from __future__ import annotations

import asyncio
import gc
import http.client
import importlib.util
import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import spanprof
from spanprof._labels._engine import run_labelled
from spanprof._labels._labelset import EMPTY, LabelSet
from spanprof._labels._scope import labels_scope
from spanprof._local._receiver import PushReceiver
from spanprof._profiling._choose import profiler_from_env
from spanprof._profiling._encoders._pprof import decode_profile
from spanprof._profiling._encoders._window import WindowEncoder, series_labels
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._exporters._pusher import Pusher
from spanprof._profiling._pyroscope import PyroscopeBackend
from spanprof._profiling._runtime import ProfilerRuntime
from spanprof._profiling._samplers import _signal
from spanprof._profiling._samplers._signal import (
    Sampler,
    SamplerUnavailable,
    SignalInUse,
)
from spanprof._profiling._window import StackTables, Window

from .conftest import AGENT_ENV, MEMORY_SAMPLED, require, run_on
from .e2e.markers import MARKERS, marker_index
from .e2e.server import ROOT, free_port
from .exporting import GZIP_FASTEST, timed_steps
from .recording_server import PostedRequest, RecordingServer

LINUX = sys.platform.startswith("linux")


def _labels(index: int) -> LabelSet:
    return LabelSet(
        {
            "span_id": f"{index + 1:016x}",
            "trace_id": f"{index + 1:032x}",
            "span_name": "GET /work/{index}",
        }
    )


@pytest.fixture
def sampler() -> Iterator[Sampler]:
    """A CPU-clock sampler at the highest rate Linux delivers, stopped afterwards."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    instance = Sampler(sample_rate=250)
    try:
        yield instance
    finally:
        instance.stop()


def _by_marker(window: Window) -> dict[int, dict[LabelSet, int]]:
    """Weight per marker index per label set, from every stack that runs a marker."""
    out: dict[int, dict[LabelSet, int]] = {}
    for (sid, labels), value in window.values.items():
        index = marker_index([frame.function for frame in window.stack(sid)])
        if index is not None:
            per = out.setdefault(index, {})
            per[labels] = per.get(labels, 0) + value
    return out


# --- the sampler ---------------------------------------------------------------------------------


@pytest.mark.engine
def test_sampler_reads_the_running_tasks_labels_at_sample_time(
    sampler: Sampler, loop_kind: str
) -> None:
    """Tasks switching every 0.2 ms get their own labels on every sample, with no engine."""
    assert spanprof.engine.installed_backend() is None

    used: list[float] = []

    # Burns of 0.1 to 0.3 ms: with fixed ones, the tasks' turns can lock in phase with a loaded
    # VM's timer checks (every scheduler tick) and one task is never the one running at a tick
    # (CI once read 122 ticks, none in marker 1).
    turns = random.Random(0x5EED)

    async def request(index: int) -> None:
        with labels_scope(_labels(index)):
            for _ in range(800):
                MARKERS[index](0.0001 + 0.0002 * turns.random())
                await asyncio.sleep(0)

    async def main() -> None:
        sampler.start()
        started = time.thread_time()
        # A loaded VM checks CPU timers only at its scheduler ticks: two CPU hogs on two cores
        # cut 125 ticks per 0.5 s of CPU to 9-46 (measured with a bare setitimer too), each
        # then weighing up to 300 ms, and the tail after the last one is not sampled. Rounds go
        # on until enough ticks were taken for the shares below to mean something.
        while True:
            await asyncio.gather(*(request(i) for i in range(3)))
            if sampler.ticks >= 100 or time.thread_time() - started > 8:
                break
        used.append(time.thread_time() - started)
        sampler.stop()

    run_on(loop_kind, main)
    by_marker = _by_marker(sampler.take_window())
    stats = sampler.stats()
    # Every sample of a task's code carries its labels and no other, and every task was sampled.
    for index, per_labels in by_marker.items():
        assert list(per_labels) == [_labels(index)], per_labels
    assert sorted(by_marker) == [0, 1, 2], stats
    # Weighed by the main thread's CPU: the samples add up to what the tasks used (how it
    # splits between three equal tasks depends on a few dozen ticks, more so on a busy machine).
    total = sum(sum(per_labels.values()) for per_labels in by_marker.values())
    assert total / 1e9 == pytest.approx(used[0], rel=0.25), stats
    assert sampler.stats()["errors"] == 0


@pytest.mark.engine
def test_sampler_weighs_each_thread_by_its_own_cpu(sampler: Sampler) -> None:
    """A worker's and the main thread's samples add up to the CPU each of them used."""
    used: dict[str, float] = {}

    def worker() -> None:
        sampler.set_thread_labels(EMPTY, _labels(1))
        started = time.thread_time()
        for _ in range(15):
            MARKERS[1](0.02)
            time.sleep(0.001)
        used["worker"] = time.thread_time() - started
        sampler.set_thread_labels(_labels(1), EMPTY)

    sampler.start()
    thread = threading.Thread(target=worker)
    thread.start()
    started = time.thread_time()
    with labels_scope(_labels(0)):
        while thread.is_alive():
            MARKERS[0](0.002)
    used["main"] = time.thread_time() - started
    thread.join()
    sampler.stop()
    window = sampler.take_window()
    by_marker = _by_marker(window)
    assert list(by_marker[0]) == [_labels(0)]
    assert list(by_marker[1]) == [_labels(1)]
    by_labels: dict[LabelSet, int] = {}
    for (_sid, labels), value in window.values.items():
        by_labels[labels] = by_labels.get(labels, 0) + value
    # The worker gives the GIL up only when it sleeps, so some of its samples show it there
    # rather than in its marker; under its own labels, all of its CPU is counted.
    assert by_labels[_labels(1)] / 1e9 == pytest.approx(used["worker"], rel=0.1)
    assert by_labels[_labels(0)] / 1e9 == pytest.approx(used["main"], rel=0.2)


@pytest.mark.engine
def test_a_tick_walks_the_other_threads_only_once_they_used_cpu(sampler: Sampler) -> None:
    """Walking the other threads is most of a tick's cost: with them idle, a tick reads the
    main thread alone. A worker that runs a little now and then is walked once its CPU adds
    up, and all of it is booked, under its labels."""
    walks: list[int] = []
    walk = sampler._sample_threads

    def counted(window: Window, tick: int, wall_now: int) -> int:
        walks.append(tick)
        return walk(window, tick, wall_now)

    sampler._sample_threads = counted  # type: ignore[method-assign]
    # The worker runs once every ten ticks, however far apart a busy machine spreads them.
    tenth_tick = threading.Event()
    others_ran = sampler._others_ran

    def ticking(main_now: int, process_now: int) -> bool:
        if sampler.ticks % 10 == 0:
            tenth_tick.set()
        return others_ran(main_now, process_now)

    sampler._others_ran = ticking  # type: ignore[method-assign]
    stop = threading.Event()
    used: list[float] = []

    def worker() -> None:
        sampler.set_thread_labels(EMPTY, _labels(1))
        started = time.thread_time()
        while not stop.is_set():
            MARKERS[1](0.0002)
            tenth_tick.clear()
            tenth_tick.wait(1.0)
        used.append(time.thread_time() - started)
        sampler.set_thread_labels(_labels(1), EMPTY)

    def burn_until(ticks: int) -> None:
        # On a busy machine the kernel folds CPU-timer expiries into fewer signals: burn until
        # the ticks are there (within a bound), not for a fixed time.
        spent = 0.0
        while sampler.ticks < ticks and spent < 5.0:
            MARKERS[0](0.05)
            spent += 0.05

    idle = [threading.Thread(target=stop.wait) for _ in range(3)]
    for thread in idle:
        thread.start()
    sampler.start()
    with labels_scope(_labels(0)):
        burn_until(40)
    quiet_ticks, quiet_walks = sampler.ticks, len(walks)
    busy = threading.Thread(target=worker)
    busy.start()
    with labels_scope(_labels(0)):
        MARKERS[0](0.3)
        burn_until(quiet_ticks + 150)
    stop.set()
    busy.join()
    for thread in idle:
        thread.join()
    sampler.stop()
    ticks, all_walks = sampler.ticks - quiet_ticks, len(walks) - quiet_walks
    # Idle: the first tick walks (to learn the threads), and the odd one after a wake-up.
    assert quiet_ticks >= 20, sampler.stats()
    assert quiet_walks <= 3 + quiet_ticks // 10, (quiet_walks, quiet_ticks)
    # The worker: 0.2 ms every ten ticks: walked about as often as it ran, not at every tick.
    assert all_walks < ticks * 0.6, (all_walks, ticks)
    by_labels: dict[LabelSet, int] = {}
    for (_sid, labels), value in sampler.take_window().values.items():
        by_labels[labels] = by_labels.get(labels, 0) + value
    assert by_labels[_labels(1)] / 1e9 == pytest.approx(used[0], rel=0.2), (by_labels, used)


@pytest.mark.engine
def test_walking_the_other_threads_leaves_no_cycles(sampler: Sampler) -> None:
    """A walk reads every thread's frames, the interrupted main thread's among them: none of
    it outlives the tick in a reference cycle that only the collector would free."""
    stop = threading.Event()
    used: list[float] = []

    def worker() -> None:
        started = time.thread_time()
        while not stop.is_set():
            MARKERS[1](0.001)
        used.append(time.thread_time() - started)

    busy = threading.Thread(target=worker)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        sampler.start()
        busy.start()
        spent = 0.0
        while sampler.ticks < 100 and spent < 5.0:
            MARKERS[0](0.05)
            spent += 0.05
        stop.set()
        busy.join()
        sampler.stop()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert sampler.ticks >= 50, sampler.stats()
    assert used[0] > 0.05, used
    frames = [o for o in garbage if isinstance(o, FrameType)]
    assert [f.f_code.co_name for f in frames] == []


class _SamplerBackend:
    """The label engine feeding a bare sampler (what ExactBackend does once started)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def start(self) -> None:
        self.sampler.start()

    def shutdown(self) -> None:
        self.sampler.stop()

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        self.sampler.set_thread_labels(previous, current)


@pytest.mark.engine
def test_short_pool_jobs_are_booked_to_their_labels_and_function(sampler: Sampler) -> None:
    """Jobs shorter than a tick still count, in full, under their labels and function."""
    spanprof.engine.install_label_engine(_SamplerBackend(sampler))
    try:
        sampler.start()

        pool_cpu: list[float] = []

        def pool() -> None:
            started = time.thread_time()
            for n in range(400):
                run_labelled(_labels(n % 4), MARKERS[n % 4], 0.0007)
            pool_cpu.append(time.thread_time() - started)

        thread = threading.Thread(target=pool)
        thread.start()
        thread.join()
        sampler.stop()
    finally:
        spanprof.engine.uninstall_label_engine()
    window = sampler.take_window()
    by_marker = _by_marker(window)
    for index in range(4):
        assert list(by_marker[index]) == [_labels(index)]
        # 100 jobs of 0.7 ms each, and their labelling around them.
        assert sum(by_marker[index].values()) / 1e9 >= 0.07 * 0.9
    # Nothing is counted twice: the jobs hold no more than the thread used. (Not 0.07 each
    # from above: on a loaded VM the thread clock runs on while the host steals the vCPU, and
    # what a steal adds to a job's few microseconds of labelling is not burnt off like a
    # marker's is, so a job books up to 12% more than 0.7 ms there.)
    booked = sum(sum(by_marker[index].values()) for index in range(4)) / 1e9
    assert booked <= pool_cpu[0] * 1.01
    leaves = {window.stack(sid)[0].function for (sid, _labels_), _v in window.values.items()}
    assert {f"burn_request_0{i}" for i in range(4)} <= leaves


@pytest.mark.engine
def test_short_to_thread_jobs_are_booked_to_their_function(sampler: Sampler) -> None:
    """asyncio.to_thread runs the job as partial(context.run, func, ...): jobs shorter than a
    tick, booked where they started, start in func (once, all of it in run_labelled)."""
    spanprof.engine.install_label_engine(_SamplerBackend(sampler))

    async def main() -> None:
        sampler.start()
        with labels_scope(_labels(0)):
            for _ in range(200):
                await asyncio.to_thread(MARKERS[1], 0.001)
        sampler.stop()

    try:
        run_on("asyncio", main)
    finally:
        spanprof.engine.uninstall_label_engine()
    window = sampler.take_window()
    # The worker's CPU: what was booked on a stack of a job run with its labels.
    by_leaf: dict[str, int] = {}
    for (sid, labels), value in window.values.items():
        stack = [frame.function for frame in window.stack(sid)]
        if labels == _labels(0) and "run_labelled" in stack:
            by_leaf[stack[0]] = by_leaf.get(stack[0], 0) + value
    # 200 jobs of 1 ms, and their labelling around them.
    assert sum(by_leaf.values()) >= 0.2e9 * 0.9, by_leaf
    assert by_leaf.get("burn_request_01", 0) >= sum(by_leaf.values()) * 0.9, by_leaf


@pytest.mark.engine
def test_a_workers_cpu_under_labels_equal_to_its_last_push_is_booked(sampler: Sampler) -> None:
    """A labels block inside another with the same labels is a new, equal set: the engine
    pushes nothing for it, and names it as the labels left at the next push. The worker's
    CPU under it belongs to those labels (once, 75% of it was dropped as unsampled)."""
    spanprof.engine.install_label_engine(_SamplerBackend(sampler))
    used: list[float] = []

    def worker() -> None:
        started = time.thread_time()
        for _ in range(300):
            with spanprof.profile_labels(tenant="acme"), spanprof.profile_labels(tenant="acme"):
                MARKERS[1](0.001)
                with spanprof.profile_labels(stage="db"):
                    MARKERS[2](0.0002)
        used.append(time.thread_time() - started)

    try:
        sampler.start()
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        sampler.stop()
    finally:
        spanprof.engine.uninstall_label_engine()
    acme = sum(
        value
        for (_sid, labels), value in sampler.take_window().values.items()
        if labels.get("tenant") == "acme"
    )
    stats = sampler.stats()
    assert acme / 1e9 == pytest.approx(used[0], rel=0.15), stats
    assert stats["unsampled_ms"] < used[0] * 1e3 * 0.1, stats


@pytest.mark.engine
@pytest.mark.timeout(60, method="thread")  # the wall clock uses SIGALRM, pytest-timeout's signal
def test_a_pool_worker_waiting_where_it_waited_before_its_jobs_keeps_a_stack() -> None:
    """Wall clock: a pool worker waits for jobs in the same frame at the same instruction
    every time (``_worker``, in the C queue's ``get``). A job's labels ending between two
    looks forgets the stack it was last seen on; the next look must not book the wait to
    that forgotten stack (once, a sample without one: the window could not be encoded)."""
    wall = Sampler(sample_rate=200, clock="wall")
    spanprof.engine.install_label_engine(_SamplerBackend(wall))
    pool = ThreadPoolExecutor(1)
    try:
        wall.start()
        for n in range(60):
            pool.submit(run_labelled, _labels(n % 3), MARKERS[n % 3], 0.0005).result()
            time.sleep(0.006)
        wall.stop()
    finally:
        pool.shutdown()
        spanprof.engine.uninstall_label_engine()
    window = wall.take_window()
    assert wall.ticks >= 40, wall.stats()
    assert [sid for sid, _labels_ in window.values if sid < 0 and sid not in window.foreign] == []
    waits = {
        window.stack(sid)[0].function
        for (sid, labels), _v in window.values.items()
        if not labels and sid >= 0
    }
    assert "_worker" in waits
    encoder = WindowEncoder(window, period_ns=5_000_000)
    while not encoder.done:
        encoder.step()
    decoded = [decode_profile(raw) for raw in encoder.profiles]
    assert sum(p.total() for p in decoded) == sum(window.values.values())


@pytest.mark.engine
def test_waiting_threads_are_never_sampled_as_running(sampler: Sampler) -> None:
    """Threads blocked in a wait show no samples with the wait as their leaf."""
    stop = threading.Event()

    def bursty() -> None:
        while not stop.is_set():
            MARKERS[5](0.001)
            stop.wait(0.003)

    threads = [threading.Thread(target=stop.wait), threading.Thread(target=bursty)]
    for thread in threads:
        thread.start()
    sampler.start()
    MARKERS[0](0.4)
    sampler.stop()
    stop.set()
    for thread in threads:
        thread.join()
    window = sampler.take_window()
    leaves = {window.stack(sid)[0].function for (sid, _labels_), _v in window.values.items()}
    assert "Condition.wait" not in leaves
    assert "wait" not in leaves
    assert 5 in _by_marker(window) or any("bursty" in leaf for leaf in leaves)


def test_the_default_selectors_and_trios_io_waits_count_as_waiting() -> None:
    """asyncio waits in the default selector's select, which on Linux is EpollSelector's own
    (not the _PollLikeSelector.select it inherits from); trio waits in its I/O manager."""
    import selectors

    blocking = _signal._blocking_codes()
    assert id(selectors.DefaultSelector.select.__code__) in blocking
    require(LINUX, "trio's epoll I/O manager is Linux's")
    require(importlib.util.find_spec("trio") is not None, "trio is not installed")
    from trio._core._io_epoll import EpollIOManager

    assert id(EpollIOManager.get_events.__code__) in _signal._blocking_codes()


@pytest.mark.engine
def test_a_loop_waiting_for_its_pool_books_nothing_to_its_selector(sampler: Sampler) -> None:
    """Requests on the main thread's loop hand labelled jobs to asyncio.to_thread and wait
    for them in the selector. The loop's CPU between ticks that find it waiting belongs to
    what it ran, never to the wait, unlabelled (once, 130 ms of 800 ms)."""
    spanprof.engine.install_label_engine(_SamplerBackend(sampler))

    async def request(index: int) -> None:
        with labels_scope(_labels(index)):
            for _ in range(50):
                MARKERS[index](0.0005)
                await asyncio.to_thread(MARKERS[2 + index], 0.002)

    async def main() -> None:
        sampler.start()
        # Rounds of 0.25 s of CPU until 150 ticks, however few of them a busy machine delivers.
        for _ in range(8):
            await asyncio.gather(*(request(i) for i in range(2)))
            if sampler.ticks >= 150:
                break
        sampler.stop()

    try:
        run_on("asyncio", main)
    finally:
        spanprof.engine.uninstall_label_engine()
    window = sampler.take_window()
    assert sampler.ticks >= 50, sampler.stats()
    waits = {
        window.stack(sid)[0].function: value
        for (sid, _labels_), value in window.values.items()
        if window.stack(sid)[0].function.endswith("Selector.select")
    }
    assert waits == {}, sampler.stats()
    # The requests' CPU, the jobs' included, is there under their labels.
    by_labels: dict[LabelSet, int] = {}
    for (_sid, labels), value in window.values.items():
        by_labels[labels] = by_labels.get(labels, 0) + value
    assert by_labels.get(_labels(0), 0) > 0.05e9, by_labels
    assert by_labels.get(_labels(1), 0) > 0.05e9, by_labels


def test_a_thread_of_only_waiting_machinery_is_booked_to_its_root() -> None:
    """CPU a thread used before blocking is booked to the callers of its wait; a thread whose
    target is the wait itself has none, and got the wait as its leaf (which the test above
    then saw, now and again: the thread's start-up CPU, first read at its second look)."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        top = sys._current_frames().get(thread.ident or 0)
        while (top is None or top.f_code.co_name != "wait") and time.monotonic() < deadline:
            time.sleep(0.01)
            top = sys._current_frames().get(thread.ident or 0)
        assert top is not None
        booked = _signal._callers_of_wait(top)
        assert booked is not None
        assert booked.f_back is None  # the thread's root frame
        assert booked.f_code.co_name == "_bootstrap"
    finally:
        stop.set()
        thread.join()


@pytest.mark.engine
@pytest.mark.timeout(60, method="thread")  # the wall clock uses SIGALRM, pytest-timeout's signal
def test_wall_clock_counts_waiting_threads(sampler: Sampler) -> None:
    """With clock="wall" a thread waiting 0.3 s shows about 0.3 s in its wait."""
    wall = Sampler(sample_rate=200, clock="wall")
    release = threading.Event()
    waiter = threading.Thread(target=release.wait, name="waiter")
    waiter.start()
    wall.start()
    try:
        time.sleep(0.3)
    finally:
        wall.stop()
        release.set()
        waiter.join()
    window = wall.take_window()
    waited = sum(
        value
        for (sid, _labels_), value in window.values.items()
        if window.stack(sid)[0].function in ("Condition.wait", "wait")
    )
    assert 0.15e9 < waited < 0.6e9
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_start_refuses_a_signal_someone_else_handles(sampler: Sampler) -> None:
    """With a SIGPROF handler installed, start() raises naming the signal and the way out."""

    def theirs(signum: int, frame: Any) -> None:
        return None

    previous = signal.signal(signal.SIGPROF, theirs)
    try:
        with pytest.raises(SignalInUse, match=r"SIGPROF.*SPANPROF_PROFILER=pyroscope"):
            sampler.start()
        backend = ExactBackend(server_address="http://127.0.0.1:9", application_name="svc")
        with pytest.raises(RuntimeError, match="SIGPROF"):
            backend.start()
        assert backend.mode == "stopped"
        assert signal.getsignal(signal.SIGPROF) is theirs
    finally:
        signal.signal(signal.SIGPROF, previous)


def test_start_refuses_an_armed_timer(sampler: Sampler) -> None:
    """An ITIMER_PROF armed by someone else makes start() refuse instead of resetting it."""
    signal.setitimer(signal.ITIMER_PROF, 300.0)
    try:
        with pytest.raises(SignalInUse, match="timer"):
            sampler.start()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0.0)


def test_stop_restores_the_handler_and_disarms_the_timer(sampler: Sampler) -> None:
    """After stop() SIGPROF is back to its default and ITIMER_PROF is disarmed."""
    sampler.start()
    assert signal.getsignal(signal.SIGPROF) != signal.SIG_DFL
    MARKERS[0](0.05)
    sampler.stop()
    assert signal.getsignal(signal.SIGPROF) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert sampler.stats()["ticks"] > 0


def test_start_outside_the_main_thread_is_unavailable(sampler: Sampler) -> None:
    """start() in another thread raises SamplerUnavailable naming that thread."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            sampler.start()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=start, name="loop-thread")
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], SamplerUnavailable)
    assert "loop-thread" in str(errors[0])


def test_sampler_failures_never_reach_the_application(
    sampler: Sampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing tick is counted and swallowed; the interrupted code runs on."""

    def broken(*args: object) -> int:
        raise RuntimeError("injected")

    monkeypatch.setattr(sampler, "_stack_id", broken)
    sampler.start()
    spins = MARKERS[0](0.1)
    sampler.stop()
    assert spins > 0
    assert sampler.stats()["errors"] > 0
    assert isinstance(sampler.last_error, RuntimeError)


# --- the uploader --------------------------------------------------------------------------------


class _Front(RecordingServer):
    """A real HTTP server in front of a PushReceiver: records requests, injects faults.

    The first requests are answered with ``statuses`` (no body) instead of being forwarded.
    """

    def __init__(self, target: str, statuses: list[int] | None = None) -> None:
        super().__init__()
        self.target = urlsplit(target)
        self.statuses = list(statuses or [])

    def respond(self, request: PostedRequest) -> int:
        with self._lock:
            if self.statuses:
                return self.statuses.pop(0)
        conn = http.client.HTTPConnection(self.target.hostname or "", self.target.port)
        try:
            conn.request("POST", request.path, body=request.body, headers=request.headers)
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()


def _leaf() -> None:
    return None


def _root() -> None:
    return None


def _window(labels: LabelSet, value: int = 10_000_000) -> Window:
    """A one-sample window: ``_leaf`` called from ``_root``, under ``labels``."""
    tables = StackTables()
    sid = tables.stack_of(
        tuple(tables.raw_frame(f.__code__, 0, f.__code__.co_firstlineno) for f in (_leaf, _root))
    )
    window = Window(time.time_ns(), tables)
    window.values[(sid, labels)] = value
    window.end_ns = window.start_ns + 1_000_000
    return window


def _windows(make: Callable[[int], Window]) -> Callable[[], Window]:
    counter = iter(range(1_000_000))
    return lambda: make(next(counter))


def _pusher(url: str, **options: Any) -> Pusher:
    defaults: dict[str, Any] = {
        "server_address": url,
        "labels": series_labels("svc", {"region": "eu"}),
        "period_ns": 10_000_000,
        "upload_interval": 60.0,
        "backoff_initial": 0.05,
        "backoff_max": 0.4,
        "flush_timeout": 2.0,
        "timeout": 2.0,
    }
    return Pusher(**{**defaults, **options})


def test_pusher_sends_what_pyroscope_io_sends() -> None:
    """Same path, headers, series labels and pprof shape as the agent; labels per sample."""
    with PushReceiver() as receiver, _Front(receiver.url) as front:
        pusher = _pusher(
            front.url, tenant_id="team-a", basic_auth_username="u", basic_auth_password="p"
        )
        pusher.start(_windows(lambda n: _window(_labels(0), 30_000_000)))
        pusher.stop()
        pushes = receiver.received_pushes()
    assert len(pushes) == 1
    headers = front.requests[0].headers
    assert headers["content-type"] == "application/proto"
    assert headers["content-encoding"] == "gzip"
    assert front.requests[0].body[8] == GZIP_FASTEST  # the gzip header's XFL: level 1
    assert headers["authorization"] == "Basic dTpw"
    assert headers["x-scope-orgid"] == "team-a"
    assert headers["user-agent"].startswith("spanprof/")
    (series,) = pushes[0].series
    names = [name for name, _value in series.labels]
    assert names[:3] == ["__name__", "region", "service_name"]
    assert dict(series.labels)["__name__"] == "process_cpu"
    assert dict(series.labels)["service_name"] == "svc"
    assert dict(series.labels)["process.runtime.name"] == sys.implementation.name
    (profile,) = series.profiles
    assert profile.sample_types == (("cpu", "nanoseconds"),)
    assert profile.period_type == ("cpu", "nanoseconds")
    assert profile.period == 10_000_000
    (sample,) = profile.samples
    assert [frame.function for frame in sample.stack] == ["_leaf", "_root"]
    assert sample.value == 30_000_000
    assert dict(sample.labels) == dict(_labels(0))
    assert pusher.stats()["uploads"] == 1


def test_pusher_retries_with_growing_backoff_after_server_errors() -> None:
    """Three 5xx answers are retried with doubling back-off, then the window arrives."""
    with PushReceiver() as receiver, _Front(receiver.url, [500, 503, 502]) as front:
        pusher = _pusher(front.url, upload_interval=0.1)
        windows = iter([_window(_labels(0))])
        pusher.start(lambda: next(windows, Window(time.time_ns(), StackTables())))
        assert receiver.wait_for(lambda r: r.pushes >= 1, timeout=10)
        pusher.stop()
        stats = pusher.stats()
    times = [request.at for request in front.requests]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert len(times) == 4
    # 0.05 s, then 0.1 s, then 0.2 s, each +-20%.
    assert gaps[1] > gaps[0] * 1.3
    assert gaps[2] > gaps[1] * 1.3
    assert (stats["failures"], stats["retries"], stats["uploads"]) == (3, 3, 1)
    assert stats["dropped"] == 0


def test_pusher_does_not_retry_a_rejected_upload() -> None:
    """A 4xx answer drops the window at once (counted), without retries."""
    with PushReceiver() as receiver, _Front(receiver.url, [400]) as front:
        pusher = _pusher(front.url)
        pusher.start(_windows(lambda n: _window(_labels(0))))
        pusher.stop()
    assert len(front.requests) == 1
    assert (pusher.stats()["rejected"], pusher.stats()["retries"]) == (1, 0)
    assert receiver.pushes == 0


def test_pusher_drops_the_oldest_windows_while_the_server_is_away() -> None:
    """With the server down, at most max_pending windows wait; the newest arrive later."""
    port = free_port()
    pusher = _pusher(
        f"http://127.0.0.1:{port}", upload_interval=0.05, max_pending=2, backoff_initial=0.3
    )
    pusher.start(_windows(lambda n: _window(LabelSet({"window": str(n)}))))
    try:
        deadline = time.monotonic() + 10
        while pusher.stats()["dropped"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.stats()["dropped"] >= 3
        assert pusher.stats()["pending"] <= 2
        with PushReceiver(port) as receiver:
            assert receiver.wait_for(lambda r: r.pushes >= 2, timeout=10)
            pusher.stop()
            received = [int(s.label_values("window")[0]) for s in receiver.samples()]
    finally:
        pusher.stop()
    stats = pusher.stats()
    assert stats["failures"] >= 1
    # Every window is either received or counted as dropped, and the oldest went first.
    assert min(received) >= 2
    assert sorted(received) == received


def test_pusher_flushes_the_last_window_on_stop() -> None:
    """stop() uploads what was collected since the last upload."""
    with PushReceiver() as receiver:
        pusher = _pusher(receiver.url, upload_interval=3600.0)
        pusher.start(_windows(lambda n: _window(_labels(3))))
        time.sleep(0.05)
        assert receiver.pushes == 0
        pusher.stop()
        assert receiver.pushes == 1


def test_stop_gives_up_after_the_flush_timeout_when_the_server_is_down() -> None:
    """With nobody listening, stop() returns within its budget and counts the drop."""
    pusher = _pusher(f"http://127.0.0.1:{free_port()}", flush_timeout=0.3, backoff_initial=0.1)
    pusher.start(_windows(lambda n: _window(_labels(0))))
    started = time.monotonic()
    pusher.stop()
    assert time.monotonic() - started < 2.0
    assert pusher.stats()["dropped"] == 1
    assert pusher.stats()["uploads"] == 0


@pytest.mark.parametrize(("max_samples", "profiles"), [(None, 1), (1000, 4)])
def test_window_encoding_steps_stay_short_and_lose_nothing(
    max_samples: int | None, profiles: int
) -> None:
    """4,000 distinct deep samples encode in steps of < 2 ms CPU: into one profile, written
    a slice at a time, or into several when a profile may hold fewer."""
    codes = [fn.__code__ for fn in (_leaf, _root, _labels, _window, _windows, _pusher)]

    def make() -> WindowEncoder:
        tables = StackTables()
        window = Window(time.time_ns(), tables)
        for n in range(4000):
            key = tuple(
                tables.raw_frame(codes[(n + depth) % len(codes)], depth * 2 + n % 7, depth + 1)
                for depth in range(48)
            )
            window.values[(tables.stack_of(key), _labels(n))] = n + 1
        window.end_ns = window.start_ns + 10_000_000_000
        if max_samples is None:
            return WindowEncoder(window, period_ns=10_000_000)
        return WindowEncoder(window, period_ns=10_000_000, max_samples=max_samples)

    encoder, longest, _ = timed_steps(make)
    assert longest < 2_000_000
    assert len(encoder.profiles) == profiles
    decoded = [decode_profile(raw) for raw in encoder.profiles]
    assert sum(len(p.samples) for p in decoded) == 4000
    assert sum(p.total() for p in decoded) == sum(range(1, 4001))
    assert all(len(s.stack) == 48 for p in decoded for s in p.samples)
    assert {s.label("span_id") for p in decoded for s in p.samples} == {
        _labels(n)["span_id"] for n in range(4000)
    }


# --- the backend ---------------------------------------------------------------------------------


def test_exact_backend_pushes_exact_labels_and_flushes_on_shutdown() -> None:
    """Through the runtime: exact mode without step hooks, labelled samples, a final flush."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        backend = ExactBackend(
            server_address=receiver.url,
            application_name="unit",
            upload_interval=3600,
            sample_rate=250,
            tags={"region": "eu"},
        )
        runtime = ProfilerRuntime(backend)
        runtime.start()
        try:
            assert (backend.mode, backend.needs_step_hooks) == ("exact", False)
            assert spanprof.engine.installed_backend() is backend
            with labels_scope(_labels(7)):
                MARKERS[7](0.2)
                # An 8 MiB block: sampled but for exp(-16), so a memory window has something to
                # push whatever else this interpreter allocates (the handler's own allocations
                # are nobody's, and 3.14 allocates little around the burn).
                del_me = bytes(8 << 20)
                del del_me
        finally:
            runtime.stop()
        assert backend.mode == "stopped"
        pushes = receiver.received_pushes()
    # One CPU push (the final flush), and the memory profiles' own where they are sampled.
    assert [[series.label("__name__") for series in push.series] for push in pushes] in (
        (
            [["process_cpu"], ["memory"]],
            [["memory"], ["process_cpu"]],
        )
        if MEMORY_SAMPLED
        else ([["process_cpu"]],)
    )
    assert pushes[0].user_agent.startswith("spanprof/")
    samples = [s for s in receiver.samples() if s.has_function("burn_request_07")]
    assert samples
    assert all(dict(s.labels) == dict(_labels(7)) for s in samples)
    assert {s.series_label("service_name") for s in samples} == {"unit"}
    assert backend.stats()["uploads"] == 1


_FALLBACK_SCRIPT = """
import asyncio, logging, sys, threading
import spanprof
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._runtime import ProfilerRuntime
from spanprof._labels._scope import labels_scope
from spanprof._labels._labelset import LabelSet
from tests.e2e.markers import MARKERS

logging.basicConfig(level=logging.WARNING)
backend = ExactBackend(server_address=sys.argv[1], application_name="fallback", upload_interval=1)
runtime = ProfilerRuntime(backend)

async def serve():
    runtime.start()
    print("mode", backend.mode, backend.needs_step_hooks, flush=True)
    with labels_scope(LabelSet({"span_id": "00000000000000aa"})):
        MARKERS[9](1.2)
    runtime.stop()

thread = threading.Thread(target=asyncio.run, args=(serve(),), name="loop-thread")
thread.start()
thread.join()
"""


def _run_script(
    path: Path, source: str, server_url: str, *python_options: str
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a script with the repository importable, pushing to ``server_url``."""
    path.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"}
    return subprocess.run(
        [sys.executable, *python_options, str(path), server_url],
        capture_output=True,
        text=True,
        timeout=45,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_exact_backend_falls_back_to_pyroscope_outside_the_main_thread(tmp_path: Path) -> None:
    """Started from a loop in another thread: a warning says why, pyroscope-io profiles."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _run_script(tmp_path / "fallback.py", _FALLBACK_SCRIPT, receiver.url)
        assert proc.returncode == 0, proc.stderr
        pushes = receiver.received_pushes()
        samples = [s for s in receiver.samples() if s.has_function("burn_request_09")]
    assert "mode pyroscope True" in proc.stdout
    assert "loop-thread" in proc.stderr
    assert "profiling with pyroscope-io and the label engine" in proc.stderr
    assert pushes
    assert all(p.user_agent.startswith("pyroscope-rs") for p in pushes)
    assert any(s.label_values("span_id") == ("00000000000000aa",) for s in samples)


_FORK_SCRIPT = """
import os, sys
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._runtime import ProfilerRuntime
from spanprof._labels._scope import labels_scope
from spanprof._labels._labelset import LabelSet
from tests.e2e.markers import MARKERS

backend = ExactBackend(
    server_address=sys.argv[1], application_name="forked", upload_interval=3600, sample_rate=250
)
runtime = ProfilerRuntime(backend)
runtime.start()
with labels_scope(LabelSet({"span_id": "000000000000000a"})):
    MARKERS[10](0.3)  # before the fork, in the parent
pid = os.fork()
if pid == 0:
    runtime.ensure_started()
    print("child", backend.mode, flush=True)
    with labels_scope(LabelSet({"span_id": "000000000000000b"})):
        MARKERS[11](0.3)
        bytes(8 << 20)  # sampled for certain: the child's memory window is not empty
    runtime.stop()
    os._exit(0)
with labels_scope(LabelSet({"span_id": "000000000000000c"})):
    MARKERS[12](0.3)
    bytes(8 << 20)
os.waitpid(pid, 0)
runtime.stop()
print("parent", backend.mode, flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_exact_backend_starts_again_in_a_forked_child(tmp_path: Path) -> None:
    """A forked worker samples and pushes on its own; the parent's window is not sent twice."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _run_script(
            tmp_path / "fork.py", _FORK_SCRIPT, receiver.url, "-W", "ignore::DeprecationWarning"
        )
        assert proc.returncode == 0, proc.stderr
        samples = receiver.samples()
        pushes = receiver.received_pushes()
    assert "child exact" in proc.stdout
    assert "parent stopped" in proc.stdout
    # Each process pushes its CPU window and (where sampled) its memory window once.
    names = sorted(series.label("__name__") or "" for push in pushes for series in push.series)
    memory = ["memory", "memory"] if MEMORY_SAMPLED else []
    assert names == [*memory, "process_cpu", "process_cpu"]

    def weight(function: str, span_id: str) -> float:
        return sum(
            s.value / 1e9
            for s in samples
            if s.has_function(function) and s.label_values("span_id") == (span_id,)
        )

    assert weight("burn_request_10", "000000000000000a") == pytest.approx(0.3, rel=0.3)
    assert weight("burn_request_11", "000000000000000b") == pytest.approx(0.3, rel=0.3)
    assert weight("burn_request_12", "000000000000000c") == pytest.approx(0.3, rel=0.3)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.needs_agent
def test_exact_backend_reads_the_same_variables_as_pyroscope() -> None:
    """Every PYROSCOPE_* variable means the same for both backends; the clock is extra."""
    exact = ExactBackend.from_env({**AGENT_ENV, "SPANPROF_PROFILE_CLOCK": "wall"})
    agent = PyroscopeBackend.from_env(AGENT_ENV)
    assert exact is not None
    assert agent is not None
    for name in (
        "server_address",
        "application_name",
        "upload_interval",
        "sample_rate",
        "tenant_id",
        "basic_auth_username",
        "basic_auth_password",
        "tags",
    ):
        assert getattr(exact, name) == getattr(agent, name), name
    assert exact.clock == "wall"
    assert ExactBackend.from_env({"OTEL_SERVICE_NAME": "x"}) is None


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({**AGENT_ENV, "SPANPROF_PROFILER": "perf"}, "SPANPROF_PROFILER"),
        ({**AGENT_ENV, "SPANPROF_PROFILER": "exact", "SPANPROF_PROFILE_CLOCK": "gpu"}, "CLOCK"),
        ({**AGENT_ENV, "SPANPROF_PROFILER": "exact", "PYROSCOPE_SAMPLE_RATE": "0"}, "SAMPLE_RATE"),
    ],
)
def test_bad_profiler_settings_name_the_variable(environ: dict[str, str], variable: str) -> None:
    """A bad value raises ValueError naming the variable."""
    with pytest.raises(ValueError, match=variable):
        profiler_from_env(environ)


def test_profiler_from_env_selects_the_backend() -> None:
    """The exact profiler by default (auto) and with exact."""
    default = profiler_from_env({k: v for k, v in AGENT_ENV.items() if k != "SPANPROF_PROFILER"})
    assert isinstance(default, ExactBackend)
    assert default.auto
    exact = profiler_from_env({**AGENT_ENV, "SPANPROF_PROFILER": " Exact "})
    assert isinstance(exact, ExactBackend)
    assert not exact.auto
    assert profiler_from_env({"SPANPROF_PROFILER": "exact"}) is None


@pytest.mark.needs_agent
def test_profiler_from_env_selects_the_agent_with_pyroscope() -> None:
    """SPANPROF_PROFILER=pyroscope: pyroscope-io."""
    assert isinstance(
        profiler_from_env({**AGENT_ENV, "SPANPROF_PROFILER": "pyroscope"}), PyroscopeBackend
    )


def test_the_span_cpu_taker_pops_what_the_span_s_samples_booked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request path takes a span's CPU through ``span_cpu_taker`` (one C call): the same
    figure as ``span_cpu_ns``, forgotten once taken, and still good after the sampler started
    its per-span totals over (full of spans nobody ended)."""
    sampler = Sampler(sample_rate=1)
    take = sampler.span_cpu_taker()
    a, b = LabelSet({"span_id": "a"}), LabelSet({"span_id": "b"})
    sampler._credit(a, 5)
    sampler._credit(a, 7)
    sampler._credit(EMPTY, 11)  # nobody's
    assert take("a", 0) == 12
    assert take("a", 0) == 0
    sampler._credit(a, 3)
    assert sampler.span_cpu_ns("a") == 3
    monkeypatch.setattr(_signal, "_MAX_SPANS", 1)
    sampler._credit(a, 1)
    sampler._credit(b, 2)  # full: starts over
    assert sampler.span_resets == 1
    assert take("a", 0) == 0
    assert take("b", 0) == 2


def test_samples_booked_after_their_span_ended_are_not_kept_for_it() -> None:
    """A sync endpoint's pool job, or a background task, is sampled under the request's labels
    after the request ended and took its span's CPU: that CPU made an entry nobody took again,
    one for about half the requests, until 65,536 of them reset the table and cost the spans in
    flight their CPU (spanprof.cpu_time_s low or missing)."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def pooled(request: Request) -> Response:  # Starlette runs it in its thread pool
        burn(0.004)
        return PlainTextResponse("x")

    async def background(request: Request) -> Response:  # runs after the response, labelled
        return PlainTextResponse("x", background=BackgroundTask(burn, 0.004))

    with PushReceiver() as receiver:
        backend = ExactBackend(
            server_address=receiver.url, application_name="late", upload_interval=60, memory=False
        )
        app = spanprof.ProfilingMiddleware(
            Starlette(routes=[Route("/pooled", pooled), Route("/background", background)]),
            profiler=backend,
            tracer_provider=TracerProvider(),  # span ids to credit
            environ={},
        )

        async def main() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for path in ("/pooled", "/background") * 150:
                    assert (await client.get(path)).status_code == 200

        try:
            asyncio.run(main())
            sampler = backend._sampler
            assert sampler is not None
            left = dict(sampler._span_ns)
            late = backend.stats()["span_cpu_late_ms"]
        finally:
            # The middleware's runtime installed the label engine with the backend: stopping
            # it uninstalls both (the backend alone would stay installed for the next test).
            app._runtime.stop()
    assert spanprof.engine.installed_backend() is None
    assert left == {}  # no request is in flight
    assert late > 0  # and some CPU did come after its span's end
