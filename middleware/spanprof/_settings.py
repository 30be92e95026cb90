"""The settings both middlewares share, resolved once from options and the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import MeterProvider

from ._backend import ProfilerBackend
from ._config import parse_bool
from ._duration import DurationRecorder
from ._exact import profiler_from_env
from ._prometheus import PrometheusMetrics
from ._runtime import ProfilerRuntime
from ._slo import SloPolicy

__all__ = ["FROM_ENV", "MiddlewareSettings"]


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Any = _FromEnv()
"""Default of ``profiler=``: the backend the ``PYROSCOPE_*`` environment describes, if any."""


def backend_from_env(env: Mapping[str, str]) -> ProfilerBackend | None:
    """The profiler the environment asks for (``None`` without a server address).

    ``SPANPROF_PROFILER=exact`` picks the exact sampler, ``pyroscope`` (default) the agent.
    """
    return profiler_from_env(env)


@dataclass(frozen=True)
class MiddlewareSettings:
    """Per-process profiler runtime, the trace-id switch and the duration recorder."""

    runtime: ProfilerRuntime
    with_trace_id: bool
    durations: DurationRecorder

    @classmethod
    def build(
        cls,
        *,
        profiler: ProfilerBackend | None,
        trace_id_label: bool | None,
        meter_provider: MeterProvider | None,
        slo_seconds: float | None,
        route_slos: Mapping[str, float] | None,
        prometheus: PrometheusMetrics | None,
        environ: Mapping[str, str] | None,
    ) -> MiddlewareSettings:
        """Validate everything now: a bad setting raises ``ValueError`` naming it."""
        env = os.environ if environ is None else environ
        backend = backend_from_env(env) if profiler is FROM_ENV else profiler
        if backend is not None and not isinstance(backend, ProfilerBackend):
            raise ValueError(
                "profiler: expected a ProfilerBackend (start, shutdown, set_thread_labels), "
                f"got {backend!r}"
            )
        if trace_id_label is None:
            raw = env.get("SPANPROF_TRACE_ID_LABEL")
            trace_id_label = True if raw is None else parse_bool("SPANPROF_TRACE_ID_LABEL", raw)
        slo = SloPolicy.build(slo_seconds=slo_seconds, route_slos=route_slos, environ=env)
        durations = DurationRecorder(
            meter_provider=meter_provider,
            slo=slo,
            extra_sinks=(prometheus.observe,) if prometheus is not None else (),
        )
        return cls(ProfilerRuntime(backend), trace_id_label, durations)
