"""The pyroscope-io backend: the Pyroscope agent, fed with the label engine's switches."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pyroscope

from .._labels._labelset import LabelSet
from .._logging import log_once, logger
from ._settings import PyroscopeSettings, WithPyroscopeSettings

__all__ = ["PyroscopeBackend"]

# Bound once: these run between task steps.
_add_tag = pyroscope.add_thread_tag
_remove_tag = pyroscope.remove_thread_tag


class PyroscopeBackend(WithPyroscopeSettings):
    """Profiles with the Pyroscope agent (``pyroscope-io``), with spanprof's exact labels.

    The agent keys labels by OS thread; the label engine calls ``set_thread_labels`` on each
    thread whenever the context running there changes, so every sample carries the labels of
    the request that was running. Start it after any fork (the middleware does, at lifespan
    startup): the agent stops in forked children.

    Arguments:
        server_address: Pyroscope URL, e.g. ``http://pyroscope:4040``.
        application_name: the ``service_name`` the profiles are stored under.
        upload_interval: whole seconds between uploads (default 10).
        sample_rate: samples per second (default 100).
        tenant_id: tenant for multi-tenant servers.
        basic_auth_username, basic_auth_password: basic auth for the server.
        tags: static labels on every sample of this process.
        extra_options: further keyword arguments for ``pyroscope.configure``.
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
        self.extra_options = dict(extra_options or {})
        self._lock = threading.Lock()
        self._running = False

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
            ok = pyroscope.configure(**self._settings.arguments(), **self.extra_options)
            if ok is False:
                log_once(
                    "pyroscope-configure",
                    "spanprof: pyroscope.configure() refused to start (already configured in "
                    "this process?); labels go to the running agent, if any",
                    exc_info=False,
                )
            self._running = True
            logger.debug("pyroscope agent started for %s", self.server_address)

    def shutdown(self) -> None:
        """Send the last window and stop the agent."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            pyroscope.shutdown()

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """Move the calling thread's agent tags from ``previous`` to ``current``."""
        # The agent keeps no reference counts and lets two values of one key coexist, so
        # remove exactly what changed before adding its replacement.
        for key, value in previous.items():
            if current.get(key) != value:
                _remove_tag(key, value)
        for key, value in current.items():
            if previous.get(key) != value:
                _add_tag(key, value)
