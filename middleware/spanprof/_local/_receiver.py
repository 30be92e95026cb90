"""A local stand-in for the Pyroscope ingest endpoint.

``PushReceiver`` speaks just enough of the Pyroscope server's HTTP surface for
pyroscope-io (and spanprof's own pusher) to upload to it: the Connect unary
``push.v1.PusherService/Push`` RPC, and OTLP profiles over HTTP
(``POST /v1development/profiles``, converted the way Pyroscope ingests them). It decodes
every upload into spanprof's pprof model and keeps it in memory, for tests and for the
embedded local UI.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from .._logging import log_once
from .._profiling._encoders._otlp import OtlpTooLargeError, decode_export_request
from .._profiling._encoders._pprof import InflatedTooLargeError, gunzip_bounded
from .._profiling._encoders._protowire import ProtoDecodeError
from .._profiling._encoders._push import (
    DEFAULT_MAX_INFLATED,
    PUSH_PATH,
    PushSeries,
    PushTooLargeError,
    decode_push_request,
)
from .._profiling._window import Frame
from ._loopback import LoopbackServer

__all__ = ["PushReceiver", "ReceivedPush", "ReceivedSample"]

#: The legacy (pre-v1) Pyroscope ingest path; accepted and ignored.
_INGEST_PATH = "/ingest"
#: OTLP profiles over HTTP (``http/protobuf``).
_OTLP_PATH = "/v1development/profiles"
# No empty Content-Type: agents always send one, and a browser can only send a body without
# a CORS preflight when its type is empty or one of three form/text types.
_PROTO_CONTENT_TYPES = frozenset(
    {"application/proto", "application/protobuf", "application/x-protobuf"}
)
_DEFAULT_MAX_BODY = 64 * 1024 * 1024
# A chunk-size line: hex digits only (no sign, no "0x", no underscores, as int(, 16) allows),
# then optional chunk extensions.
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\r?\n\Z")
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Rejected requests are kept for tests and the page; a flood of them must not grow memory.
_MAX_ERRORS = 1000


@dataclass(frozen=True, slots=True)
class ReceivedPush:
    """One accepted Push call: when it arrived, from whom, and its decoded series."""

    received_at: float
    user_agent: str
    series: tuple[PushSeries, ...]


@dataclass(frozen=True, slots=True)
class ReceivedSample:
    """One pprof sample from a received push, flattened with its series labels."""

    series_labels: tuple[tuple[str, str], ...]
    stack: tuple[Frame, ...]
    value: int
    labels: tuple[tuple[str, str], ...]
    received_at: float
    #: Every value of the sample, one per sample type (``value`` is the first).
    values: tuple[int, ...] = ()

    def label_values(self, key: str) -> tuple[str, ...]:
        """Return every per-sample label value under ``key``, in wire order."""
        return tuple(v for k, v in self.labels if k == key)

    def series_label(self, name: str) -> str | None:
        """Return the first series label value under ``name``, or ``None``."""
        for k, v in self.series_labels:
            if k == name:
                return v
        return None

    def has_function(self, name: str) -> bool:
        """Whether any frame of the stack is function ``name``."""
        return any(f.function == name for f in self.stack)


class _BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _host_name(host: str) -> str:
    """The name part of a ``Host`` header value (``[::1]:80`` -> ``::1``), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _Server(LoopbackServer):
    def __init__(self, address: tuple[str, int], receiver: PushReceiver) -> None:
        self.receiver = receiver
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        # Keep-alive clients (reqwest pools connections) would otherwise leave
        # handler threads blocked in readline() after the server is stopped.
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def report_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr; record it instead.
        self.receiver._record_error(f"internal error: {traceback.format_exc(limit=5)}")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # http.server answers unparsable requests with an HTML page quoting the request line.
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s\n"
    protocol_version = "HTTP/1.1"
    server_version = "spanprof-receiver"
    sys_version = ""
    # Drop idle keep-alive connections eventually instead of holding a thread forever.
    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:
        # Silence per-request access logging to stderr.
        return

    def do_POST(self) -> None:
        if self._refuse_foreign():
            return
        path = urlsplit(self.path).path
        try:
            body = self._read_body(self.server.receiver.max_body_bytes)
        except _BodyError as exc:
            self.server.receiver._reject("body", str(exc))
            code = "resource_exhausted" if exc.status == 413 else "invalid_argument"
            self._connect_error(exc.status, code, str(exc))
            self.close_connection = True
            return
        if path == PUSH_PATH:
            self._push(body)
        elif path == _OTLP_PATH:
            self._otlp(body)
        elif path == _INGEST_PATH:
            self._reply(200, b"", "text/plain")
        else:
            self._reply(404, b"404 page not found\n", "text/plain; charset=utf-8")

    def do_GET(self) -> None:
        if self._refuse_foreign():
            return
        self._reply(404, b"404 page not found\n", "text/plain; charset=utf-8")

    def do_OPTIONS(self) -> None:
        # A CORS preflight: answering it with anything but 2xx makes the browser give up.
        if self._refuse_foreign():
            return
        self._reply(405, b"", "text/plain")
        self.close_connection = True

    def _refuse_foreign(self) -> bool:
        """Answer 403 to what a web page sent, not an agent; ``True`` when refused.

        Any page the developer visits can make the browser send requests to loopback. Agents
        send no ``Origin`` and address the receiver by its own name; a page's requests carry
        an ``Origin``, and a DNS-rebinding page's carry its own host name.
        """
        receiver = self.server.receiver
        origin = self.headers.get("Origin")
        host = self.headers.get("Host")
        if origin is not None:
            kind, reason = (
                "origin",
                f"refused a request with Origin {origin[:100]!r} (agents send none)",
            )
        elif host is not None and _host_name(host) not in receiver.host_names:
            kind, reason = "host", f"refused a request for Host {host[:100]!r}"
        else:
            return False
        receiver._reject(kind, reason)
        # The body is not read: close instead of parsing it as the next request.
        self.close_connection = True
        self._reply(403, b"forbidden\n", "text/plain; charset=utf-8")
        return True

    def _push(self, body: bytes) -> None:
        receiver = self.server.receiver
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type not in _PROTO_CONTENT_TYPES:
            receiver._reject("content-type", f"unsupported Content-Type {content_type[:100]!r}")
            # Connect answers an unknown codec with a bare 415.
            self._reply(415, b"", "text/plain")
            return
        try:
            # One decode at a time: a decoded push is several times its inflated size.
            with receiver._decode_lock:
                series = decode_push_request(
                    body,
                    self.headers.get("Content-Encoding"),
                    max_inflated=receiver.max_inflated_bytes,
                )
        except PushTooLargeError as exc:
            receiver._reject("too-large", f"push too large: {exc}")
            self._connect_error(413, "resource_exhausted", str(exc))
            return
        except ProtoDecodeError as exc:
            receiver._reject("undecodable", f"undecodable push: {exc}")
            self._connect_error(400, "invalid_argument", str(exc))
            return
        receiver._record_push(
            ReceivedPush(time.time(), self.headers.get("User-Agent") or "", tuple(series))
        )
        # An empty serialized PushResponse, as the Pyroscope server (connect-go) answers.
        self._reply(200, b"", "application/proto")

    def _otlp(self, body: bytes) -> None:
        receiver = self.server.receiver
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type not in ("application/x-protobuf", "application/protobuf"):
            receiver._record_error(f"unsupported OTLP Content-Type {content_type!r}")
            self._reply(415, b"", "text/plain")
            return
        encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
        try:
            if encoding == "gzip":
                # Inflated under the same cap as pushes: a small bomb must not cost gigabytes.
                body = gunzip_bounded(body, receiver.max_inflated_bytes)
            elif encoding not in ("", "identity"):
                raise ProtoDecodeError(f"unsupported Content-Encoding {encoding!r}")
            with receiver._decode_lock:
                series = decode_export_request(body)
        except (InflatedTooLargeError, OtlpTooLargeError) as exc:
            receiver._reject("too-large", f"OTLP profiles too large: {exc}")
            self._reply(413, str(exc).encode(), "text/plain; charset=utf-8")
            return
        except ProtoDecodeError as exc:
            receiver._reject("undecodable", f"undecodable OTLP profiles: {exc}")
            self._reply(400, str(exc).encode(), "text/plain; charset=utf-8")
            return
        receiver._record_push(
            ReceivedPush(time.time(), self.headers.get("User-Agent") or "", tuple(series))
        )
        # An empty ExportProfilesServiceResponse: everything accepted.
        self._reply(200, b"", "application/x-protobuf")

    def _read_body(self, limit: int) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked(limit)
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            return b""
        try:
            length = int(raw_length)
        except ValueError:
            raise _BodyError(400, f"invalid Content-Length {raw_length!r}") from None
        if length < 0 or length > limit:
            raise _BodyError(413, f"body of {length} bytes exceeds limit {limit}")
        body = self.rfile.read(length)
        if len(body) != length:
            raise _BodyError(400, "truncated body")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            match = _CHUNK_SIZE.match(line)
            if match is None:
                raise _BodyError(400, "invalid chunked encoding: bad chunk size line")
            size = int(match.group(1), 16)
            if size == 0:
                # The trailer section ends with an empty line; bound it like the chunks.
                for _ in range(64):
                    if self.rfile.readline(1024) in (b"\r\n", b"\n", b""):
                        return b"".join(chunks)
                raise _BodyError(400, "invalid chunked encoding: trailer too long")
            total += size
            if total > limit:
                raise _BodyError(413, f"body exceeds limit {limit}")
            chunk = self.rfile.read(size)
            if len(chunk) != size or self.rfile.readline(8) not in (b"\r\n", b"\n"):
                raise _BodyError(400, "invalid chunked encoding: truncated chunk")
            chunks.append(chunk)

    def _connect_error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"code": code, "message": message}).encode()
        self._reply(status, body, "application/json")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)


class PushReceiver:
    """In-memory Pyroscope push endpoint on ``127.0.0.1`` (ephemeral port by default).

    Use as a context manager, point an agent's ``server_address`` at ``.url``
    and inspect ``series()`` / ``samples()``. Accepted pushes are answered exactly
    like the Pyroscope server does (``200``, empty ``application/proto`` body);
    undecodable ones get a Connect ``invalid_argument`` error (``400``), oversized ones
    ``resource_exhausted`` (``413``), and requests a web page sent (an ``Origin``, or a
    ``Host`` that is not the receiver's own name) ``403``. Each rejection is recorded in
    ``errors`` (the last 1,000) and its kind logged once per process.

    ``max_body_bytes`` bounds the body on the wire, ``max_inflated_bytes`` what a
    gzip-compressed push may inflate to (checked while inflating).

    ``on_push`` is called from the request thread after each accepted push is
    stored; exceptions it raises are recorded in ``errors``, never sent back.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        on_push: Callable[[ReceivedPush], None] | None = None,
        max_body_bytes: int = _DEFAULT_MAX_BODY,
        max_inflated_bytes: int = DEFAULT_MAX_INFLATED,
    ) -> None:
        self._host = host
        self._port = port
        self._on_push = on_push
        self.max_body_bytes = max_body_bytes
        self.max_inflated_bytes = max_inflated_bytes
        #: The ``Host`` names accepted: loopback's and the address it listens on.
        self.host_names = _LOOPBACK_NAMES | {_host_name(host)}
        self._decode_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._pushes: list[ReceivedPush] = []
        self._errors: deque[str] = deque(maxlen=_MAX_ERRORS)
        # Bumped on every state change so wait_for() never misses a notification.
        self._generation = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> PushReceiver:
        """Bind and start serving in a background thread; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("PushReceiver already started")
        server = _Server((self._host, self._port), self)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"spanprof-push-receiver:{server.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close open connections and release the port (idempotent)."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.close_connections()
        server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> PushReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port (only while started)."""
        if self._server is None:
            raise RuntimeError("PushReceiver is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL to use as the agent's ``server_address``, e.g. ``http://127.0.0.1:4040``."""
        return f"http://{self._host}:{self.port}"

    # -- recorded data -----------------------------------------------------

    @property
    def pushes(self) -> int:
        """Number of accepted Push calls since start or the last ``clear()``."""
        with self._cond:
            return len(self._pushes)

    @property
    def errors(self) -> list[str]:
        """Descriptions of rejected requests and internal errors, oldest first."""
        with self._cond:
            return list(self._errors)

    def received_pushes(self) -> list[ReceivedPush]:
        """Every accepted push, oldest first."""
        with self._cond:
            return list(self._pushes)

    def series(self) -> list[PushSeries]:
        """Every received series, in arrival order."""
        with self._cond:
            return [s for p in self._pushes for s in p.series]

    def samples(self, profile_type: str | None = "process_cpu") -> list[ReceivedSample]:
        """Every pprof sample of every received series of ``profile_type``, flattened.

        ``profile_type`` is the series' ``__name__`` (``process_cpu`` by default, ``memory``
        for memory profiles; a series without one counts as CPU); ``None`` takes every series.
        """
        out: list[ReceivedSample] = []
        for push in self.received_pushes():
            for series in push.series:
                name = series.label("__name__") or "process_cpu"
                if profile_type is not None and name != profile_type:
                    continue
                for profile in series.profiles:
                    for s in profile.samples:
                        out.append(
                            ReceivedSample(
                                series_labels=series.labels,
                                stack=s.stack,
                                value=s.values[0] if s.values else 0,
                                labels=s.labels,
                                received_at=push.received_at,
                                values=s.values,
                            )
                        )
        return out

    def clear(self) -> None:
        """Forget all received pushes and errors."""
        with self._cond:
            self._pushes.clear()
            self._errors.clear()
            self._generation += 1
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[PushReceiver], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` is true or ``timeout`` seconds pass; return it.

        The predicate runs without the internal lock held, so it may call any
        accessor; it is re-evaluated after every push, error or ``clear()``.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                generation = self._generation
            if predicate(self):
                return True
            with self._cond:
                while self._generation == generation:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)

    # -- called from request threads ---------------------------------------

    def _record_push(self, push: ReceivedPush) -> None:
        with self._cond:
            self._pushes.append(push)
            self._generation += 1
            self._cond.notify_all()
        if self._on_push is not None:
            try:
                self._on_push(push)
            except Exception as exc:
                self._reject("on_push", f"on_push callback failed: {exc!r}")

    def _reject(self, kind: str, message: str) -> None:
        # Recorded every time (tests and the page read them), logged once per kind: an attack
        # repeats itself thousands of times and must not flood the developer's terminal.
        self._record_error(message)
        log_once(f"receiver:{kind}", f"spanprof receiver: {message}", exc_info=False)

    def _record_error(self, message: str) -> None:
        with self._cond:
            self._errors.append(message)
            self._generation += 1
            self._cond.notify_all()
