"""The OTLP exporter survives bad settings and bad endpoints as the Pyroscope pusher does."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spanprof._labels._labelset import LabelSet
from spanprof._profiling._exporters._otlp import OtlpExporter, OtlpSettings
from spanprof._profiling._window import StackTables, Window

from .e2e.faults import faulty_endpoint, read_request
from .otlp_profiles import OtlpProfilesReceiver

PATH = "/v1development/profiles"


def _leaf() -> None:
    pass


def _window() -> Window:
    tables = StackTables()
    code = _leaf.__code__
    sid = tables.stack_of((tables.raw_frame(code, 0, code.co_firstlineno),))
    window = Window(time.time_ns(), tables)
    window.values[(sid, LabelSet({"span_id": "00000000000000aa"}))] = 10_000_000
    window.end_ns = window.start_ns + 1_000_000
    return window


class _Windows:
    """A collect() that counts how often it was called."""

    def __init__(self) -> None:
        self.taken = 0

    def __call__(self) -> Window:
        self.taken += 1
        return _window()


def _exporter(url: str, *, timeout: float = 0.5, **options: Any) -> OtlpExporter:
    defaults: dict[str, Any] = {
        "upload_interval": 0.1,
        "backoff_initial": 0.05,
        "backoff_max": 0.2,
        "flush_timeout": 0.5,
        "resource_attributes": lambda: {"service.name": "svc"},
    }
    return OtlpExporter(OtlpSettings(endpoint=url, timeout=timeout), **{**defaults, **options})


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture(autouse=True)
def _fresh_log_once() -> Iterator[None]:
    from spanprof._logging import reset_log_once

    reset_log_once()
    yield
    reset_log_once()


# --- header values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "why"),
    [("x-team=%E2%82%AC", "Latin-1"), ("x-team=a%00b", "control character")],
)
def test_header_values_http_cannot_send_are_refused_naming_the_variable(raw: str, why: str) -> None:
    """A value http.client would refuse at every export is a ValueError when read."""
    with pytest.raises(ValueError, match=f"OTEL_EXPORTER_OTLP_HEADERS.*{why}"):
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_HEADERS": raw})


def test_settings_built_directly_check_their_header_values_too() -> None:
    """OtlpSettings(headers=...) refuses what from_env refuses: nothing fails in the thread."""
    with pytest.raises(ValueError, match=r"headers.*x-team.*Latin-1"):
        OtlpSettings(endpoint="http://127.0.0.1:4318" + PATH, headers=(("x-team", "€"),))


# --- exceptions ----------------------------------------------------------------------------------


def test_no_exception_ends_the_export_thread(caplog: pytest.LogCaptureFixture) -> None:
    """An export that raises something unexpected is logged once; windows keep being taken."""
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url)
        # Fault injection: a header value http.client refuses (ValueError in putheader), past
        # the configuration's checks.
        exporter._headers["x-team"] = "team-a\n"
        windows = _Windows()
        with caplog.at_level(logging.WARNING, logger="spanprof"):
            exporter.start(windows)
            try:
                assert _wait(lambda: exporter.stats()["otlp_errors"] >= 3, 5), exporter.stats()
                taken = windows.taken
                # Still taking the sampler's window every interval: its memory stays bounded.
                assert _wait(lambda: windows.taken >= taken + 3, 5), windows.taken
                assert exporter._thread is not None
                assert exporter._thread.is_alive()
                assert exporter.stats()["otlp_pending"] <= exporter.max_pending
                # And it exports again once the header is fixed.
                exporter._headers["x-team"] = "team-a"
                assert _wait(lambda: len(receiver.received) >= 1, 5)
            finally:
                exporter.stop()
    assert len(_messages(caplog, "goes on with the next window")) == 1


# --- slow and huge answers -----------------------------------------------------------------------


def test_a_trickling_endpoint_cannot_hold_an_export_past_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An answer trickling a byte every 0.1 s fails the 0.5 s export; the next window is taken."""
    with faulty_endpoint("trickle", trickle_every=0.1) as address:
        exporter = _exporter(address + PATH, upload_interval=0.2)
        windows = _Windows()
        with caplog.at_level(logging.WARNING, logger="spanprof"):
            started = time.monotonic()
            exporter.start(windows)
            try:
                assert _wait(lambda: exporter.stats()["otlp_failures"] >= 2, 6), exporter.stats()
                assert windows.taken >= 2
            finally:
                exporter.stop()
            elapsed = time.monotonic() - started
    # Two exports of at most 0.5 s each, plus intervals and back-off.
    assert elapsed < 5, elapsed
    (failed,) = _messages(caplog, "failed (no answer within 0.5 s")
    assert address in failed


def test_a_huge_answer_is_not_read_whole() -> None:
    """A 200 with a 200 MB body: the exporter reads a few KiB and drops the connection."""
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
        url = f"http://127.0.0.1:{listener.getsockname()[1]}{PATH}"
        exporter = _exporter(url, timeout=10.0, upload_interval=3600)
        exporter.start(_Windows())
        exporter.stop()
        thread.join(10)
    finally:
        listener.close()
    assert not thread.is_alive()
    assert exporter.stats()["otlp_uploads"] == 1
    # Whatever loopback's socket buffers took before the connection was closed; not 200 MB.
    assert sent[0] < 32 * 1024 * 1024, sent[0]


def test_stop_cuts_an_export_in_flight_to_the_flush_budget() -> None:
    """stop() during an export to an endpoint that never answers returns within flush_timeout."""
    with faulty_endpoint("hang") as address:
        exporter = _exporter(address + PATH, timeout=30.0, flush_timeout=0.5)
        exporter.start(_Windows())
        time.sleep(0.4)  # the first export is waiting for its answer now
        started = time.monotonic()
        thread = exporter._thread
        exporter.stop()
        took = time.monotonic() - started
    assert thread is not None
    assert not thread.is_alive()
    # The export in flight and the flush share the 0.5 s budget (plus one 0.25 s wait slice).
    assert took < 1.2, took
    assert exporter.stats()["otlp_dropped"] >= 1
