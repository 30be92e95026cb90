"""Shared fixtures: the recorder-backed label engine, in-memory spans, and event loops."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import spanprof
from spanprof._logging import reset_log_once

T = TypeVar("T")

LOOPS = ["asyncio", "uvloop"]

# Under CI a test that needs a component the machine lacks must fail, not skip.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Every Pyroscope agent variable set, as a deployment would: the backends read all of them.
AGENT_ENV = {
    "SPANPROF_PROFILER": "pyroscope",
    "PYROSCOPE_SERVER_ADDRESS": "http://pyroscope:4040/",
    "OTEL_SERVICE_NAME": "checkout",
    "PYROSCOPE_UPLOAD_INTERVAL": "15s",
    "PYROSCOPE_SAMPLE_RATE": "97",
    "PYROSCOPE_TENANT_ID": "team-a",
    "PYROSCOPE_BASIC_AUTH_USER": "u",
    "PYROSCOPE_BASIC_AUTH_PASSWORD": "p",
    "PYROSCOPE_LABELS": "region=eu-west-1, zone = b",
}


def require(condition: bool, reason: str) -> None:
    """Skip locally, fail under CI, when a test's component is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"missing under CI: {reason}")
    pytest.skip(reason)


# pyroscope-io publishes builds for CPython 3.10-3.14 only, and pyproject.toml installs it only
# below 3.15: on later versions no user can have the agent, so tests of the real agent do not
# apply there. Decided by the version, not by a failed import: where a build exists, a missing
# agent is a missing component like any other (it fails under CI).
AGENT_HAS_A_BUILD = sys.version_info < (3, 15)
NO_AGENT_BUILD = (
    f"pyroscope-io has no build for CPython {sys.version_info[0]}.{sys.version_info[1]} "
    "(pyproject.toml installs it below 3.15 only)"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``needs_agent`` tests are skipped, with the reason, where pyroscope-io has no build."""
    if AGENT_HAS_A_BUILD:
        return
    for item in items:
        if item.get_closest_marker("needs_agent") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_AGENT_BUILD))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Where pyroscope-io has a build, ``needs_agent`` tests require it (they fail under CI)."""
    if AGENT_HAS_A_BUILD and item.get_closest_marker("needs_agent") is not None:
        require(
            importlib.util.find_spec("pyroscope") is not None,
            "pyroscope-io (the Pyroscope agent) is not installed",
        )


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A fresh event loop of ``kind`` (``asyncio`` or ``uvloop``)."""
    if kind == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def run_on(kind: str, main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` to completion on a new loop of ``kind`` and close the loop."""
    loop = new_loop(kind)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


@pytest.fixture(params=LOOPS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    """Each test using this runs on asyncio and on uvloop."""
    kind: str = request.param
    return kind


@pytest.fixture
def recorder() -> Iterator[spanprof.RecorderBackend]:
    """The label engine installed with a recorder backend, uninstalled afterwards."""
    backend = spanprof.RecorderBackend()
    spanprof.engine.install_label_engine(backend)
    try:
        yield backend
    finally:
        spanprof.engine.uninstall_label_engine()
        reset_log_once()


@pytest.fixture
def fresh_log_once() -> Iterator[None]:
    """Each test starts and ends with nothing logged once yet (it counts its own messages)."""
    reset_log_once()
    yield
    reset_log_once()


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    """Collects finished spans in memory."""
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A tracer provider exporting synchronously to ``span_exporter``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    yield provider
    provider.shutdown()


def labels_of(value: Any) -> dict[str, str]:
    """A plain dict of a label mapping (for readable assertion diffs)."""
    return dict(value)


# Indices for the memory tests' functions that fill a preallocated list, made once at import,
# outside any sampling: iterating range() would allocate an int (above 256) per item.
ALLOC_INDICES = tuple(range(20_000))

# The allocation sampler walks the interpreter's frames itself; it knows 3.10-3.15's layouts.
MEMORY_SAMPLED = sys.version_info < (3, 16)
MEMORY_VERSIONS = pytest.mark.skipif(
    not MEMORY_SAMPLED,
    reason="allocation sampling supports CPython 3.10-3.15 (it refuses later ones, tested)",
)


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    """An in-memory reader on a fresh MeterProvider with the SDK's default exemplar settings."""
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(metric_reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    """A MeterProvider read by ``metric_reader``."""
    provider = MeterProvider(metric_readers=[metric_reader])
    yield provider
    provider.shutdown()


def histogram_points(reader: InMemoryMetricReader, name: str) -> list[HistogramDataPoint]:
    """Every data point of histogram ``name`` that ``reader`` collects now."""
    data = reader.get_metrics_data()
    points: list[HistogramDataPoint] = []
    if data is None:
        return points
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    points.extend(p for p in metric.data.data_points)  # type: ignore[misc]
    return points
