"""The label engine: keeps each thread's profiler labels equal to the context running on it.

The profiler attributes a sample to the labels of the *OS thread* it was taken on, but labels
live in a ContextVar, and on an event loop one thread runs many contexts in turn. So the engine
hooks every place where a thread starts running code of another context and, only when the label
set differs from what that thread last pushed, tells the backend. It follows those switches
with one of two mechanisms (``MECHANISMS``, chosen at install):

- ``"hooks"`` (every version; the default, cheaper per step): asyncio's ``Handle._run`` (every
  task step and callback runs in its handle's context); on loops whose handles are compiled
  (uvloop), a task factory whose coroutine proxy re-syncs on every ``send``/``throw``, the same
  factory re-syncing after eager tasks (3.12+) ran their first step inside the creating call;
  a trio instrument's ``before_task_step``;
- ``"watcher"`` (CPython 3.14+, with the C extension): a ``PyContext_AddWatcher`` callback runs
  after every context switch on every thread (each asyncio, eager, uvloop and trio task step
  in and out, each ``Context.run``) and pushes the now-current context's labels.

And with either:

- thread pools: ``ThreadPoolExecutor.submit`` (so ``loop.run_in_executor``, which runs the job
  outside any copied context, and ``asyncio.to_thread``) and ``anyio.to_thread.run_sync``
  (Starlette's ``run_in_threadpool``) run the job with the submitter's labels and clear the
  worker's labels afterwards;
- code that sets labels itself (``profile_labels``, the middlewares) calls ``sync()``, because a
  ``ContextVar.set`` fires neither a hook nor the watcher.

Nothing is patched at import time: ``install_label_engine`` patches, ``uninstall_label_engine``
restores the originals.

The context watcher, the ``Handle._run`` hook, the coroutine proxy and the per-thread state come
in C (``spanprof._cproxy``) when the package was built with a compiler; without it the engine
uses the hooks, in their Python versions below, slower.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
import weakref
from asyncio import format_helpers
from collections.abc import Callable, Coroutine, Generator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from .._logging import log_once
from ._backend import ProfilerBackend, ReadsMainThreadContext
from ._labelset import EMPTY, LABELS, LabelSet
from ._native import cproxy

if TYPE_CHECKING:
    from ._cproxy import HandleRunHook as _CHandleRunHook
    from ._cproxy import LabelledCoroutine as _CLabelledCoroutine
    from ._cproxy import ThreadLabels as _CThreadLabels
    from ._cproxy import set_quiet as _c_set_quiet
    from ._cproxy import unwatch_contexts as _c_unwatch_contexts
    from ._cproxy import watch_contexts as _c_watch_contexts
elif cproxy is not None:
    _CHandleRunHook = cproxy.HandleRunHook
    _CLabelledCoroutine = cproxy.LabelledCoroutine
    _CThreadLabels = cproxy.ThreadLabels
    _c_set_quiet = cproxy.set_quiet
    # Only built on CPython 3.14+ (PyContext_AddWatcher).
    _c_watch_contexts = getattr(cproxy, "watch_contexts", None)
    _c_unwatch_contexts = getattr(cproxy, "unwatch_contexts", None)
else:  # no C extension here: the Python versions below do the same
    _CHandleRunHook = _CLabelledCoroutine = _CThreadLabels = _c_set_quiet = None
    _c_watch_contexts = _c_unwatch_contexts = None

__all__ = [
    "MECHANISMS",
    "Mechanism",
    "apply",
    "attach_loop",
    "available_mechanisms",
    "check_native_thread_state",
    "default_mechanism",
    "install_label_engine",
    "installed_backend",
    "installed_mechanism",
    "run_labelled",
    "run_steps_hooked",
    "steps_hooked",
    "sync",
    "uninstall_label_engine",
]

T = TypeVar("T")

Mechanism = Literal["watcher", "hooks"]
MECHANISMS: tuple[Mechanism, ...] = ("hooks", "watcher")


def _native_thread_local() -> type[threading.local]:
    # gevent's monkey patching swaps threading.local for a greenlet-local class. The engine must
    # remember what it pushed per OS thread, as the profiler keys labels: take the original
    # class when spanprof is imported after patching (gunicorn's gevent worker without preload).
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None:
        return threading.local
    original: type[threading.local] = monkey.get_original("_thread", "_local")
    return original


if TYPE_CHECKING:
    _NativeLocal = threading.local
else:
    _NativeLocal = _native_thread_local()


class _PerThread(Protocol):
    # What the backend was last told for the calling thread.
    labels: LabelSet


class _ThreadState(_NativeLocal):
    labels: LabelSet = EMPTY


def _new_thread_state() -> _PerThread:
    # A fresh state: every thread starts again from EMPTY. The C one lives in the OS thread's
    # state: per OS thread whatever gevent patched, and read without running Python code.
    if _CThreadLabels is not None:
        return _CThreadLabels(EMPTY)
    return _ThreadState()


_tls = _new_thread_state()
_backend: ProfilerBackend | None = None
# How the installed engine follows context switches; None while it is not installed.
_mechanism: Mechanism | None = None
_lock = threading.RLock()
_restore: list[Callable[[], None]] = []
_fork_hook_registered = False


# What a thread's state holds while its backend reads that thread's labels from the running
# context itself (the exact sampler, in the main thread): nothing is pushed for it, and the
# step hooks (Python and C, see _cproxy.set_quiet) see no change to push.
_QUIET = LabelSet({"spanprof_quiet": "1"})


def apply(labels: LabelSet) -> None:
    """The calling thread now runs with ``labels``: push them if that is a change."""
    backend = _backend
    if backend is None:
        # Nothing to tell, and nothing to remember: installing starts every thread afresh.
        return
    state = _tls
    previous = state.labels
    if labels is previous or previous is _QUIET:
        return
    state.labels = labels
    # The dicts compared directly: LabelSet.__eq__ would add a Python call to every switch.
    if labels._map == previous._map:
        return
    try:
        backend.set_thread_labels(previous, labels)
    except Exception:
        log_once(
            f"backend-labels-{id(backend)}",
            "spanprof: the profiler backend failed to switch labels; samples may be "
            "misattributed until it recovers (logged once)",
        )


def sync() -> None:
    """Push the current context's labels for the calling thread (after a ``LABELS.set``)."""
    apply(LABELS.get())


def check_native_thread_state() -> None:
    """Raise ``RuntimeError`` if the engine's per-thread state is per greenlet instead.

    The engine remembers what it pushed per OS thread. If spanprof was imported after gevent's
    monkey patching, a Python ``threading.local`` state would be greenlet-local, and switches
    would leave stale labels on the thread. The C state lives in the OS thread's state whatever
    gevent patched.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not isinstance(_tls, _ThreadState):
        return
    native_local = monkey.get_original("_thread", "_local")
    if not isinstance(_tls, native_local):
        raise RuntimeError(
            "spanprof was imported after gevent.monkey.patch_all(), so its per-thread state is "
            "per-greenlet; import spanprof before patching (e.g. with gunicorn's preload_app "
            "or an import at the top of the gunicorn config)"
        )


def installed_backend() -> ProfilerBackend | None:
    """The backend the engine currently feeds, or ``None`` when it is not installed."""
    return _backend


def available_mechanisms() -> tuple[Mechanism, ...]:
    """The mechanisms this interpreter supports: ``"hooks"`` runs everywhere; ``"watcher"``
    needs CPython 3.14+ and the C extension."""
    if _c_watch_contexts is None:
        return ("hooks",)
    return MECHANISMS


def default_mechanism() -> Mechanism:
    """What ``install_label_engine`` uses unless told otherwise: ``"hooks"``, on 3.14+ too.

    Measured on 3.14 (docs/benchmarks.md, "context watcher vs hooks"): the watcher runs on
    entering each step's context *and* on leaving it for the loop's own, unlabelled context,
    so a labelled step costs two pushes where the hooks push only when the next step's labels
    differ from the last (none while they stay the same); with nothing to push it still costs
    ~100-125 ns a step, where the C ``Handle._run`` replacement costs less than no hook. The
    watcher's gain is exactness between steps (the loop's own work runs unlabelled) and
    covering any ``Context.run`` without a hook per library.
    """
    return "hooks"


def installed_mechanism() -> Mechanism | None:
    """How the installed engine follows context switches, or ``None`` when not installed."""
    return _mechanism


# --- asyncio handles -------------------------------------------------------------------------

# The ``Handle._run`` the hooks call: whatever was in place when the engine was installed (asyncio's
# own, or a wrapper another library applied after spanprof was imported), and what uninstalling
# puts back. Set by _install_patches; asyncio's own until then.
_orig_handle_run: Callable[[asyncio.Handle], None] = asyncio.Handle._run


# --- a failed label sync never drops a step ----------------------------------------------------
#
# apply() reports the backend's Exceptions itself, but a KeyboardInterrupt or SystemExit (a signal
# landing in its Python code, a backend that exits) gets through. Skipping the step then would
# leave its task waiting forever for a step that never ran: the step always runs, and the sync's
# exception is raised as if it had come right after the step. Same rules as the C versions.

_EXIT = (SystemExit, KeyboardInterrupt)


def _prevailing(step: BaseException, sync: BaseException) -> BaseException:
    # Of the step's exception and the sync's (raised "after" it), the one that propagates, with
    # the other as its __context__: the sync's, unless only the step's is an exit exception.
    winner, loser = (
        (step, sync) if isinstance(step, _EXIT) and not isinstance(sync, _EXIT) else (sync, step)
    )
    if winner is not loser:
        winner.__context__ = loser
    return winner


def _run_despite(handle: asyncio.Handle, failure: BaseException) -> None:
    # The handle's sync raised ``failure``: run it anyway. asyncio's own _run lets only exit
    # exceptions out; then the failure goes the way a failing callback's would (as the C hook
    # that replaces asyncio's _run does), or propagates from any other _run.
    try:
        _orig_handle_run(handle)
    except BaseException as raised:
        raise _prevailing(raised, failure)  # noqa: B904 - chained by _prevailing
    if _report_sync_failure is None or isinstance(failure, _EXIT):
        raise failure
    try:
        raise failure
    except BaseException as exc:  # reported while being handled, as asyncio's except block does
        _report_sync_failure(handle, exc)


def _handle_run(self: asyncio.Handle) -> None:
    # Hot path: one context lookup and one identity check per callback.
    try:
        labels = self._context.get(LABELS, EMPTY)  # type: ignore[attr-defined]
        if labels is not _tls.labels:
            apply(labels)
    except BaseException as failure:
        _run_despite(self, failure)
        return
    _orig_handle_run(self)


def _report_callback_error(handle: asyncio.Handle, exc: BaseException) -> None:
    # The except block of asyncio's Handle._run (identical in 3.10-3.15 but for ``debug``),
    # for the C hook that runs asyncio's own handles itself.
    h: Any = handle
    if sys.version_info >= (3, 13):
        source = format_helpers._format_callback_source(
            h._callback, h._args, debug=h._loop.get_debug()
        )
    else:
        source = format_helpers._format_callback_source(h._callback, h._args)
    context: dict[str, Any] = {
        "message": f"Exception in callback {source}",
        "exception": exc,
        "handle": handle,
    }
    if h._source_traceback:
        context["source_traceback"] = h._source_traceback
    h._loop.call_exception_handler(context)


def _is_asyncios_own(run: Callable[..., object]) -> bool:
    # functools.wraps copies names, not code: a wrapper someone else installed must keep running.
    code = getattr(run, "__code__", None)
    return (
        code is not None and code.co_name == "_run" and code.co_filename == asyncio.events.__file__
    )


# How the Python hook reports a failed sync after the step: as asyncio's own _run reports a
# failing callback, when the hooked _run is asyncio's own (as the C hook, which replaces it then).
# Decided again at each install, for the _run hooked then.
_report_sync_failure: Callable[[asyncio.Handle, BaseException], None] | None = None


def _handle_run_hook() -> Callable[[asyncio.Handle], None]:
    if _CHandleRunHook is None:
        return _handle_run
    # Reads ``_tls`` from this module's namespace on every call, like the C proxy.
    report = _report_callback_error if _is_asyncios_own(_orig_handle_run) else None
    return _CHandleRunHook(
        _orig_handle_run, LABELS, EMPTY, globals(), apply, asyncio.Handle, report
    )


# --- task factory for loops whose handles we cannot patch ------------------------------------


class _LabelledCoroutine:
    """A coroutine proxy that syncs labels before each step of the wrapped coroutine.

    Task steps run inside the task's context, so ``LABELS.get()`` here is the task's labels.
    """

    __slots__ = ("__weakref__", "_coro")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro

    def send(self, value: Any) -> Any:
        try:
            labels = LABELS.get()
            if labels is not _tls.labels:
                apply(labels)
        except BaseException as failure:
            return self._step_despite(failure, self._coro.send, value)
        return self._coro.send(value)

    def __next__(self) -> Any:
        return self.send(None)

    def throw(self, *args: Any) -> Any:
        try:
            labels = LABELS.get()
            if labels is not _tls.labels:
                apply(labels)
        except BaseException as failure:
            return self._step_despite(failure, self._coro.throw, *args)
        return self._coro.throw(*args)

    def _step_despite(self, failure: BaseException, step: Callable[..., Any], *args: Any) -> Any:
        # The sync raised ``failure``: take the step anyway, then raise it as if right after the
        # step. Waiting at an await, the coroutine gets it thrown in there (as a signal arriving
        # then would; the value it yielded is dropped); returned, it loses its value to it.
        try:
            step(*args)
        except StopIteration:
            pass
        except BaseException as raised:
            raise _prevailing(raised, failure)  # noqa: B904 - chained by _prevailing
        else:
            return self._coro.throw(failure)
        raise failure

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self

    def __iter__(self) -> _LabelledCoroutine:
        return self

    def __getattr__(self, name: str) -> Any:
        # cr_frame, cr_running, cr_await, __qualname__...: inspect.getcoroutinestate, anyio and
        # asyncio's repr read these from the task's coroutine.
        return getattr(self._coro, name)

    def __repr__(self) -> str:
        return repr(self._coro)


Coroutine.register(_LabelledCoroutine)
if _CLabelledCoroutine is not None:
    # asyncio.Task accepts only coroutines; its check is isinstance(coro, abc.Coroutine).
    Coroutine.register(_CLabelledCoroutine)


def _labelled(coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
    if _CLabelledCoroutine is not None:
        # The C proxy reads ``_tls`` from this module's namespace on every step, because
        # install, uninstall and fork replace it: ``_tls.labels`` stays the one source of truth.
        return _CLabelledCoroutine(coro, LABELS, globals(), apply)
    return _LabelledCoroutine(coro)


_PROXY_TYPES: tuple[type, ...] = (
    (_LabelledCoroutine,)
    if _CLabelledCoroutine is None
    else (_CLabelledCoroutine, _LabelledCoroutine)
)

# Set while a task that escapes the engine runs a coroutine it hooked with run_steps_hooked.
_STEPS_HOOKED: ContextVar[bool] = ContextVar("spanprof.steps_hooked", default=False)


def steps_hooked() -> bool:
    """Whether the engine syncs labels before every step of the calling task.

    False only for a task on a loop whose handles cannot be patched (uvloop) that was created
    before ``attach_loop`` gave the loop its task factory: the request that hooked the loop,
    and any already running then (a server without lifespan, such as Django's ASGI handler),
    or by a factory the app set since.
    Its steps run under whatever labels the last hooked step pushed, unless its code runs
    inside ``run_steps_hooked``. Cheap enough to ask once per request.
    """
    if _backend is None or _mechanism == "watcher":
        return True  # the watcher sees every step of every task
    if _tls.labels is _QUIET:
        return True  # the sampler reads this thread's labels from its context: nothing to sync
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop running here (trio has its own instrument)
        return True
    if task is None:
        return True
    loop = task.get_loop()
    factory = loop.get_task_factory()
    if isinstance(factory, _LabelTaskFactory):
        if not factory.wrap_coroutines:
            return True  # the loop's handles are hooked
    elif isinstance(loop, asyncio.BaseEventLoop):
        return True  # the loop's handles are hooked
    # A loop whose handles cannot be hooked: only the label factory's proxies sync its steps (and
    # none at all if the app's own factory replaced it since attach_loop).
    return _STEPS_HOOKED.get() or isinstance(task.get_coro(), _PROXY_TYPES)


async def run_steps_hooked(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` with the labels synced before each of its steps, as in a hooked task."""
    token = _STEPS_HOOKED.set(True)
    try:
        result: T = await _labelled(coro)
        return result
    finally:
        _STEPS_HOOKED.reset(token)


_TaskFactory = Callable[..., "asyncio.Future[Any]"]


class _LabelTaskFactory:
    """Wraps a loop's task factory (or the default one) for the label engine."""

    __slots__ = ("inner", "wrap_coroutines")

    def __init__(self, inner: _TaskFactory | None, *, wrap_coroutines: bool) -> None:
        self.inner = inner
        self.wrap_coroutines = wrap_coroutines

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Future[Any]:
        # Left on a loop by a "hooks" engine that was since reinstalled as a "watcher" one, it
        # passes through: the watcher sees the steps and the eager start.
        engaged = _backend is not None and _mechanism == "hooks"
        # Not a coroutine: left unwrapped, so the task raises its usual TypeError at once.
        if engaged and self.wrap_coroutines and asyncio.iscoroutine(coro):
            coro = _labelled(coro)
        task: asyncio.Future[Any]
        if self.inner is None:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        else:
            task = self.inner(loop, coro, **kwargs)
        if engaged:
            # An eager task ran its first step inside this call and may have left its own labels
            # on the thread; the caller continues in its own context.
            sync()
        return task


_seen_loop: weakref.ReferenceType[asyncio.AbstractEventLoop] | None = None
# The task factory _seen_loop had when last looked at (after hooking it). The app may set its own
# later (eager tasks, a factory on uvloop), after the middleware's lifespan startup attached the
# loop: a different one means the loop is looked at again. Held strongly (a loop at most).
_seen_factory: object = None


def attach_loop(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Hook ``loop`` (default: the running loop) if its handles cannot be patched.

    Pure-Python asyncio loops need nothing unless they use a task factory (eager tasks). uvloop
    and other compiled loops get a task factory whose coroutines sync labels on every step.
    With the context watcher no loop needs anything. Either way, the main thread of a backend
    that reads its context itself is left alone from here on. Cheap to call on every request:
    it remembers the last loop it saw and that loop's task factory, and looks again when the
    app has set another factory since (eager tasks, its own factory on uvloop).
    """
    global _seen_loop, _seen_factory
    if _backend is None or _tls.labels is _QUIET:
        # Quiet: the sampler reads this thread's labels from its context, whatever loop runs.
        return
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _attach_trio()
            return
    # Per request: one get_task_factory() call and an identity check, to notice a factory set
    # since (which would otherwise run every later task unhooked).
    factory = loop.get_task_factory()
    if _seen_loop is not None and _seen_loop() is loop and factory is _seen_factory:
        return
    if _samples_context_here():
        # No task factory, and the step hooks leave this thread alone.
        _tls.labels = _QUIET
    elif _mechanism == "hooks" and not isinstance(factory, _LabelTaskFactory):
        python_handles = isinstance(loop, asyncio.BaseEventLoop)
        if not python_handles or factory is not None:
            loop.set_task_factory(
                _LabelTaskFactory(factory, wrap_coroutines=not python_handles)  # type: ignore[arg-type]
            )
            factory = loop.get_task_factory()
    _seen_factory = factory
    try:
        _seen_loop = weakref.ref(loop)
    except TypeError:  # a loop type without weak references: just re-check next time
        _seen_loop = None


class _TrioLabels:
    """A trio instrument: each task step runs with its task's labels (``task.context``)."""

    __slots__ = ()

    def before_task_step(self, task: Any) -> None:
        labels = task.context.get(LABELS, EMPTY)
        if labels is not _tls.labels:
            apply(labels)


_TRIO_LABELS = _TrioLabels()
# The trio run last hooked (its token): each run is looked at once. Adding the one instrument
# again is a no-op to trio.
_seen_trio: object = None


def _attach_trio() -> None:
    # trio runs every task step in the task's own context and tells instruments about each.
    global _seen_trio
    # Only a completely imported trio (see _patch_trio) can be running this code.
    lowlevel = sys.modules.get("trio.lowlevel")
    current_token = getattr(lowlevel, "current_trio_token", None)
    if lowlevel is None or current_token is None:
        return
    try:
        token = current_token()
    except RuntimeError:  # not in a trio run
        return
    if token is _seen_trio:
        return
    _seen_trio = token
    if _samples_context_here():
        _tls.labels = _QUIET
    elif _mechanism == "hooks":  # trio runs each step in task.context.run: the watcher sees it
        lowlevel.add_instrument(_TRIO_LABELS)


def _detach_trio() -> None:
    # Only the current run's instruments can be reached (trio has no other API). Another run
    # keeps the instrument until it ends: harmless, apply() does nothing while uninstalled, and
    # a later install adds the same instrument again, which trio ignores.
    lowlevel = sys.modules.get("trio.lowlevel")
    remove_instrument = getattr(lowlevel, "remove_instrument", None)
    if remove_instrument is None:
        return
    # RuntimeError: not in a trio run; KeyError: this run never had it (watcher, quiet thread).
    with contextlib.suppress(KeyError, RuntimeError):
        remove_instrument(_TRIO_LABELS)


def _samples_context_here() -> bool:
    # The exact sampler reads the main thread's labels from the context running at each sample
    # (ReadsMainThreadContext): its loops need no per-step pushes.
    backend = _backend
    return (
        isinstance(backend, ReadsMainThreadContext)
        and not backend.needs_step_hooks
        and threading.current_thread() is threading.main_thread()
    )


def _detach_loop(loop: asyncio.AbstractEventLoop) -> None:
    factory = loop.get_task_factory()
    if isinstance(factory, _LabelTaskFactory):
        loop.set_task_factory(factory.inner)


# --- thread pools ------------------------------------------------------------------------------


# Set while a patched to_thread.run_sync hands a labelled job on (to another patched one).
_JOB_WRAPPED: ContextVar[bool] = ContextVar("spanprof.job_wrapped", default=False)


def run_labelled(labels: LabelSet, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on this thread with ``labels``, then restore the thread's own labels."""
    # What the thread ran with before the job, not what the context says after it: anyio and
    # asyncio.to_thread run the job inside a copied context that still holds the labels.
    previous = _tls.labels
    token = LABELS.set(labels)
    # A job handed on by a patched to_thread.run_sync runs in a copy of its context, where
    # _JOB_WRAPPED is set: cleared, so a to_thread.run_sync the job starts (through
    # from_thread.run, whose task copies the job's context) labels its own job. Set only then:
    # submit's jobs pay just the get.
    wrapped = _JOB_WRAPPED.set(False) if _JOB_WRAPPED.get() else None
    try:
        apply(labels)
        return fn(*args, **kwargs)
    finally:
        if wrapped is not None:
            _JOB_WRAPPED.reset(wrapped)
        LABELS.reset(token)
        apply(previous)


# The submit _submit calls: the one in place at install (see _orig_handle_run); set then.
_orig_submit = concurrent.futures.ThreadPoolExecutor.submit


def _submit(
    self: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., T], /, *args: Any, **kwargs: Any
) -> concurrent.futures.Future[T]:
    labels = LABELS.get()
    if labels:
        return _orig_submit(self, run_labelled, labels, fn, *args, **kwargs)
    return _orig_submit(self, fn, *args, **kwargs)


def _labelling(original: Callable[..., Any]) -> Callable[..., Any]:
    """An async ``to_thread.run_sync`` that runs the job with the caller's labels."""

    @functools.wraps(original)
    async def run_sync(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        labels = LABELS.get()
        if not labels or _JOB_WRAPPED.get():
            return await original(func, *args, **kwargs)
        # anyio's trio backend hands the job, in a wrapper of its own, to trio's run_sync:
        # wrap it once, so the sampler finds the job's own function as the job's entry.
        token = _JOB_WRAPPED.set(True)
        try:
            return await original(functools.partial(run_labelled, labels, func), *args, **kwargs)
        finally:
            _JOB_WRAPPED.reset(token)

    return run_sync


def _patch_anyio() -> Callable[[], None] | None:
    try:
        import anyio.to_thread
    except ImportError:  # anyio is optional: without it there is nothing to patch
        return None
    module = anyio.to_thread
    original = module.run_sync

    module.run_sync = _labelling(original)  # type: ignore[assignment]

    def restore() -> None:
        module.run_sync = original

    return restore


def _patch_trio() -> Callable[[], None] | None:
    # Patched only where the app already imported trio (it then serves with it). Read from
    # sys.modules, and only once complete: another thread may be importing trio right now, and
    # a half-initialised module has no to_thread.run_sync yet.
    module = sys.modules.get("trio.to_thread")
    original = getattr(module, "run_sync", None)
    if module is None or original is None:
        return None
    patched = module

    patched.run_sync = _labelling(original)  # type: ignore[attr-defined]

    def restore() -> None:
        patched.run_sync = original  # type: ignore[attr-defined]

    return restore


# --- install / uninstall -----------------------------------------------------------------------


def _unwatch_contexts() -> None:
    if _c_unwatch_contexts is not None:
        _c_unwatch_contexts()


def _watch_contexts() -> bool:
    # Reads ``_tls`` from this module's namespace on every switch, like the C proxy.
    if _c_watch_contexts is None:
        return False
    try:
        _c_watch_contexts(LABELS, EMPTY, globals(), apply)
    except RuntimeError:  # the interpreter's 8 context watcher ids are all taken
        log_once(
            "engine-no-watcher-id",
            "spanprof: no context watcher id left in this interpreter (other libraries hold "
            "all 8); the label engine uses its hooks instead (logged once)",
        )
        return False
    _restore.append(_unwatch_contexts)
    return True


def _install_patches(mechanism: Mechanism) -> Mechanism:
    # The mechanism installed: the hooks when the watcher cannot be had.
    global _orig_handle_run, _report_sync_failure, _orig_submit
    if _c_set_quiet is not None:
        _c_set_quiet(_QUIET)
    if mechanism == "watcher" and _watch_contexts():
        installed: Mechanism = "watcher"
    else:
        installed = "hooks"
        # Read now, not at import: a wrapper another library applied since keeps running under
        # the hook, and is what uninstalling restores.
        handle_run = asyncio.Handle._run
        _orig_handle_run = handle_run
        _report_sync_failure = _report_callback_error if _is_asyncios_own(handle_run) else None
        setattr(asyncio.Handle, "_run", _handle_run_hook())  # noqa: B010 - a swap mypy forbids
        _restore.append(lambda: setattr(asyncio.Handle, "_run", handle_run))
    submit = concurrent.futures.ThreadPoolExecutor.submit
    _orig_submit = submit
    concurrent.futures.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign,assignment]
    _restore.append(lambda: setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit))
    for patch in (_patch_anyio, _patch_trio):
        restore = patch()
        if restore is not None:
            _restore.append(restore)
    return installed


def _after_fork_in_child() -> None:
    global _tls, _seen_loop, _seen_trio
    # Only the forking thread survives; whatever the parent's backend was told is not true for
    # the child's profiler, which starts fresh.
    _tls = _new_thread_state()
    _seen_loop = _seen_trio = None


def install_label_engine(backend: ProfilerBackend, *, mechanism: Mechanism | None = None) -> None:
    """Feed ``backend`` with every thread's label switches, patching the runtime once.

    Installing again with the same backend and mechanism does nothing; with another backend,
    the engine switches to it (threads re-push their labels on their next switch), with another
    mechanism it swaps its patches. Also hooks the running event loop, if called from one.

    Args:
        backend: the profiler backend told about every thread's label changes.
        mechanism: how context switches are followed: ``"hooks"`` or ``"watcher"`` (CPython
            3.14+, needs the C extension); default: the installed engine's, or
            ``default_mechanism()`` when it is not installed. ``ValueError`` if this
            interpreter lacks it (see ``available_mechanisms()``). Should the interpreter have
            no context watcher id left (8, shared by all libraries), the engine logs it once and
            uses the hooks (``installed_mechanism()`` says which runs).
    """
    global _backend, _tls, _fork_hook_registered, _seen_loop, _seen_trio, _mechanism
    if mechanism is not None and mechanism not in available_mechanisms():
        raise ValueError(
            f"label engine mechanism {mechanism!r} is not available here (available: "
            f"{', '.join(available_mechanisms())}); 'watcher' needs CPython 3.14+ and "
            "spanprof's C extension"
        )
    with _lock:
        wanted = mechanism or _mechanism or default_mechanism()
        if _backend is backend and _mechanism == wanted:
            attach_loop()
            return
        if _restore and _mechanism != wanted:
            while _restore:
                _restore.pop()()
        if not _restore:
            _mechanism = _install_patches(wanted)
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_registered = True
        _tls = _new_thread_state()
        _seen_loop = _seen_trio = None
        _backend = backend
    attach_loop()
    sync()


def uninstall_label_engine() -> None:
    """Restore everything ``install_label_engine`` patched and stop feeding the backend.

    The calling thread's labels are cleared on the backend first. Loops other than the running
    one keep a pass-through task factory until they close, and trio runs other than the current
    one an instrument that does nothing.
    """
    global _backend, _tls, _seen_loop, _seen_trio, _mechanism
    with _lock:
        if _backend is None:
            return
        apply(EMPTY)
        while _restore:
            _restore.pop()()
        with contextlib.suppress(RuntimeError):  # not called from a running loop
            _detach_loop(asyncio.get_running_loop())
        _detach_trio()
        _backend = None
        _mechanism = None
        _tls = _new_thread_state()
        _seen_loop = _seen_trio = None
