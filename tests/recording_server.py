"""A loopback HTTP server that records every POST (no dependencies beyond the standard library).

The label engine's test matrix imports it too, in virtualenvs without OpenTelemetry's protobufs.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

__all__ = ["PostedRequest", "RecordingServer"]


class PostedRequest(NamedTuple):
    """One POST as it arrived: ``at`` is its ``time.monotonic()``; header names lower-cased."""

    at: float
    path: str
    headers: dict[str, str]
    body: bytes


_Server = TypeVar("_Server", bound="RecordingServer")


class RecordingServer:
    """A threaded HTTP/1.1 server on ``127.0.0.1`` that records every POST in ``requests``.

    Each is answered with ``respond``'s status and an empty body. Use as a context manager.
    """

    def __init__(self) -> None:
        self.requests: list[PostedRequest] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, like real servers: clients that reuse connections are tested as such.
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                request = PostedRequest(time.monotonic(), self.path, headers, body)
                with server._lock:
                    server.requests.append(request)
                status = server.respond(request)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def respond(self, request: PostedRequest) -> int:
        """The status to answer ``request`` with; called in the request's thread."""
        return 200

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self: _Server) -> _Server:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
