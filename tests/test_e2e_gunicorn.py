"""End to end: gunicorn (and uWSGI) workers + WSGIProfilingMiddleware + the real pyroscope-io agent.

Each server runs two pre-forked workers; 16 concurrent requests each burn CPU in their own
marker function (in the view, a thread-pool job, a spawned greenlet under gevent and the
streamed body). The agent in each worker pushes to the test receiver.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from spanprof._local._receiver import PushReceiver, ReceivedSample

from .conftest import require
from .e2e.analysis import attribute
from .e2e.server import free_port, serve

pytestmark = pytest.mark.e2e

CONCURRENCY = 16
FLASK = "tests.e2e.wsgi_app:app"
DJANGO = "tests.e2e.django_wsgi:application"


# Requests that switch every 0.5 ms, 60 steps a burn (~0.27 s of CPU per request).
FAST_STEPS = {"E2E_DEFAULTS": "1", "E2E_STEP_SECONDS": "0.0005", "E2E_REPEAT": "60"}


@dataclass(frozen=True)
class Setup:
    """One way of serving the app."""

    server: str  # gunicorn or uwsgi
    app: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    background: bool = True  # the gunicorn config starts an unlabelled burner per worker
    exact: bool = False  # default configuration: the exact sampler, samples without a pid label
    # Requests on pool threads, sampled exactly: the handler sees a pool thread only when it hands
    # over the GIL (here mostly at the yields between 0.5 ms steps), so most of a request's CPU is
    # booked on the frame that yielded rather than in its marker; labels stay exact.
    threaded: bool = False

    @property
    def trailing_slash(self) -> str:
        return "/" if self.app == DJANGO else ""


SETUPS = {
    # preload_app: the app (and spanprof) is imported in the master before the fork.
    "gthread-preload": Setup(
        "gunicorn", FLASK, ("-k", "gthread", "--threads", "4", "--worker-connections", "8",
                            "--preload")),
    # No preload: gevent patches the worker before it imports the app (and spanprof).
    "gevent": Setup("gunicorn", FLASK, ("-k", "gevent", "--worker-connections", "8"),
                    env={"E2E_GREENLETS": "1"}),
    # Preload: the greenlet hook is installed in the master and must survive the fork.
    "gevent-preload": Setup("gunicorn", FLASK, ("-k", "gevent", "--worker-connections", "8",
                                                "--preload"), env={"E2E_GREENLETS": "1"}),
    "sync-preload-django": Setup("gunicorn", DJANGO, ("-k", "sync", "--preload")),
    "uwsgi-threads": Setup("uwsgi", FLASK, ("--processes", "2", "--threads", "4"),
                           background=False),
    # The README's Flask quickstart and nothing else (default profiler, no greenlet call),
    # requests switching every 0.5 ms: the exact sampler, >= 99%.
    "gevent-preload-defaults": Setup(
        "gunicorn", FLASK, ("-k", "gevent", "--worker-connections", "8", "--preload"),
        env={"E2E_GREENLETS": "1", **FAST_STEPS}, exact=True),
    # Threaded workers with SPANPROF_PROFILER=exact: the middleware, built in the main thread at
    # import, installs the exact sampler's handler there; the first request (on a pool thread)
    # arms the timer. With preload the handler is installed in the master and inherited.
    "gthread-exact": Setup(
        "gunicorn", FLASK, ("-k", "gthread", "--threads", "4", "--worker-connections", "8"),
        env={**FAST_STEPS, "SPANPROF_PROFILER": "exact"}, exact=True, threaded=True),
    "gthread-preload-exact": Setup(
        "gunicorn", FLASK, ("-k", "gthread", "--threads", "4", "--worker-connections", "8",
                            "--preload"),
        env={**FAST_STEPS, "SPANPROF_PROFILER": "exact"}, exact=True, threaded=True),
    # The defaults where pyroscope-io is not installed (CPython 3.15; here `import pyroscope`
    # is made to fail): auto picks the exact sampler for the threaded worker.
    "gthread-defaults-without-agent": Setup(
        "gunicorn", FLASK, ("-k", "gthread", "--threads", "4", "--worker-connections", "8"),
        env={**FAST_STEPS, "E2E_WITHOUT_AGENT": "1"}, exact=True, threaded=True),
    # The sync worker's one thread is busy with requests for the whole run, so the background
    # burner gets the GIL, and a sample, only now and then: 0 to 2 ticks per run. Its CPU is
    # still checked never to carry a request's labels; its presence is not required.
    "sync-defaults": Setup("gunicorn", FLASK, ("-k", "sync",), env=FAST_STEPS, exact=True,
                           background=False),
}  # fmt: skip


def _argv(setup: Setup, port: int) -> list[str]:
    if setup.server == "gunicorn":
        return [
            sys.executable, "-m", "gunicorn", setup.app, "--bind", f"127.0.0.1:{port}",
            "--workers", "2", "--config", "tests/e2e/gunicorn_conf.py", "--graceful-timeout",
            "10", "--log-level", "info", *setup.args,
        ]  # fmt: skip
    uwsgi = shutil.which("uwsgi", path=str(Path(sys.executable).parent))
    require(uwsgi is not None, "uwsgi is not installed (pip install uwsgi)")
    assert uwsgi is not None
    return [
        uwsgi, "--http-socket", f"127.0.0.1:{port}", "--module", setup.app, "--master",
        "--enable-threads", "--die-on-term", "--home", sys.prefix, "--disable-logging",
        *setup.args,
    ]  # fmt: skip


def _sample_pids(samples: list[ReceivedSample]) -> set[str]:
    return {pid for sample in samples for pid in sample.label_values("pid")}


async def _fire(base: str, suffix: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.get(f"/burn/{i}{suffix}") for i in range(CONCURRENCY))
        )
    for response in responses:
        response.raise_for_status()
    return [json.loads(response.text) for response in responses]


@pytest.mark.parametrize(
    "name",
    # The other setups serve the app with an explicit PyroscopeBackend (tests/e2e/wsgi_app.py).
    [pytest.param(n, marks=() if s.exact else pytest.mark.needs_agent) for n, s in SETUPS.items()],
)
def test_workers_profile_their_requests_exactly(name: str, tmp_path: Path) -> None:
    """>= 97% of request CPU carries its own span id, none two; both workers' profiles arrive."""
    setup = SETUPS[name]
    if setup.server == "gunicorn":
        require(shutil.which("gunicorn", path=str(Path(sys.executable).parent)) is not None,
                "gunicorn is not installed")  # fmt: skip
    if "E2E_GREENLETS" in setup.env:
        require(importlib.util.find_spec("gevent") is not None, "gevent is not installed")
    port = free_port()
    log_path = tmp_path / "server.log"
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "e2e-wsgi",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
            # pyroscope-io reports a fork after it started as a DeprecationWarning: show it.
            "PYTHONWARNINGS": "always::DeprecationWarning",
            **setup.env,
        }
        argv = _argv(setup, port)
        with serve(
            argv,
            health_url=f"http://127.0.0.1:{port}/health{setup.trailing_slash}",
            env=env,
            log_path=log_path,
            stop_signal=signal.SIGTERM,
        ) as process:
            master = process.pid
            reports = asyncio.run(_fire(f"http://127.0.0.1:{port}", setup.trailing_slash))
            if not setup.exact:
                # Each worker's agent uploads every second: wait (bounded) for every worker that
                # served to have uploaded before stopping, rather than count on a worker whose
                # requests all fell within its first second flushing at exit (one uWSGI worker's
                # samples never arrived in one CI run on 3.14; not reproduced in 17 reruns).
                served_by = {str(report["pid"]) for report in reports}
                receiver.wait_for(lambda r: served_by <= _sample_pids(r.samples()), timeout=15)
        # Workers flush their last window as they exit (pyroscope's atexit hook).
        samples = receiver.samples()
        assert receiver.errors == []
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "use of fork()" not in log, log

    route = f"GET /burn/<int:index>{setup.trailing_slash}"
    expected = {}
    for index, report in enumerate(reports):
        labels = report["labels"]
        assert isinstance(labels, dict)
        assert set(labels) == {"span_id", "trace_id", "span_name"}
        assert labels["span_name"] == route
        # Thread-pool work, spawned greenlets and the streamed body ran with the same labels.
        for where in ("pool", "greenlet", "body"):
            if report.get(where) is not None:
                assert report[where] == labels, (where, report)
        expected[index] = labels
    if "E2E_GREENLETS" in setup.env:
        assert all(report["greenlet"] is not None for report in reports)
    assert len({labels["span_id"] for labels in expected.values()}) == CONCURRENCY

    worker_pids = {str(report["pid"]) for report in reports}
    assert len(worker_pids) == 2, worker_pids
    if setup.exact:
        assert "profiling with the exact sampler" in log, log
        assert "profiling with pyroscope-io" not in log, log
        if setup.threaded:
            assert "requests run on pool threads" in log, log
        if "E2E_WITHOUT_AGENT" in setup.env:
            assert "pyroscope-io, which auto prefers on threaded servers, is not installed" in log
    else:
        sample_pids = _sample_pids(samples)
        assert worker_pids <= sample_pids, (worker_pids, sample_pids)
        assert str(master) not in sample_pids  # the master never profiled

    # The burner thread's own frame: under the exact sampler a thread seen between bursts is
    # in _background's sleep, not in background_burn.
    result = attribute(samples, expected, background_function="_background")
    print(name, result.summary())
    # ~336 ticks burn in the markers (see benchmarks/bench_servers.py); threaded: ~30% land there.
    assert result.request_total >= (50 if setup.threaded else 100) * 10_000_000, result.summary()
    assert len(result.per_request) == CONCURRENCY, result.summary()
    assert result.exact_share >= (0.99 if setup.exact else 0.97), result.summary()
    assert result.double_span == 0, result.summary()
    if setup.background:
        assert result.background_total > 0, result.summary()
    if setup.exact:
        assert result.background_labelled == 0, result.summary()
    else:
        # pyroscope-io reads a thread's stack and its labels at two instants, so a switch
        # into the burner between the two books one tick of it with the request it left
        # (1 of 22 background ticks seen on 3.14): the same race the 97% bar allows for.
        tick = 10_000_000
        assert result.background_labelled <= max(tick, 0.03 * result.background_total), (
            result.summary()
        )
