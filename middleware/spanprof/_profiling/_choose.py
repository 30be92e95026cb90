"""Which profiler runs: what ``SPANPROF_PROFILER`` or a middleware's ``profiler=`` asks for."""

from __future__ import annotations

import enum
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Final, Literal

from .._env import env_value
from .._labels._backend import ProfilerBackend
from ._exact import ExactBackend, parse_exporters
from ._pyroscope import PyroscopeBackend

__all__ = ["FROM_ENV", "PROFILERS", "FromEnv", "choose_profiler", "profiler_from_env"]

#: Values of ``SPANPROF_PROFILER``; the first is the default.
PROFILERS = ("auto", "exact", "pyroscope")

# One exact backend per configuration and process: two middlewares in one process (a Flask app
# mounted in a FastAPI app, local mode's two services) share its one SIGPROF timer.
_exact_backends: weakref.WeakValueDictionary[tuple[object, ...], ExactBackend] = (
    weakref.WeakValueDictionary()
)
_exact_lock = threading.Lock()


class FromEnv(enum.Enum):
    """The type of ``FROM_ENV``: "configure the profiler from the environment"."""

    FROM_ENV = "FROM_ENV"

    def __repr__(self) -> str:
        return "spanprof.FROM_ENV"

    __str__ = __repr__


FROM_ENV: Final[Literal[FromEnv.FROM_ENV]] = FromEnv.FROM_ENV
"""Default of ``profiler=``: the backend ``SPANPROF_PROFILER`` and ``PYROSCOPE_*`` describe."""


def profiler_from_env(environ: Mapping[str, str] | None = None) -> ProfilerBackend | None:
    """The profiler ``SPANPROF_PROFILER`` names, configured from ``PYROSCOPE_*``, or ``None``.

    ``auto`` (default): the exact sampler wherever it can be exact, pyroscope-io with the label
    engine where it cannot (no main-thread event loop) and for requests on pool threads (a
    threaded server) unless pyroscope-io is not installed; ``exact``: the exact sampler
    wherever it can run, threaded servers included, a fallback is a warning; ``pyroscope``:
    the pyroscope-io agent. ``None`` when
    ``PYROSCOPE_SERVER_ADDRESS`` is unset (and no OTLP export is asked for). OTLP profiles
    (``SPANPROF_PROFILES_EXPORTER`` with ``otlp``) come from the exact sampler only: they
    contradict ``SPANPROF_PROFILER=pyroscope``.
    """
    env = os.environ if environ is None else environ
    choice = env_value(env, "SPANPROF_PROFILER", PROFILERS[0]).strip().lower()
    exporters = parse_exporters(
        "SPANPROF_PROFILES_EXPORTER", env_value(env, "SPANPROF_PROFILES_EXPORTER", "pyroscope")
    )
    if choice == "pyroscope" and "otlp" in exporters:
        raise ValueError(
            "SPANPROF_PROFILES_EXPORTER: otlp needs SPANPROF_PROFILER=auto or exact (pyroscope-io "
            "only pushes to Pyroscope)"
        )
    if choice == "pyroscope":
        return PyroscopeBackend.from_env(env)
    if choice in ("auto", "exact"):
        backend = ExactBackend.from_env(env, auto=choice == "auto")
        return None if backend is None else _shared(backend)
    raise ValueError(f"SPANPROF_PROFILER={choice!r}: expected one of {', '.join(PROFILERS)}")


def _shared(backend: ExactBackend) -> ExactBackend:
    """The exact backend already made for the same configuration, else ``backend``."""
    arguments = backend.settings.arguments()
    key = (
        *sorted((name, value) for name, value in arguments.items() if name != "tags"),
        tuple(sorted(arguments["tags"].items())),
        backend.clock,
        backend.auto,
        backend.exporters,
        backend.otlp_settings,
        backend.memory,
        backend.alloc_sample_bytes,
    )
    with _exact_lock:
        existing = _exact_backends.get(key)
        if existing is not None:
            return existing
        _exact_backends[key] = backend
        return backend


def choose_profiler(
    profiler: ProfilerBackend | FromEnv | None, environ: Mapping[str, str]
) -> ProfilerBackend | None:
    """The backend a ``profiler=`` option means; a wrong type raises ``ValueError`` now."""
    if profiler is FROM_ENV:
        return profiler_from_env(environ)
    if profiler is not None and not isinstance(profiler, ProfilerBackend):
        raise ValueError(
            "profiler: expected a ProfilerBackend (start, shutdown, set_thread_labels), "
            f"got {profiler!r}"
        )
    return profiler
