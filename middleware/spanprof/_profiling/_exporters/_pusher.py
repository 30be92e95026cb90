"""Uploads to Pyroscope exactly the way pyroscope-io does, from a background thread.

One ``POST {server}/push.v1.PusherService/Push`` per upload interval: a gzip'd ``PushRequest``
(``Content-Type: application/proto``, ``Content-Encoding: gzip``) holding one series labelled
``__name__=process_cpu``, ``service_name``, the static tags and ``process.runtime.*``, whose
pprof samples carry the per-sample labels (``span_id``, ``trace_id``, ``span_name``...). Basic
auth and the tenant header (``X-Scope-OrgID``) as the agent sends them.

The window is encoded (``_encoders._window``) in slices of at most ~0.5 ms of CPU each,
releasing the GIL in between, so the application's threads never wait long for the exporter;
each small pprof profile becomes one ``RawSample`` of the push. A failed upload is retried
with exponential back-off; while the server is away at most ``max_pending`` windows wait,
and the oldest is dropped (and counted) to make room.

Nothing the server does can hold the thread: each upload (connect, send, answer) has one
overall deadline, however slowly the server trickles its answer, and at most
``max_response_bytes`` of an answer are read. No exception ends the thread either: an
unexpected one is logged once and counted (``stats()['upload_errors']``), and the next interval's
window is taken as usual, so the sampler's window never grows past one interval.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable
from typing import Protocol
from urllib.parse import urlsplit

from ..._config import parse_header_value, parse_server_address, redact_url, split_credentials
from ..._logging import log_once
from ..._version import __version__
from .._encoders._pprof import SharedLocations
from .._encoders._push import PUSH_CONTENT_TYPE, PUSH_PATH, encode_push_request
from .._encoders._window import CPU_TIME, WindowEncoder
from .._window import Window
from ._http import Poster, gzipped
from ._interval import IntervalExporter, Outcome, Wording

__all__ = ["Pusher", "StepEncoder"]

#: Statuses that mean "these credentials (or this tenant) are not accepted".
_AUTH_STATUSES = (401, 403)


class StepEncoder(Protocol):
    """Encodes one window into pprof ``profiles``, a bounded slice of work per ``step()``."""

    profiles: list[bytes]

    @property
    def done(self) -> bool: ...

    def step(self) -> bool: ...


class Pusher(IntervalExporter):
    """Encodes windows and pushes them to a Pyroscope server from a daemon thread.

    Arguments:
        server_address: the Pyroscope URL (the push path is appended to it).
        labels: the series labels (see ``series_labels``).
        period_ns: the sampling period written into the profiles.
        value_type: what the default encoder's values count (``CPU_TIME``, or ``WALL_TIME``
            for a wall-clock sampler's); its profile name goes in ``labels``.
        upload_interval: seconds between uploads.
        tenant_id: sent as ``X-Scope-OrgID`` when set.
        basic_auth_username, basic_auth_password: basic auth, when either is set (else the
            user info of ``server_address``, if any).
        timeout: deadline of one upload, seconds: connecting, sending and reading the answer.
        max_response_bytes: at most this much of an answer is read (the rest is discarded
            with the connection).
        max_pending: windows kept while the server is away; the oldest is dropped beyond that.
        backoff_initial, backoff_max: seconds before the first retry, and the cap of the
            doubling back-off.
        flush_timeout: how long ``stop()`` may spend on the last window and pending retries.
        encoder: makes the encoder of a window (default: CPU profiles, ``WindowEncoder``); the
            memory profiles' pusher passes ``MemoryEncoder``.
    """

    thread_name = "spanprof-exact-pusher"
    wording = Wording(
        key="exact-push",
        window="a profile window",
        windows="profile windows",
        post="a profile upload",
        sending="pushing profiles",
        sender="uploader",
        peer="server",
        dropped_key="dropped",
    )

    def __init__(
        self,
        *,
        server_address: str,
        labels: Iterable[tuple[str, str]],
        period_ns: int,
        value_type: tuple[str, str] = CPU_TIME,
        upload_interval: float = 10.0,
        tenant_id: str = "",
        basic_auth_username: str = "",
        basic_auth_password: str = "",
        timeout: float = 10.0,
        max_response_bytes: int = 64 * 1024,
        max_pending: int = 6,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        flush_timeout: float = 5.0,
        encoder: Callable[[Window], StepEncoder] | None = None,
    ) -> None:
        # The same checks as the settings': nothing here may fail later, in the upload thread.
        address, url_user, url_password = split_credentials(
            parse_server_address("server_address", server_address)
        )
        if not (basic_auth_username or basic_auth_password):
            basic_auth_username, basic_auth_password = url_user, url_password
        parse_header_value("tenant_id", tenant_id)
        parts = urlsplit(address)
        self.url = redact_url(address) + PUSH_PATH
        self.labels = list(labels)
        self.period_ns = period_ns
        self.value_type = value_type
        self.timeout = timeout
        self._encoder = encoder
        # A stack's location ids stay encoded from one window to the next.
        self._locations = SharedLocations()
        self._headers = {
            "Content-Type": PUSH_CONTENT_TYPE,
            "Content-Encoding": "gzip",
            "User-Agent": f"spanprof/{__version__}",
        }
        if basic_auth_username or basic_auth_password:
            token = f"{basic_auth_username}:{basic_auth_password}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(token).decode("ascii")
        if tenant_id:
            self._headers["X-Scope-OrgID"] = tenant_id
        self._poster = Poster(
            https=parts.scheme == "https",
            host=parts.hostname or "",
            port=parts.port,
            path=parts.path.rstrip("/") + PUSH_PATH,
            headers=self._headers,
            max_response_bytes=max_response_bytes,
        )
        self._init_interval(
            upload_interval=upload_interval,
            timeout=timeout,
            flush_timeout=flush_timeout,
            max_pending=max_pending,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )

    def stats(self) -> dict[str, float]:
        """Upload counters and the longest single export step (CPU and wall microseconds)."""
        return {
            "uploads": self.uploads,
            "failures": self.failures,
            "retries": self.retries,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "upload_errors": self.errors,
            "pending": len(self._queue),
            "bytes_sent": self.bytes_sent,
            **self._steps.stats(""),
        }

    # --- the upload thread ----------------------------------------------------------------------

    def _encode(self, window: Window) -> bytes:
        encoder: StepEncoder = (
            WindowEncoder(
                window,
                period_ns=self.period_ns,
                value_type=self.value_type,
                locations=self._locations,
            )
            if self._encoder is None
            else self._encoder(window)
        )
        while not encoder.done:
            self._steps.run(encoder.step)
        request: list[bytes] = []
        self._steps.run(
            lambda: request.append(encode_push_request([(self.labels, encoder.profiles)]))
        )
        return gzipped(request[0])

    def _rejected(self, detail: str) -> None:
        if self.last_status not in _AUTH_STATUSES:
            super()._rejected(detail)
            return
        log_once(
            "exact-push-auth",
            f"spanprof: {self.url} refused the profile upload's credentials ({detail}); "
            "profiles are dropped until it accepts them. Check PYROSCOPE_BASIC_AUTH_USER / "
            "PYROSCOPE_BASIC_AUTH_PASSWORD (or user:password@ in PYROSCOPE_SERVER_ADDRESS) "
            "and PYROSCOPE_TENANT_ID (logged once)",
            exc_info=False,
        )

    def _post(self, body: bytes) -> tuple[Outcome, str, float | None]:
        answer = self._post_http(body)
        if isinstance(answer, str):
            return "retry", answer, None
        status = answer.status
        if 200 <= status < 300:
            return "ok", str(status), None
        if status in (408, 429) or status >= 500:
            return "retry", f"HTTP {status}", None
        return "reject", f"HTTP {status}", None
