"""A label push that raises never drops a step: the step runs, then the failure is raised."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import types
from collections.abc import Generator
from typing import Any

import pytest

from spanprof import RecorderBackend
from spanprof._labels import _engine
from spanprof._labels._labelset import EMPTY, LABELS, LabelSet

from .conftest import new_loop, require

pytestmark = pytest.mark.engine


class Halt(BaseException):
    """Not an ``Exception``: ``apply()`` does not swallow it."""


class _RaisingBackend(RecorderBackend):
    """Raises ``error`` once, on the first switch to ``trigger`` after ``arm()``."""

    def __init__(self, trigger: LabelSet, error: type[BaseException]) -> None:
        super().__init__()
        self.trigger = trigger
        self.error = error
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        super().set_thread_labels(previous, current)
        if self.armed and current is self.trigger:
            self.armed = False
            raise self.error("push failed")


def _engine_flavour(flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if flavour == "python":  # before the engine installs, which picks the hook
        monkeypatch.setattr(_engine, "_CHandleRunHook", None)
        monkeypatch.setattr(_engine, "_CLabelledCoroutine", None)


def _labelled_task(
    loop: asyncio.AbstractEventLoop, labels: LabelSet, coro: Any
) -> asyncio.Task[Any]:
    # A task whose context holds ``labels``, created without pushing them: its first step must.
    context = contextvars.copy_context()
    context.run(LABELS.set, labels)
    task: asyncio.Task[Any] = context.run(loop.create_task, coro)
    return task


@pytest.mark.parametrize("flavour", ["c", "python"])
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_push_raising_a_base_exception_still_runs_the_step(
    kind: str, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step runs; the failure is reported (asyncio) or raised at the await (uvloop)."""
    _engine_flavour(flavour, monkeypatch)
    trigger = LabelSet({"req": "a"})
    backend = _RaisingBackend(trigger, Halt)
    steps: list[str] = []
    handled: list[BaseException] = []

    async def job() -> str:
        steps.append("first")
        try:
            await asyncio.sleep(0)
        except Halt:
            steps.append("halted")
        steps.append("second")
        return "done"

    _engine.install_label_engine(backend, mechanism="hooks")
    loop = new_loop(kind)
    try:
        loop.set_exception_handler(lambda _loop, context: handled.append(context["exception"]))
        _engine.attach_loop(loop)
        task = _labelled_task(loop, trigger, job())
        backend.arm()
        loop.run_until_complete(asyncio.wait([task], timeout=2))
    finally:
        loop.close()
        _engine.uninstall_label_engine()
    assert not backend.armed  # the push did raise
    assert task.done()
    assert task.result() == "done"
    if kind == "asyncio":  # the step handle failed: the loop's handler hears of it
        assert steps == ["first", "second"]
        assert [type(exc) for exc in handled] == [Halt]
    else:  # inside the task: the coroutine gets it where it waits
        assert steps == ["first", "halted", "second"]
        assert handled == []


@pytest.mark.parametrize("flavour", ["c", "python"])
def test_a_push_raising_keyboard_interrupt_runs_the_step_then_stops_the_loop(
    flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt leaves the loop after the step ran; the task then finishes."""
    _engine_flavour(flavour, monkeypatch)
    trigger = LabelSet({"req": "a"})
    backend = _RaisingBackend(trigger, KeyboardInterrupt)
    steps: list[str] = []

    async def job() -> str:
        steps.append("first")
        await asyncio.sleep(0)
        steps.append("second")
        return "done"

    _engine.install_label_engine(backend, mechanism="hooks")
    loop = new_loop("asyncio")
    try:
        task = _labelled_task(loop, trigger, job())
        backend.arm()
        with pytest.raises(KeyboardInterrupt, match="push failed"):
            loop.run_until_complete(task)
        assert steps == ["first"]
        loop.run_until_complete(asyncio.wait([task], timeout=2))
    finally:
        loop.close()
        _engine.uninstall_label_engine()
    assert task.done()
    assert task.result() == "done"
    assert steps == ["first", "second"]


def _cproxy() -> Any:
    """The C extension module, or ``None`` when spanprof was built without it."""
    if importlib.util.find_spec("spanprof._labels._cproxy") is None:
        return None
    return importlib.import_module("spanprof._labels._cproxy")


def _proxy_classes() -> list[Any]:
    module = _cproxy()
    classes: list[Any] = [_engine._LabelledCoroutine]
    if module is not None:
        classes.append(module.LabelledCoroutine)
    return classes


def _failing_proxy(proxy_class: Any, coro: Any) -> Any:
    # A proxy whose every sync raises Halt: its thread "last pushed" nothing it will ever see.
    class State:
        labels = LabelSet({"never": "matches"})

    def apply(labels: LabelSet) -> None:
        raise Halt("sync failed")

    if proxy_class is _engine._LabelledCoroutine:
        proxy = proxy_class(coro)
        return proxy, {"_tls": State(), "apply": apply}
    return proxy_class(coro, LABELS, {"_tls": State()}, apply), None


@pytest.mark.parametrize("proxy_class", _proxy_classes(), ids=lambda c: c.__module__)
@pytest.mark.parametrize("step", ["yield", "return", "raise", "throw-return"])
def test_a_proxy_whose_sync_fails_takes_the_step_then_raises(
    proxy_class: Any, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every outcome of a step after a failed sync, alike in the C and the Python proxy."""
    ran: list[str] = []

    @types.coroutine
    def waiting() -> Generator[str, None, None]:
        try:
            yield "waiting"
        except Halt:
            ran.append("halt thrown in")
            raise

    async def coro() -> str:
        ran.append("step")
        if step == "yield":
            await waiting()
        elif step == "raise":
            raise ValueError("the step's own")
        return "returned"

    proxy, patches = _failing_proxy(proxy_class, coro())
    if patches is not None:  # the Python proxy reads the engine's globals
        for name, value in patches.items():
            monkeypatch.setattr(_engine, name, value)
    take_step: Any = (
        functools.partial(proxy.throw, ValueError("thrown"))
        if step == "throw-return"
        else functools.partial(proxy.send, None)
    )
    with pytest.raises(Halt, match="sync failed") as raised:
        take_step()
    if step == "throw-return":  # thrown into a coroutine that had not started: it never ran
        assert ran == []
        assert isinstance(raised.value.__context__, ValueError)
    elif step == "yield":
        assert ran == ["step", "halt thrown in"]
    elif step == "return":
        assert ran == ["step"]
    else:
        assert ran == ["step"]
        assert str(raised.value.__context__) == "the step's own"


def test_the_wrapping_c_hook_runs_the_original_when_its_sync_fails() -> None:
    """A ``Handle._run`` someone else wrapped still runs; the failure then propagates."""
    module = _cproxy()
    require(module is not None, "spanprof._labels._cproxy is not built")
    ran: list[asyncio.Handle] = []

    class State:
        labels = LabelSet({"never": "matches"})

    def apply(labels: LabelSet) -> None:
        raise Halt("sync failed")

    hook = module.HandleRunHook(ran.append, LABELS, EMPTY, {"_tls": State()}, apply, asyncio.Handle)
    loop = asyncio.new_event_loop()
    try:
        handle = asyncio.Handle(print, (), loop)
        with pytest.raises(Halt, match="sync failed"):
            hook(handle)
    finally:
        loop.close()
    assert ran == [handle]
