"""Request latency while the profiler's endpoint is down, hanging, failing or trickling.

A real uvicorn serving ``tests/e2e/asgi_app.py`` under spanprof, with the real pyroscope-io
agent, with spanprof's exact profiler pushing to Pyroscope (its own uploader) and with the
exact profiler exporting OTLP profiles, each with 1 s uploads, pointed
at: a healthy receiver (the baseline), a closed port, an endpoint that accepts and never answers,
one that answers 500, one that trickles its answer (a byte every 5 s) and one that answers 401.
A sequential client measures each request's latency; the server runs a few upload intervals
first, so the uploader has failed before the measured requests. The claim is "unchanged latency
within noise": the ratio to the same profiler's healthy run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tests.e2e.faults import FAULT_MODES, faulty_endpoint
from tests.e2e.server import free_port, serve, uvicorn_argv
from tests.otlp_profiles import OtlpProfilesReceiver

from spanprof._local._receiver import PushReceiver
from spanprof._profiling._exporters._otlp import OTLP_PROFILES_PATH

from ._report import Section, Spread, markdown_table

__all__ = ["run"]


@contextmanager
def _endpoint(mode: str, otlp: bool) -> Iterator[dict[str, str]]:
    """The variables that point the profiler at an endpoint in state ``mode``."""
    if mode == "healthy":
        receiver = OtlpProfilesReceiver() if otlp else PushReceiver()
        with receiver:
            # Each receiver's URL is what its clients are given: the OTLP one's has the path.
            yield _pointing(receiver.url, otlp)
        return
    with faulty_endpoint(mode) as address:
        yield _pointing(address + OTLP_PROFILES_PATH if otlp else address, otlp)


def _pointing(url: str, otlp: bool) -> dict[str, str]:
    if otlp:
        return {"OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": url}
    return {"PYROSCOPE_SERVER_ADDRESS": url}


#: What is measured: a name, and the variables that choose the profiler and its exporter.
PROFILERS: dict[str, dict[str, str]] = {
    "pyroscope-io agent": {"SPANPROF_PROFILER": "pyroscope"},
    "exact profiler, Pyroscope push": {"SPANPROF_PROFILER": "exact"},
    "exact profiler, OTLP exporter": {
        "SPANPROF_PROFILER": "exact",
        "SPANPROF_PROFILES_EXPORTER": "otlp",
    },
}


def _latencies(profiler: dict[str, str], mode: str, count: int, workdir: Path) -> list[float]:
    port = free_port()
    env = {
        **profiler,
        "PYROSCOPE_UPLOAD_INTERVAL": "1",
        "E2E_STEP_SECONDS": "0.001",
        "E2E_HANDLER_STEPS": "2",
        "E2E_CHILD_STEPS": "1",
        "E2E_POOL_SECONDS": "0.001",
    }
    otlp = profiler.get("SPANPROF_PROFILES_EXPORTER") == "otlp"
    with (
        _endpoint(mode, otlp) as pointing,
        serve(
            uvicorn_argv("tests.e2e.asgi_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env={**env, **pointing},
            log_path=workdir / f"uvicorn-{len(os.listdir(workdir))}-{mode}.log",
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
    """Latency per profiler and endpoint state, and its ratio to that profiler's healthy run."""
    count = 150 if quick else 600
    section = Section("faults", "Request latency while the profile endpoint fails")
    section.body.append(
        f"{count} sequential requests per endpoint state after a 50-request warm-up; each "
        "request burns about 4 ms of CPU in the handler, a child task and the thread pool. "
        "States run one after another (each needs its own server), so the ratios carry the "
        "machine's drift between runs. `trickle` answers one byte every 5 s (the exact "
        "uploader and the OTLP exporter give each upload a 10 s deadline); `401` refuses the "
        "credentials."
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, profiler in PROFILERS.items():
            results = {
                mode: _latencies(profiler, mode, count, Path(tmp))
                for mode in ("healthy", *FAULT_MODES)
            }
            base = statistics.median(results["healthy"])
            rows = []
            for mode, values in results.items():
                spread = Spread.of(values)
                p90 = statistics.quantiles(values, n=10)[-1]
                rows.append([mode, spread.format(2), f"{p90:.2f}", f"{spread.median / base:.3f}"])
            variables = " ".join(f"{key}={value}" for key, value in profiler.items())
            section.body += [
                f"**{name}** (`{variables}`):",
                markdown_table(
                    [
                        "endpoint",
                        "latency ms: median (IQR; min..max)",
                        "p90 ms",
                        "median x healthy",
                    ],
                    rows,
                ),
            ]
    return section
