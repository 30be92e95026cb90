"""OTLP profiles over gRPC (``OTEL_EXPORTER_OTLP_PROFILES_PROTOCOL=grpc``; needs ``grpcio``).

One unary ``opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export`` call
per window, the already encoded request passed as bytes both ways (no ``protobuf`` needed).
Retries follow OTLP/gRPC: ``CANCELLED``, ``DEADLINE_EXCEEDED``, ``ABORTED``, ``OUT_OF_RANGE``,
``UNAVAILABLE`` and ``DATA_LOSS`` are retried, ``RESOURCE_EXHAUSTED`` only when the server
sends a ``RetryInfo``; a ``RetryInfo``'s delay is honoured whatever the code (throttling is
``UNAVAILABLE`` with one); anything else drops the window.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from .._encoders._protowire import ProtoDecodeError, as_bytes, as_int, as_str, iter_fields

__all__ = ["EXPORT_METHOD", "GrpcSettings", "GrpcTransport", "grpc_available", "retry_info_delay"]

EXPORT_METHOD = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"
_RETRYABLE = frozenset(
    {"CANCELLED", "DEADLINE_EXCEEDED", "ABORTED", "OUT_OF_RANGE", "UNAVAILABLE", "DATA_LOSS"}
)
_RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"
_Outcome = Literal["ok", "retry", "reject"]


def grpc_available() -> bool:
    """Whether ``grpcio`` can be imported."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        return False
    return True


def retry_info_delay(status_details: bytes) -> float | None:
    """The ``RetryInfo.retry_delay`` (seconds) in a ``google.rpc.Status``, or ``None``."""
    try:
        for field, _w, value in iter_fields(status_details):
            if field != 3:  # details: repeated google.protobuf.Any
                continue
            type_url, payload = "", b""
            for f, _w2, v in iter_fields(as_bytes(value)):
                if f == 1:
                    type_url = as_str(v)
                elif f == 2:
                    payload = as_bytes(v)
            if type_url != _RETRY_INFO_TYPE:
                continue
            seconds = nanos = 0
            for f, _w2, v in iter_fields(payload):
                if f == 1:  # retry_delay: google.protobuf.Duration
                    for df, _w3, dv in iter_fields(as_bytes(v)):
                        if df == 1:
                            seconds = as_int(dv)
                        elif df == 2:
                            nanos = as_int(dv)
            return seconds + nanos / 1e9
    except ProtoDecodeError:
        return None
    return None


def grpc_target(endpoint: str, insecure: bool) -> tuple[str, bool]:
    """``(host:port, secure)`` for an OTLP gRPC endpoint (a URL, or ``host:port``)."""
    if "://" not in endpoint:
        return endpoint.strip("/"), not insecure
    parts = urlsplit(endpoint)
    return parts.netloc, parts.scheme == "https"


class GrpcSettings(Protocol):
    """What the transport reads of the exporter's settings (``OtlpSettings`` has it all)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def insecure(self) -> bool: ...
    @property
    def headers(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def compression(self) -> str: ...
    @property
    def certificate(self) -> str: ...
    @property
    def client_certificate(self) -> str: ...
    @property
    def client_key(self) -> str: ...


class GrpcTransport:
    """One channel to the endpoint, created on first use (in the exporter's thread)."""

    def __init__(self, settings: GrpcSettings) -> None:
        self.settings = settings
        self.target, self.secure = grpc_target(settings.endpoint, settings.insecure)
        self._channel: Any = None
        self._call: Any = None
        self._metadata = tuple((k.lower(), v) for k, v in settings.headers)
        self._wake = threading.Event()

    def wake(self) -> None:
        """Make a call in flight read its ``until()`` again (from another thread)."""
        self._wake.set()

    def _connect(self) -> Any:
        import grpc

        if self._call is None:
            settings = self.settings
            compression = (
                grpc.Compression.Gzip
                if settings.compression == "gzip"
                else grpc.Compression.NoCompression
            )
            if self.secure:

                def read(path: str) -> bytes | None:
                    if not path:
                        return None
                    with open(path, "rb") as file:
                        return file.read()

                # The client certificate's file may hold its key too (as Python's ssl, and so
                # OtlpSettings, accepts): grpcio must get the key either way, since a certificate
                # without one fails a CHECK in gRPC core that aborts the whole process.
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=read(settings.certificate),
                    private_key=read(settings.client_key or settings.client_certificate),
                    certificate_chain=read(settings.client_certificate),
                )
                self._channel = grpc.secure_channel(
                    self.target, credentials, compression=compression
                )
            else:
                self._channel = grpc.insecure_channel(self.target, compression=compression)
            self._call = self._channel.unary_unary(
                EXPORT_METHOD, request_serializer=None, response_deserializer=None
            )
        return self._call

    def export(
        self, body: bytes, timeout: float, until: Callable[[], float] = lambda: math.inf
    ) -> tuple[_Outcome, str, float | None, bytes]:
        """``(outcome, detail, wait seconds or None, response bytes)`` of one Export call.

        A call's deadline is fixed when it is sent, so a sooner end (``stop()``) is a cancel:
        the call is cancelled once ``time.monotonic()`` passes ``until()``, which is read again
        whenever ``wake()`` is called.
        """
        import grpc

        call = self._connect()
        wake = self._wake
        wake.clear()
        future = call.future(body, timeout=timeout, metadata=self._metadata)
        future.add_done_callback(lambda _future: wake.set())
        # Cleared before until() is read, so a wake() after the read is not missed.
        while not future.done():
            remaining = until() - time.monotonic()
            if remaining <= 0:
                future.cancel()
                break
            wake.wait(None if remaining == math.inf else remaining)
            wake.clear()
        if future.cancelled():
            return "retry", "gRPC call cut short by shutdown", None, b""
        try:
            answer: bytes = future.result()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", "UNKNOWN")
            detail = f"gRPC {name}"
            if name not in _RETRYABLE and name != "RESOURCE_EXHAUSTED":
                return "reject", detail, None, b""
            # OTLP/gRPC throttling is UNAVAILABLE with a RetryInfo, whose delay the client
            # SHOULD wait (as an HTTP 503's Retry-After); RESOURCE_EXHAUSTED is retryable only
            # with one.
            delay = None
            trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
            for key, value in trailers or ():
                if key == "grpc-status-details-bin" and isinstance(value, bytes):
                    delay = retry_info_delay(value)
                    break
            if name in _RETRYABLE or delay is not None:
                return "retry", detail, delay, b""
            return "reject", detail, None, b""
        return "ok", "OK", None, answer

    def close(self) -> None:
        """Close the channel (a new one is made on the next export)."""
        channel, self._channel, self._call = self._channel, None, None
        if channel is not None:
            channel.close()
