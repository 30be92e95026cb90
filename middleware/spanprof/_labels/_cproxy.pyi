"""Type stub of the optional C extension ``spanprof._labels._cproxy`` (source: ``_cproxy.c``)."""

import asyncio
from collections.abc import Callable, Coroutine, Generator
from contextvars import ContextVar
from types import CodeType, FrameType
from typing import Any, final

from ._labelset import LabelSet

@final
class LabelledCoroutine(Coroutine[Any, Any, Any]):
    """A coroutine proxy that syncs the thread's profiler labels before each step."""

    def __new__(
        cls,
        coro: Coroutine[Any, Any, Any],
        labels_var: ContextVar[LabelSet],
        namespace: dict[str, Any],
        apply: Callable[[LabelSet], object],
    ) -> LabelledCoroutine: ...
    def send(self, value: Any, /) -> Any: ...
    def throw(self, *args: Any) -> Any: ...
    def close(self) -> None: ...
    def __await__(self) -> Generator[Any, None, Any]: ...
    def __iter__(self) -> LabelledCoroutine: ...
    def __next__(self) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

@final
class ThreadLabels:
    """What each OS thread last pushed: ``labels`` is the calling thread's value."""

    labels: LabelSet
    def __new__(cls, default: LabelSet) -> ThreadLabels: ...

@final
class HandleRunHook:
    """A replacement for ``asyncio.Handle._run`` that syncs labels first; binds like a function."""

    __wrapped__: Callable[[asyncio.Handle], None]
    # The original's, for code that introspects Handle._run as a function.
    __code__: CodeType
    __name__: str
    __qualname__: str
    def __new__(
        cls,
        run: Callable[[asyncio.Handle], None],
        labels_var: ContextVar[LabelSet],
        empty: LabelSet,
        namespace: dict[str, Any],
        apply: Callable[[LabelSet], object],
        handle_type: type[asyncio.Handle],
        report: Callable[[asyncio.Handle, BaseException], object] | None = None,
    ) -> HandleRunHook: ...
    @property
    def replaces(self) -> bool: ...
    def __call__(self, handle: asyncio.Handle, /) -> None: ...

def set_quiet(marker: LabelSet, /) -> None:
    """A thread whose state holds ``marker`` as its labels is never pushed to."""

def current_frames_gc_off() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the collector off during the call (gh-106883)."""

# The context watcher: only built on CPython 3.14+ (PyContext_AddWatcher); look them up with
# getattr on older versions.
def watch_contexts(
    labels_var: ContextVar[LabelSet],
    empty: LabelSet,
    namespace: dict[str, Any],
    apply: Callable[[LabelSet], object],
) -> None:
    """After every context switch, push the now-current context's labels if they changed."""

def unwatch_contexts() -> bool:
    """Remove the context watcher: whether one was installed."""

def watching_contexts() -> bool:
    """Whether the context watcher is installed."""

def watch_failures() -> int:
    """How many pushes raised out of ``apply`` since ``watch_contexts``."""
