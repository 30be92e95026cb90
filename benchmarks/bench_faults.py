"""Request latency while the profiler's endpoint is down, hanging or failing.

A real uvicorn serving ``tests/e2e/asgi_app.py`` under spanprof with the real pyroscope-io agent
(1 s uploads) pointed at: a healthy receiver (the baseline), a closed port, an endpoint that
accepts and never answers, and one that answers 500. A sequential client measures each request's
latency; the server runs a few upload intervals first, so the agent has failed before the
measured requests. The claim is "unchanged latency within noise": the ratio to the healthy run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tests.e2e.faults import FAULT_MODES, faulty_endpoint
from tests.e2e.server import free_port, serve, uvicorn_argv

from spanprof._local._receiver import PushReceiver

from ._report import Section, Spread, markdown_table

__all__ = ["run"]


@contextmanager
def _endpoint(mode: str) -> Iterator[str]:
    if mode == "healthy":
        with PushReceiver() as receiver:
            yield receiver.url
        return
    with faulty_endpoint(mode) as address:
        yield address


def _latencies(mode: str, count: int, workdir: Path) -> list[float]:
    port = free_port()
    env = {
        "PYROSCOPE_UPLOAD_INTERVAL": "1",
        "E2E_STEP_SECONDS": "0.001",
        "E2E_HANDLER_STEPS": "2",
        "E2E_CHILD_STEPS": "1",
        "E2E_POOL_SECONDS": "0.001",
    }
    with (
        _endpoint(mode) as address,
        serve(
            uvicorn_argv("tests.e2e.asgi_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env={**env, "PYROSCOPE_SERVER_ADDRESS": address},
            log_path=workdir / f"uvicorn-{mode}.log",
        ),
    ):
        time.sleep(2.5)  # let the agent try (and fail) a couple of uploads first
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for i in range(50):  # warm-up
                client.get(f"/burn/{i % 16}")
            values = []
            for i in range(count):
                started = time.perf_counter()
                response = client.get(f"/burn/{i % 16}")
                values.append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
    return values


def run(quick: bool) -> Section:
    """Latency per endpoint state, and its ratio to the healthy run."""
    count = 150 if quick else 600
    section = Section("faults", "Request latency while the profile endpoint fails")
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: _latencies(mode, count, Path(tmp)) for mode in ("healthy", *FAULT_MODES)}
    base = statistics.median(results["healthy"])
    rows = []
    for mode, values in results.items():
        spread = Spread.of(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        rows.append([mode, spread.format(2), f"{p90:.2f}", f"{spread.median / base:.3f}"])
    section.body += [
        f"{count} sequential requests per endpoint state after a 50-request warm-up; each "
        "request burns about 4 ms of CPU in the handler, a child task and the thread pool. "
        "States run one after another (each needs its own server), so the ratios carry the "
        "machine's drift between runs.",
        markdown_table(
            ["endpoint", "latency ms: median (IQR; min..max)", "p90 ms", "median x healthy"], rows
        ),
    ]
    return section
