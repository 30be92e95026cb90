"""Attribution per WSGI server model: the default profiler against pyroscope-io + the engine.

gunicorn (2 workers) serves ``tests/e2e/wsgi_app.py`` as the README's Flask quickstart writes
it (no ``profiler=``, no greenlet call); 16 concurrent requests each burn CPU in their own
marker function in the view, a thread-pool job, a spawned greenlet (gevent) and the streamed
body, in steps of 0.5 ms or 10 ms that yield in between. ``SPANPROF_PROFILER`` unset is the
default (auto: the exact sampler where it can run, pyroscope-io where it cannot);
``pyroscope`` forces the agent with the label engine. Both push to a ``PushReceiver``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tests.e2e.analysis import Attribution, attribute
from tests.e2e.server import free_port, serve

from spanprof._local._receiver import PushReceiver

from ._report import Section, Verdict, markdown_table

__all__ = ["run"]

CONCURRENCY = 16
TICK = 10_000_000
FLASK = "tests.e2e.wsgi_app:app"

# server model -> gunicorn arguments (and whether greenlets are in play)
MODELS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gunicorn sync": (("-k", "sync"), False),
    "gunicorn gevent --preload": (("-k", "gevent", "--worker-connections", "8", "--preload"), True),
    "gunicorn gthread (4 threads)": (
        ("-k", "gthread", "--threads", "4", "--worker-connections", "8"),
        False,
    ),
}
# Same CPU per request (~0.27 s) at both step lengths.
STEPS = {
    "0.5 ms": {"E2E_STEP_SECONDS": "0.0005", "E2E_REPEAT": "60"},
    "10 ms": {"E2E_STEP_SECONDS": "0.01", "E2E_REPEAT": "3"},
}
PROFILERS = {
    "default (auto)": {},
    "exact": {"SPANPROF_PROFILER": "exact"},
    "pyroscope-io + engine": {"SPANPROF_PROFILER": "pyroscope"},
}
# The exact row only where the default may run something else (threaded workers).
EXACT_ROW_MODELS = ("gunicorn gthread (4 threads)",)


def _marker_ticks(model: str, step: str) -> float:
    """CPU all requests burn in their markers, in ticks: REPEAT steps in 3 + 2 + 2 bursts (view,
    pool job at twice the step, body), + 2 in a greenlet under gevent."""
    env = STEPS[step]
    bursts = 9 if MODELS[model][1] else 7
    seconds = CONCURRENCY * bursts * int(env["E2E_REPEAT"]) * float(env["E2E_STEP_SECONDS"])
    return seconds * 1e9 / TICK


@dataclass(frozen=True)
class Outcome:
    """One server run's attribution and which profiler actually ran."""

    model: str
    profiler: str
    step: str
    ran: str
    attribution: Attribution
    seconds: float
    # Weight of all samples labelled with one of the requests' spans, in markers or not.
    labelled: int = 0

    @property
    def in_marker(self) -> float:
        """Share of the requests' labelled CPU that sits in the marker that burnt it."""
        return self.attribution.exact / self.labelled if self.labelled else 0.0


async def _fire(base: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/burn/{i}") for i in range(CONCURRENCY)))
    for response in responses:
        response.raise_for_status()
    return [json.loads(response.text) for response in responses]


def _run(model: str, profiler: str, step: str, workdir: Path) -> Outcome:
    started = time.perf_counter()
    args, greenlets = MODELS[model]
    port = free_port()
    log = workdir / f"{abs(hash((model, profiler, step)))}.log"
    argv = [
        sys.executable, "-m", "gunicorn", FLASK, "--bind", f"127.0.0.1:{port}", "--workers",
        "2", "--config", "tests/e2e/gunicorn_conf.py", "--graceful-timeout", "10", *args,
    ]  # fmt: skip
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "bench-servers",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
            "E2E_DEFAULTS": "1",
            **({"E2E_GREENLETS": "1"} if greenlets else {}),
            **STEPS[step],
            **PROFILERS[profiler],
        }
        with serve(
            argv,
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=log,
            stop_signal=signal.SIGTERM,
        ):
            reports = asyncio.run(_fire(f"http://127.0.0.1:{port}"))
        samples = receiver.samples()
    text = log.read_text()
    if "Traceback" in text:
        raise RuntimeError(f"{model}, {profiler}, {step}: the server failed:\n{text[-3000:]}")
    ran = "exact sampler" if "profiling with the exact sampler" in text else "pyroscope-io"
    expected = {index: report["labels"] for index, report in enumerate(reports)}
    span_ids = {labels["span_id"] for labels in expected.values()}  # type: ignore[index]
    labelled = sum(
        sample.value
        for sample in samples
        if any(value in span_ids for value in sample.label_values("span_id"))
    )
    return Outcome(
        model,
        profiler,
        step,
        ran,
        attribute(samples, expected, background_function="_background"),  # type: ignore[arg-type]
        time.perf_counter() - started,
        labelled,
    )


def _row(outcome: Outcome) -> list[str]:
    a = outcome.attribution
    total = a.request_total
    return [
        outcome.model,
        outcome.profiler,
        outcome.ran,
        outcome.step,
        f"{total / TICK:.0f} ({total / TICK / _marker_ticks(outcome.model, outcome.step):.0%})",
        f"{outcome.in_marker:.0%}",
        f"{a.exact_share:.1%}",
        f"{a.wrong / total:.1%}" if total else "—",
        f"{a.unlabelled / total:.1%}" if total else "—",
        f"{a.background_labelled / TICK:.0f} of {a.background_total / TICK:.0f}",
    ]


def run(quick: bool) -> Section:
    """Serve each (model, profiler, step) once; tabulate the attribution."""
    steps = ["0.5 ms"] if quick else list(STEPS)
    section = Section("servers", "Attribution per WSGI server model (gunicorn)")
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = [
            _run(model, profiler, step, Path(tmp))
            for step in steps
            for model in MODELS
            for profiler in PROFILERS
            if profiler != "exact" or model in EXACT_ROW_MODELS
        ]
    section.body += [
        str(__doc__).strip().split("\n\n", 1)[0].replace("\n", " "),
        "*ran*: what the start-up line said. *request ticks*: CPU samples (10 ms ticks) whose "
        "stack runs a request's marker function, and in brackets their share of the CPU the "
        f"markers really burn ({_marker_ticks(next(iter(MODELS)), '0.5 ms'):.0f} ticks, "
        "thread CPU clocks); above 100%: the profiler counts time a thread waited for a core "
        "as CPU. *in marker*: the share of all CPU labelled with the requests' spans that "
        "sits in the marker that burnt it (the markers burn nearly all of a request's CPU: "
        "about 100% is right; less is CPU put on other frames). The other shares are of the "
        "samples in request markers; *exact*: the request's own `span_id`, `trace_id` and "
        "`span_name` and nothing else. Background: the burner thread's samples.",
        markdown_table(
            [
                "server model",
                "SPANPROF_PROFILER",
                "ran",
                "CPU step",
                "request ticks",
                "in marker",
                "exact",
                "wrong",
                "unlabelled",
                "background labelled",
            ],
            [_row(outcome) for outcome in outcomes],
        ),
        _threaded_note(outcomes),
    ]
    for outcome in outcomes:
        if outcome.profiler != "pyroscope-io + engine" and outcome.ran == "exact sampler":
            a = outcome.attribution
            who = "default profiler" if outcome.profiler.startswith("default") else "exact"
            section.verdicts.append(
                Verdict(
                    f"{who}, {outcome.model}, {outcome.step} steps (≥ 99% exact)",
                    a.exact_share >= 0.99 and a.double_span == 0,
                    a.summary(),
                )
            )
    return section


def _threaded_note(outcomes: list[Outcome]) -> str:
    """What the threaded rows say, with their numbers."""

    def shares(profiler: str) -> str:
        found = [
            f"{o.in_marker:.0%} at {o.step}"
            for o in outcomes
            if o.model in EXACT_ROW_MODELS and o.profiler == profiler
        ]
        return " and ".join(found) or "—"

    return (
        "Threaded workers serve each request on a pool thread. The WSGI middleware, built in "
        "the worker's main thread when the app is imported, installs the exact sampler's "
        "handler there, and the first request arms its timer: `SPANPROF_PROFILER=exact` runs "
        "it on gthread, every sample with exactly its request's labels. But the handler reads "
        "a pool thread's stack only when that thread hands over the GIL, here mostly at the "
        "yield between two steps, so the CPU a step burnt is booked on the view's frame that "
        f"yielded: {shares('exact')} of the requests' CPU sits in its marker. pyroscope-io "
        "reads stacks from outside, without the GIL ("
        f"{shares('pyroscope-io + engine')} in the marker), and its per-thread tags are right "
        "because a request owns its thread. So the default (auto) keeps pyroscope-io for "
        "threaded workers where it is installed, and runs the exact sampler where it is not "
        "(CPython 3.15), or when asked for (for slo labels, spanprof.cpu_time_s and labelled "
        "memory)."
    )
