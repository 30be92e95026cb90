"""End to end: real Prometheus scrapes OpenMetrics exemplars of SLO breaches from uvicorn."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from .conftest import require
from .e2e.server import free_port, serve, uvicorn_argv, wait_ready

pytestmark = pytest.mark.e2e


def test_prometheus_finds_the_slow_requests_trace_id(tmp_path: Path) -> None:
    """Prometheus stores the breach's trace_id as an exemplar; fast requests leave none."""
    binary = shutil.which("prometheus")
    require(binary is not None, "Debian's prometheus package is not installed")
    assert binary is not None
    app_port, prom_port = free_port(), free_port()
    with serve(
        uvicorn_argv("tests.e2e.metrics_app:app", app_port, "asyncio"),
        health_url=f"http://127.0.0.1:{app_port}/health",
        env={},
        log_path=tmp_path / "uvicorn.log",
    ):
        base = f"http://127.0.0.1:{app_port}"
        slow = httpx.get(f"{base}/work?sleep=0.2", timeout=10).json()
        fast = [httpx.get(f"{base}/work", timeout=10).json() for _ in range(5)]
        accept = {"Accept": "application/openmetrics-text"}
        first = httpx.get(f"{base}/metrics", headers=accept, timeout=10)
        assert first.status_code == 200  # served at /metrics itself, no redirect
        text = httpx.get(f"{base}/metrics", headers=accept, timeout=10).text
        assert slow["trace_id"] in text  # exposed as an OpenMetrics exemplar
        assert 'http_route="/metrics' not in text  # the first scrape was not observed
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: app\n"
            "    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{app_port}']\n"
        )
        with (tmp_path / "prometheus.log").open("wb") as log:
            prometheus = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--enable-feature=exemplar-storage",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", prometheus)
            found: list[dict[str, str]] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not found:
                now = time.time()
                reply = httpx.get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query_exemplars",
                    params={
                        "query": "http_server_request_duration_seconds_bucket",
                        "start": now - 600,
                        "end": now + 60,
                    },
                    timeout=10,
                ).json()
                assert reply["status"] == "success", reply
                found = [e["labels"] for series in reply["data"] for e in series["exemplars"]]
                time.sleep(0.5)
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
    assert found, (tmp_path / "prometheus.log").read_text()[-2000:]
    trace_ids = {labels["trace_id"] for labels in found}
    assert trace_ids == {slow["trace_id"]}
    assert {labels["span_id"] for labels in found} == {slow["span_id"]}
    assert not trace_ids & {f["trace_id"] for f in fast}
