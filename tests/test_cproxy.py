"""The C coroutine proxy behaves exactly like the coroutine it wraps and syncs labels each step."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import importlib
import importlib.util
import inspect
import subprocess
import sys
import threading
import traceback
import tracemalloc
import types
import warnings
import weakref
from collections.abc import Coroutine, Generator, Iterator
from typing import Any

import anyio
import pytest

from spanprof import RecorderBackend, current_labels, profile_labels
from spanprof._labels import _engine
from spanprof._labels._engine import attach_loop
from spanprof._labels._labelset import EMPTY, LABELS, LabelSet
from spanprof._logging import reset_log_once

from .conftest import require, run_on

pytestmark = pytest.mark.engine


@pytest.fixture
def recorder() -> Iterator[RecorderBackend]:
    """The engine installed with its hooks (what this module tests), fed to a recorder."""
    backend = RecorderBackend()
    _engine.install_label_engine(backend, mechanism="hooks")
    try:
        yield backend
    finally:
        _engine.uninstall_label_engine()
        reset_log_once()


Op = tuple[str, Any]


def c_types() -> tuple[Any, Any]:
    """The extension's LabelledCoroutine and ThreadLabels; skips (fails under CI) if not built."""
    require(
        importlib.util.find_spec("spanprof._labels._cproxy") is not None,
        "spanprof._labels._cproxy is not built (installed without a C compiler)",
    )
    # Built but failing to import is a failure, not a skip.
    module = importlib.import_module("spanprof._labels._cproxy")
    return module.LabelledCoroutine, module.ThreadLabels


def wrap(coro: Coroutine[Any, Any, Any]) -> Any:
    """Wrap ``coro`` in the C proxy exactly as the engine's task factory does."""
    try:
        proxy_type, _ = c_types()
    except BaseException:  # skipped: no "never awaited" warning for the coroutine
        coro.close()
        raise
    return proxy_type(coro, LABELS, vars(_engine), _engine.apply)


class Boom(Exception):
    """Raised by the scenario coroutine."""


@types.coroutine
def _suspend(value: object) -> Generator[object, object, object]:
    return (yield value)


async def scenario() -> object:
    """Yields how many values it got; what it is sent decides how it ends."""
    received: list[object] = []
    try:
        while True:
            sent = await _suspend(len(received))
            if sent == "tuple":
                return (1, 2)
            if sent == "exception":
                return Boom("a return value, not raised")
            if sent == "none":
                return None
            if sent == "raise":
                raise Boom("raised inside")
            if sent == "stopiteration":
                raise StopIteration("raised inside")
            received.append(sent)
    except KeyError as exc:
        return ("caught", exc.args)
    except GeneratorExit:
        if "stubborn" in received:
            await _suspend("ignoring close")
        raise


def _plain(value: object) -> object:
    # Exceptions compare by identity: compare what they say instead.
    if isinstance(value, BaseException):
        return ("exception", type(value), value.args)
    return value


def drive(coro: Any, ops: list[Op]) -> list[object]:
    """Apply ``ops`` to ``coro``; log every outcome, warning and coroutine state."""
    log: list[object] = []
    for op, arg in ops:
        thrown: BaseException | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if op == "send":
                    outcome: tuple[object, ...] = ("yield", coro.send(arg))
                elif op == "throw":
                    thrown = arg()
                    outcome = ("yield", coro.throw(thrown))
                elif op == "throw3":
                    thrown = arg()
                    outcome = ("yield", coro.throw(type(thrown), thrown, None))
                elif op == "throw-class":
                    outcome = ("yield", coro.throw(arg))
                else:
                    outcome = ("close", coro.close())
            except StopIteration as stop:
                outcome = ("return", type(stop.value), _plain(stop.value), len(stop.args))
            except BaseException as exc:
                frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
                outcome = (
                    "raise",
                    _plain(exc),
                    exc is thrown,
                    _plain(exc.__cause__),
                    _plain(exc.__context__),
                    frames[1:],  # below drive(): the coroutine's own frames only
                )
        log.append(outcome)
        log.append([(w.category, str(w.message)) for w in caught])
        log.append((inspect.getcoroutinestate(coro), type(coro.cr_await).__name__))
    coro.close()
    return log


SCENARIOS: dict[str, list[Op]] = {
    "return-tuple": [("send", None), ("send", 1), ("send", "tuple")],
    "return-exception-object": [("send", None), ("send", "exception")],
    "return-none": [("send", None), ("send", "none")],
    "raise": [("send", None), ("send", "raise")],
    "stopiteration-inside": [("send", None), ("send", "stopiteration")],
    "non-none-first-send": [("send", 1)],
    "throw-caught": [("send", None), ("throw", lambda: KeyError("k"))],
    "throw-uncaught": [("send", None), ("throw", lambda: ValueError("v"))],
    "throw-3-args": [("send", None), ("throw3", lambda: ValueError("v"))],
    "throw-class": [("send", None), ("throw-class", KeyError)],
    "throw-before-start": [("throw", lambda: ValueError("v"))],
    "close-then-send": [("send", None), ("close", None), ("send", None)],
    "close-ignored": [("send", None), ("send", "stubborn"), ("close", None)],
    "close-before-start": [("close", None), ("send", None)],
    "send-after-return": [("send", None), ("send", "none"), ("send", None)],
    "throw-after-close": [("send", None), ("close", None), ("throw", lambda: ValueError("v"))],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_proxy_matches_the_native_coroutine(name: str) -> None:
    """Values, return values, exceptions, warnings and states match the unwrapped coroutine."""
    c_types()
    ops = SCENARIOS[name]
    assert drive(wrap(scenario()), ops) == drive(scenario(), ops)


def test_next_iter_await_and_attributes_forward() -> None:
    """next() steps like send(None); __await__/__iter__ return the proxy; attributes forward."""
    c_types()
    native: Any = scenario()
    inner = scenario()
    proxy = wrap(inner)
    assert repr(proxy) == repr(inner)
    assert proxy.__await__() is proxy
    assert iter(proxy) is proxy
    assert (proxy.__name__, proxy.__qualname__) == (native.__name__, native.__qualname__)
    assert proxy.cr_code is native.cr_code
    if sys.version_info >= (3, 11):
        assert proxy.cr_suspended is False
    assert next(proxy) == native.send(None)
    assert next(proxy) == native.send("x")
    with pytest.raises(StopIteration) as stopped:
        proxy.send("tuple")
    assert stopped.value.value == (1, 2)
    native.close()

    async def two_steps() -> str:
        await _suspend(1)
        return "end"

    native_iterator, proxy = two_steps().__await__(), wrap(two_steps())
    assert next(proxy) == next(native_iterator) == 1
    for iterator in (proxy, native_iterator):
        with pytest.raises(StopIteration) as stopped:
            next(iterator)
        assert stopped.value.value == "end"

    async def outer() -> object:
        return await wrap(scenario())

    coro = outer()
    assert coro.send(None) == 0
    with pytest.raises(StopIteration) as stopped:
        coro.send("none")
    assert stopped.value.value is None


async def _job(mode: str, log: list[str]) -> object:
    await asyncio.sleep(0)
    if mode == "raise":
        raise Boom("from the task")
    if mode == "return":
        return ("done", mode)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError as exc:
        log.append(f"cancelled {exc.args}")
        if mode == "swallow-cancel":
            return ("swallowed", exc.args)
        raise
    finally:
        log.append("finally")
    return "not cancelled"


async def _task_outcome(mode: str, proxied: bool) -> tuple[object, ...]:
    log: list[str] = []
    coro: Any = _job(mode, log)
    task = asyncio.Task(wrap(coro) if proxied else coro)
    for _ in range(3):
        await asyncio.sleep(0)
    if mode in ("cancel", "swallow-cancel"):
        task.cancel("stop")
    shown = "coro=<_job() running at" in repr(task)
    try:
        result: object = ("result", await task)
    except asyncio.CancelledError:
        result = ("cancelled", task.cancelled())
    except Boom as exc:
        result = ("raised", _plain(exc), task.exception() is exc)
    task_coro: Any = task.get_coro()
    return result, tuple(log), shown, inspect.getcoroutinestate(task_coro)


@pytest.mark.parametrize("mode", ["return", "raise", "cancel", "swallow-cancel"])
def test_tasks_of_proxied_coroutines_end_like_native_ones(loop_kind: str, mode: str) -> None:
    """Results, exceptions and cancellation reach a Task's awaiter as without the proxy."""
    c_types()

    async def main() -> tuple[tuple[object, ...], tuple[object, ...]]:
        return await _task_outcome(mode, True), await _task_outcome(mode, False)

    proxied, native = run_on(loop_kind, main)
    assert proxied == native


def test_getcoroutinestate_follows_the_wrapped_coroutine(loop_kind: str) -> None:
    """inspect.getcoroutinestate sees created, running, suspended and closed through the proxy."""
    c_types()

    async def probe(states: list[str]) -> None:
        task = asyncio.current_task()
        assert task is not None
        running: Any = task.get_coro()
        states.append(inspect.getcoroutinestate(running))
        await asyncio.sleep(0)

    async def run(proxied: bool) -> list[str]:
        states: list[str] = []
        coro: Any = probe(states)
        if proxied:
            coro = wrap(coro)
        states.append(inspect.getcoroutinestate(coro))
        task = asyncio.Task(coro)
        await asyncio.sleep(0)
        states.append(inspect.getcoroutinestate(coro))
        await task
        states.append(inspect.getcoroutinestate(coro))
        return states

    async def main() -> tuple[list[str], list[str]]:
        return await run(True), await run(False)

    proxied, native = run_on(loop_kind, main)
    assert proxied == native
    assert proxied == ["CORO_CREATED", "CORO_RUNNING", "CORO_SUSPENDED", "CORO_CLOSED"]


def test_anyio_cancel_scopes_reach_proxied_tasks_on_uvloop(recorder: RecorderBackend) -> None:
    """anyio cancels task-group children (it checks their coroutine state) under the C proxy."""
    proxy_type, _ = c_types()
    seen: list[type] = []

    async def child() -> None:
        task = asyncio.current_task()
        assert task is not None
        seen.append(type(task.get_coro()))
        await anyio.sleep_forever()

    async def body() -> bool:
        with anyio.move_on_after(0.05) as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(child)
                group.start_soon(child)
        return scope.cancelled_caught

    async def main() -> bool:
        attach_loop()
        return await asyncio.wait_for(asyncio.create_task(body()), 10)

    assert run_on("uvloop", main) is True
    assert seen == [proxy_type, proxy_type]


def test_labels_are_exact_at_every_step_on_uvloop(recorder: RecorderBackend) -> None:
    """On uvloop, tasks run through the C proxy and the profiler sees each step's own labels."""
    proxy_type, slots_type = c_types()
    assert isinstance(_engine._tls, slots_type)
    mismatches: list[tuple[dict[str, str], dict[str, str]]] = []
    checks = 0
    proxied: set[type] = set()

    def check() -> None:
        nonlocal checks
        checks += 1
        if recorder.thread_labels() != current_labels():
            mismatches.append((dict(current_labels()), dict(recorder.thread_labels())))

    async def worker(i: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        proxied.add(type(task.get_coro()))
        with profile_labels(req=str(i)):
            for step in range(20):
                check()
                await asyncio.sleep(0)
                check()
                if step == 10:
                    with profile_labels(stage="inner"):
                        await asyncio.sleep(0)
                        check()

    async def unlabelled() -> None:
        for _ in range(20):
            check()
            await asyncio.sleep(0)

    async def body() -> None:
        await asyncio.gather(*(worker(i) for i in range(4)), unlabelled())

    async def main() -> None:
        attach_loop()
        await asyncio.create_task(body())

    run_on("uvloop", main)
    assert checks == 4 * 41 + 20
    assert mismatches == []
    assert proxied == {proxy_type}
    assert recorder.labelled_threads() == {}


@pytest.mark.parametrize("state_kind", ["ThreadLabels", "threading.local"])
def test_apply_is_called_only_when_the_labels_object_changes(state_kind: str) -> None:
    """Each step compares by identity with the thread's last push; only a change calls apply."""
    proxy_type, slots_type = c_types()
    state: Any = slots_type(EMPTY) if state_kind == "ThreadLabels" else _Local()
    pushed: list[LabelSet] = []

    def apply(labels: LabelSet) -> None:
        pushed.append(labels)
        state.labels = labels

    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})
    contexts = {}
    for name, labels in (("a", a), ("b", b)):
        context = contextvars.copy_context()
        context.run(LABELS.set, labels)
        contexts[name] = context

    async def spin() -> str:
        while True:
            if await _suspend(None) == "stop":
                return "spun"

    proxy = proxy_type(spin(), LABELS, {"_tls": state}, apply)
    for name in "aaabbaba":
        contexts[name].run(proxy.send, None)
    assert pushed == [a, b, a, b, a]
    with pytest.raises(StopIteration) as stopped:
        contexts["b"].run(proxy.send, "stop")
    assert stopped.value.value == "spun"
    assert pushed == [a, b, a, b, a, b]


class _Local(threading.local):
    labels: LabelSet = EMPTY


@pytest.mark.parametrize("state_kind", ["ThreadLabels", "threading.local"])
def test_no_reference_or_memory_leak_over_100k_steps(state_kind: str) -> None:
    """100k proxied steps, each a label change, leave refcounts and traced memory unchanged."""
    proxy_type, slots_type = c_types()
    state: Any = slots_type(EMPTY) if state_kind == "ThreadLabels" else _Local()
    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})
    pushes = 0

    def apply(labels: LabelSet) -> None:
        nonlocal pushes
        pushes += 1
        state.labels = labels

    namespace = {"_tls": state}
    context_a, context_b = contextvars.copy_context(), contextvars.copy_context()
    context_a.run(LABELS.set, a)
    context_b.run(LABELS.set, b)

    async def spin(steps: int) -> tuple[str, int]:
        for _ in range(steps):
            await _suspend(None)
        return ("spun", steps)

    steps = 100_000
    coro = spin(steps)
    proxy = proxy_type(coro, LABELS, namespace, apply)
    tracked = (a, b, coro, namespace, apply, state)
    for _ in range(50):  # settle one-time allocations (the thread's slot, caches)
        context_a.run(proxy.send, None)
        context_b.run(proxy.send, None)
    gc.collect()
    refs_before = [sys.getrefcount(obj) for obj in tracked]
    tracemalloc.start()
    try:
        memory_before = tracemalloc.get_traced_memory()[0]
        for _ in range((steps - 100) // 2):
            context_a.run(proxy.send, None)
            context_b.run(proxy.send, None)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - memory_before
    finally:
        tracemalloc.stop()
    refs_after = [sys.getrefcount(obj) for obj in tracked]
    assert refs_after == refs_before
    assert growth < 16 * 1024
    assert pushes == steps
    with pytest.raises(StopIteration) as stopped:
        proxy.send(None)
    assert stopped.value.value == ("spun", steps)


def test_proxies_are_freed_on_every_ending_and_in_cycles() -> None:
    """Finished, failed, thrown-into, closed and self-referencing proxies are all freed."""
    proxy_type, slots_type = c_types()
    state = slots_type(EMPTY)
    namespace: dict[str, Any] = {"_tls": state}

    def apply(labels: LabelSet) -> None:
        state.labels = labels

    def run_once(ending: str) -> weakref.ref[Any]:
        holder: list[object] = []

        async def body() -> object:
            held = holder  # the coroutine's frame references the proxy: a cycle
            await _suspend(held)
            if ending == "raise":
                raise Boom("end")
            return ending

        proxy = proxy_type(body(), LABELS, namespace, apply)
        holder.append(proxy)
        proxy.send(None)
        if ending == "close":
            proxy.close()
        elif ending == "throw":
            with pytest.raises(ValueError, match="in"):
                proxy.throw(ValueError("in"))
        elif ending == "raise":
            with pytest.raises(Boom):
                proxy.send(None)
        else:
            with pytest.raises(StopIteration):
                proxy.send(None)
        if ending == "cycle":
            proxy = proxy_type(body(), LABELS, namespace, apply)
            holder.append(proxy)
            proxy.send(None)  # left suspended inside a reference cycle
        return weakref.ref(proxy)

    gc.collect()  # earlier tests' garbage may still hold LABELS
    refs_before = [sys.getrefcount(obj) for obj in (namespace, apply, state, LABELS)]
    endings = ["return", "raise", "throw", "close", "cycle"]
    refs = [run_once(ending) for _ in range(2000) for ending in endings]
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    assert [sys.getrefcount(obj) for obj in (namespace, apply, state, LABELS)] == refs_before


def test_thread_labels_are_per_thread_and_a_new_one_starts_empty() -> None:
    """ThreadLabels keeps one value per OS thread; a new instance reads the default everywhere."""
    _, slots_type = c_types()
    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})
    slots = slots_type(EMPTY)
    assert slots.labels is EMPTY
    slots.labels = a
    seen: list[LabelSet] = []

    def other_thread() -> None:
        seen.append(slots.labels)
        slots.labels = b
        seen.append(slots.labels)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [EMPTY, b]
    assert slots.labels is a
    fresh = slots_type(EMPTY)
    assert fresh.labels is EMPTY
    fresh.labels = b
    assert fresh.labels is b
    del fresh.labels
    assert fresh.labels is EMPTY


def test_non_coroutines_still_fail_at_create_task_on_uvloop(recorder: RecorderBackend) -> None:
    """The task factory leaves non-coroutines unwrapped, so create_task raises TypeError."""

    async def main() -> None:
        attach_loop()
        with pytest.raises(TypeError, match="coroutine was expected"):
            asyncio.get_running_loop().create_task(42)  # type: ignore[arg-type]

    run_on("uvloop", main)


def test_python_fallback_keeps_labels_exact(
    monkeypatch: pytest.MonkeyPatch, loop_kind: str
) -> None:
    """Without the extension the engine's Python proxy and threading.local do the same job."""
    monkeypatch.setattr(_engine, "_CLabelledCoroutine", None, raising=False)
    monkeypatch.setattr(_engine, "_CThreadLabels", None, raising=False)
    monkeypatch.setattr(_engine, "_CHandleRunHook", None, raising=False)
    recorder = RecorderBackend()
    _engine.install_label_engine(recorder, mechanism="hooks")
    assert asyncio.Handle._run is _engine._handle_run
    mismatches: list[str] = []
    proxied: set[type] = set()

    async def worker(i: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        proxied.add(type(task.get_coro()))
        with profile_labels(req=str(i)):
            for _ in range(5):
                await asyncio.sleep(0)
                if recorder.thread_labels() != current_labels():
                    mismatches.append(str(i))

    async def main() -> None:
        attach_loop()
        await asyncio.gather(*(asyncio.create_task(worker(i)) for i in range(3)))

    try:
        assert isinstance(_engine._tls, threading.local)
        run_on(loop_kind, main)
    finally:
        _engine.uninstall_label_engine()
    assert mismatches == []
    if loop_kind == "uvloop":
        assert proxied == {_engine._LabelledCoroutine}


def hook_type() -> Any:
    """The extension's HandleRunHook; skips (fails under CI) if the extension is not built."""
    c_types()
    return importlib.import_module("spanprof._labels._cproxy").HandleRunHook


def test_engine_hooks_asyncio_handles_with_the_c_hook() -> None:
    """Installed, ``Handle._run`` is the C hook around the original; uninstalled, the original."""
    hook = hook_type()
    original = asyncio.Handle._run
    assert type(original) is not hook
    _engine.install_label_engine(RecorderBackend(), mechanism="hooks")
    try:
        assert type(asyncio.Handle._run) is hook
        assert asyncio.Handle._run.__wrapped__ is original  # type: ignore[attr-defined]
        assert asyncio.Handle._run.replaces is True  # type: ignore[attr-defined]
    finally:
        _engine.uninstall_label_engine()
    assert asyncio.Handle._run is original


def test_the_c_hook_looks_like_the_method_it_replaces() -> None:
    """Code reading ``Handle._run.__code__`` at import (playwright) works with the engine on."""
    hook_type()
    original = asyncio.Handle._run
    _engine.install_label_engine(RecorderBackend())
    try:
        hooked: Any = asyncio.Handle._run
        assert hooked.__code__ is original.__code__
        assert hooked.__name__ == original.__name__
        assert hooked.__qualname__ == original.__qualname__
        assert hooked.__module__ == original.__module__
    finally:
        _engine.uninstall_label_engine()
    if importlib.util.find_spec("playwright") is None:
        return
    # Importing playwright with the engine on raised AttributeError: '...HandleRunHook' object
    # has no attribute '__code__'. In a process of its own: playwright is imported once.
    script = (
        "from spanprof import RecorderBackend\n"
        "from spanprof._labels import _engine\n"
        "_engine.install_label_engine(RecorderBackend())\n"
        "import playwright.sync_api\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("state_kind", ["ThreadLabels", "threading.local"])
def test_handle_hook_pushes_only_changes_then_runs_the_handle(state_kind: str) -> None:
    """Each call reads the handle's context, pushes only a changed label set, then runs it."""
    hook = hook_type()
    _, slots_type = c_types()
    state: Any = slots_type(EMPTY) if state_kind == "ThreadLabels" else _Local()
    events: list[object] = []

    def apply(labels: LabelSet) -> None:
        events.append(labels)
        state.labels = labels

    def run(handle: asyncio.Handle) -> str:
        events.append(("run", handle))
        return "ran"

    class Handle(asyncio.Handle):
        _run = hook(run, LABELS, EMPTY, {"_tls": state}, apply, asyncio.Handle)

    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})
    contexts = {"-": contextvars.Context()}
    for name, labels in (("a", a), ("b", b)):
        contexts[name] = contextvars.copy_context()
        contexts[name].run(LABELS.set, labels)
    loop = asyncio.new_event_loop()
    try:
        handles = {n: Handle(print, (), loop, context=c) for n, c in contexts.items()}
        results = [handles[name]._run() for name in "aab-ba"]
        # Unbound, through the class: the same call.
        assert Handle._run(handles["a"]) == "ran"
    finally:
        loop.close()
    assert results == ["ran"] * 6
    runs = [("run", handles[name]) for name in "aab-baa"]
    assert events == [a, *runs[:2], b, runs[2], EMPTY, runs[3], b, runs[4], a, *runs[5:]]


def test_handle_hook_keeps_asyncio_error_handling(recorder: RecorderBackend) -> None:
    """A failing callback still reaches the loop's exception handler, with its labels applied."""
    hook_type()
    seen: list[tuple[object, LabelSet]] = []

    def fail() -> None:
        raise Boom("in a callback")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(
            lambda _loop, context: seen.append((context["exception"], recorder.thread_labels()))
        )
        with profile_labels(req="x"):
            loop.call_soon(fail)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    run_on("asyncio", main)
    assert len(seen) == 1
    assert isinstance(seen[0][0], Boom)
    assert seen[0][1] == LabelSet({"req": "x"})


@pytest.mark.parametrize("mode", ["replaces", "wraps"])
def test_handle_hook_leaks_no_references_over_100k_calls(mode: str) -> None:
    """100k hooked runs, each a label change, leave refcounts and traced memory unchanged."""
    hook = hook_type()
    _, slots_type = c_types()
    state = slots_type(EMPTY)
    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})

    def apply(labels: LabelSet) -> None:
        state.labels = labels

    def run(handle: asyncio.Handle) -> None:
        return None

    def report(handle: asyncio.Handle, exc: BaseException) -> None:
        raise AssertionError("no callback fails here")

    namespace = {"_tls": state}
    if mode == "wraps":
        report = None  # type: ignore[assignment]

    class Handle(asyncio.Handle):
        _run = hook(run, LABELS, EMPTY, namespace, apply, asyncio.Handle, report)

    context_a, context_b = contextvars.copy_context(), contextvars.copy_context()
    context_a.run(LABELS.set, a)
    context_b.run(LABELS.set, b)
    loop = asyncio.new_event_loop()
    try:
        ha = Handle(print, (), loop, context=context_a)
        hb = Handle(print, (), loop, context=context_b)
        tracked = (a, b, ha, hb, context_a, context_b, namespace, apply, run, state, print)
        for _ in range(50):
            ha._run()
            hb._run()
        gc.collect()
        refs_before = [sys.getrefcount(obj) for obj in tracked]
        tracemalloc.start()
        try:
            memory_before = tracemalloc.get_traced_memory()[0]
            for _ in range(50_000):
                ha._run()
                hb._run()
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - memory_before
        finally:
            tracemalloc.stop()
    finally:
        loop.close()
    assert [sys.getrefcount(obj) for obj in tracked] == refs_before
    assert growth < 16 * 1024


def test_handle_hook_rejects_bad_arguments() -> None:
    """Wrong types fail at construction; a call without the handle fails with TypeError."""
    hook = hook_type()
    with pytest.raises(TypeError):
        hook(None, LABELS, EMPTY, {}, print, asyncio.Handle)
    with pytest.raises(TypeError):
        hook(print, "not a ContextVar", EMPTY, {}, print, asyncio.Handle)
    with pytest.raises(TypeError):
        hook(print, LABELS, EMPTY, {}, 42, asyncio.Handle)
    with pytest.raises(TypeError):
        hook(print, LABELS, EMPTY, {}, print, asyncio.Handle, 42)
    with pytest.raises(TypeError, match="not an object slot"):
        hook(print, LABELS, EMPTY, {}, print, type("NoSlots", (), {"_context": None}), print)
    bare = hook(print, LABELS, EMPTY, {"_tls": c_types()[1](EMPTY)}, print, asyncio.Handle)
    with pytest.raises(TypeError, match="expected the handle"):
        bare()


def _failing_callback_report(engine: bool, *, debug: bool) -> dict[str, Any]:
    """What the loop's exception handler sees for a failing callback, engine on or off."""
    seen: dict[str, Any] = {}

    def fail(value: int) -> None:
        raise Boom(f"callback failed with {value}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_debug(debug)

        def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            seen.update(context)
            seen["exc_info"] = sys.exc_info()[1]

        loop.set_exception_handler(handler)
        seen["scheduled"] = loop.call_soon(fail, 7)
        await asyncio.sleep(0)

    if engine:
        _engine.install_label_engine(RecorderBackend(), mechanism="hooks")
    try:
        run_on("asyncio", main)
    finally:
        if engine:
            _engine.uninstall_label_engine()
    return seen


@pytest.mark.parametrize("debug", [False, True], ids=["normal", "debug"])
def test_hooked_handles_report_failures_exactly_like_asyncio(debug: bool) -> None:
    """The replacing hook gives the exception handler what asyncio's own ``_run`` gives it."""
    hook_type()
    plain = _failing_callback_report(engine=False, debug=debug)
    hooked = _failing_callback_report(engine=True, debug=debug)
    for seen in (plain, hooked):
        assert seen["handle"] is seen["scheduled"]
        assert isinstance(seen["exception"], Boom)
        # Reported while being handled, as in an except block.
        assert seen["exc_info"] is seen["exception"]
    assert hooked["message"] == plain["message"]
    assert "fail" in hooked["message"]
    assert str(hooked["exception"]) == str(plain["exception"]) == "callback failed with 7"
    assert set(hooked) == set(plain)
    if debug:
        assert len(hooked["source_traceback"]) == len(plain["source_traceback"]) > 0
    # Nothing stays "being handled" after the handler.
    assert sys.exc_info() == (None, None, None)


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_hooked_handles_let_exit_exceptions_through(exc_type: type[BaseException]) -> None:
    """SystemExit and KeyboardInterrupt leave the loop, as they do from asyncio's ``_run``."""
    hook_type()

    def stop() -> None:
        raise exc_type("stop")

    async def main() -> None:
        asyncio.get_running_loop().call_soon(stop)
        await asyncio.sleep(1)

    _engine.install_label_engine(RecorderBackend(), mechanism="hooks")
    try:
        with pytest.raises(exc_type, match="stop"):
            run_on("asyncio", main)
    finally:
        _engine.uninstall_label_engine()


def test_hooked_handles_run_callbacks_that_cancel_themselves(recorder: RecorderBackend) -> None:
    """A callback that cancels its own handle (dropping its slots) runs and ends cleanly."""
    hook_type()
    ran: list[tuple[object, ...]] = []
    handles: list[asyncio.Handle] = []

    def callback(*args: object) -> None:
        handles[0].cancel()
        gc.collect()
        ran.append(args)

    async def main() -> None:
        with profile_labels(req="self-cancelling"):
            handles.append(asyncio.get_running_loop().call_soon(callback, "x", ("y",), 3))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    run_on("asyncio", main)
    assert ran == [("x", ("y",), 3)]
    assert handles[0].cancelled()
    assert (threading.get_ident(), LabelSet({"req": "self-cancelling"})) in recorder.switches


def test_a_handle_run_someone_else_patched_keeps_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """When ``Handle._run`` is already wrapped, the hook syncs labels and calls that wrapper."""
    hook_type()
    original = asyncio.Handle._run
    recorder = RecorderBackend()
    calls: list[LabelSet] = []

    @functools.wraps(original)
    def slow_callback_logger(self: asyncio.Handle) -> None:
        # Outside the handle's context: what the engine pushed before calling the wrapper.
        calls.append(recorder.thread_labels())
        original(self)

    monkeypatch.setattr(asyncio.Handle, "_run", slow_callback_logger)
    monkeypatch.setattr(_engine, "_orig_handle_run", slow_callback_logger)
    seen: list[LabelSet] = []

    async def main() -> None:
        with profile_labels(req="wrapped"):
            await asyncio.sleep(0)
            seen.append(recorder.thread_labels())

    _engine.install_label_engine(recorder, mechanism="hooks")
    try:
        assert asyncio.Handle._run.replaces is False  # type: ignore[attr-defined]
        run_on("asyncio", main)
    finally:
        _engine.uninstall_label_engine()
    assert asyncio.Handle._run is slow_callback_logger
    assert seen == [LabelSet({"req": "wrapped"})]
    assert LabelSet({"req": "wrapped"}) in calls


@pytest.mark.parametrize("state_kind", ["ThreadLabels", "local"])
def test_a_quiet_thread_is_never_pushed_to(state_kind: str) -> None:
    """A thread whose state holds the quiet marker runs every step without calling apply();
    any other labels in the state are compared as before."""
    proxy_type, slots_type = c_types()
    module = importlib.import_module("spanprof._labels._cproxy")
    quiet = LabelSet({"spanprof_quiet": "1"})
    module.set_quiet(quiet)
    state: Any = slots_type(quiet) if state_kind == "ThreadLabels" else _Local()
    state.labels = quiet
    a, b = LabelSet({"req": "a"}), LabelSet({"req": "b"})
    pushed: list[LabelSet] = []

    def apply(labels: LabelSet) -> None:
        pushed.append(labels)
        state.labels = labels

    context_a, context_b = contextvars.copy_context(), contextvars.copy_context()
    context_a.run(LABELS.set, a)
    context_b.run(LABELS.set, b)

    async def spin(steps: int) -> int:
        for _ in range(steps):
            await _suspend(None)
        return steps

    proxy = proxy_type(spin(1000), LABELS, {"_tls": state}, apply)
    try:
        for _ in range(10):
            context_a.run(proxy.send, None)
            context_b.run(proxy.send, None)
        assert pushed == []
        state.labels = EMPTY  # no longer quiet: every switch is pushed again
        for _ in range(10):
            context_a.run(proxy.send, None)
            context_b.run(proxy.send, None)
        assert pushed == [a, b] * 10
    finally:
        proxy.close()
        module.set_quiet(_engine._QUIET)  # the engine's own marker, as installing sets it
