"""Both exporters (the Pyroscope pusher, OTLP) survive bad settings and bad endpoints alike.

Issue #13's defects 1 and 8, fixed in the pusher first: no exception ends the thread, no
endpoint holds an upload past its deadline or makes it read a huge answer, and ``stop()``
cuts an upload in flight to the flush budget.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import CodeType
from typing import Any

import pytest

from spanprof._labels._labelset import LabelSet
from spanprof._local._receiver import PushReceiver
from spanprof._profiling._encoders._window import series_labels
from spanprof._profiling._exporters._interval import IntervalExporter
from spanprof._profiling._exporters._otlp import OtlpExporter, OtlpSettings
from spanprof._profiling._exporters._pusher import Pusher
from spanprof._profiling._window import Window

from .e2e.faults import faulty_endpoint, read_request
from .e2e.server import free_port
from .exporting import CountingWindows, log_messages, one_sample_window, wait_until
from .otlp_profiles import OtlpProfilesReceiver

OTLP_PATH = "/v1development/profiles"
# Fast intervals and short budgets: each test's faults show within seconds.
FAST: dict[str, Any] = {
    "upload_interval": 0.1,
    "backoff_initial": 0.05,
    "backoff_max": 0.2,
    "flush_timeout": 0.5,
}


@dataclass(frozen=True)
class Kind:
    """One exporter, and the names it gives the same things."""

    name: str
    make: Callable[..., IntervalExporter]
    #: What a bare server's base URL becomes as this exporter's address (a receiver's own
    #: ``url`` is its address already).
    path: str
    #: stats() keys: failures, uploads, dropped, unexpected errors, pending.
    keys: dict[str, str]
    #: A real receiver, and how many requests it took.
    receiver: Callable[[], AbstractContextManager[Any]]
    received: Callable[[Any], int]

    def stat(self, exporter: IntervalExporter, what: str) -> float:
        return exporter.stats()[self.keys[what]]


def _pusher(url: str, *, timeout: float = 0.5, **options: Any) -> Pusher:
    return Pusher(
        server_address=url,
        labels=series_labels("svc", {}),
        period_ns=10_000_000,
        timeout=timeout,
        **{**FAST, **options},
    )


def _otlp(url: str, *, timeout: float = 0.5, **options: Any) -> OtlpExporter:
    return OtlpExporter(
        OtlpSettings(endpoint=url, timeout=timeout),
        resource_attributes=lambda: {"service.name": "svc"},
        **{**FAST, **options},
    )


KINDS = [
    Kind(
        "pusher",
        _pusher,
        "",
        {
            "failures": "failures",
            "uploads": "uploads",
            "dropped": "dropped",
            "errors": "upload_errors",
            "pending": "pending",
        },
        PushReceiver,
        lambda receiver: receiver.pushes,
    ),
    Kind(
        "otlp",
        _otlp,
        OTLP_PATH,
        {
            "failures": "otlp_failures",
            "uploads": "otlp_uploads",
            "dropped": "otlp_dropped",
            "errors": "otlp_errors",
            "pending": "otlp_pending",
        },
        OtlpProfilesReceiver,
        lambda receiver: len(receiver.received),
    ),
]


@pytest.fixture(params=KINDS, ids=[kind.name for kind in KINDS])
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


pytestmark = pytest.mark.usefixtures("fresh_log_once")


# --- 1. header values and unexpected exceptions --------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "why"),
    [("x-team=%E2%82%AC", "Latin-1"), ("x-team=a%00b", "control character")],
)
def test_otlp_header_values_http_cannot_send_are_refused_naming_the_variable(
    raw: str, why: str
) -> None:
    """A value http.client would refuse at every export is a ValueError when read."""
    with pytest.raises(ValueError, match=f"OTEL_EXPORTER_OTLP_HEADERS.*{why}"):
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_HEADERS": raw})


def test_otlp_settings_built_directly_check_their_header_values_too() -> None:
    """OtlpSettings(headers=...) refuses what from_env refuses: nothing fails in the thread."""
    with pytest.raises(ValueError, match=r"headers.*x-team.*Latin-1"):
        OtlpSettings(endpoint="http://127.0.0.1:4318" + OTLP_PATH, headers=(("x-team", "€"),))


def test_no_exception_ends_the_upload_thread(kind: Kind, caplog: pytest.LogCaptureFixture) -> None:
    """An upload that raises something unexpected is logged once; windows keep being taken."""
    with kind.receiver() as receiver:
        exporter = kind.make(receiver.url)
        # Fault injection: a header value http.client refuses (ValueError in putheader), past
        # the configuration's checks.
        headers = exporter._poster.headers
        headers["X-Scope-OrgID"] = "team-a\n"
        windows = CountingWindows()
        with caplog.at_level(logging.WARNING, logger="spanprof"):
            exporter.start(windows)
            try:
                assert wait_until(lambda: kind.stat(exporter, "errors") >= 3, 5), exporter
                taken = windows.taken
                # Still taking the sampler's window every interval: its memory stays bounded.
                assert wait_until(lambda: windows.taken >= taken + 3, 5), windows.taken
                assert exporter._thread is not None
                assert exporter._thread.is_alive()
                assert kind.stat(exporter, "pending") <= exporter.max_pending
                # What failed so is dropped, not sent again: the same bytes would fail the same way.
                assert kind.stat(exporter, "dropped") >= 3
                # And it uploads again once the header is fixed.
                headers["X-Scope-OrgID"] = "team-a"
                assert wait_until(lambda: kind.received(receiver) >= 1, 5)
            finally:
                exporter.stop()
    assert len(log_messages(caplog, "goes on with the next window")) == 1


# --- names Python decoded with surrogateescape -------------------------------------------------

# A module imported from a directory whose name is not UTF-8 (b"caf\xe9"): Python decodes the
# byte to a lone surrogate in co_filename, which UTF-8 cannot encode.
_LEGACY_CODE = compile("def work():\n    return 1\n", "/srv/caf\udce9/legacy.py", "exec")
_LEGACY_WORK = next(c for c in _LEGACY_CODE.co_consts if isinstance(c, CodeType))


def _window_with_an_undecodable_frame() -> Window:
    window = one_sample_window()
    tables = window.tables
    work = _LEGACY_WORK.replace(co_name="w\udcffrk")
    if sys.version_info >= (3, 11):  # the qualified name is the one reported from 3.11 on
        work = work.replace(co_qualname="w\udcffrk")
    sid = tables.stack_of((tables.raw_frame(work, 0, 2),))
    window.values[(sid, LabelSet())] = 10_000_000
    return window


def test_a_frame_from_a_non_utf8_path_is_sent_with_the_rest_of_its_window(kind: Kind) -> None:
    """A surrogate in a frame's file or function name is spelled out; the window is not dropped."""
    with kind.receiver() as receiver:
        exporter = kind.make(receiver.url, upload_interval=3600)
        exporter.start(_window_with_an_undecodable_frame)
        exporter.stop()
        samples = receiver.samples()
    assert kind.stat(exporter, "errors") == 0
    assert kind.stat(exporter, "dropped") == 0
    frames = {(f.function, f.filename) for s in samples for f in s.stack}
    assert ("w\\xffrk", "/srv/caf\\xe9/legacy.py") in frames, frames
    assert any(s.has_function("_leaf") for s in samples), samples


def test_a_window_retried_for_hours_still_backs_off_without_an_error(kind: Kind) -> None:
    """An idle process (only empty windows) retries its one pending window for as long as the
    endpoint is down: past 1024 attempts (8 hours at the default 30 s back-off) the doubling
    back-off must not overflow, making each retry an unexpected error."""
    exporter = kind.make(
        f"http://127.0.0.1:{free_port()}{kind.path}",
        # 1100 attempts in about a second, not in 9 hours.
        backoff_initial=1e-6,
        backoff_max=1e-6,
    )
    windows = iter([one_sample_window()])
    exporter.start(lambda: next(windows, Window(time.time_ns(), one_sample_window().tables)))
    try:
        assert wait_until(lambda: kind.stat(exporter, "failures") >= 1100, 60), exporter
        assert (kind.stat(exporter, "errors"), kind.stat(exporter, "pending")) == (0, 1)
    finally:
        exporter.stop()


# --- 8. slow and huge answers --------------------------------------------------------------------


def test_a_trickling_server_cannot_hold_an_upload_past_its_deadline(
    kind: Kind, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer trickling a byte every 0.1 s fails the 0.5 s upload; the next window is taken."""
    with faulty_endpoint("trickle", trickle_every=0.1) as address:
        exporter = kind.make(address + kind.path, upload_interval=0.2)
        windows = CountingWindows()
        with caplog.at_level(logging.WARNING, logger="spanprof"):
            started = time.monotonic()
            exporter.start(windows)
            try:
                assert wait_until(lambda: kind.stat(exporter, "failures") >= 2, 6), exporter
                assert windows.taken >= 2
            finally:
                exporter.stop()
            elapsed = time.monotonic() - started
    # Two uploads of at most 0.5 s each, plus intervals and back-off.
    assert elapsed < 5, elapsed
    (failed,) = log_messages(caplog, "failed (no answer within 0.5 s")
    assert address in failed


def test_a_huge_answer_is_not_read_whole(kind: Kind) -> None:
    """A 200 with a 200 MB body: the uploader reads a few KiB and drops the connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    sent = [0]
    size = 200 * 1024 * 1024

    def serve() -> None:
        conn = listener.accept()[0]
        with conn:
            read_request(conn)
            chunk = b"\0" * 65536
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                while sent[0] < size:
                    conn.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}{kind.path}"
        exporter = kind.make(url, timeout=10.0, upload_interval=3600)
        exporter.start(CountingWindows())
        exporter.stop()
        thread.join(10)
    finally:
        listener.close()
    assert not thread.is_alive()
    assert kind.stat(exporter, "uploads") == 1
    # Whatever loopback's socket buffers took before the connection was closed; not 200 MB.
    assert sent[0] < 32 * 1024 * 1024, sent[0]


def _assert_stop_cuts_the_first_upload_to_the_flush_budget(kind: Kind, url: str) -> None:
    """stop() 0.4 s into the first upload to ``url`` (one that never completes) returns within
    the 0.5 s flush budget, its thread gone and the window dropped."""
    exporter = kind.make(url, timeout=30.0, flush_timeout=0.5)
    exporter.start(CountingWindows())
    time.sleep(0.4)  # the first upload is under way now
    started = time.monotonic()
    thread = exporter._thread
    exporter.stop()
    took = time.monotonic() - started
    assert thread is not None
    assert not thread.is_alive()
    # The upload in flight and the flush share the 0.5 s budget (plus one 0.25 s wait slice).
    assert took < 1.2, took
    assert kind.stat(exporter, "dropped") >= 1


def test_stop_cuts_an_upload_in_flight_to_the_flush_budget(kind: Kind) -> None:
    """stop() during an upload to a server that never answers returns within flush_timeout."""
    with faulty_endpoint("hang") as address:
        _assert_stop_cuts_the_first_upload_to_the_flush_budget(kind, address + kind.path)


@pytest.fixture
def black_hole() -> Iterator[str]:
    """The URL of a listener whose accept queue is full: the kernel drops further SYNs, so a
    connect hangs, as to a firewalled host (a DROP rule)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    held: list[socket.socket] = []
    try:
        while True:  # fill the queue until a connect hangs
            conn = socket.socket()
            held.append(conn)
            conn.settimeout(0.2)
            try:
                conn.connect(address)
            except TimeoutError:
                break
        yield f"http://127.0.0.1:{address[1]}"
    finally:
        for conn in held:
            conn.close()
        listener.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_stop_cuts_an_upload_still_connecting_to_the_flush_budget(
    kind: Kind, black_hole: str, scheme: str
) -> None:
    """stop() while an upload's connect hangs (SYNs dropped) returns within flush_timeout, and
    the thread with it: a connect timeout, fixed when the connect starts, would hold them for
    the whole 30 s upload timeout."""
    address = black_hole.replace("http://", f"{scheme}://", 1)
    _assert_stop_cuts_the_first_upload_to_the_flush_budget(kind, address + kind.path)


def test_stop_cuts_an_upload_in_its_tls_handshake_to_the_flush_budget(kind: Kind) -> None:
    """stop() while an https upload waits for a ServerHello that never comes returns within
    flush_timeout: the handshake waits in slices too."""
    with faulty_endpoint("hang") as address:
        url = address.replace("http://", "https://", 1) + kind.path
        _assert_stop_cuts_the_first_upload_to_the_flush_budget(kind, url)
