"""Pyroscope endpoints that fail in the ways production ones do.

Down (connection refused), hanging (accepts, never answers), 500s, trickling (answers one byte
every few seconds, forever) and 401 (refuses the credentials).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .server import free_port

__all__ = ["FAULT_MODES", "faulty_endpoint", "read_request"]

FAULT_MODES = ("down", "hang", "500", "trickle", "401")


def read_request(conn: socket.socket) -> None:
    """Read one HTTP request's head and its Content-Length body (best effort)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip() or 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


@contextmanager
def _trickling(every: float) -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000

    def trickle(conn: socket.socket) -> None:
        with conn:
            try:
                read_request(conn)
                for byte in answer:
                    if stop.wait(every):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


@contextmanager
def faulty_endpoint(mode: str, *, trickle_every: float = 5.0) -> Iterator[str]:
    """A Pyroscope URL that fails as ``mode`` says (one of ``FAULT_MODES``).

    ``trickle``: the answer's bytes come one every ``trickle_every`` seconds.
    """
    if mode == "trickle":
        with _trickling(trickle_every) as address:
            yield address
        return
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

    if mode not in ("500", "401"):
        raise ValueError(f"mode: expected one of {FAULT_MODES}, got {mode!r}")
    status = int(mode)

    class Fail(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(status)
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
