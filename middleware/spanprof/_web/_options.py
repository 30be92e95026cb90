"""The options both middlewares take, and the settings resolved from them once, at build time.

One ``ProfilingOptions`` type describes the keyword arguments of both middlewares (each adds
only its own ``route_resolver``), so the two constructors cannot drift apart, and
``MiddlewareSettings.build`` validates them all before the first request: a bad value raises
``ValueError`` naming the option or the environment variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from .._config import parse_bool
from .._env import env_value
from .._labels._backend import ProfilerBackend
from .._labels._engine import MECHANISMS, Mechanism, available_mechanisms
from .._logging import log_once
from .._profiling._choose import FROM_ENV, FromEnv, choose_profiler
from .._profiling._runtime import ProfilerRuntime
from .._signals._duration import DurationRecorder
from .._signals._prometheus import PrometheusMetrics
from .._signals._slo import SloPolicy

__all__ = ["ExcludedUrls", "MiddlewareSettings", "ProfilingOptions"]


class ProfilingOptions(TypedDict, total=False):
    """Keyword options of ``ProfilingMiddleware`` and ``WSGIProfilingMiddleware``.

    Every option is optional; the environment fills in what is left out (see README,
    "Configuration").

    Arguments:
        profiler: a ``ProfilerBackend``; default ``FROM_ENV``: the backend ``SPANPROF_PROFILER``
            names, configured from ``PYROSCOPE_*`` (no profiler when
            ``PYROSCOPE_SERVER_ADDRESS`` is unset); ``None``: labels without a profiler. It is
            started once per process (after any fork) and flushed at shutdown.
        tracer_provider: the OpenTelemetry tracer provider (default: the global one).
        trace_id_label: label samples with ``trace_id`` too (default ``True``, or
            ``SPANPROF_TRACE_ID_LABEL``); turn off for Pyroscope servers older than 2.0.3,
            where ``trace_id`` becomes a series label.
        excluded_urls: comma-separated URL patterns to leave untraced and unlabelled
            (OpenTelemetry syntax: regular expressions, each searched in the URL on its own, so
            a leading ``(?i)`` is its own pattern's); matching requests go straight to the app.
            Blank items are ignored; a pattern that is no regex, or matches every URL, raises
            ``ValueError``.
        meter_provider: where the ``http.server.request.duration`` histogram is recorded
            (default: the global provider).
        slo: a ``SloPolicy`` (default and per-route latency SLOs); exclusive with
            ``slo_seconds`` and ``route_slos``.
        slo_seconds: the latency SLO of every route (default 0.5, or ``SPANPROF_SLO_SECONDS``).
            Slower requests get an exemplar with their span's ids and the span attributes
            ``spanprof.slo.breached`` and ``spanprof.slo.threshold_s``.
        route_slos: per-route SLOs by template, e.g. ``{"/checkout": 0.25}`` (or
            ``SPANPROF_ROUTE_SLO="/checkout=0.25,/search=1"``).
        prometheus: also record the histogram (with exemplars) in this ``PrometheusMetrics``.
        environ: the environment to read settings from (default ``os.environ``), including
            ``SPANPROF_LABEL_ENGINE`` (``hooks`` or ``watcher``: how the label engine follows
            context switches; see README, "Configuration").
    """

    profiler: ProfilerBackend | FromEnv | None
    tracer_provider: TracerProvider | None
    trace_id_label: bool | None
    excluded_urls: str | None
    meter_provider: MeterProvider | None
    slo: SloPolicy | None
    slo_seconds: float | None
    route_slos: Mapping[str, float] | None
    prometheus: PrometheusMetrics | None
    environ: Mapping[str, str] | None


_OPTION_NAMES = frozenset(ProfilingOptions.__annotations__)


def _label_engine(env: Mapping[str, str]) -> Mechanism | None:
    """``SPANPROF_LABEL_ENGINE``: the engine's mechanism, or ``None`` for its default."""
    raw = env_value(env, "SPANPROF_LABEL_ENGINE").strip().lower()
    if not raw:
        return None
    for mechanism in MECHANISMS:
        if raw == mechanism:
            if mechanism not in available_mechanisms():
                raise ValueError(
                    f"SPANPROF_LABEL_ENGINE={raw!r}: the context watcher needs CPython 3.14+ "
                    "and spanprof's C extension; unset it or use 'hooks'"
                )
            return mechanism
    raise ValueError(
        f"SPANPROF_LABEL_ENGINE={raw!r}: expected one of {', '.join(MECHANISMS)} (or unset)"
    )


def _check_types(options: ProfilingOptions) -> None:
    """Refuse an option of the wrong type by name, instead of an AttributeError mid-request."""
    environ = options.get("environ")
    if environ is not None and not isinstance(environ, Mapping):
        raise TypeError(
            f"environ: expected a mapping of variable names to values, got "
            f"{type(environ).__name__} {environ!r}"
        )
    trace_id_label = options.get("trace_id_label")
    # "false" would be a true value: only a real bool (or None, for the variable) says it.
    if trace_id_label is not None and not isinstance(trace_id_label, bool):
        raise TypeError(
            f"trace_id_label: expected True, False or None, got "
            f"{type(trace_id_label).__name__} {trace_id_label!r}"
        )
    prometheus = options.get("prometheus")
    if prometheus is not None and not isinstance(prometheus, PrometheusMetrics):
        raise TypeError(f"prometheus: expected a spanprof.PrometheusMetrics, got {prometheus!r}")
    # Duck-typed, as OpenTelemetry itself treats providers: only the one method used is needed.
    for name, method in (("meter_provider", "get_meter"), ("tracer_provider", "get_tracer")):
        provider = options.get(name)
        if provider is not None and not callable(getattr(provider, method, None)):
            raise TypeError(
                f"{name}: expected an OpenTelemetry provider (with {method}), got {provider!r}"
            )


class ExcludedUrls:
    """The ``excluded_urls`` patterns, each searched in the URL on its own.

    OpenTelemetry's ``ExcludeList`` compiles its patterns joined with ``|``: a leading ``(?i)``
    then applies to every pattern (or is an error after the first one), and two patterns with a
    group of one name cannot compile together. Each pattern here means what it means alone.
    """

    def __init__(self, patterns: Sequence[re.Pattern[str]]) -> None:
        self.patterns = tuple(patterns)
        self._searches = tuple(pattern.search for pattern in self.patterns)

    def url_disabled(self, url: str) -> bool:
        """Whether any one pattern is found in ``url``."""
        return any(search(url) is not None for search in self._searches)


# A pattern found in all of these is taken to match every URL: they differ in scheme and host and
# path, and share nothing a real exclusion ("/health", "healthz", "/$") could be found in. The
# empty string is no probe: "^$" matches it and no URL.
_ANY_URLS = ("http://0/", "https://0/", "http://0/x", "http://a/")


def _warn_if_environment_differs(slo: SloPolicy, env: Mapping[str, str]) -> None:
    """The SLO given in code beats ``SPANPROF_SLO_SECONDS``/``SPANPROF_ROUTE_SLO``: say so.

    ``spanprof dev`` passes its SLO to the app through them, and judges the requests the
    middleware leaves unmarked (under half their threshold) by it: a different SLO in code
    makes its page disagree with the exemplars and the samples' ``slo`` label.
    """
    if not (env_value(env, "SPANPROF_SLO_SECONDS") or env_value(env, "SPANPROF_ROUTE_SLO")):
        return
    try:
        from_env = SloPolicy.build(slo_seconds=None, route_slos=None, environ=env)
    except ValueError:
        return  # unused, and the code's SLO stands
    if from_env != slo:
        log_once(
            "slo-env-overridden",
            "spanprof: the SLO passed in code overrides SPANPROF_SLO_SECONDS/SPANPROF_ROUTE_SLO "
            f"(code: {slo.default} s, routes {dict(slo.routes)}; environment: "
            f"{from_env.default} s, routes {dict(from_env.routes)}); under `spanprof dev` the "
            "page judges short requests by the environment's (logged once)",
            exc_info=False,
        )


def _excluded(setting: str, value: object) -> ExcludedUrls | None:
    """The patterns of a comma-separated ``value``, or ``None`` when there are none.

    OpenTelemetry's ``parse_excluded_urls`` keeps blank items: ``"/health,"`` becomes
    ``/health|`` and that empty alternative matches every URL, so one stray comma would turn
    tracing off for all requests without a word. Blank items are dropped here, and a pattern
    that still matches every URL (or is no regex at all) is refused.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{setting}: expected a comma-separated string of URL patterns, "
            f"got {type(value).__name__} {value!r}"
        )
    compiled: list[re.Pattern[str]] = []
    for pattern in (item.strip() for item in value.split(",")):
        if not pattern:
            continue
        try:
            regex = re.compile(pattern)
        # OverflowError: a repeat count too large ("a{4294967296}") is not an re.error.
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(
                f"{setting}: {pattern!r} is not a valid regular expression ({exc})"
            ) from None
        if all(regex.search(url) is not None for url in _ANY_URLS):
            why = (
                "an empty alternative, as in '/health|'?"
                if regex.search("") is not None
                else "patterns are searched in the whole URL, 'http://host/path?query'"
            )
            raise ValueError(
                f"{setting}: {pattern!r} matches every URL ({why}), so no request would be "
                "traced; to trace nothing, leave the middleware out"
            )
        compiled.append(regex)
    return ExcludedUrls(compiled) if compiled else None


@dataclass(frozen=True)
class MiddlewareSettings:
    """What a middleware needs per process and per request, resolved from its options."""

    runtime: ProfilerRuntime
    with_trace_id: bool
    durations: DurationRecorder
    tracer_provider: TracerProvider | None
    excluded: ExcludedUrls | None

    @classmethod
    def build(
        cls, owner: str, options: ProfilingOptions, *, route_resolver: object, resolves: str
    ) -> MiddlewareSettings:
        """Validate everything now: a bad setting raises ``ValueError`` naming it.

        ``owner`` is the middleware's name for errors; ``route_resolver`` must be ``None`` or a
        callable taking what ``resolves`` names (``scope`` or ``environ``).
        """
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            # What Python itself says of an unexpected keyword argument.
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        if route_resolver is not None and not callable(route_resolver):
            raise ValueError(
                f"route_resolver: expected a callable {resolves} -> str | None, "
                f"got {route_resolver!r}"
            )
        _check_types(options)
        environ = options.get("environ")
        env = os.environ if environ is None else environ
        backend = choose_profiler(options.get("profiler", FROM_ENV), env)
        trace_id_label = options.get("trace_id_label")
        if trace_id_label is None:
            raw = env_value(env, "SPANPROF_TRACE_ID_LABEL", "true")
            trace_id_label = parse_bool("SPANPROF_TRACE_ID_LABEL", raw)
        slo = options.get("slo")
        slo_seconds, route_slos = options.get("slo_seconds"), options.get("route_slos")
        slo_in_code = slo is not None or slo_seconds is not None or route_slos is not None
        if slo is None:
            slo = SloPolicy.build(slo_seconds=slo_seconds, route_slos=route_slos, environ=env)
        elif not isinstance(slo, SloPolicy):
            raise ValueError(f"slo: expected a SloPolicy, got {slo!r}")
        elif slo_seconds is not None or route_slos is not None:
            raise ValueError("slo: pass either slo= or slo_seconds=/route_slos=, not both")
        if slo_in_code:
            _warn_if_environment_differs(slo, env)
        prometheus = options.get("prometheus")
        durations = DurationRecorder(
            meter_provider=options.get("meter_provider"),
            slo=slo,
            extra_sinks=(prometheus.observe,) if prometheus is not None else (),
        )
        excluded = _excluded("excluded_urls", options.get("excluded_urls"))
        return cls(
            runtime=ProfilerRuntime(backend, mechanism=_label_engine(env)),
            with_trace_id=trace_id_label,
            durations=durations,
            tracer_provider=options.get("tracer_provider"),
            excluded=excluded,
        )
