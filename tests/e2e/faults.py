"""Pyroscope endpoints that fail in the ways production ones do: down, hanging, or 500s."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .server import free_port

__all__ = ["FAULT_MODES", "faulty_endpoint"]

FAULT_MODES = ("down", "hang", "500")


@contextmanager
def faulty_endpoint(mode: str) -> Iterator[str]:
    """A Pyroscope URL that refuses connections, never answers, or answers 500."""
    if mode == "down":
        yield f"http://127.0.0.1:{free_port()}"
        return
    if mode == "hang":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])  # read nothing, answer nothing
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join()
            for conn in held:
                conn.close()
            listener.close()
        return

    class Fail(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Fail)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
