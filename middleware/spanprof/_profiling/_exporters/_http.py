"""One HTTP ``POST`` at a time to one URL, each under one deadline, its answer read bounded.

Both exporters' threads post through ``Poster``, and nothing an endpoint does can hold one:
- http.client's timeout applies to each socket operation, so a server that answers one byte
  every few seconds never trips it. These connections give every operation only what is
  left of the post's deadline: sendall's timeout covers the whole send, and each read gets
  the remainder.
- At most ``max_response_bytes`` of an answer are read. A longer one is cut, and the
  connection goes with it.
- The connect waits in slices too, and so does the TLS handshake: a black-holed endpoint (its
  SYNs dropped) holds a post no longer than its deadline, which ``cut()`` can move closer.
- ``cut(deadline)`` moves the deadline of a post in flight closer (``stop()`` does).
"""

from __future__ import annotations

import errno
import gzip
import http.client
import io
import os
import selectors
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["GZIP_LEVEL", "Answer", "Poster", "gzipped"]

# Socket waits are cut in slices this long, so that a deadline moved closer (by cut()) is seen.
_SLICE = 0.25

#: The gzip level of the bodies the exporters post: the fastest, as Go's runtime/pprof writes its
#: profiles. On a server's real windows level 6 took 5 times as long (memory) and twice as long
#: (CPU) as level 1, for bodies 4-5% smaller.
GZIP_LEVEL = 1


def gzipped(body: bytes) -> bytes:
    """``body`` gzip-compressed at ``GZIP_LEVEL``; zlib releases the GIL while it deflates."""
    return gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)


@dataclass(frozen=True)
class Answer:
    """What the endpoint answered: status, the headers asked for, the body read (bounded)."""

    status: int
    body: bytes
    #: Whether ``body`` is the whole body (``False``: cut at ``max_response_bytes``).
    complete: bool
    headers: dict[str, str]


class Poster:
    """Posts bodies to ``host:port/path`` over one kept-alive connection (used by one thread).

    ``post`` raises ``OSError`` or ``http.client.HTTPException`` when the endpoint cannot be
    reached or does not answer in time (``TimeoutError`` once the deadline passed).
    """

    def __init__(
        self,
        *,
        https: bool,
        host: str,
        port: int | None,
        path: str,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext | None = None,
        max_response_bytes: int = 64 * 1024,
        answer_headers: tuple[str, ...] = (),
    ) -> None:
        self._https = https
        self._host = host
        self._port = port
        self.path = path
        self.headers = headers
        self._ssl = ssl_context
        self.max_response_bytes = max_response_bytes
        self._answer_headers = answer_headers
        self._conn: _DeadlineHTTP | _DeadlineHTTPS | None = None

    def post(self, body: bytes, deadline: float) -> Answer:
        """Post ``body``; the whole post, a stale connection's retry included, ends by
        ``deadline`` (``time.monotonic()`` seconds)."""
        reused = self._conn is not None
        try:
            return self._post_once(body, deadline)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            # A kept-alive connection the server had closed fails on first use: once more,
            # fresh (not after a timeout: that one did not fail for being stale).
            if not reused or isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                raise
        except BaseException:
            # Whatever failed (a header http.client refuses...) left the connection mid-request.
            self.close()
            raise
        try:
            return self._post_once(body, deadline)
        except BaseException:
            self.close()
            raise

    def cut(self, deadline: float) -> None:
        """Let a post in flight (from another thread) run until ``deadline`` at the latest."""
        conn = self._conn
        if conn is not None:
            conn.deadline = min(conn.deadline, deadline)

    def close(self) -> None:
        """Close the kept-alive connection (the next post opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _post_once(self, body: bytes, deadline: float) -> Answer:
        conn = self._connection()
        conn.deadline = deadline
        if conn.sock is None:
            conn.timeout = max(0.001, deadline - time.monotonic())
        conn.request("POST", self.path, body=body, headers=self.headers)
        response = conn.getresponse()
        limit = self.max_response_bytes
        data = response.read(limit + 1)
        complete = len(data) <= limit
        headers = {
            name: value
            for name in self._answer_headers
            if (value := response.getheader(name)) is not None
        }
        if not complete or response.will_close or not response.isclosed():
            # Cut short (or to be closed by the server): the rest is not read, the
            # connection goes.
            self.close()
        return Answer(response.status, data[:limit], complete, headers)

    def _connection(self) -> _DeadlineHTTP | _DeadlineHTTPS:
        if self._conn is None:
            if self._https:
                self._conn = _DeadlineHTTPS(self._host, self._port, context=self._ssl)
            else:
                self._conn = _DeadlineHTTP(self._host, self._port)
        return self._conn


def _remaining(conn: _DeadlineHTTP | _DeadlineHTTPS, doing: str) -> float:
    remaining = conn.deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"the upload's deadline passed while {doing}")
    return min(remaining, _SLICE)


class _DeadlineReader(io.RawIOBase):
    """A socket's reading side whose every read must finish before ``conn.deadline``."""

    def __init__(self, sock: socket.socket, conn: _DeadlineHTTP | _DeadlineHTTPS) -> None:
        super().__init__()
        self._sock = sock
        # Held, never read through: it keeps the socket open (socket.close() waits for its
        # makefile()s) while the response still reads, as http.client expects.
        self._ref = sock.makefile("rb", buffering=0)
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        while True:
            self._sock.settimeout(_remaining(self._conn, "reading the answer"))
            try:
                return self._sock.recv_into(buffer)
            except TimeoutError:
                continue  # one slice passed: check the deadline again

    def close(self) -> None:
        self._ref.close()
        super().close()


class _DeadlineSocket:
    """The connection's socket, as http.client sees it: sends and reads within the deadline."""

    def __init__(self, sock: socket.socket, conn: _DeadlineHTTP | _DeadlineHTTPS) -> None:
        self._sock = sock
        self._conn = conn

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            self._sock.settimeout(_remaining(self._conn, "sending"))
            try:
                sent = self._sock.send(view)
            except TimeoutError:
                continue  # one slice passed: check the deadline again
            view = view[sent:]

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._conn))

    def close(self) -> None:
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


_CONNECTING = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK, errno.EINTR)


def _connect_by_deadline(
    conn: _DeadlineHTTP | _DeadlineHTTPS,
    address: tuple[str, int],
    timeout: object = None,
    source_address: tuple[str, int] | None = None,
) -> socket.socket:
    """``socket.create_connection`` whose wait for each address is cut in slices, checking
    ``conn.deadline`` between them: one connect timeout would be fixed when the connect starts,
    and ``cut()`` could not shorten it (``timeout``, http.client's, is not used)."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _name, peer in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if source_address:
                sock.bind(source_address)
            sock.setblocking(False)
            code = sock.connect_ex(peer)
            if code in _CONNECTING:
                with selectors.DefaultSelector() as selector:
                    selector.register(sock, selectors.EVENT_WRITE)
                    while code in _CONNECTING:
                        if selector.select(_remaining(conn, "connecting")):
                            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            sock.settimeout(_remaining(conn, "connecting"))
            return sock
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):
                raise
            error = exc
    raise error or OSError(f"no address found for {host!r}")


class _DeadlineHTTP(http.client.HTTPConnection):
    deadline = float("inf")

    def connect(self) -> None:
        self._create_connection = lambda *args: _connect_by_deadline(self, *args)
        super().connect()
        self.sock = cast(socket.socket, _DeadlineSocket(self.sock, self))


class _DeadlineHTTPS(http.client.HTTPSConnection):
    deadline = float("inf")

    def connect(self) -> None:
        self._create_connection = lambda *args: _connect_by_deadline(self, *args)
        # TCP only; then the TLS handshake, in slices too (http.client's would run under one
        # timeout, fixed when it starts).
        http.client.HTTPConnection.connect(self)
        sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=self.host, do_handshake_on_connect=False
        )
        self.sock = sock
        while True:
            sock.settimeout(_remaining(self, "in the TLS handshake"))
            try:
                sock.do_handshake()
                break
            except TimeoutError:
                continue  # one slice passed: check the deadline again
        self.sock = cast(socket.socket, _DeadlineSocket(sock, self))
