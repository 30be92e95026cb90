"""Profiler faults: a Pyroscope endpoint that is down, hangs or fails never touches requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from .e2e.faults import FAULT_MODES, faulty_endpoint
from .e2e.server import free_port, serve, uvicorn_argv

pytestmark = pytest.mark.e2e


async def _fire(base: str, count: int) -> list[int]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> int:
            async with gate:
                return (await client.get(f"/burn/{i % 16}")).status_code

        return list(await asyncio.gather(*(one(i) for i in range(count))))


@pytest.mark.parametrize(
    "profiler", [pytest.param("pyroscope", marks=pytest.mark.needs_agent), "exact"]
)
@pytest.mark.parametrize("mode", FAULT_MODES)
def test_requests_succeed_whatever_the_profiler_endpoint_does(
    mode: str, profiler: str, tmp_path: Path
) -> None:
    """Every request succeeds and the server still shuts down promptly."""
    port = free_port()
    log = tmp_path / "uvicorn.log"
    with faulty_endpoint(mode) as address:
        env = {
            "SPANPROF_PROFILER": profiler,
            "PYROSCOPE_SERVER_ADDRESS": address,
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
            "E2E_STEP_SECONDS": "0.002",
            "E2E_POOL_SECONDS": "0.002",
        }
        with serve(
            uvicorn_argv("tests.e2e.asgi_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=log,
        ) as process:
            statuses = asyncio.run(_fire(f"http://127.0.0.1:{port}", 64))
            time.sleep(1.5)  # at least one upload attempt against the broken endpoint
            stopping = time.monotonic()
        stopped_after = time.monotonic() - stopping
        assert process.returncode is not None
    assert statuses == [200] * 64
    text = log.read_text()
    assert "Traceback" not in text, text[-2000:]
    # Both profilers say that the profiles are not getting through (spanprof says it for the
    # agent, which does not): once, whatever the number of uploads. The agent's check is a TCP
    # connect, so it sees only the endpoint that is down.
    if profiler == "exact" or mode == "down":
        assert text.count("spanprof: ") >= 1, text[-2000:]
    if mode == "down":
        said = [line for line in text.splitlines() if "ConnectionRefusedError" in line]
        assert len(said) == 1, text[-2000:]
    # The agent's final flush must not hold shutdown hostage to a hanging endpoint.
    assert stopped_after < 20, f"shutdown took {stopped_after:.1f} s"
