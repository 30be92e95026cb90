"""A uvicorn server under callgrind, driven over HTTP: instructions per response, load-free.

The exact section's HTTP run measures CPU per response, and on a shared VM fresh processes of
one configuration differ by several percent in it, as much as the profiler costs. Counted
instructions do not depend on load or on the process's layout: the server runs under
``valgrind --tool=callgrind`` (every thread counted), serves a warm-up and then ``count``
responses to a raw-socket client, and is stopped gracefully (its profiler's last upload
included). Two runs that differ only in ``count`` give the cost of one response, start-up,
imports, warm-up and shutdown cancelled out.

callgrind runs the server about 50 times slower, so what the profiler does per second of wall
time (drains four times a second, an upload every 10 s) would count 50 times over per
response: the upload interval is stretched to match (``PYROSCOPE_UPLOAD_INTERVAL=500``), the
drain's period too (``benchmarks/apps/slowed_app.py``), and the 100 Hz CPU-time ticks become
2 Hz of callgrind's CPU time, about as many ticks per response as 100 Hz gives a native server
(the run reports ticks per response).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tests.e2e.server import free_port, serve, uvicorn_argv

from ._load import load

__all__ = [
    "HTTP_TICK_HZ",
    "HTTP_UPLOAD_INTERVAL",
    "SLOWDOWN",
    "HttpCount",
    "count_http",
]

#: About how many times slower callgrind runs the server than it runs natively.
SLOWDOWN = 50
#: Ticks per second of callgrind's CPU time: the default 100 Hz of native CPU, slowed down.
HTTP_TICK_HZ = 100 // SLOWDOWN
#: Seconds between uploads: the default 10 s, slowed down.
HTTP_UPLOAD_INTERVAL = 10 * SLOWDOWN

_TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class HttpCount:
    """One counted server run: its instructions and, when profiled, its profiler's stats."""

    instructions: int
    stats: dict[str, Any]


def count_http(
    app: str,
    env: Mapping[str, str],
    warmup: int,
    count: int,
    *,
    profiled: bool,
    meet: int = 0,
    meet_bytes: int | None = None,
) -> HttpCount:
    """Instructions of a callgrind'd uvicorn serving ``app`` for ``warmup`` then ``count``
    responses and stopping; with ``profiled``, ``/stats`` read before the stop.

    With ``meet_bytes``, the warm-up starts with ``meet`` responses sampled every
    ``meet_bytes`` bytes (``benchmarks/apps/slowed_app.py``'s ``/sample-bytes``).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        port = free_port()
        argv = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            *uvicorn_argv(app, port, "asyncio"),
        ]
        stats: dict[str, Any] = {}
        with serve(
            argv,
            health_url=f"http://127.0.0.1:{port}/health",
            env={**env, "PYTHONHASHSEED": "0"},
            log_path=Path(tmp) / "server.log",
            ready_timeout=900.0,
            stop_timeout=900.0,
        ):
            if meet_bytes is not None:
                _get(port, f"/sample-bytes?{meet_bytes}")
                load([port], count=meet)
                _get(port, "/sample-bytes?")
            load([port], count=warmup)
            before = _stats(port) if profiled else {}
            load([port], count=count)
            if profiled:
                after = _stats(port)
                stats = {**after, "counted_ticks": after["ticks"] - before["ticks"]}
                if "memory_samples" in after:
                    stats["counted_samples"] = after["memory_samples"] - before["memory_samples"]
        match = _TOTALS.search(out.read_text(encoding="utf-8", errors="replace"))
        if match is None:
            raise RuntimeError(f"no instruction total in callgrind's output for {app} {env}")
        return HttpCount(int(match.group(1)), stats)


def _get(port: int, path: str) -> httpx.Response:
    answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=120)
    answer.raise_for_status()
    return answer


def _stats(port: int) -> dict[str, Any]:
    stats: dict[str, Any] = _get(port, "/stats").json()
    return stats
