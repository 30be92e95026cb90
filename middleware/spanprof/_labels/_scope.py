"""``profile_labels``: labels for a block, merged over the enclosing ones (Go's ``pprof.Do``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from contextvars import Token
from types import TracebackType
from typing import Any, TypeVar, cast

from ._engine import sync
from ._labelset import LABELS, LabelSet, sanitize_value, validate_key

__all__ = ["current_labels", "labels_scope", "profile_labels"]

F = TypeVar("F", bound=Callable[..., Any])


def current_labels() -> LabelSet:
    """The profile labels the current context runs with (empty outside any request or block)."""
    return LABELS.get()


class labels_scope:
    """Set an exact label set for a block (internal: the middlewares use it per request)."""

    __slots__ = ("_labels", "_token")

    def __init__(self, labels: LabelSet) -> None:
        self._labels = labels
        self._token: Token[LabelSet] | None = None

    def __enter__(self) -> LabelSet:
        self._token = LABELS.set(self._labels)
        sync()
        return self._labels

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._token
        self._token = None
        if token is not None:
            LABELS.reset(token)
        sync()


class profile_labels:
    """Add profile labels to a block of code, on top of the labels already in effect.

    Usable as a context manager (sync or async code) and as a decorator on sync and async
    functions, and on generator and async generator functions, whose body runs with the labels
    at each step (not the consumer between two steps). Labels follow the context: child tasks
    and thread-pool work started inside the block inherit them, and they are removed on every
    way out of the block.

    ```python
    with spanprof.profile_labels(tenant="acme"):
        render_invoice()

    @spanprof.profile_labels(stage="parse")
    async def parse(body: bytes) -> Doc: ...
    ```

    Arguments:
        **labels: label names (letters, digits, ``_``; not ``span_id``, ``trace_id``,
            ``span_name``, ``slo``, ``service_name`` or a name starting with ``__``) to
            values. Values are converted to ``str`` and sanitized to what Pyroscope accepts
            (a value whose ``str()`` raises is labelled ``<TypeName>``, logged once).
            Invalid names raise ``ValueError`` at once.
    """

    __slots__ = ("_labels", "_tokens")

    def __init__(self, **labels: object) -> None:
        self._labels: dict[str, str] = {
            validate_key(key, setting="profile_labels"): sanitize_value(value)
            for key, value in labels.items()
        }
        # One token per entry: the same instance may be entered again while active.
        self._tokens: list[Token[LabelSet]] = []

    def __enter__(self) -> LabelSet:
        labels = LABELS.get().merged(self._labels)
        self._tokens.append(LABELS.set(labels))
        sync()
        return labels

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tokens = self._tokens
        # Normally the last token; if one instance is shared by concurrent tasks, the token of
        # this context is the newest one that resets here.
        for index in range(len(tokens) - 1, -1, -1):
            try:
                LABELS.reset(tokens[index])
            except ValueError:
                continue
            del tokens[index]
            break
        sync()

    async def __aenter__(self) -> LabelSet:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        labels: Mapping[str, str] = self._labels
        if inspect.isasyncgenfunction(func):
            return cast(F, _labelled_async_generator(func, labels))
        if inspect.isgeneratorfunction(func):
            return cast(F, _labelled_generator(func, labels))
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                token = LABELS.set(LABELS.get().merged(labels))
                try:
                    sync()
                    return await func(*args, **kwargs)
                finally:
                    LABELS.reset(token)
                    sync()

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = LABELS.set(LABELS.get().merged(labels))
            try:
                sync()
                return func(*args, **kwargs)
            finally:
                LABELS.reset(token)
                sync()

        return cast(F, wrapper)


# A generator's body runs in steps, each in the context of whoever resumes it, and its labels
# must not stay set while the consumer runs between two steps. So the wrappers drive the
# generator themselves, as ``yield from`` would (send, throw, close, the return value), and set
# the labels around each step only. They are generator functions themselves, so that frameworks
# that look (FastAPI's yield dependencies, contextlib) still see one.


def _labelled_generator(
    func: Callable[..., Generator[Any, Any, Any]], labels: Mapping[str, str]
) -> Callable[..., Generator[Any, Any, Any]]:
    @functools.wraps(func)
    def generator_wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        generator = func(*args, **kwargs)
        step: Callable[[Any], Any] = generator.send
        arg: Any = None
        while True:
            token = LABELS.set(LABELS.get().merged(labels))
            try:
                sync()
                try:
                    value = step(arg)
                except StopIteration as stop:
                    return stop.value
            finally:
                arg = None  # a thrown exception: no cycle through this frame when it propagates
                LABELS.reset(token)
                sync()
            try:
                arg = yield value
            except GeneratorExit:
                # Closed (or collected) between steps: its finally blocks run labelled too.
                token = LABELS.set(LABELS.get().merged(labels))
                try:
                    sync()
                    generator.close()
                finally:
                    LABELS.reset(token)
                    sync()
                raise
            except BaseException as thrown:
                step, arg = generator.throw, thrown
            else:
                step = generator.send

    return generator_wrapper


def _labelled_async_generator(
    func: Callable[..., AsyncGenerator[Any, Any]], labels: Mapping[str, str]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    @functools.wraps(func)
    async def async_generator_wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        generator = func(*args, **kwargs)
        step: Callable[[Any], Awaitable[Any]] = generator.asend
        arg: Any = None
        while True:
            # Set in the task's context for the whole step, its awaits included: the engine's
            # step hooks push them whenever the task resumes inside it.
            token = LABELS.set(LABELS.get().merged(labels))
            try:
                sync()
                try:
                    value = await step(arg)
                except StopAsyncIteration:
                    return
            finally:
                arg = None  # a thrown exception: no cycle through this frame when it propagates
                LABELS.reset(token)
                sync()
            try:
                arg = yield value
            except GeneratorExit:
                token = LABELS.set(LABELS.get().merged(labels))
                try:
                    sync()
                    await generator.aclose()
                finally:
                    LABELS.reset(token)
                    sync()
                raise
            except BaseException as thrown:
                step, arg = generator.athrow, thrown
            else:
                step = generator.asend

    return async_generator_wrapper
