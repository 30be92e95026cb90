"""Says, once, when a profile server cannot be reached and nobody else would say it.

pyroscope-io uploads from its Rust agent and logs nothing when the server is away: profiles
are lost in silence. spanprof cannot see those uploads, so it checks what it cheaply can: that
the server accepts a TCP connection, at start, every upload interval, and at shutdown (when
the agent's last window is about to be sent). One connect per interval, from a daemon thread:
requests never wait for it. It catches a wrong address, a server that is down and a network
that drops packets; not a server that accepts connections and refuses the uploads.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

from ..._config import redact_url
from ..._logging import log_once

__all__ = ["ReachabilityWatch", "probe"]


def probe(server_address: str, timeout: float) -> str | None:
    """``None`` if ``server_address``'s host accepts a TCP connection, else why not."""
    parts = urlsplit(server_address)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class ReachabilityWatch:
    """Probes ``server_address`` now, every ``interval`` seconds and at ``stop()``.

    The first failure is logged once (``who`` names what uploads there); after that it stops
    probing. ``stop()`` probes a last time, within ``final_timeout``, unless a failure was
    already logged.
    """

    def __init__(
        self,
        server_address: str,
        *,
        interval: float,
        who: str,
        timeout: float = 2.0,
        final_timeout: float = 1.0,
    ) -> None:
        self.server_address = server_address
        self.interval = interval
        self.who = who
        self.timeout = timeout
        self.final_timeout = final_timeout
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Probe in a daemon thread (now, then every interval)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="spanprof-reachability", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop probing; probe once more (at most ``final_timeout``) if all was well so far."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(self.final_timeout + 0.5)
        if self.failures:
            return
        # In a thread too: a name lookup can outlast any timeout given to the connect.
        final = threading.Thread(
            target=self._check, args=(self.final_timeout, True), name="spanprof-reachability"
        )
        final.daemon = True
        final.start()
        final.join(self.final_timeout + 0.5)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._check(self.timeout, False):
                return
            if self._stop.wait(self.interval):
                return

    def _check(self, timeout: float, final: bool) -> bool:
        error = probe(self.server_address, timeout)
        if error is None:
            return True
        self.failures += 1
        when = (
            "at shutdown: the last profiles cannot be delivered"
            if final
            else "so profiles are being lost (checked with a TCP connect every "
            f"{self.interval:g} s)"
        )
        log_once(
            f"unreachable-{self.server_address}",
            f"spanprof: the profile server {redact_url(self.server_address)} is unreachable "
            f"({error}) {when}; {self.who} does not log this itself (logged once)",
            exc_info=False,
        )
        return False
