"""The label engine keeps each thread's profiler labels equal to the running context's labels."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import sys
import threading
from collections.abc import AsyncGenerator, Coroutine, Generator, Iterator
from typing import Any

import anyio.from_thread
import anyio.to_thread
import pytest

import spanprof
from spanprof import LabelSet, RecorderBackend, current_labels, profile_labels
from spanprof._labels import _engine
from spanprof._labels._engine import Mechanism, attach_loop
from spanprof._logging import reset_log_once

from .conftest import run_on

pytestmark = pytest.mark.engine


@pytest.fixture(params=_engine.available_mechanisms())
def mechanism(request: pytest.FixtureRequest) -> Mechanism:
    """Each test using this runs with every mechanism this interpreter has (the context watcher
    from 3.14)."""
    chosen: Mechanism = request.param
    return chosen


@pytest.fixture
def recorder(mechanism: Mechanism) -> Iterator[RecorderBackend]:
    """The engine installed with a recorder backend and ``mechanism``, uninstalled afterwards."""
    backend = RecorderBackend()
    spanprof.engine.install_label_engine(backend, mechanism=mechanism)
    try:
        assert _engine.installed_mechanism() == mechanism
        yield backend
    finally:
        spanprof.engine.uninstall_label_engine()
        reset_log_once()


class Checker:
    """Asserts, wherever it is called, that the profiler sees the context's labels."""

    def __init__(self, recorder: RecorderBackend) -> None:
        self.recorder = recorder
        self.checks = 0
        self.mismatches: list[tuple[dict[str, str], dict[str, str]]] = []
        self._lock = threading.Lock()

    def __call__(self) -> None:
        seen = self.recorder.thread_labels()
        expected = current_labels()
        with self._lock:
            self.checks += 1
            if seen != expected:
                self.mismatches.append((dict(expected), dict(seen)))

    def assert_exact(self, minimum_checks: int) -> None:
        assert self.checks >= minimum_checks
        assert self.mismatches == []


def test_profile_labels_nest_merge_and_restore() -> None:
    """Nested blocks merge over the enclosing labels and restore them on exit."""
    assert current_labels() == {}
    with profile_labels(tenant="acme", stage="a") as outer:
        assert outer == {"tenant": "acme", "stage": "a"}
        with profile_labels(stage="b", user_tier="gold"):
            assert current_labels() == {"tenant": "acme", "stage": "b", "user_tier": "gold"}
        assert current_labels() == {"tenant": "acme", "stage": "a"}
    assert current_labels() == {}


def test_profile_labels_restore_on_exception() -> None:
    """Labels are removed when the block raises."""
    with pytest.raises(KeyError), profile_labels(stage="x"):
        raise KeyError("boom")
    assert current_labels() == {}


def test_profile_labels_decorates_sync_and_async(recorder: RecorderBackend) -> None:
    """As a decorator, labels apply for each call of sync and async functions."""

    @profile_labels(stage="sync")
    def sync_fn() -> dict[str, str]:
        assert recorder.thread_labels() == {"stage": "sync"}
        return dict(current_labels())

    @profile_labels(stage="async")
    async def async_fn() -> dict[str, str]:
        await asyncio.sleep(0)
        assert recorder.thread_labels() == {"stage": "async"}
        return dict(current_labels())

    assert sync_fn() == {"stage": "sync"}
    assert asyncio.run(async_fn()) == {"stage": "async"}
    assert current_labels() == {}
    assert recorder.thread_labels() == {}


def test_profile_labels_decorates_generators_step_by_step(recorder: RecorderBackend) -> None:
    """On a generator function, each step of the body runs with the labels and the consumer
    between two steps without them; send, throw, close and the return value pass through as
    with ``yield from``."""
    steps: list[tuple[str, dict[str, str], dict[str, str]]] = []

    def seen(where: str) -> None:
        steps.append((where, dict(current_labels()), dict(recorder.thread_labels())))

    @profile_labels(stage="rows")
    def rows() -> Generator[int, str, str]:
        try:
            seen("first")
            got = yield 1
            seen(f"sent {got}")
            try:
                yield 2
            except KeyError:
                seen("caught")
            yield 3
            seen("last")
            return "done"
        finally:
            seen("finally")

    with profile_labels(req="r"):
        consumer = rows()
        assert next(consumer) == 1
        seen("consumer")
        assert consumer.send("x") == 2
        assert consumer.throw(KeyError("k")) == 3
        with pytest.raises(StopIteration) as stop:
            next(consumer)
        assert stop.value.value == "done"
        closed = rows()
        assert next(closed) == 1
        closed.close()
        seen("consumer after close")
        failing = rows()
        next(failing)
        with pytest.raises(ValueError, match="v"):
            failing.throw(ValueError("v"))  # not handled: out through the wrapper, unlabelled
        seen("consumer after throw")
    both = {"req": "r", "stage": "rows"}
    assert steps == [
        ("first", both, both),
        ("consumer", {"req": "r"}, {"req": "r"}),
        ("sent x", both, both),
        ("caught", both, both),
        ("last", both, both),
        ("finally", both, both),
        ("first", both, both),
        ("finally", both, both),  # close() runs the body's finally labelled
        ("consumer after close", {"req": "r"}, {"req": "r"}),
        ("first", both, both),
        ("finally", both, both),
        ("consumer after throw", {"req": "r"}, {"req": "r"}),
    ]
    assert current_labels() == {}
    assert recorder.thread_labels() == {}
    assert inspect.isgeneratorfunction(rows)  # still one to frameworks that look


def test_profile_labels_decorates_async_generators_step_by_step(
    recorder: RecorderBackend, loop_kind: str
) -> None:
    """On an async generator function, each step (its awaits included, while other tasks run)
    has the labels and the consumer between two steps not; asend, athrow and aclose pass
    through."""
    check = Checker(recorder)
    events: list[tuple[str, dict[str, str]]] = []

    @profile_labels(stage="stream")
    async def stream() -> AsyncGenerator[int, str]:
        try:
            check()
            await asyncio.sleep(0)  # another task's labelled steps run in between
            check()
            events.append(("first", dict(current_labels())))
            got = yield 1
            events.append((f"sent {got}", dict(current_labels())))
            try:
                yield 2
            except KeyError:
                check()
                events.append(("caught", dict(current_labels())))
            yield 3
        finally:
            await asyncio.sleep(0)
            check()
            events.append(("finally", dict(current_labels())))

    async def other() -> None:
        with profile_labels(other="o"):
            for _ in range(5):
                await asyncio.sleep(0)
                check()

    async def consume() -> None:
        with profile_labels(req="r"):
            agen = stream()
            assert await agen.__anext__() == 1
            check()
            events.append(("consumer", dict(current_labels())))
            assert await agen.asend("x") == 2
            assert await agen.athrow(KeyError("k")) == 3
            await agen.aclose()
            check()
            async for _ in stream():
                check()
            check()

    async def main() -> None:
        attach_loop()
        await asyncio.gather(consume(), other())

    run_on(loop_kind, main)
    check.assert_exact(15)
    both = {"req": "r", "stage": "stream"}
    assert events == [
        ("first", both),
        ("consumer", {"req": "r"}),
        ("sent x", both),
        ("caught", both),
        ("finally", both),
        ("first", both),
        ("sent None", both),
        ("finally", both),
    ]
    assert recorder.thread_labels() == {}
    assert inspect.isasyncgenfunction(stream)


def test_reused_instance_is_safe_across_tasks() -> None:
    """One profile_labels instance entered by two interleaving tasks resets each task's own."""
    shared = profile_labels(stage="shared")

    async def worker(name: str) -> dict[str, str]:
        with profile_labels(worker=name):
            with shared:
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            return dict(current_labels())

    async def main() -> list[dict[str, str]]:
        return list(await asyncio.gather(worker("a"), worker("b")))

    assert asyncio.run(main()) == [{"worker": "a"}, {"worker": "b"}]


def test_invalid_label_names_raise() -> None:
    """Label names Pyroscope rejects, and reserved ones, fail at once with ValueError."""
    for bad in ("span_id", "trace_id", "span_name", "service_name", "__name__", "a-b", "1x", ""):
        with pytest.raises(ValueError, match="profile_labels"):
            profile_labels(**{bad: "v"})


def test_values_are_sanitized() -> None:
    """Values with characters Pyroscope rejects are replaced, and long ones truncated."""
    with profile_labels(note='a=b,"c"\nd\u00e9', big="x" * 1000, n=5):
        labels = current_labels()
    assert labels["note"] == "a_b__c__d_"
    assert len(labels["big"]) == 256
    assert labels["n"] == "5"


class LazyUser:
    """A request's user object whose str() fails (its lazy name needs a closed database)."""

    def __str__(self) -> str:
        raise ConnectionError("database gone")


def test_a_value_whose_str_fails_is_a_placeholder_logged_once(
    fresh_log_once: None, caplog: pytest.LogCaptureFixture
) -> None:
    """profile_labels runs per request: a value it cannot print is named by its type instead."""
    with caplog.at_level("WARNING", logger="spanprof"):
        for _ in range(2):
            with profile_labels(user=LazyUser(), tenant="acme"):
                labels = dict(current_labels())
            assert labels == {"user": "<LazyUser>", "tenant": "acme"}
    assert len([r for r in caplog.records if "str() failed" in r.getMessage()]) == 1


def test_interleaved_tasks_keep_exact_labels(recorder: RecorderBackend, loop_kind: str) -> None:
    """Tasks switching on one loop each run under their own labels, at every step."""
    check = Checker(recorder)

    async def request(i: int) -> None:
        with profile_labels(req=str(i)):
            for _ in range(20):
                check()
                await asyncio.sleep(0)
                check()

    async def main() -> None:
        attach_loop()
        await asyncio.gather(*(asyncio.create_task(request(i)) for i in range(8)))
        check()

    run_on(loop_kind, main)
    check.assert_exact(8 * 40)
    assert recorder.labelled_threads() == {}


def test_child_tasks_taskgroup_and_gather_inherit(
    recorder: RecorderBackend, loop_kind: str
) -> None:
    """Child tasks, gather and TaskGroup members run under the parent's labels."""
    check = Checker(recorder)
    seen: list[dict[str, str]] = []

    async def child(tag: str) -> None:
        for _ in range(3):
            check()
            seen.append(dict(current_labels()))
            await asyncio.sleep(0)

    async def parent(i: int) -> None:
        with profile_labels(req=str(i)):
            await asyncio.create_task(child("task"))
            await asyncio.gather(child("g1"), child("g2"))
            if sys.version_info >= (3, 11):
                async with asyncio.TaskGroup() as group:
                    group.create_task(child("tg1"))
                    group.create_task(child("tg2"))
            check()

    async def main() -> None:
        attach_loop()
        await asyncio.gather(parent(1), parent(2))

    run_on(loop_kind, main)
    check.assert_exact(2 * 9)
    assert {label["req"] for label in seen} == {"1", "2"}
    assert recorder.labelled_threads() == {}


def test_thread_pool_paths_carry_request_labels(recorder: RecorderBackend, loop_kind: str) -> None:
    """run_in_executor, to_thread, anyio and submit run with the labels, then clear them."""
    check = Checker(recorder)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    results: list[tuple[str, dict[str, str]]] = []

    def work(path: str) -> None:
        check()
        results.append((path, dict(recorder.thread_labels())))

    async def request(i: int) -> None:
        loop = asyncio.get_running_loop()
        with profile_labels(req=str(i)):
            await loop.run_in_executor(None, work, "run_in_executor")
            await loop.run_in_executor(pool, work, "run_in_executor_pool")
            await asyncio.to_thread(work, "to_thread")
            await anyio.to_thread.run_sync(work, "anyio")
            await asyncio.wrap_future(pool.submit(work, "submit"))
            check()

    async def main() -> None:
        attach_loop()
        await asyncio.gather(*(request(i) for i in range(4)))

    try:
        run_on(loop_kind, main)
    finally:
        pool.shutdown()
    check.assert_exact(4 * 6)
    assert len(results) == 20
    for path, labels in results:
        assert set(labels) == {"req"}, path
    # Every worker thread dropped the labels when its job ended.
    assert recorder.labelled_threads() == {}


@pytest.mark.parametrize("anyio_backend_name", ["asyncio", "trio"])
def test_a_job_a_thread_pool_job_starts_through_the_loop_is_labelled(
    mechanism: Mechanism, anyio_backend_name: str
) -> None:
    """A to_thread.run_sync awaited by a task that a pool job started (from_thread.run) runs
    its own job with the labels too, though that task's context is a copy of the job's."""
    backend = RecorderBackend()
    check = Checker(backend)
    seen: list[dict[str, str]] = []

    def nested_job() -> None:
        check()
        seen.append(dict(backend.thread_labels()))

    async def from_the_job() -> None:
        check()
        await anyio.to_thread.run_sync(nested_job)

    def job() -> None:
        check()
        anyio.from_thread.run(from_the_job)
        check()

    async def main() -> None:
        # Installed in the run: the trio backend's trio.to_thread is imported by then.
        spanprof.engine.install_label_engine(backend, mechanism=mechanism)
        with profile_labels(req="r"):
            await anyio.to_thread.run_sync(job)
            check()

    try:
        anyio.run(main, backend=anyio_backend_name)
    finally:
        spanprof.engine.uninstall_label_engine()
        reset_log_once()
    check.assert_exact(5)
    assert seen == [{"req": "r"}]
    assert backend.labelled_threads() == {}


def test_unlabelled_work_runs_without_labels(recorder: RecorderBackend, loop_kind: str) -> None:
    """Code in a context without labels runs with none, even right after labelled code."""
    check = Checker(recorder)

    async def background() -> None:
        for _ in range(10):
            check()
            assert recorder.thread_labels() == {}
            await asyncio.sleep(0)

    async def request() -> None:
        with profile_labels(req="1"):
            for _ in range(10):
                check()
                await asyncio.sleep(0)

    async def main() -> None:
        attach_loop()
        bg = asyncio.create_task(background())
        await asyncio.gather(asyncio.create_task(request()), bg)

    run_on(loop_kind, main)
    check.assert_exact(20)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="eager tasks exist from 3.12")
def test_eager_tasks_leave_the_caller_its_labels(recorder: RecorderBackend, loop_kind: str) -> None:
    """An eager task that sets labels and suspends hands the thread back to the caller's."""
    check = Checker(recorder)

    async def eager_child() -> None:
        with profile_labels(child="yes"):
            check()
            await asyncio.sleep(0)
            check()

    def eager_factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        kwargs["eager_start"] = True
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # Not asyncio.eager_task_factory: uvloop 0.23 passes it `eager_start`, which 3.13's
        # rejects (with or without spanprof).
        loop.set_task_factory(eager_factory)  # type: ignore[arg-type]
        attach_loop(loop)
        with profile_labels(req="parent"):
            task = asyncio.create_task(eager_child())
            check()
            assert recorder.thread_labels() == {"req": "parent"}
            await task
            check()

    run_on(loop_kind, main)
    check.assert_exact(4)


@pytest.mark.parametrize("factory_kind", ["plain", "eager"])
def test_a_task_factory_set_after_the_loop_was_attached_is_hooked(
    recorder: RecorderBackend, loop_kind: str, factory_kind: str
) -> None:
    """The app sets its own task factory after the middleware's lifespan startup attached the
    loop: the next request's attach_loop hooks it, and steps_hooked() tells the truth about the
    request task the app's factory created unhooked."""
    if factory_kind == "eager" and sys.version_info < (3, 12):
        pytest.skip("eager tasks exist from 3.12")
    check = Checker(recorder)
    answers: list[bool] = []

    def app_factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        if factory_kind == "eager":
            kwargs["eager_start"] = True
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def child(name: str) -> None:
        with profile_labels(child=name):
            for _ in range(5):
                check()
                await asyncio.sleep(0)  # the other child's steps run in between
            check()

    async def handle() -> None:
        with profile_labels(req="r"):
            first = asyncio.create_task(child("a"))
            check()
            second = asyncio.create_task(child("b"))
            check()
            await asyncio.gather(first, second)
            check()

    async def request() -> None:
        answers.append(_engine.steps_hooked())
        attach_loop()  # what the middleware does on every request
        answers.append(_engine.steps_hooked())
        if answers[-1]:
            await handle()
        else:
            await _engine.run_steps_hooked(handle())

    async def main() -> None:
        attach_loop()  # the middleware's lifespan startup
        asyncio.get_running_loop().set_task_factory(app_factory)  # type: ignore[arg-type]
        await asyncio.create_task(request())

    run_on(loop_kind, main)
    check.assert_exact(15)
    # Only uvloop's steps need the label factory's coroutine proxies, which the request task,
    # created by the app's factory, lacks.
    unhooked = loop_kind == "uvloop" and _engine.installed_mechanism() == "hooks"
    assert answers == [not unhooked] * 2


def test_backend_failure_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture, mechanism: Mechanism
) -> None:
    """A backend that raises on every push is logged once; labelled code runs normally."""

    class Broken(RecorderBackend):
        def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
            raise RuntimeError("profiler down")

    reset_log_once()  # its key holds the backend's id, which an earlier one may have had
    spanprof.engine.install_label_engine(Broken(), mechanism=mechanism)
    try:

        async def main() -> int:
            total = 0
            for i in range(50):
                with profile_labels(req=str(i)):
                    await asyncio.sleep(0)
                    total += 1
            return total

        with caplog.at_level("WARNING", logger="spanprof"):
            assert asyncio.run(main()) == 50
    finally:
        spanprof.engine.uninstall_label_engine()
        reset_log_once()
    failures = [r for r in caplog.records if "failed to switch labels" in r.getMessage()]
    assert len(failures) == 1


def test_install_twice_and_uninstall_restore_originals() -> None:
    """Installing twice is harmless; uninstalling restores every patched function."""
    originals = (
        asyncio.Handle._run,
        concurrent.futures.ThreadPoolExecutor.submit,
        anyio.to_thread.run_sync,
    )
    backend = RecorderBackend()
    spanprof.engine.install_label_engine(backend, mechanism="hooks")
    spanprof.engine.install_label_engine(backend)
    assert spanprof.engine.installed_backend() is backend
    assert _engine.installed_mechanism() == "hooks"
    assert asyncio.Handle._run is not originals[0]
    spanprof.engine.uninstall_label_engine()
    spanprof.engine.uninstall_label_engine()
    assert spanprof.engine.installed_backend() is None
    assert (
        asyncio.Handle._run,
        concurrent.futures.ThreadPoolExecutor.submit,
        anyio.to_thread.run_sync,
    ) == originals


def test_wrappers_applied_after_import_run_while_installed_and_are_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Handle._run`` and ``submit`` wrapped by another library after ``import spanprof`` keep
    running under the engine's hooks, and uninstalling puts exactly those wrappers back."""
    asyncio_run = asyncio.Handle._run
    pool_submit = concurrent.futures.ThreadPoolExecutor.submit
    calls = {"run": 0, "submit": 0}

    def other_run(self: asyncio.Handle) -> None:
        calls["run"] += 1
        asyncio_run(self)

    def other_submit(
        self: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        calls["submit"] += 1
        return pool_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(asyncio.Handle, "_run", other_run)
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", other_submit)
    backend = RecorderBackend()
    labelled: list[LabelSet] = []

    async def main() -> None:
        with profile_labels(req="wrapped"):
            await asyncio.sleep(0)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(lambda: labelled.append(backend.thread_labels())).result()

    spanprof.engine.install_label_engine(backend, mechanism="hooks")
    try:
        assert asyncio.Handle._run is not other_run
        run_on("asyncio", main)
    finally:
        spanprof.engine.uninstall_label_engine()
    assert calls["run"] > 0
    assert calls["submit"] == 1
    assert labelled == [LabelSet({"req": "wrapped"})]
    assert asyncio.Handle._run is other_run
    assert concurrent.futures.ThreadPoolExecutor.submit is other_submit


class _ReadsMainContext(RecorderBackend):
    """A recorder that, like the exact sampler, reads the main thread's labels itself."""

    needs_step_hooks = False


@pytest.mark.parametrize("reads_context", [False, True])
def test_main_thread_loops_get_a_step_hook_unless_the_backend_reads_their_context(
    reads_context: bool,
) -> None:
    """uvloop gets the label task factory, except in the main thread of a backend that reads
    the running context there itself; a loop in another thread always gets it."""
    backend = _ReadsMainContext() if reads_context else RecorderBackend()
    factories: dict[str, object] = {}

    async def probe(where: str) -> None:
        attach_loop()
        factories[where] = asyncio.get_running_loop().get_task_factory()

    spanprof.engine.install_label_engine(backend, mechanism="hooks")
    try:
        run_on("uvloop", lambda: probe("main"))
        thread = threading.Thread(target=run_on, args=("uvloop", lambda: probe("thread")))
        thread.start()
        thread.join()
    finally:
        spanprof.engine.uninstall_label_engine()
    assert (factories["main"] is None) is reads_context, factories
    assert factories["thread"] is not None, factories


def test_a_thread_read_from_its_context_asks_asyncio_nothing_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the main thread is left to a backend that reads its context, the middleware's two
    per-request engine calls return at once: no loop or task lookup (before, two a request)."""
    calls: list[str] = []
    current_task, get_running_loop = asyncio.current_task, asyncio.get_running_loop

    def counting_current_task(loop: Any = None) -> Any:
        calls.append("current_task")
        return current_task(loop)

    def counting_get_running_loop() -> asyncio.AbstractEventLoop:
        calls.append("get_running_loop")
        return get_running_loop()

    answers: list[bool] = []

    async def requests() -> None:
        attach_loop()  # the first request: the thread is left alone from here on
        monkeypatch.setattr(asyncio, "current_task", counting_current_task)
        monkeypatch.setattr(asyncio, "get_running_loop", counting_get_running_loop)
        try:
            for _ in range(100):
                attach_loop()
                answers.append(_engine.steps_hooked())
        finally:
            monkeypatch.undo()

    spanprof.engine.install_label_engine(_ReadsMainContext(), mechanism="hooks")
    try:
        run_on("asyncio", requests)
    finally:
        spanprof.engine.uninstall_label_engine()
    assert answers == [True] * 100
    assert calls == []


@pytest.mark.parametrize("engine", ["c", "python", "watcher"])
@pytest.mark.parametrize("reads_context", [False, True])
def test_no_pushes_for_the_main_thread_when_the_backend_reads_its_context(
    reads_context: bool, engine: str, loop_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interleaved labelled tasks push every switch, unless the backend reads the main thread's
    context itself; thread-pool jobs push theirs either way. With the C hooks, without, and
    with the context watcher."""
    if engine == "watcher" and "watcher" not in _engine.available_mechanisms():
        pytest.skip("the context watcher needs CPython 3.14+ and the C extension")
    mechanism: Mechanism = "watcher" if engine == "watcher" else "hooks"
    if engine == "python":
        for name in ("_CLabelledCoroutine", "_CThreadLabels", "_CHandleRunHook", "_c_set_quiet"):
            monkeypatch.setattr(_engine, name, None, raising=False)
    backend = _ReadsMainContext() if reads_context else RecorderBackend()
    main = threading.get_ident()
    seen_in_pool: list[dict[str, str]] = []

    def job() -> None:
        seen_in_pool.append(dict(backend.thread_labels()))

    async def request(index: int) -> None:
        with profile_labels(request=str(index)):
            for _ in range(20):
                await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, job)

    async def scenario() -> None:
        spanprof.engine.install_label_engine(backend, mechanism=mechanism)
        try:
            backend.clear()
            await asyncio.gather(*(request(i) for i in range(3)))
        finally:
            spanprof.engine.uninstall_label_engine()

    run_on(loop_kind, scenario)
    from_main = [labels for ident, labels in backend.switches if ident == main]
    from_pool = [labels for ident, labels in backend.switches if ident != main]
    if reads_context:
        assert from_main == []
    else:
        assert len(from_main) >= 3 * 20, len(from_main)
    assert sorted(labels.get("request") for labels in from_pool if labels) == ["0", "1", "2"]
    assert sorted(labels["request"] for labels in seen_in_pool) == ["0", "1", "2"]


def test_label_set_is_immutable_and_hashable() -> None:
    """LabelSet compares by content, hashes, and has no mutators."""
    a = LabelSet({"x": "1", "y": "2"})
    b = LabelSet([("y", "2"), ("x", "1")])
    assert a == b
    assert hash(a) == hash(b)
    assert a == {"x": "1", "y": "2"}
    assert a.merged({"x": "3"}) == {"x": "3", "y": "2"}
    assert a == {"x": "1", "y": "2"}
    assert not hasattr(a, "__setitem__")


def test_uninstalling_inside_a_trio_run_removes_its_instrument() -> None:
    """Uninstalled inside a trio run, the engine takes its instrument out of that run; installed
    again in the same run, it puts it back and follows the steps again."""
    trio = importlib.import_module("trio")
    backend = RecorderBackend()
    check = Checker(backend)
    left_in_run: list[bool] = []

    async def labelled(name: str) -> None:
        with profile_labels(task=name):
            for _ in range(3):
                await trio.lowlevel.checkpoint()  # the other task's steps run in between
                check()

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(labelled, "a")
            nursery.start_soon(labelled, "b")

    async def main() -> None:
        for _ in range(2):
            spanprof.engine.install_label_engine(backend, mechanism="hooks")
            try:
                await both()
            finally:
                spanprof.engine.uninstall_label_engine()
            try:
                trio.lowlevel.remove_instrument(_engine._TRIO_LABELS)
            except KeyError:
                left_in_run.append(False)
            else:
                left_in_run.append(True)

    trio.run(main)
    check.assert_exact(12)
    assert left_in_run == [False, False]


def test_a_half_imported_trio_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installing while another thread is still importing trio (no to_thread.run_sync yet)
    patches nothing there and does not fail (it broke the demo's lifespan)."""
    import types

    half = types.ModuleType("trio.to_thread")
    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))
    monkeypatch.setitem(sys.modules, "trio.to_thread", half)
    backend = RecorderBackend()
    spanprof.engine.install_label_engine(backend)
    try:
        assert spanprof.engine.installed_backend() is backend
        assert not hasattr(half, "run_sync")
    finally:
        spanprof.engine.uninstall_label_engine()
