"""Attribution accuracy of spanprof vs pyroscope-otel under 16 concurrent requests.

Both apps run the same handler (``tests/e2e``'s marker burns across awaits, a child task and
Starlette's thread pool, plus an unlabelled background task) under a real uvicorn with the
real pyroscope-io agent pushing to a ``PushReceiver``. Each request burns CPU in its own marker
function, so a sample's stack says whose it is; its labels say whose the profiler thought it
was.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.analysis import Attribution, attribute
from tests.e2e.client import fire
from tests.e2e.markers import marker_index
from tests.e2e.server import free_port, serve, uvicorn_argv

from spanprof._local._receiver import PushReceiver, ReceivedSample

from ._report import Section, Verdict, markdown_table

__all__ = ["CONCURRENCY", "run"]

CONCURRENCY = 16
# Batches of CONCURRENCY requests, one after the other, pooled: one batch is ~250 ticks, where a
# share's sampling noise alone spans about 2 points between runs.
ROUNDS = 3

APPS = {
    "spanprof": "tests.e2e.asgi_app:app",
    "pyroscope-otel": "benchmarks.apps.pyroscope_otel_app:app",
}
# Per request: handler steps + child steps of STEP seconds each, then 40 ms in the thread pool;
# the 2 ms case keeps the CPU per request the same (160 ms) with ten times the awaits.
STEPS: dict[str, dict[str, str]] = {
    "20 ms": {},
    "2 ms": {"E2E_STEP_SECONDS": "0.002", "E2E_HANDLER_STEPS": "40", "E2E_CHILD_STEPS": "20"},
}
TICK = 10_000_000  # ns of CPU per sample at 100 Hz


@dataclass(frozen=True)
class Case:
    """One server run: which instrumentation, loop and step length."""

    app: str
    loop: str
    step: str


@dataclass(frozen=True)
class Outcome:
    """A case's attribution, plus what the Pyroscope server would credit."""

    case: Case
    attribution: Attribution
    double_in_requests: int
    server_credited: int
    seconds: float


def _server_view(
    samples: Sequence[ReceivedSample], expected: Mapping[int, Mapping[str, str]]
) -> tuple[int, int]:
    """Request-sample weight carrying several span ids, and weight the server credits right.

    The Pyroscope server keeps one ``span_id`` per sample, the lexicographically smallest of
    the valid ones, so a double-labelled sample still counts for one of its spans.
    """
    double = credited = 0
    for sample in samples:
        names = [frame.function for frame in sample.stack]
        if "background_burn" in names:
            continue
        index = marker_index(names)
        if index is None or index not in expected:
            continue
        spans = sample.label_values("span_id")
        if len(spans) > 1:
            double += sample.value
        valid = sorted(s for s in spans if len(s) == 16)
        if valid and valid[0] == expected[index]["span_id"]:
            credited += sample.value
    return double, credited


def _run_case(case: Case, workdir: Path) -> Outcome:
    started = time.perf_counter()
    port = free_port()
    log = workdir / f"{case.app}-{case.loop}-{case.step.replace(' ', '')}.log"
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "bench-accuracy",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
            **STEPS[case.step],
        }
        with serve(
            uvicorn_argv(APPS[case.app], port, case.loop),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=log,
        ):
            expected = asyncio.run(
                fire(f"http://127.0.0.1:{port}", concurrency=CONCURRENCY, rounds=ROUNDS)
            )
        samples = receiver.samples()
        if receiver.errors:
            raise RuntimeError(f"{case}: the receiver rejected uploads: {receiver.errors[:3]}")
    text = log.read_text()
    if "Traceback" in text:
        raise RuntimeError(f"{case}: the server logged an error:\n{text[-3000:]}")
    if len({ids["span_id"] for ids in expected.values()}) != ROUNDS * CONCURRENCY:
        raise RuntimeError(f"{case}: requests did not get distinct span ids: {expected!r}")
    double, credited = _server_view(samples, expected)
    return Outcome(
        case, attribute(samples, expected), double, credited, time.perf_counter() - started
    )


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "—"


def _row(outcome: Outcome) -> list[str]:
    a = outcome.attribution
    total = a.request_total
    return [
        outcome.case.app,
        outcome.case.loop,
        outcome.case.step,
        f"{total / TICK:.0f}",
        _share(a.exact, total),
        _share(a.wrong, total),
        _share(a.unlabelled, total),
        _share(outcome.double_in_requests, total),
        _share(outcome.server_credited, total),
        f"{a.background_labelled / TICK:.0f} of {a.background_total / TICK:.0f} "
        f"({_share(a.background_labelled, a.background_total)})",
    ]


def run(quick: bool) -> Section:
    """Serve each case once with uvicorn and the real agent; tabulate the attribution."""
    loops = ["asyncio"] if quick else ["asyncio", "uvloop"]
    steps = ["20 ms"] if quick else list(STEPS)
    # Alternate the apps case by case, so machine load hits both alike.
    cases = [Case(app, loop, step) for step in steps for loop in loops for app in APPS]
    section = Section("accuracy", f"Attribution accuracy under {CONCURRENCY} concurrent requests")
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = [_run_case(case, Path(tmp)) for case in cases]
    section.body += [
        f"uvicorn serving {ROUNDS} batches of {CONCURRENCY} concurrent `GET /burn/{{i}}` "
        "requests, pooled (one batch is about 250 ticks, where 5 ticks move a share by 2 "
        "points); each request burns CPU in its own marker function: handler steps and "
        "child-task steps separated by `await asyncio.sleep(0)`, then 40 ms in "
        "`run_in_threadpool`; 160 ms of CPU per request in both step sizes (20 ms: 4 + 2 "
        "steps; 2 ms: 40 + 20 steps). An unlabelled background task burns 5 ms every 10 ms. "
        "The real pyroscope-io agent (100 Hz, 1 s uploads) pushes to a `PushReceiver`; every "
        "sample in a marker is classified by its labels. **spanprof**: "
        "`tests/e2e/asgi_app.py` (`ProfilingMiddleware`, profiler from the environment). "
        "**pyroscope-otel**: `benchmarks/apps/pyroscope_otel_app.py` (`pyroscope.configure` +"
        " `PyroscopeSpanProcessor` + OTel ASGI middleware), which tags the event loop's OS "
        "thread at each server span's start and untags it at its end, so every request in "
        "flight lands on every sample of the loop thread, and thread-pool work is unlabelled.",
        "Shares are of the CPU samples taken in request markers (pooled over all requests; "
        "a tick is one 10 ms sample). *exact*: exactly one `span_id` and one `trace_id`, both "
        "the request's own. *wrong*: anything else with a span label, including samples "
        "carrying several span ids. *double-labelled*: samples with more than one `span_id`. "
        "*server credits own*: the Pyroscope server keeps only the smallest valid `span_id` of "
        "a sample, so this is the share a span's profile in Grafana would really contain. "
        "*background*: ticks of the unlabelled background task that carried a span label.",
        markdown_table(
            [
                "instrumentation",
                "loop",
                "CPU step",
                "request ticks",
                "exact",
                "wrong",
                "unlabelled",
                "double-labelled",
                "server credits own",
                "background labelled",
            ],
            [_row(outcome) for outcome in outcomes],
        ),
        "Fewer exact samples at 2 ms steps is expected for any engine that pushes thread tags: "
        "pyroscope-io reads the stacks first and the thread tags ~0.2 ms later, so a sample "
        "taken just before a label switch can carry the next step's labels; the error grows as "
        "that lag divided by the step length.",
    ]
    for outcome in outcomes:
        if outcome.case.app != "spanprof" or outcome.case.step != "20 ms":
            continue
        a = outcome.attribution
        section.verdicts.append(
            Verdict(
                f"spanprof attribution, {outcome.case.loop}, 20 ms steps (the issue's "
                "end-to-end criterion: ≥ 97% exact, no double span ids, background unlabelled)",
                a.exact_share >= 0.97 and a.double_span == 0 and a.background_labelled == 0,
                a.summary(),
            )
        )
    return section
