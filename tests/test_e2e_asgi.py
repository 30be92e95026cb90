"""End to end: uvicorn + Starlette + ProfilingMiddleware + the real pyroscope-io agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from spanprof._local._receiver import PushReceiver

from .e2e.analysis import attribute
from .e2e.client import fire
from .e2e.server import free_port, serve, uvicorn_argv

pytestmark = pytest.mark.e2e

CONCURRENCY = 16
# Batches of CONCURRENCY, pooled: one batch is ~250 ticks, where pyroscope-io's tag lag alone
# moves the exact share by a couple of points from run to run (96.9-100% measured).
ROUNDS = 3
TICK = 10_000_000  # one 100 Hz sample, in the pprof value's nanoseconds


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pyroscope_samples_carry_exactly_their_requests_ids(loop: str, tmp_path: Path) -> None:
    """>= 97% of request CPU carries its own span and trace id; none carries two; none leaks."""
    port = free_port()
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "e2e-asgi",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
        }
        with serve(
            uvicorn_argv("tests.e2e.asgi_app:app", port, loop),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=tmp_path / "uvicorn.log",
        ):
            expected = asyncio.run(
                fire(f"http://127.0.0.1:{port}", concurrency=CONCURRENCY, rounds=ROUNDS)
            )
        # The server flushed its last window at lifespan shutdown, before it exited.
        samples = receiver.samples()
        assert receiver.errors == []
    log = (tmp_path / "uvicorn.log").read_text()
    assert "Traceback" not in log, log
    assert len({labels["span_id"] for labels in expected.values()}) == ROUNDS * CONCURRENCY
    assert all(set(labels) == {"span_id", "trace_id", "span_name"} for labels in expected.values())
    assert {s.series_label("service_name") for s in samples} == {"e2e-asgi"}
    result = attribute(samples, expected)
    print(loop, result.summary())
    assert result.request_total >= 100 * 10_000_000, result.summary()
    assert len(result.per_request) == ROUNDS * CONCURRENCY, result.summary()
    assert result.exact_share >= 0.97, result.summary()
    assert result.double_span == 0, result.summary()
    assert result.background_total > 0, result.summary()
    # The background task shares the loop thread with the requests, and pyroscope-io reads a
    # thread's tags ~0.2 ms after its stack: a sample at the very end of a background step can
    # carry the next request's labels (measured 0 of 6-26 ticks quiet, 1 of 16 under load).
    # One tick or 3% is that lag, not a leak; the exact sampler's test asserts zero.
    assert result.background_labelled <= max(TICK, 0.03 * result.background_total), result.summary()
