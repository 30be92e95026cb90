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
PROFILERS = {"default (auto)": {}, "pyroscope-io + engine": {"SPANPROF_PROFILER": "pyroscope"}}


@dataclass(frozen=True)
class Outcome:
    """One server run's attribution and which profiler actually ran."""

    model: str
    profiler: str
    step: str
    ran: str
    attribution: Attribution
    seconds: float


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
    return Outcome(
        model,
        profiler,
        step,
        ran,
        attribute(samples, expected),  # type: ignore[arg-type]
        time.perf_counter() - started,
    )


def _row(outcome: Outcome) -> list[str]:
    a = outcome.attribution
    total = a.request_total
    return [
        outcome.model,
        outcome.profiler,
        outcome.ran,
        outcome.step,
        f"{total / TICK:.0f}",
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
        ]
    section.body += [
        str(__doc__).strip().split("\n\n", 1)[0].replace("\n", " "),
        "*ran*: what the start-up line said. Shares are of the CPU samples in request markers "
        "(10 ms ticks); *exact*: the request's own `span_id`, `trace_id` and `span_name` and "
        "nothing else.",
        markdown_table(
            [
                "server model",
                "SPANPROF_PROFILER",
                "ran",
                "CPU step",
                "request ticks",
                "exact",
                "wrong",
                "unlabelled",
                "background labelled",
            ],
            [_row(outcome) for outcome in outcomes],
        ),
        "Threaded workers serve each request on a pool thread, where the exact sampler cannot "
        "run its handler: the default falls back to pyroscope-io there (the same numbers as "
        "forcing it), whose per-thread tags are right because a request owns its thread; only "
        "labels of work a request hands to another thread can lag.",
    ]
    for outcome in outcomes:
        if outcome.profiler.startswith("default") and outcome.ran == "exact sampler":
            a = outcome.attribution
            section.verdicts.append(
                Verdict(
                    f"default profiler, {outcome.model}, {outcome.step} steps (≥ 99% exact)",
                    a.exact_share >= 0.99 and a.double_span == 0,
                    a.summary(),
                )
            )
    return section
