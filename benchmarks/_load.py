"""A raw-socket HTTP client that keeps servers busy: ``GET /health`` on keep-alive connections.

Each server gets ``connections`` connections with one request in flight each, so it is busy for
the whole load and what its threads do meanwhile (drains, uploads) is paid out of load, as on a
server that is never idle. The client costs a small fraction of what a server spends per
request, so the servers stay the bottleneck.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time

__all__ = ["load"]

_HEALTH = b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n"

#: Seconds a counted load waits for any response before it gives up.
_STALL_SECONDS = 120.0


def load(
    ports: list[int],
    *,
    seconds: float | None = None,
    count: int | None = None,
    connections: int = 8,
) -> dict[int, int]:
    """Responses each server completed, per port: all loaded at once for ``seconds``, or (one
    server) until it has answered ``count`` requests."""
    if (seconds is None) == (count is None):
        raise ValueError("load: give seconds or count, not both")
    if count is not None and len(ports) != 1:
        raise ValueError("load: a counted load drives one server")
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    owners: dict[socket.socket, int] = {}
    done = dict.fromkeys(ports, 0)
    sent = 0
    try:
        for port in ports:
            for _ in range(connections if count is None else min(connections, count)):
                conn = socket.create_connection(("127.0.0.1", port))
                buffers[conn] = bytearray()
                owners[conn] = port
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_HEALTH)
                sent += 1
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ, data=conn)
        deadline = time.monotonic() + seconds if seconds is not None else None
        wanted = count if count is not None else 0
        while time.monotonic() < deadline if deadline is not None else sum(done.values()) < wanted:
            events = selector.select(0.1 if deadline is not None else _STALL_SECONDS)
            if not events and deadline is None:
                raise TimeoutError(
                    f"no response in {_STALL_SECONDS:g} s ({sum(done.values())} of {count})"
                )
            for key, _events in events:
                conn = key.data
                buffer = buffers[conn]
                chunk = conn.recv(65536)
                if not chunk:
                    raise ConnectionError(
                        f"the server closed a connection ({sum(done.values())} answered)"
                    )
                buffer += chunk
                while (end := buffer.find(b"\r\n\r\n")) >= 0:
                    head = bytes(buffer[:end]).lower()
                    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    if len(buffer) < end + 4 + length:
                        break
                    del buffer[: end + 4 + length]
                    done[owners[conn]] += 1
                    if deadline is not None or sent < wanted:
                        conn.setblocking(True)
                        conn.sendall(_HEALTH)
                        conn.setblocking(False)
                        sent += 1
    finally:
        for conn in buffers:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            conn.close()
        selector.close()
    return done
