"""What the local mode's two HTTP servers (the push receiver and the page) share."""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = ["LoopbackServer", "url_host"]


class LoopbackServer(ThreadingHTTPServer):
    """A threaded HTTP server that takes bursts of connections and lets clients hang up.

    A failure while serving a connection goes to ``report_error`` (the default prints its
    traceback to stderr), except a client hanging up mid-connection, which is ordinary: a
    reset while its keep-alive connection waits for the next request, a pipe broken under a
    reply, a browser tab closed.
    """

    daemon_threads = True
    # socketserver's default backlog of 5 drops SYNs when connections arrive in a burst, and
    # each dropped one costs its client a second or more of retransmission.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        self.report_error(request, client_address)

    def report_error(self, request: Any, client_address: Any) -> None:
        """Called in the ``except`` block of a failure other than a hang-up."""
        super().handle_error(request, client_address)


def url_host(host: str) -> str:
    """``host`` as a URL's host part: an IPv6 address bracketed (``::1`` -> ``[::1]``)."""
    return f"[{host}]" if ":" in host else host
