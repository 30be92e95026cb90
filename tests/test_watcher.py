"""The context-watcher mechanism (CPython 3.14+): installed instead of the hooks, exact at every
switch, harmless to the code it watches, and gone after uninstall."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import ctypes
import importlib
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import anyio.to_thread
import pytest

import spanprof
from spanprof import LabelSet, RecorderBackend, current_labels, profile_labels
from spanprof._labels import _engine
from spanprof._labels._labelset import LABELS
from spanprof._labels._native import cproxy
from spanprof._logging import reset_log_once
from spanprof._types import Receive, Scope, Send

from .conftest import require, run_on

pytestmark = pytest.mark.engine

WATCHER = "watcher" in _engine.available_mechanisms()
needs_watcher = pytest.mark.skipif(
    not WATCHER, reason="the context watcher needs CPython 3.14+ and the C extension"
)
_A = LabelSet({"req": "a"})


def _labelled_context(labels: LabelSet) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(LABELS.set, labels)
    return context


@pytest.fixture
def watched() -> Iterator[RecorderBackend]:
    """The engine installed with the context watcher, fed to a recorder."""
    backend = RecorderBackend()
    _engine.install_label_engine(backend, mechanism="watcher")
    try:
        yield backend
    finally:
        _engine.uninstall_label_engine()
        reset_log_once()


def test_the_watcher_is_available_exactly_on_3_14_and_later() -> None:
    """3.14+ with the C extension offers the watcher; older versions only the hooks."""
    if sys.version_info >= (3, 14):
        require(cproxy is not None, "spanprof._labels._cproxy is not built")
    expected = sys.version_info >= (3, 14) and cproxy is not None
    assert WATCHER is expected
    assert _engine.default_mechanism() == "hooks"  # the cheaper one (docs/benchmarks.md)


@pytest.mark.skipif(WATCHER, reason="this interpreter has the watcher")
def test_asking_for_the_watcher_where_there_is_none_is_a_value_error() -> None:
    """Before 3.14 (or without the C extension) mechanism="watcher" says what it needs."""
    with pytest.raises(ValueError, match=r"3\.14"):
        _engine.install_label_engine(RecorderBackend(), mechanism="watcher")
    assert _engine.installed_backend() is None


@needs_watcher
def test_the_watcher_replaces_the_hooks_and_uninstall_removes_it() -> None:
    """Installed as the watcher: Handle._run unpatched, no task factory for uvloop, the watcher
    registered; uninstalled: the watcher cleared and every patch restored."""
    assert cproxy is not None
    originals = (
        asyncio.Handle._run,
        concurrent.futures.ThreadPoolExecutor.submit,
        anyio.to_thread.run_sync,
    )
    factories: list[object] = []

    async def probe() -> None:
        _engine.attach_loop()
        factories.append(asyncio.get_running_loop().get_task_factory())
        assert _engine.steps_hooked()

    backend = RecorderBackend()
    _engine.install_label_engine(backend, mechanism="watcher")
    try:
        assert _engine.installed_mechanism() == "watcher"
        assert cproxy.watching_contexts()
        assert asyncio.Handle._run is originals[0]
        assert concurrent.futures.ThreadPoolExecutor.submit is not originals[1]
        run_on("uvloop", probe)
        run_on("asyncio", probe)
    finally:
        _engine.uninstall_label_engine()
    assert factories == [None, None]
    assert not cproxy.watching_contexts()
    assert _engine.installed_mechanism() is None
    assert (
        asyncio.Handle._run,
        concurrent.futures.ThreadPoolExecutor.submit,
        anyio.to_thread.run_sync,
    ) == originals
    # Cleared, not merely idle: switches after uninstall push nothing, and the interpreter's
    # 8 watcher ids are not used up by installing again and again.
    backend.clear()
    _labelled_context(_A).run(lambda: None)
    assert list(backend.switches) == []
    for _ in range(9):
        _engine.install_label_engine(RecorderBackend(), mechanism="watcher")
        _engine.uninstall_label_engine()


@needs_watcher
def test_switching_mechanisms_while_installed_swaps_the_patches() -> None:
    """hooks -> watcher unpatches Handle._run and registers the watcher; and back."""
    assert cproxy is not None
    original = asyncio.Handle._run
    backend = RecorderBackend()
    _engine.install_label_engine(backend, mechanism="hooks")
    try:
        assert asyncio.Handle._run is not original
        assert not cproxy.watching_contexts()
        _engine.install_label_engine(backend, mechanism="watcher")
        assert asyncio.Handle._run is original
        assert cproxy.watching_contexts()
        # Without a mechanism, installing again keeps the installed one.
        _engine.install_label_engine(RecorderBackend())
        assert _engine.installed_mechanism() == "watcher"
        _engine.install_label_engine(backend, mechanism="hooks")
        assert asyncio.Handle._run is not original
        assert not cproxy.watching_contexts()
    finally:
        _engine.uninstall_label_engine()
    assert asyncio.Handle._run is original
    assert not cproxy.watching_contexts()


@needs_watcher
def test_with_every_watcher_id_taken_the_engine_uses_its_hooks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Other libraries holding the interpreter's 8 watcher ids: logged once, hooks installed."""
    callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.py_object)
    callback = callback_type(lambda event, context: 0)
    add = ctypes.pythonapi.PyContext_AddWatcher
    add.argtypes, add.restype = [callback_type], ctypes.c_int
    clear = ctypes.pythonapi.PyContext_ClearWatcher
    clear.argtypes, clear.restype = [ctypes.c_int], ctypes.c_int
    taken: list[int] = []
    try:
        while len(taken) < 8:
            try:
                taken.append(add(callback))
            except RuntimeError:  # ids already held by someone else count as taken
                break
        original = asyncio.Handle._run
        with caplog.at_level("WARNING", logger="spanprof"):
            _engine.install_label_engine(RecorderBackend(), mechanism="watcher")
        try:
            assert _engine.installed_mechanism() == "hooks"
            assert asyncio.Handle._run is not original
        finally:
            _engine.uninstall_label_engine()
            reset_log_once()
    finally:
        for watcher_id in taken:
            clear(watcher_id)
    assert asyncio.Handle._run is original
    assert any("no context watcher id left" in r.getMessage() for r in caplog.records)
    # With the ids free again, the watcher installs.
    _engine.install_label_engine(RecorderBackend(), mechanism="watcher")
    try:
        assert _engine.installed_mechanism() == "watcher"
    finally:
        _engine.uninstall_label_engine()


class _Checker:
    """Records every place where the profiler's labels differ from the context's."""

    def __init__(self, recorder: RecorderBackend) -> None:
        self.recorder = recorder
        self.checks = 0
        self.wrong: list[tuple[dict[str, str], dict[str, str]]] = []
        self._lock = threading.Lock()

    def __call__(self) -> None:
        seen, expected = self.recorder.thread_labels(), current_labels()
        with self._lock:
            self.checks += 1
            if seen != expected:
                self.wrong.append((dict(expected), dict(seen)))


@needs_watcher
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_labels_are_right_at_every_step_plain_eager_and_in_threads(
    watched: RecorderBackend, kind: str
) -> None:
    """Interleaved plain tasks, eager tasks, an unlabelled background task, and to_thread,
    run_in_executor and anyio jobs: every check sees the context's labels, with no hook."""
    check = _Checker(watched)

    def job() -> None:
        check()

    async def background() -> None:
        for _ in range(10):
            check()
            await asyncio.sleep(0)

    async def child() -> None:
        with profile_labels(child="yes"):
            check()
            await asyncio.sleep(0)
            check()
        check()

    async def request(i: int) -> None:
        loop = asyncio.get_running_loop()
        with profile_labels(req=str(i)):
            for _ in range(10):
                check()
                await asyncio.sleep(0)
                check()
            eager = asyncio.Task(child(), loop=loop, eager_start=True)  # type: ignore[call-arg]
            check()  # the eager child's first step left the thread to this task's labels
            await eager
            await asyncio.to_thread(job)
            await loop.run_in_executor(None, job)
            await anyio.to_thread.run_sync(job)
            check()

    async def main() -> None:
        _engine.attach_loop()
        assert asyncio.get_running_loop().get_task_factory() is None
        bg = asyncio.create_task(background())
        await asyncio.gather(*(request(i) for i in range(4)), bg)
        check()

    run_on(kind, main)
    assert check.wrong == []
    assert check.checks >= 4 * (20 + 3 + 3 + 2) + 10
    assert watched.labelled_threads() == {}


@needs_watcher
def test_trio_tasks_are_followed_without_the_instrument(
    watched: RecorderBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trio runs each step in its task's context: the watcher sees it, no instrument needed."""
    trio = importlib.import_module("trio")
    check = _Checker(watched)
    instrument_steps: list[object] = []
    monkeypatch.setattr(_engine._TrioLabels, "before_task_step", instrument_steps.append)

    async def request(i: int) -> None:
        with profile_labels(req=str(i)):
            for _ in range(10):
                check()
                await trio.lowlevel.checkpoint()
                check()

    async def main() -> None:
        _engine.attach_loop()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(request, i)

    trio.run(main)
    assert check.wrong == []
    assert check.checks == 3 * 20
    assert instrument_steps == []  # attach_loop added no instrument


@needs_watcher
def test_an_exception_pending_across_a_switch_is_kept(watched: RecorderBackend) -> None:
    """Leaving a context after its callable raised pushes labels with the exception pending:
    the same exception, with its traceback, propagates."""
    error = ValueError("the callable's own")

    def fail() -> None:
        raise error

    watched.clear()
    with pytest.raises(ValueError) as raised:
        _labelled_context(_A).run(fail)
    assert raised.value is error
    assert traceback.extract_tb(raised.value.__traceback__)[-1].name == "fail"
    # Entering pushed A; leaving, with the ValueError pending, pushed the empty set back.
    assert [dict(labels) for _, labels in watched.switches] == [{"req": "a"}, {}]


@needs_watcher
def test_a_raising_task_step_keeps_its_exception(watched: RecorderBackend) -> None:
    """A task whose step raises (the C Task leaves its context with the error pending) fails
    with its own exception."""

    async def failing() -> None:
        with profile_labels(req="x"):
            await asyncio.sleep(0)
            raise KeyError("from the task")

    async def main() -> None:
        with pytest.raises(KeyError, match="from the task"):
            await asyncio.create_task(failing())

    run_on("asyncio", main)


class _Raising(RecorderBackend):
    """Raises ``error`` on pushes of ``trigger``."""

    def __init__(self, trigger: LabelSet, error: BaseException) -> None:
        super().__init__()
        self.trigger = trigger
        self.error = error
        self.raised = 0

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        super().set_thread_labels(previous, current)
        if current is self.trigger:
            self.raised += 1
            raise self.error


class Halt(BaseException):
    """Not an ``Exception``: ``apply()`` lets it out, into the watcher."""


@needs_watcher
def test_a_push_raising_past_apply_is_reported_once_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing escapes the watcher: the first failure goes to sys.unraisablehook, the rest are
    counted, and the watched code's own exception and result are untouched."""
    assert cproxy is not None
    reports: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    backend = _Raising(_A, Halt("push failed"))
    _engine.install_label_engine(backend, mechanism="watcher")
    try:
        context = _labelled_context(_A)
        assert context.run(lambda: 42) == 42
        with pytest.raises(ZeroDivisionError):
            context.run(lambda: 1 / 0)
        assert context.run(LABELS.get) is _A
        failures = cproxy.watch_failures()
    finally:
        _engine.uninstall_label_engine()
    assert backend.raised == 3
    assert failures == 3
    assert len(reports) == 1
    assert isinstance(reports[0].exc_value, Halt)
    assert "context watcher" in (reports[0].err_msg or "")


@needs_watcher
def test_a_keyboard_interrupt_in_a_push_is_raised_again_not_lost() -> None:
    """A Ctrl-C landing in a push comes out of the watched code right after the switch."""
    backend = _Raising(_A, KeyboardInterrupt())
    ran: list[str] = []

    def step() -> None:
        for _ in range(3):  # a loop: the interpreter checks for async exceptions here
            ran.append("ran")

    _engine.install_label_engine(backend, mechanism="watcher")
    try:
        with pytest.raises(KeyboardInterrupt):
            _labelled_context(_A).run(step)
    finally:
        _engine.uninstall_label_engine()
    assert backend.raised == 1
    assert len(ran) < 3


@needs_watcher
def test_switches_made_by_a_push_are_not_pushed_again() -> None:
    """A backend that itself runs code in another context (switching twice) is not re-entered:
    only the outer switches reach it."""
    other = _labelled_context(LabelSet({"inner": "1"}))
    depth = 0
    nested: list[int] = []

    class Switching(RecorderBackend):
        def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
            nonlocal depth
            depth += 1
            nested.append(depth)
            try:
                other.run(lambda: None)
                super().set_thread_labels(previous, current)
            finally:
                depth -= 1

    backend = Switching()
    _engine.install_label_engine(backend, mechanism="watcher")
    try:
        backend.clear()
        nested.clear()
        _labelled_context(_A).run(lambda: None)
    finally:
        _engine.uninstall_label_engine()
    assert nested == [1, 1]  # in and out, never nested
    assert [dict(labels) for _, labels in backend.switches] == [{"req": "a"}, {}]


@needs_watcher
def test_each_os_thread_keeps_its_own_labels(watched: RecorderBackend) -> None:
    """Threads switching contexts at once each end up with their own context's labels."""
    barrier = threading.Barrier(4)
    wrong: list[str] = []

    def worker(i: int) -> None:
        labels = LabelSet({"worker": str(i)})
        context = _labelled_context(labels)
        barrier.wait()
        for _ in range(2000):
            if context.run(watched.thread_labels) is not labels:
                wrong.append(f"worker {i}")
        if watched.thread_labels():
            wrong.append(f"worker {i} kept labels after leaving")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_public_engine_switch_takes_a_mechanism() -> None:
    """spanprof.engine.install_label_engine accepts mechanism= (hooks everywhere)."""
    backend = RecorderBackend()
    spanprof.engine.install_label_engine(backend, mechanism="hooks")
    try:
        assert _engine.installed_mechanism() == "hooks"
    finally:
        spanprof.engine.uninstall_label_engine()


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    return None


@pytest.mark.parametrize("value", ["watcher", "hooks", ""])
def test_spanprof_label_engine_picks_the_middlewares_mechanism(value: str) -> None:
    """SPANPROF_LABEL_ENGINE=watcher|hooks is what the middleware's profiler start installs
    (unset: the default); watcher where there is none is a ValueError naming the variable."""
    if value == "watcher" and not WATCHER:
        with pytest.raises(ValueError, match="SPANPROF_LABEL_ENGINE"):
            spanprof.ProfilingMiddleware(
                _app, profiler=RecorderBackend(), environ={"SPANPROF_LABEL_ENGINE": value}
            )
        return
    middleware = spanprof.ProfilingMiddleware(
        _app, profiler=RecorderBackend(), environ={"SPANPROF_LABEL_ENGINE": value}
    )
    runtime = middleware._runtime
    runtime.start()
    try:
        assert _engine.installed_mechanism() == (value or _engine.default_mechanism())
    finally:
        runtime.stop()
    assert _engine.installed_mechanism() is None
