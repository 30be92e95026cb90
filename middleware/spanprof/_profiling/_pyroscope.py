"""The pyroscope-io backend: the Pyroscope agent, fed with the label engine's switches."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .._config import header_name_problem, parse_header_value
from .._labels._labelset import LabelSet
from .._logging import log_once, logger
from ._exporters._reachability import ReachabilityWatch
from ._settings import PyroscopeSettings, SettingsArguments, WithPyroscopeSettings

__all__ = ["PyroscopeBackend"]


def _import_agent() -> Any:
    # Imported when the backend is chosen, not with spanprof: pyroscope-io is not installed on
    # CPython 3.15+, which it has no wheel for (its sdist needs a Rust toolchain).
    try:
        import pyroscope
    except ImportError as exc:
        raise RuntimeError(
            "spanprof's pyroscope backend needs the Pyroscope agent: pip install pyroscope-io "
            "(it has no build for CPython 3.15 yet; there, leave SPANPROF_PROFILER unset for the "
            "exact sampler)"
        ) from exc
    return pyroscope


# pyroscope.configure's own names for what spanprof passes from its settings; app_name is the
# agent's older spelling of application_name. Given again in extra_options, configure raises
# "multiple values" at start, after the process has been serving without profiles.
_SET_BY_SPANPROF: dict[str, str] = {
    **{name: name for name in SettingsArguments.__annotations__},
    "app_name": "application_name",
}


def _check_extra_options(options: Mapping[str, Any], agent: Any | None) -> None:
    """Refuse, now, the extra options ``pyroscope.configure`` would refuse at start.

    ``agent`` is the imported module: its ``configure``'s parameters are the known names (none
    are checked when it takes ``**kwargs``, or with no agent to ask).
    """
    for key in options:
        if not isinstance(key, str):
            raise TypeError(f"extra_options: expected option names as strings, got {key!r}")
        if key in _SET_BY_SPANPROF:
            raise ValueError(
                f"extra_options: {key!r} is set by spanprof; pass it as "
                f"PyroscopeBackend({_SET_BY_SPANPROF[key]}=...) instead"
            )
    headers = options.get("http_headers")
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise TypeError(
                "extra_options['http_headers']: expected a mapping of header names to values, "
                f"got {type(headers).__name__}"
            )
        for name, value in headers.items():
            # The value is never shown: headers often carry tokens.
            problem = header_name_problem(name) if isinstance(name, str) else "not a string"
            if problem is not None:
                raise ValueError(f"extra_options['http_headers']: {name!r}: {problem}")
            if not isinstance(value, str):
                raise TypeError(
                    f"extra_options['http_headers'][{name!r}]: expected a string value, "
                    f"got {type(value).__name__}"
                )
            # The agent would fail on these later, in its own thread, saying nothing.
            parse_header_value(f"extra_options['http_headers'][{name!r}]", value)
    configure = getattr(agent, "configure", None)
    if configure is None:
        return
    try:
        parameters = inspect.signature(configure).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in options:
        if key not in parameters:
            known = ", ".join(sorted(set(parameters) - set(_SET_BY_SPANPROF)))
            raise ValueError(
                f"extra_options: {key!r} is not an option of pyroscope.configure (the "
                f"installed pyroscope-io takes {known})"
            )


class PyroscopeBackend(WithPyroscopeSettings):
    """Profiles with the Pyroscope agent (``pyroscope-io``), with spanprof's exact labels.

    The agent keys labels by OS thread; the label engine calls ``set_thread_labels`` on each
    thread whenever the context running there changes, so every sample carries the labels of
    the request that was running. Start it after any fork (the middleware does, at lifespan
    startup): the agent stops in forked children.

    The agent logs nothing when its uploads fail. So that an unreachable server is said at
    least once, spanprof checks that it accepts a TCP connection: from a daemon thread at start
    and every upload interval, and at shutdown (within 1 s); the first failure is logged once
    (see ``_exporters/_reachability``).

    Arguments:
        server_address: Pyroscope URL, e.g. ``http://pyroscope:4040``.
        application_name: the ``service_name`` the profiles are stored under.
        upload_interval: whole seconds between uploads (default 10).
        sample_rate: samples per second (default 100).
        tenant_id: tenant for multi-tenant servers.
        basic_auth_username, basic_auth_password: basic auth for the server.
        tags: static labels on every sample of this process.
        extra_options: further keyword arguments for ``pyroscope.configure`` (``report_pid``,
            ``http_headers``...). A name ``configure`` does not take, or one of the settings
            above, raises ``ValueError`` here rather than at start.

    Raises ``RuntimeError`` when ``pyroscope-io`` is not installed.
    """

    def __init__(
        self,
        *,
        server_address: str,
        application_name: str,
        upload_interval: int = 10,
        sample_rate: int = 100,
        tenant_id: str = "",
        basic_auth_username: str = "",
        basic_auth_password: str = "",
        tags: Mapping[str, str] | None = None,
        extra_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._settings = PyroscopeSettings(
            server_address=server_address,
            application_name=application_name,
            upload_interval=upload_interval,
            sample_rate=sample_rate,
            tenant_id=tenant_id,
            basic_auth_username=basic_auth_username,
            basic_auth_password=basic_auth_password,
            tags=tags or {},
        )
        if extra_options is not None and not isinstance(extra_options, Mapping):
            raise TypeError(
                "extra_options: expected a mapping of pyroscope.configure arguments, "
                f"got {type(extra_options).__name__}"
            )
        self.extra_options = dict(extra_options or {})
        # What needs no agent first: these errors are the same where it is not installed.
        _check_extra_options(self.extra_options, None)
        self._agent = _import_agent()
        _check_extra_options(self.extra_options, self._agent)
        # Bound once: these run between task steps.
        self._add_tag: Callable[[str, str], object] = self._agent.add_thread_tag
        self._remove_tag: Callable[[str, str], object] = self._agent.remove_thread_tag
        self._lock = threading.Lock()
        self._running = False
        self._watch: ReachabilityWatch | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PyroscopeBackend | None:
        """A backend configured like the Pyroscope agents, or ``None`` without a server address.

        Reads ``PYROSCOPE_SERVER_ADDRESS``, ``PYROSCOPE_APPLICATION_NAME`` (default
        ``OTEL_SERVICE_NAME``), ``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``,
        ``PYROSCOPE_TENANT_ID``, ``PYROSCOPE_BASIC_AUTH_USER``, ``PYROSCOPE_BASIC_AUTH_PASSWORD``
        and ``PYROSCOPE_LABELS``. A bad value raises ``ValueError`` naming the variable.
        """
        settings = PyroscopeSettings.from_env(environ)
        return None if settings is None else cls(**settings.arguments())

    def start(self) -> None:
        """Configure and start the agent (once per process)."""
        with self._lock:
            if self._running:
                return
            # The settings' names are pyroscope.configure's own; tags come as a fresh dict.
            ok = self._agent.configure(**self._settings.arguments(), **self.extra_options)
            if ok is False:
                log_once(
                    "pyroscope-configure",
                    "spanprof: pyroscope.configure() refused to start (already configured in "
                    "this process?); labels go to the running agent, if any",
                    exc_info=False,
                )
            self._running = True
            watch = ReachabilityWatch(
                self.server_address, interval=self.upload_interval, who="pyroscope-io"
            )
            watch.start()
            self._watch = watch
            logger.debug("pyroscope agent started for %s", self.server_address)

    def shutdown(self) -> None:
        """Send the last window and stop the agent."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            watch, self._watch = self._watch, None
            if watch is not None:
                watch.stop()  # before the agent's last upload: says if that one is lost
            self._agent.shutdown()

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """Move the calling thread's agent tags from ``previous`` to ``current``."""
        # The agent keeps no reference counts and lets two values of one key coexist, so
        # remove exactly what changed before adding its replacement.
        for key, value in previous.items():
            if current.get(key) != value:
                self._remove_tag(key, value)
        for key, value in current.items():
            if previous.get(key) != value:
                self._add_tag(key, value)
