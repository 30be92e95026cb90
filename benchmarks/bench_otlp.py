"""OTLP profiles vs the Pyroscope push: encoding cost per window and bytes on the wire.

In-process: the same synthetic windows encoded the way each exporter does it, step by step
(``OtlpEncoder`` for ``OtlpExporter``; ``WindowEncoder`` + ``encode_push_request`` for
``Pusher``), then gzip'd as both send them (``gzipped``, at ``GZIP_LEVEL``). *CPU* is the
encoding thread's CPU time over all steps, *longest step* the most CPU one step took while
holding the GIL (gzip runs outside them: zlib releases the GIL).

End to end: ``tests/e2e/exact_app.py`` under uvicorn with ``SPANPROF_PROFILES_EXPORTER=
pyroscope,otlp``, so both exporters ship the very same windows; their own counters give bytes
sent and the longest step.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tests.e2e.server import free_port, serve, uvicorn_argv
from tests.otlp_profiles import OtlpProfilesReceiver

from spanprof._labels._labelset import EMPTY, LabelSet
from spanprof._local._receiver import PushReceiver
from spanprof._profiling._encoders._otlp import OtlpEncoder, encode_resource, encode_scope
from spanprof._profiling._encoders._push import encode_push_request
from spanprof._profiling._encoders._window import WindowEncoder, series_labels
from spanprof._profiling._exporters._http import gzipped
from spanprof._profiling._exporters._steps import StepTimer
from spanprof._profiling._window import Frame, StackTables, Window

from ._report import Section, Spread, Verdict, markdown_table

__all__ = ["run"]

STEP_BUDGET_US = 2000.0
RESOURCE = {
    "service.name": "bench",
    "service.instance.id": "5f0c4a39-5f1e-4b53-9d0a-3c1d2e6f7a8b",
    "telemetry.sdk.language": "python",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": "1.45.2",
}


@dataclass(frozen=True)
class Shape:
    """A synthetic window: ``samples`` distinct (stack, labels) pairs."""

    name: str
    samples: int
    stacks: int
    depth: int
    requests: int


SHAPES = (
    Shape("10 s at 100 Hz, 16 concurrent requests", 600, 60, 30, 160),
    Shape("10 s at 250 Hz, busy service", 2500, 400, 40, 1000),
    Shape("worst case: every sample distinct", 4000, 4000, 48, 4000),
)


def _window(shape: Shape) -> Window:
    tables = StackTables()
    frames = [
        Frame(f"module{i % 40}.Class{i % 7}.function_{i}", f"/srv/app/pkg{i % 40}/mod{i}.py", i)
        for i in range(shape.stacks + shape.depth)
    ]
    tables.frames = frames
    for s in range(shape.stacks):
        tables.stacks.append(tuple(frames[s + d] for d in range(shape.depth)))
    labels = [
        LabelSet(
            {
                "span_id": f"{r * 7919 + 1:016x}",
                "trace_id": f"{r * 104729 + 1:032x}",
                "span_name": f"GET /route/{r % 12}",
            }
        )
        for r in range(shape.requests)
    ]
    window = Window(time.time_ns(), tables)
    for n in range(shape.samples):
        # A tenth of the samples run unlabelled (background work).
        label = EMPTY if n % 10 == 9 else labels[n % shape.requests]
        window.values[(n % shape.stacks, label)] = 10_000_000 + n
    window.end_ns = window.start_ns + 10_000_000_000
    return window


def _timed_steps(step: Callable[[], object], done: Callable[[], bool]) -> StepTimer:
    # The exporters' own timer: a collection that lands in a step is counted apart.
    timer = StepTimer()
    while not done():
        timer.run(step)
    return timer


def _otlp(window: Window) -> tuple[StepTimer, int, int]:
    encoder = OtlpEncoder(
        window, resource=encode_resource(RESOURCE), scope=encode_scope(), attributes=()
    )
    timer = _timed_steps(encoder.step, lambda: encoder.done)
    body = gzipped(encoder.request)
    return timer, len(encoder.request), len(body)


def _push(window: Window) -> tuple[StepTimer, int, int]:
    encoder = WindowEncoder(window, period_ns=10_000_000)
    timer = _timed_steps(encoder.step, lambda: encoder.done)
    raw: list[bytes] = []
    # The envelope is one more step, as in the pusher.
    timer.run(
        lambda: raw.append(encode_push_request([(series_labels("bench", {}), encoder.profiles)]))
    )
    body = gzipped(raw[0])
    return timer, len(raw[0]), len(body)


def _measure(shape: Shape, rounds: int) -> dict[str, dict[str, list[float]]]:
    window = _window(shape)
    out: dict[str, dict[str, list[float]]] = {}
    for name in ("otlp", "push"):
        out[name] = {"cpu_ms": [], "step_us": [], "gc_us": [], "raw": [], "gzip": []}
    for index in range(rounds):
        order = (("otlp", _otlp), ("push", _push))
        for name, encode in order if index % 2 else order[::-1]:
            gc.collect()
            timer, raw, packed = encode(window)
            out[name]["cpu_ms"].append(timer.cpu_ns / 1e6)
            out[name]["step_us"].append(timer.max_ns / 1e3)
            out[name]["gc_us"].append(timer.max_gc_ns / 1e3)
            out[name]["raw"].append(raw)
            out[name]["gzip"].append(packed)
    return out


async def _fire(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/work/{i}") for i in range(16)))
        for response in responses:
            response.raise_for_status()
        stats: dict[str, Any] = (await client.get("/stats")).json()
        return stats


def _e2e(workdir: Path) -> tuple[dict[str, Any], int, int]:
    port = free_port()
    with PushReceiver() as pyroscope, OtlpProfilesReceiver() as otlp:
        env = {
            "SPANPROF_PROFILER": "exact",
            "SPANPROF_PROFILES_EXPORTER": "pyroscope,otlp",
            "PYROSCOPE_SERVER_ADDRESS": pyroscope.url,
            "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": otlp.url,
            "OTEL_SERVICE_NAME": "bench-otlp",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
        }
        with serve(
            uvicorn_argv("tests.e2e.exact_app:app", port, "asyncio"),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=workdir / "uvicorn.log",
        ):
            stats = asyncio.run(_fire(f"http://127.0.0.1:{port}"))
            # Let both exporters ship the windows of the burst before reading their counters.
            time.sleep(2.5)
            stats = asyncio.run(_fire(f"http://127.0.0.1:{port}"))
        if otlp.errors or pyroscope.errors:
            raise RuntimeError(f"receivers rejected uploads: {otlp.errors[:3]} {pyroscope.errors}")
        return stats, pyroscope.pushes, len(otlp.received)


def run(quick: bool) -> Section:
    """Encoding cost and size per window, then the same windows through both exporters."""
    rounds = 5 if quick else 21
    section = Section("otlp", "OTLP profiles vs the Pyroscope push: encoding cost and bytes")
    rows: list[list[str]] = []
    longest_otlp = 0.0
    for shape in SHAPES:
        result = _measure(shape, rounds)
        for name, label in (("otlp", "OTLP"), ("push", "Pyroscope push")):
            r = result[name]
            step = Spread.of(r["step_us"])
            if name == "otlp":
                longest_otlp = max(longest_otlp, step.high)
            rows.append(
                [
                    shape.name,
                    label,
                    Spread.of(r["cpu_ms"]).format(2),
                    f"{step.median:.0f} (max {step.high:.0f})",
                    f"{max(r['gc_us']):.0f}",
                    f"{r['raw'][0] / 1024:.1f}",
                    f"{r['gzip'][0] / 1024:.1f}",
                ]
            )
    with tempfile.TemporaryDirectory() as tmp:
        stats, pushes, exports = _e2e(Path(tmp))
    section.body += [
        "**Per window, in-process.** Synthetic windows of the given number of distinct "
        "(stack, labels) samples (stacks of 30-48 frames; a tenth unlabelled), encoded "
        f"{rounds} times each, alternating the two encoders. CPU and step times in the "
        "encoding thread; the longest step is what the application may wait for the GIL. A "
        "garbage collection that lands in a step is not the encoder's (the collector runs on "
        "whichever thread crosses its threshold): it is left out of the step and its longest "
        "pause shown apart.",
        markdown_table(
            [
                "window",
                "format",
                "CPU ms",
                "longest step µs",
                "GC in a step µs",
                "raw KiB",
                "gzip KiB",
            ],
            rows,
        ),
        "**Same windows, both exporters.** uvicorn serving `tests/e2e/exact_app.py` (two bursts "
        "of 16 concurrent requests, 100 Hz, 1 s uploads) with "
        "`SPANPROF_PROFILES_EXPORTER=pyroscope,otlp`: "
        f"{pushes} pushes and {exports} OTLP exports received.",
        markdown_table(
            [
                "exporter",
                "bytes sent (gzip)",
                "export CPU ms",
                "longest step µs",
                "GC in a step µs",
            ],
            [
                [
                    "Pyroscope push",
                    f"{int(stats['bytes_sent'])}",
                    f"{float(stats['export_cpu_ms']):.2f}",
                    f"{float(stats['max_export_step_us']):.0f}",
                    f"{float(stats['max_export_step_gc_us']):.0f}",
                ],
                [
                    "OTLP",
                    f"{int(stats['otlp_bytes_sent'])}",
                    f"{float(stats['otlp_export_cpu_ms']):.2f}",
                    f"{float(stats['otlp_max_export_step_us']):.0f}",
                    f"{float(stats['otlp_max_export_step_gc_us']):.0f}",
                ],
            ],
        ),
    ]
    longest_e2e = float(stats["otlp_max_export_step_us"])
    section.verdicts.append(
        Verdict(
            f"no OTLP encoding step holds the GIL over {STEP_BUDGET_US / 1000:.0f} ms",
            max(longest_otlp, longest_e2e) <= STEP_BUDGET_US,
            f"longest step {longest_otlp:.0f} µs in-process, {longest_e2e:.0f} µs under uvicorn",
        )
    )
    return section
