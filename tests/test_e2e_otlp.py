"""End to end: uvicorn + the exact profiler exporting OTLP profiles, each sample linked to a span.

The app is the exact-profiler e2e app (16 concurrent requests burning CPU in 0.5 ms steps, plus
unlabelled background CPU); the profiles go to a loopback OTLP receiver that decodes them with
opentelemetry-proto's generated classes and checks the data model's rules.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import require
from .e2e.analysis import attribute
from .e2e.faults import faulty_endpoint
from .e2e.server import free_port, serve, uvicorn_argv
from .otlp_profiles import (
    PATH,
    GrpcProfilesReceiver,
    OtlpProfilesReceiver,
    Response,
    resource_attributes,
)

pytestmark = [pytest.mark.e2e]

CONCURRENCY = 16


async def _fire(base: str, count: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/work/{i}") for i in range(count)))
        stats = (await client.get("/stats")).json()
    for response in responses:
        response.raise_for_status()
    return {i: response.json() for i, response in enumerate(responses)}, stats


def _env(endpoint: str, **extra: str) -> dict[str, str]:
    return {
        "SPANPROF_PROFILER": "exact",
        "SPANPROF_PROFILES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "e2e-otlp",
        "PYROSCOPE_UPLOAD_INTERVAL": "1",
        "PYROSCOPE_SAMPLE_RATE": "250",
        **extra,
    }


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_otlp_profiles_link_every_sample_to_its_requests_span(loop: str, tmp_path: Path) -> None:
    """>= 99% of request CPU links to exactly its trace and span; background CPU to none."""
    require(sys.platform.startswith("linux"), "the exact profiler needs Linux thread CPU clocks")
    port = free_port()
    with OtlpProfilesReceiver() as receiver:
        with serve(
            uvicorn_argv("tests.e2e.exact_app:app", port, loop),
            health_url=f"http://127.0.0.1:{port}/health",
            env=_env(receiver.url),
            log_path=tmp_path / "uvicorn.log",
        ):
            results, stats = asyncio.run(_fire(f"http://127.0.0.1:{port}", CONCURRENCY))
        # The last window was flushed at lifespan shutdown, before the server exited.
        requests = receiver.requests()
        samples = receiver.samples()
        assert receiver.errors == []
    log = (tmp_path / "uvicorn.log").read_text()
    assert "Traceback" not in log, log
    assert stats["mode"] == "exact", stats
    assert stats["errors"] == 0, stats
    assert requests
    assert stats["service_name"] == "e2e-otlp"
    for request in requests:
        assert resource_attributes(request)["service.name"] == stats["service_name"]
        scope = request.resource_profiles[0].scope_profiles[0].scope
        assert scope.name == "spanprof"
    expected = {i: result["labels"] for i, result in results.items()}
    assert len({labels["span_id"] for labels in expected.values()}) == CONCURRENCY

    result = attribute(samples, expected, keys=("span_id", "trace_id", "span_name"))
    print(loop, result.summary(), stats)
    assert len(result.per_request) == CONCURRENCY, result.summary()
    assert result.exact_share >= 0.99, result.summary()
    assert result.double_span == 0, result.summary()
    assert result.background_total > 0, result.summary()
    assert result.background_labelled == 0, result.summary()
    measured_total = sum(r["cpu"] for r in results.values())
    assert 0.85 <= sum(result.per_request.values()) / 1e9 / measured_total <= 1.15
    # The 2 ms budget is measured in benchmarks/ (bench_exact, bench_otlp: 0.7-1.6 ms there). Here,
    # on a busy CI machine a step's CPU time wanders around it (2,019 us seen on 3.13): only an
    # encode an order of magnitude over it (an unsliced window) fails the test.
    assert stats["otlp_max_export_step_us"] < 20_000, stats
    assert stats["otlp_dropped"] == stats["otlp_rejected"] == 0, stats


def test_otlp_profiles_over_grpc_link_every_sample_too(tmp_path: Path) -> None:
    """The same under OTEL_EXPORTER_OTLP_PROFILES_PROTOCOL=grpc: grpcio's threads next to the
    SIGPROF sampler change nothing."""
    from spanprof._profiling._exporters._otlp_grpc import grpc_available

    require(sys.platform.startswith("linux"), "the exact profiler needs Linux thread CPU clocks")
    require(grpc_available(), "grpcio (the grpc extra) is not installed")
    port = free_port()
    with GrpcProfilesReceiver() as receiver:
        env = _env(f"http://127.0.0.1:{receiver.port}", OTEL_EXPORTER_OTLP_PROFILES_PROTOCOL="grpc")
        with serve(
            uvicorn_argv("tests.e2e.exact_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=tmp_path / "uvicorn.log",
        ):
            results, stats = asyncio.run(_fire(f"http://127.0.0.1:{port}", CONCURRENCY))
        samples = receiver.samples()
        assert receiver.errors == []
    log = (tmp_path / "uvicorn.log").read_text()
    assert "Traceback" not in log, log
    assert stats["mode"] == "exact", stats
    assert stats["errors"] == 0, stats
    expected = {i: result["labels"] for i, result in results.items()}
    result = attribute(samples, expected, keys=("span_id", "trace_id", "span_name"))
    print("grpc", result.summary(), stats)
    assert len(result.per_request) == CONCURRENCY, result.summary()
    assert result.exact_share >= 0.99, result.summary()
    assert result.background_labelled == 0, result.summary()
    assert stats["otlp_uploads"] >= 1, stats


FAULTS = ("down", "429", "500", "hang")


@contextmanager
def _faulty(mode: str) -> Iterator[str]:
    if mode in ("down", "hang"):
        with faulty_endpoint(mode) as base:
            yield base + PATH
        return
    answer = Response(429, (("Retry-After", "30"),)) if mode == "429" else Response(int(mode))
    with OtlpProfilesReceiver([answer] * 10_000) as receiver:
        yield receiver.url
        assert receiver.received == []


async def _stats(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        response = await client.get("/stats")
        stats: dict[str, Any] = response.json()
        return stats


@pytest.mark.parametrize("mode", FAULTS)
def test_requests_are_unaffected_whatever_the_otlp_endpoint_does(mode: str, tmp_path: Path) -> None:
    """Requests succeed, the failure is counted, undelivered windows are dropped and counted."""
    require(sys.platform.startswith("linux"), "the exact profiler needs Linux thread CPU clocks")
    port = free_port()
    log_path = tmp_path / "uvicorn.log"
    base = f"http://127.0.0.1:{port}"
    env = {
        "E2E_HANDLER_STEPS": "10",
        "E2E_CHILD_STEPS": "4",
        "E2E_POOL_JOBS": "4",
        "OTEL_EXPORTER_OTLP_PROFILES_TIMEOUT": "1000",
    }
    with _faulty(mode) as endpoint:
        with serve(
            uvicorn_argv("tests.e2e.exact_app:app", port, "asyncio"),
            health_url=f"{base}/health",
            env=_env(endpoint, **env),
            log_path=log_path,
        ) as process:
            results, _ = asyncio.run(_fire(base, CONCURRENCY))
            # At least one export attempt against the broken endpoint.
            deadline = time.monotonic() + 15
            stats = asyncio.run(_stats(base))
            while (
                stats["otlp_failures"] + stats["otlp_rejected"] == 0 and time.monotonic() < deadline
            ):
                time.sleep(0.2)
                stats = asyncio.run(_stats(base))
            stopping = time.monotonic()
        stopped_after = time.monotonic() - stopping
        assert process.returncode == 0
    assert len(results) == CONCURRENCY
    assert all(r["labels"]["span_id"] for r in results.values())
    assert stats["mode"] == "exact", stats
    assert stats["otlp_uploads"] == 0, stats
    log = log_path.read_text()
    assert "Traceback" not in log, log[-2000:]
    if mode == "500":
        # Not retryable under OTLP's rules: each window is dropped at once, as rejected.
        assert stats["otlp_rejected"] >= 1, stats
        assert stats["otlp_retries"] == 0, stats
        assert "rejected an OTLP profile export (HTTP 500)" in log, log[-2000:]
    else:
        assert stats["otlp_failures"] >= 1, stats
        assert stats["otlp_rejected"] == 0, stats
        # What still waited for the endpoint at shutdown was dropped, and said so.
        assert "dropped OTLP profile windows" in log, log[-2000:]
    # The flush never holds shutdown hostage (2 s flush budget, 1 s timeouts).
    assert stopped_after < 15, f"shutdown took {stopped_after:.1f} s"


@pytest.mark.parametrize("name", ["gevent-preload-defaults", "sync-defaults"])
def test_otlp_profiles_from_gunicorn_workers(name: str, tmp_path: Path) -> None:
    """Under gunicorn's gevent and sync workers (the exporter a greenlet, or a thread, of each
    forked worker) OTLP samples link to their spans as exactly as the push's do."""
    import importlib.util
    import shutil
    import signal

    from .test_e2e_gunicorn import SETUPS
    from .test_e2e_gunicorn import _argv as gunicorn_argv
    from .test_e2e_gunicorn import _fire as fire_burns

    setup = SETUPS[name]
    require(
        shutil.which("gunicorn", path=str(Path(sys.executable).parent)) is not None,
        "gunicorn is not installed",
    )
    if "E2E_GREENLETS" in setup.env:
        require(importlib.util.find_spec("gevent") is not None, "gevent is not installed")
    port = free_port()
    log_path = tmp_path / "server.log"
    with OtlpProfilesReceiver() as receiver:
        env = {
            **_env(receiver.url),
            "OTEL_SERVICE_NAME": "e2e-otlp-wsgi",
            **setup.env,
        }
        del env["SPANPROF_PROFILER"]  # the default, auto
        with serve(
            gunicorn_argv(setup, port),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=log_path,
            stop_signal=signal.SIGTERM,
        ):
            reports = asyncio.run(fire_burns(f"http://127.0.0.1:{port}", ""))
        requests = receiver.requests()
        samples = receiver.samples()
        assert receiver.errors == []
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "profiling with the exact sampler" in log, log
    assert {resource_attributes(r)["service.name"] for r in requests} == {"e2e-otlp-wsgi"}
    expected = {}
    for index, report in enumerate(reports):
        labels = report["labels"]
        assert isinstance(labels, dict)
        expected[index] = labels
    assert len({str(report["pid"]) for report in reports}) == 2
    result = attribute(samples, expected)
    print(name, result.summary())
    assert len(result.per_request) == CONCURRENCY, result.summary()
    assert result.exact_share >= 0.99, result.summary()
    assert result.double_span == 0, result.summary()
    assert result.background_labelled == 0, result.summary()
