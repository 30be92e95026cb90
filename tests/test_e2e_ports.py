"""The end-to-end servers' ports: outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket

from .e2e.server import ephemeral_range, free_port


def test_a_servers_port_is_never_one_a_connection_could_take_meanwhile() -> None:
    low, high = ephemeral_range()
    assert 1024 <= low <= high
    ports = {free_port() for _ in range(20)}
    # Spread out, so that two tests' servers rarely pick the same one.
    assert len(ports) >= 18, ports
    for port in ports:
        assert 1024 <= port < low, (port, low)
    port = ports.pop()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        # Taken now: never handed out while a server holds it.
        assert all(free_port() != port for _ in range(50))
