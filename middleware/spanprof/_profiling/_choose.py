"""Which profiler runs: what ``SPANPROF_PROFILER`` or a middleware's ``profiler=`` asks for."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Final, Literal

from .._labels._backend import ProfilerBackend
from ._exact import ExactBackend, parse_exporters
from ._pyroscope import PyroscopeBackend

__all__ = ["FROM_ENV", "PROFILERS", "FromEnv", "choose_profiler", "profiler_from_env"]

#: Values of ``SPANPROF_PROFILER``.
PROFILERS = ("pyroscope", "exact")


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

    ``pyroscope`` (default): ``PyroscopeBackend.from_env``; ``exact``: ``ExactBackend.from_env``.
    Either is ``None`` when ``PYROSCOPE_SERVER_ADDRESS`` is unset (and no OTLP export is asked
    for). OTLP profiles (``SPANPROF_PROFILES_EXPORTER`` with ``otlp``) come from the exact
    profiler only: they make it the default, and contradict ``SPANPROF_PROFILER=pyroscope``.
    """
    env = os.environ if environ is None else environ
    exporters = parse_exporters(
        "SPANPROF_PROFILES_EXPORTER", env.get("SPANPROF_PROFILES_EXPORTER", "") or "pyroscope"
    )
    default = "exact" if "otlp" in exporters else "pyroscope"
    choice = env.get("SPANPROF_PROFILER", "").strip().lower() or default
    if choice == "pyroscope" and "otlp" in exporters:
        raise ValueError(
            "SPANPROF_PROFILES_EXPORTER: otlp needs SPANPROF_PROFILER=exact (pyroscope-io "
            "only pushes to Pyroscope)"
        )
    if choice == "pyroscope":
        return PyroscopeBackend.from_env(env)
    if choice == "exact":
        return ExactBackend.from_env(env)
    raise ValueError(f"SPANPROF_PROFILER={choice!r}: expected one of {', '.join(PROFILERS)}")


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
