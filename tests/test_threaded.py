"""Threaded WSGI servers: the exact sampler prepared in the main thread, started from a pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from opentelemetry.sdk.trace import TracerProvider

from spanprof import WSGIProfilingMiddleware, current_labels
from spanprof._local._receiver import PushReceiver
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._samplers._signal import Sampler, SamplerUnavailable

from .conftest import require
from .e2e.markers import MARKERS
from .e2e.server import ROOT

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

LINUX = sys.platform.startswith("linux")


def _wait_for_default_handler(timeout: float = 2.0) -> object:
    # A handler released off the main thread is put back by the main thread: give it bytecodes.
    deadline = time.monotonic() + timeout
    while signal.getsignal(signal.SIGPROF) != signal.SIG_DFL and time.monotonic() < deadline:
        time.sleep(0.001)
    return signal.getsignal(signal.SIGPROF)


def _in_thread(target: object, name: str = "pool-1") -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()  # the main thread waits here; the sampler's ticks interrupt the wait
    return errors


def test_a_prepared_sampler_starts_and_stops_from_a_pool_thread() -> None:
    """prepare() in the main thread lets a pool thread arm it; stop() there removes the handler."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    sampler = Sampler(sample_rate=250)
    try:
        sampler.prepare()
        assert sampler.prepared
        assert not sampler.running

        def work() -> None:
            sampler.start()
            assert sampler.running
            # Each tick's handler runs in the main thread once this one hands it the GIL. On a
            # loaded machine the first took up to 0.33 s of this thread's CPU (60 runs with
            # four CPU hogs on two cores): burn until it came, not for a fixed time.
            deadline = time.thread_time() + 5.0
            while sampler.ticks == 0 and time.thread_time() < deadline:
                MARKERS[3](0.01)
            sampler.stop()

        assert _in_thread(work) == []
        assert sampler.stats()["ticks"] > 0
        assert _wait_for_default_handler() == signal.SIG_DFL
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    finally:
        sampler.stop()


def _main_thread_has_pending(signum: int) -> bool:
    # SigPnd of the main thread (its TID is the pid): read from any thread.
    with open(f"/proc/self/task/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("SigPnd:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError("no SigPnd line in /proc/self/task/<pid>/status")


def test_a_stop_off_the_main_thread_is_not_lost_behind_a_queued_tick() -> None:
    """A tick still queued when a pool thread stops the sampler must not swallow its wake-up.

    Since Linux 6.13 the signal of a deleted timer stays pending and is dropped when it would
    be delivered, and a ``pthread_kill`` of the same signal sent meanwhile merges into it: the
    main thread was never told to put the previous handler back.
    """
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    sampler = Sampler(sample_rate=1000)
    sampler.prepare()
    # Blocked in the main thread, the timer's tick stays queued there until the pool stopped.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPROF})
    try:
        queued: list[bool] = []

        def work() -> None:
            sampler.start()
            deadline = time.thread_time() + 5.0
            while not _main_thread_has_pending(signal.SIGPROF) and time.thread_time() < deadline:
                MARKERS[3](0.002)
            queued.append(_main_thread_has_pending(signal.SIGPROF))
            sampler.stop()

        assert _in_thread(work) == []
        assert queued == [True], "the timer's tick never became pending in the main thread"
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGPROF})
    try:
        assert _wait_for_default_handler() == signal.SIG_DFL
        assert not sampler.restore_pending
    finally:
        sampler.stop()
        signal.signal(signal.SIGPROF, signal.SIG_IGN)  # drops whatever is still pending
        signal.signal(signal.SIGPROF, signal.SIG_DFL)


def test_an_unprepared_sampler_still_refuses_a_pool_thread() -> None:
    """Without prepare(), start() in another thread raises, naming the thread and the fix."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    sampler = Sampler()
    errors = _in_thread(sampler.start, name="pool-7")
    assert len(errors) == 1
    assert isinstance(errors[0], SamplerUnavailable)
    assert "pool-7" in str(errors[0])
    assert "no handler was prepared there" in str(errors[0])
    assert signal.getsignal(signal.SIGPROF) == signal.SIG_DFL


def test_a_prepared_handler_that_never_started_is_removed() -> None:
    """stop() of a sampler that was only prepared puts the previous handler back."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    sampler = Sampler()
    sampler.prepare()
    assert signal.getsignal(signal.SIGPROF) != signal.SIG_DFL
    sampler.stop()
    assert signal.getsignal(signal.SIGPROF) == signal.SIG_DFL


def _burn_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    MARKERS[int(environ["PATH_INFO"].rsplit("/", 1)[1])](0.3)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [current_labels()["span_id"].encode()]


def _request(app: WSGIProfilingMiddleware, index: int) -> str:
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": f"/burn/{index}",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
    }
    body = app(environ, lambda status, headers, exc_info=None: lambda data: None)
    try:
        return b"".join(body).decode()
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_the_middleware_prepares_the_handler_and_shutdown_removes_it(
    tracer_provider: TracerProvider,
) -> None:
    """Built in the main thread, the middleware installs the handler; requests on a pool thread
    are sampled exactly; the runtime's shutdown (from a helper thread) removes the handler."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        backend = ExactBackend(
            server_address=receiver.url, application_name="threaded", memory=False
        )
        app = WSGIProfilingMiddleware(_burn_app, profiler=backend, tracer_provider=tracer_provider)
        try:
            installed = signal.getsignal(signal.SIGPROF)
            assert getattr(installed, "__self__", None) is not None, installed
            assert backend.mode == "stopped"  # prepared, not started: nothing samples yet
            span_ids: list[str] = []
            assert _in_thread(lambda: span_ids.extend(_request(app, i) for i in (4, 5))) == []
            assert backend.mode == "exact"
        finally:
            app._runtime.stop()  # as at exit: the flush runs on the runtime's helper thread
        assert _wait_for_default_handler() == signal.SIG_DFL
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
        samples = receiver.samples()
    for index, span_id in zip((4, 5), span_ids, strict=True):
        mine = [s for s in samples if s.has_function(f"burn_request_{index:02d}")]
        assert mine, index
        assert all(s.label_values("span_id") == (span_id,) for s in mine)


_SERVER_SCRIPT = """
import logging, os, selectors, sys, threading
if os.environ.get("WITHOUT_AGENT") == "1":
    sys.modules["pyroscope"] = None  # as where pyroscope-io is not installed (CPython 3.15)
from spanprof import WSGIProfilingMiddleware
from spanprof._profiling._runtime import stop_started
from tests.e2e.markers import MARKERS

logging.basicConfig(level=logging.INFO)

def app(environ, start_response):
    MARKERS[1](0.05)
    start_response("200 OK", [])
    return [b"ok"]

plain = app
if os.environ.get("BUILT_IN_POOL") != "1":
    app = WSGIProfilingMiddleware(plain)  # in the main thread, as a server imports the app
environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "SERVER_NAME": "x", "SERVER_PORT": "80",
           "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http"}
done = threading.Event()
def pool():
    global app
    if os.environ.get("BUILT_IN_POOL") == "1":
        app = WSGIProfilingMiddleware(plain)  # no handler prepared in the main thread
    b"".join(app(environ, lambda *a: None))
    print("mode", app.profiler.mode, flush=True)
    done.set()
threading.Thread(target=pool, name="pool-1").start()
selector = selectors.DefaultSelector()  # the main thread waits like gunicorn's gthread worker
while not done.is_set():
    selector.select(0.05)
stop_started()
"""


def _serve(tmp_path: Path, receiver_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(_SERVER_SCRIPT))
    full_env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}",
        "PYROSCOPE_SERVER_ADDRESS": receiver_url,
        "PYROSCOPE_UPLOAD_INTERVAL": "1",
        **env,
    }
    full_env.pop("SPANPROF_PROFILER", None)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=45,
        env=full_env,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_auto_picks_the_exact_sampler_on_a_threaded_server_without_the_agent(
    tmp_path: Path,
) -> None:
    """With `import pyroscope` failing, auto runs the exact sampler from the pool thread and
    says so, and why, at INFO."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _serve(tmp_path, receiver.url, WITHOUT_AGENT="1")
    assert proc.returncode == 0, proc.stderr
    assert "mode exact" in proc.stdout
    assert "INFO:spanprof:spanprof: profiling with the exact sampler" in proc.stderr
    assert "SPANPROF_PROFILER=auto" in proc.stderr
    assert "requests run on pool threads" in proc.stderr
    assert "pyroscope-io, which auto prefers on threaded servers, is not installed" in proc.stderr
    assert "failed" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_no_profiler_at_all_is_one_clear_warning_and_requests_are_served(tmp_path: Path) -> None:
    """Neither the exact sampler (no handler prepared in the main thread) nor the agent (not
    installed): one warning says both reasons and what would help, with no traceback."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _serve(tmp_path, receiver.url, WITHOUT_AGENT="1", BUILT_IN_POOL="1")
    assert proc.returncode == 0, proc.stderr
    assert "mode stopped" in proc.stdout  # the request was served, unprofiled
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING:spanprof")]
    assert len(warnings) == 1, proc.stderr
    assert "no profiler can run in this process" in warnings[0]
    assert "the exact sampler cannot run here" in warnings[0]
    assert "pyroscope-io, its fallback, is not installed" in warnings[0]
    assert "main thread" in warnings[0]  # what would make the exact sampler run
    assert "leave SPANPROF_PROFILER unset" not in proc.stderr  # the advice that cannot help
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_auto_keeps_pyroscope_io_on_a_threaded_server_and_says_why(tmp_path: Path) -> None:
    """With the agent installed, auto runs pyroscope-io for pool-thread requests, at INFO."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _serve(tmp_path, receiver.url)
    assert proc.returncode == 0, proc.stderr
    assert "mode pyroscope" in proc.stdout
    assert "INFO:spanprof:spanprof: profiling with pyroscope-io and the label engine" in (
        proc.stderr
    )
    assert "requests run on pool threads (a threaded server), where auto prefers" in proc.stderr
    assert "SPANPROF_PROFILER=exact" in proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_auto_samples_a_threaded_server_exactly_when_the_wall_clock_is_asked_for(
    tmp_path: Path,
) -> None:
    """SPANPROF_PROFILE_CLOCK=wall: only the exact sampler sends wall profiles, so auto does not
    prefer pyroscope-io on a threaded server (as with OTLP); it used to run the agent, which
    sent CPU profiles, with no word of the wall clock asked for."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _serve(tmp_path, receiver.url, SPANPROF_PROFILE_CLOCK="wall")
    assert proc.returncode == 0, proc.stderr
    assert "mode exact" in proc.stdout
    assert "INFO:spanprof:spanprof: profiling with the exact sampler" in proc.stderr
    assert ", wall clock" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_auto_off_the_main_thread_without_a_prepared_handler_says_what_would_make_it_exact(
    tmp_path: Path,
) -> None:
    """Started from a pool thread with no handler prepared in the main thread, auto runs
    pyroscope-io because the exact sampler cannot run, and says what would let it: not the
    threaded-server preference, whose SPANPROF_PROFILER=exact could not run either."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        proc = _serve(tmp_path, receiver.url, BUILT_IN_POOL="1")
    assert proc.returncode == 0, proc.stderr
    assert "mode pyroscope" in proc.stdout
    assert "INFO:spanprof:spanprof: profiling with pyroscope-io and the label engine" in (
        proc.stderr
    )
    assert "the exact sampler cannot run here" in proc.stderr
    assert "build the WSGI middleware in the main thread" in proc.stderr
    assert "auto prefers pyroscope-io" not in proc.stderr
    assert "SPANPROF_PROFILER=exact" not in proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


_FULL_WAKEUP_FD_SCRIPT = """
import os, signal
from spanprof._profiling._samplers._signal import Sampler
from tests.e2e.markers import MARKERS

# As gunicorn's gthread and gevent workers do: a non-blocking pipe as the wakeup fd, never read.
# Filled up front: as after 65,536 ticks (about 11 minutes of CPU at 100 Hz).
read_end, write_end = os.pipe()
os.set_blocking(write_end, False)
signal.set_wakeup_fd(write_end)
try:
    while True:
        os.write(write_end, b"x" * 4096)
except BlockingIOError:
    pass
sampler = Sampler(sample_rate=250)
sampler.start()
MARKERS[2](0.3)
sampler.stop()
print("ticks", sampler.stats()["ticks"], "fd", signal.set_wakeup_fd(-1) == write_end, flush=True)
"""


@pytest.mark.timeout(60)
def test_ticks_never_flood_a_wakeup_fd_nobody_reads(tmp_path: Path) -> None:
    """A full wakeup pipe (gunicorn's workers never read theirs) gets no traceback per tick,
    and the wakeup fd stays the server's."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    script = tmp_path / "wakeup.py"
    script.write_text(textwrap.dedent(_FULL_WAKEUP_FD_SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"},
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ticks = int(proc.stdout.split()[1])
    assert ticks >= 10, proc.stdout
    assert proc.stdout.split()[3] == "True", proc.stdout
    assert "wakeup fd" not in proc.stderr, proc.stderr[:2000]


_WARNING_BACK_SCRIPT = """
import os, signal, sys
from spanprof._profiling._samplers._signal import Sampler
from tests.e2e.markers import MARKERS

read_end, write_end = os.pipe()
os.set_blocking(write_end, False)
signal.set_wakeup_fd(write_end)  # the app's choice: warn about a full buffer (the default)
try:
    while True:
        os.write(write_end, b"x" * 4096)
except BlockingIOError:
    pass
signal.signal(signal.SIGUSR1, lambda signum, frame: None)
sampler = Sampler(sample_rate=250)
sampler.start()
MARKERS[2](0.05)
sampler.stop()
print("stopped", flush=True)
print("--", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGUSR1)
MARKERS[2](0.01)  # the warning is reported once Python code runs again
print("fd", signal.set_wakeup_fd(-1) == write_end, flush=True)
"""


@pytest.mark.timeout(60)
def test_stop_gives_the_app_its_wakeup_fd_warning_back(tmp_path: Path) -> None:
    """The sampler silences the wakeup fd's full-buffer warning while it ticks; once stopped,
    a signal on the app's full pipe is reported again, as the app chose."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    script = tmp_path / "warning_back.py"
    script.write_text(textwrap.dedent(_WARNING_BACK_SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"},
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["stopped", "fd", "True"], proc.stdout
    while_sampling, after_stop = proc.stderr.split("--\n")
    assert "wakeup fd" not in while_sampling, while_sampling[:2000]
    # "when trying to write" before 3.14, "while trying to write" from it.
    assert "trying to write to the signal wakeup fd" in after_stop, after_stop[:2000]
