"""End to end: uvicorn + Starlette + ProfilingMiddleware + the exact profiler, at 0.5 ms steps."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from spanprof._local._receiver import PushReceiver

from .conftest import require
from .e2e.analysis import attribute
from .e2e.server import free_port, gunicorn_uvicorn_argv, hypercorn_argv, serve, uvicorn_argv

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

CONCURRENCY = 16


async def _fire(base: str, count: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/work/{i}") for i in range(count)))
        stats = (await client.get("/stats")).json()
    for response in responses:
        response.raise_for_status()
    return {i: response.json() for i, response in enumerate(responses)}, stats


SERVERS = {
    "uvicorn-asyncio": lambda port: uvicorn_argv("tests.e2e.exact_app:app", port, "asyncio"),
    "uvicorn-uvloop": lambda port: uvicorn_argv("tests.e2e.exact_app:app", port, "uvloop"),
    "hypercorn-asyncio": lambda port: hypercorn_argv("tests.e2e.exact_app:app", port, "asyncio"),
    "hypercorn-trio": lambda port: hypercorn_argv("tests.e2e.exact_app:app", port, "trio"),
    # gunicorn managing a uvicorn worker: the worker's loop runs in its main thread, so the
    # default is exact there too. With --preload the app, its middleware and spanprof are
    # imported in the master, and the profiler must start in the forked worker.
    "gunicorn-uvicorn": lambda port: gunicorn_uvicorn_argv("tests.e2e.exact_app:app", port),
    "gunicorn-uvicorn-preload": lambda port: gunicorn_uvicorn_argv(
        "tests.e2e.exact_app:app", port, "--preload"
    ),
}


@pytest.mark.parametrize(
    ("server", "profiler"),
    [
        # SPANPROF_PROFILER unset: the default a user gets from the README's quickstart.
        ("uvicorn-asyncio", None),
        ("uvicorn-uvloop", None),
        ("hypercorn-asyncio", None),
        ("hypercorn-trio", None),
        ("gunicorn-uvicorn", None),
        ("gunicorn-uvicorn-preload", None),
        ("uvicorn-asyncio", "exact"),
        ("uvicorn-uvloop", "exact"),
    ],
)
def test_exact_profiler_attributes_every_sample_to_its_request(
    server: str, profiler: str | None, tmp_path: Path
) -> None:
    """>= 99% of request CPU carries exactly its labels; shares match measured CPU to 3 points."""
    require(sys.platform.startswith("linux"), "the exact profiler needs Linux thread CPU clocks")
    if server.startswith("hypercorn"):
        require(importlib.util.find_spec("hypercorn") is not None, "hypercorn is not installed")
    if server.startswith("gunicorn"):
        require(importlib.util.find_spec("gunicorn") is not None, "gunicorn is not installed")
    if server.endswith("trio"):
        require(importlib.util.find_spec("trio") is not None, "trio is not installed")
    port = free_port()
    with PushReceiver() as receiver:
        env = {
            **({"SPANPROF_PROFILER": profiler} if profiler is not None else {}),
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "e2e-exact",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
            # The most Linux delivers (HZ=250): more samples, less sampling noise in the shares.
            "PYROSCOPE_SAMPLE_RATE": "250",
        }
        with serve(
            SERVERS[server](port),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=tmp_path / "server.log",
            # gunicorn's master stops its workers gracefully on SIGTERM (SIGINT is immediate).
            stop_signal=signal.SIGTERM if server.startswith("gunicorn") else signal.SIGINT,
        ):
            results, stats = asyncio.run(_fire(f"http://127.0.0.1:{port}", CONCURRENCY))
        # The last window was flushed at lifespan shutdown, before the server exited.
        samples = receiver.samples()
        pushes = receiver.received_pushes()
        assert receiver.errors == []
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log
    assert stats["mode"] == "exact", stats
    assert stats["errors"] == 0, stats
    assert {push.user_agent.split("/")[0] for push in pushes} == {"spanprof"}
    assert {s.series_label("service_name") for s in samples} == {"e2e-exact"}
    assert {s.series_label("__name__") for s in samples} == {"process_cpu"}
    expected = {i: result["labels"] for i, result in results.items()}
    assert len({labels["span_id"] for labels in expected.values()}) == CONCURRENCY
    assert all(set(labels) == {"span_id", "trace_id", "span_name"} for labels in expected.values())

    result = attribute(samples, expected, keys=("span_id", "trace_id", "span_name"))
    print(server, profiler, result.summary(), stats)
    assert len(result.per_request) == CONCURRENCY, result.summary()
    assert result.exact_share >= 0.99, result.summary()
    assert result.double_span == 0, result.summary()
    assert result.background_total > 0, result.summary()
    assert result.background_labelled == 0, result.summary()

    measured = {i: result_["cpu"] for i, result_ in results.items()}
    sampled_total = sum(result.per_request.values())
    measured_total = sum(measured.values())
    # Sampling misses a little of the loop's CPU and books a little of its overhead.
    assert 0.85 <= sampled_total / 1e9 / measured_total <= 1.15
    for i in range(CONCURRENCY):
        share = result.per_request[i] / sampled_total
        # ~650 samples: a 8% share has ~1.1 points of binomial noise, and the worst of 16
        # requests sits near 3 sigma (3.5 points seen once on 3.13), so 3 points flakes.
        assert share == pytest.approx(measured[i] / measured_total, abs=0.05), (i, share)
    # The 2 ms budget is measured in benchmarks/ (bench_exact, bench_otlp: 0.7-1.6 ms there). Here,
    # on a busy CI machine a step's CPU time wanders around it (2,019 us seen on 3.13): only an
    # encode an order of magnitude over it (an unsliced window) fails the test. A collection
    # that lands in a step is not the step's (21.5 ms seen on 3.11 before it was left out).
    assert stats["max_export_step_us"] < 20_000, stats


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_requests_that_start_processes_get_their_results(method: str, tmp_path: Path) -> None:
    """A request starts a process pool and a process under the default profiler (its signal
    handler, timer, allocation hooks and threads in the parent): every child returns its
    result and exits 0, whatever the start method, and the server still profiles exactly."""
    require(sys.platform.startswith("linux"), "the exact profiler needs Linux thread CPU clocks")
    port = free_port()
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "e2e-processes",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
        }
        with serve(
            uvicorn_argv("tests.e2e.process_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=tmp_path / "server.log",
        ):
            response = httpx.get(f"http://127.0.0.1:{port}/pool/{method}", timeout=120)
        samples = receiver.samples()
        pushes = receiver.received_pushes()
        assert receiver.errors == []
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log
    # The exact sampler's uploader (pyroscope-io's says "pyroscope-rs"), and only the server's.
    assert {push.user_agent.split("/")[0] for push in pushes} == {"spanprof"}
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["exitcode"] == 0, body
    assert body["kept"] == [100] * 4, body
    assert body["server"] not in body["children"], body
    # The request's own 0.1 s of CPU in the server is its span's (~10 ticks at 100 Hz).
    labelled = sum(
        s.value for s in samples if s.label_values("span_name") == ("GET /pool/{method}",)
    )
    assert labelled >= 50_000_000, [(s.labels, s.value) for s in samples]
