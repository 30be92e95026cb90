"""Exports profile windows as OTLP profiles (``http/protobuf`` or ``grpc``) from a thread.

One ``POST`` of an ``ExportProfilesServiceRequest`` per upload interval to the profiles
endpoint (``Content-Type: application/x-protobuf``, gzip'd by default), configured like every
OpenTelemetry exporter (``OtlpSettings.from_env``). The window is encoded (``_encoders._otlp``)
in slices of ~0.5 ms of CPU each, releasing the GIL in between.

With ``grpc`` (the ``grpc`` extra: grpcio) the same bytes go through ``_otlp_grpc``. Retries
follow the OTLP/HTTP rules: 429, 502, 503 and 504 (and connection failures) are retried
with exponential back-off, or after the server's ``Retry-After`` when it sends one; any other
status drops the window (counted in ``rejected``). While the endpoint is away at most
``max_pending`` windows wait, and the oldest is dropped (counted in ``dropped``) to make room.

Nothing the endpoint does can hold the thread (``_http.Poster``): each export has one overall
deadline, however slowly the answer trickles, and at most ``max_response_bytes`` of it are
read. No exception ends the thread either (``_interval.IntervalExporter``): an unexpected one
is logged once and counted (``stats()['otlp_errors']``).
"""

from __future__ import annotations

import base64
import email.utils
import os
import ssl
import string
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from ..._config import (
    check_url,
    header_name_problem,
    parse_bool,
    parse_header_value,
    parse_int,
    redact_url,
    split_credentials,
    url_problem,
)
from ..._env import env_value
from ..._logging import log_once
from ..._version import __version__
from .._encoders._otlp import (
    OtlpEncoder,
    OtlpRequestEncoder,
    current_resource_attributes,
    encode_resource,
    encode_scope,
)
from .._encoders._protowire import ProtoDecodeError, as_bytes, as_int, as_str, iter_fields
from .._window import Window
from ._http import Poster, gzipped
from ._interval import IntervalExporter, Outcome, Wording
from ._otlp_grpc import GrpcTransport, grpc_available

__all__ = [
    "OTLP_CONTENT_TYPE",
    "OTLP_PROFILES_PATH",
    "OtlpEncoderFactory",
    "OtlpExporter",
    "OtlpSettings",
]

#: Where the profiles signal goes under ``OTEL_EXPORTER_OTLP_ENDPOINT``.
OTLP_PROFILES_PATH = "/v1development/profiles"
OTLP_CONTENT_TYPE = "application/x-protobuf"
PROTOCOLS = ("http/protobuf", "grpc")
COMPRESSIONS = ("gzip", "none")
#: OTLP/HTTP: only these statuses are worth another try.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})

_DEFAULT_ENDPOINT = "http://localhost:4318"
_DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"


def _variable(env: Mapping[str, str], suffix: str) -> tuple[str, str]:
    """``(name, value)`` of the profiles-specific variable if set, else of the generic one."""
    for name in (f"OTEL_EXPORTER_OTLP_PROFILES_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"):
        value = env_value(env, name).strip()
        if value:
            return name, value
    return f"OTEL_EXPORTER_OTLP_PROFILES_{suffix}", ""


def _check_target(name: str, value: str) -> str:
    """A gRPC ``host:port`` given without a scheme, checked as the same URL with one would be."""
    if "@" in value:
        raise ValueError(
            f"{name}={redact_url(value)!r}: credentials need the URL form, "
            "http(s)://user:password@host:port"
        )
    problem = url_problem(f"http://{value}")
    if problem is not None:
        raise ValueError(f"{name}={value!r}: expected host:port or a URL; {problem}")
    # The whole value becomes the channel's target, which names no path: a channel to
    # "host:port/otlp" never connects, and every export would be retried until dropped.
    if urlsplit(f"http://{value}").path not in ("", "/") or "?" in value:
        raise ValueError(
            f"{name}={value!r}: a gRPC endpoint is host:port (or http(s)://host:port), "
            "without a path or ?query"
        )
    return value


def parse_headers(name: str, value: str) -> tuple[tuple[str, str], ...]:
    """``key=value,key2=value2`` with URL-encoded values, as OTel's exporters read them.

    Errors say which item is wrong without quoting it: values are often secrets.
    """
    headers: list[tuple[str, str]] = []
    for index, item in enumerate(value.split(","), start=1):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key = unquote(key).strip()
        if not sep:
            raise ValueError(
                f"{name}: item {index} has no '='; expected key=value pairs separated by commas"
            )
        problem = header_name_problem(key)
        if problem is not None:
            raise ValueError(f"{name}: item {index}: {problem}")
        val = parse_header_value(f"{name}: header {key!r}", unquote(val).strip())
        headers.append((key, val))
    return tuple(headers)


# gRPC metadata (PROTOCOL-HTTP2.md): a name of these characters (the transport lowercases it),
# a value of printable ASCII; grpcio refuses anything else in every call, in the export thread.
_GRPC_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")


def grpc_header_problem(key: str, value: str) -> str | None:
    """Why ``key: value`` cannot be gRPC metadata, or ``None`` (one character of the value at
    most is quoted: values are often secrets)."""
    if key.lower().endswith("-bin"):
        # Binary metadata: grpcio wants bytes, and no OTel variable says how to give them.
        return f"header {key!r}: a name ending in '-bin' is binary gRPC metadata, not supported"
    bad = next((ch for ch in key if ch not in _GRPC_KEY_CHARS), None)
    if bad is not None:
        return (
            f"header {key!r}: a gRPC metadata name cannot contain {bad!r} (letters, digits, "
            "'-', '_' and '.' only)"
        )
    bad = next((ch for ch in value if not " " <= ch <= "~"), None)
    if bad is not None:
        return (
            f"header {key!r}: contains {bad!r}, which gRPC metadata cannot carry "
            "(printable ASCII only)"
        )
    return None


def _check_file(name: str, value: str) -> str:
    if value and not os.path.isfile(value):
        raise ValueError(f"{name}={value!r}: no such file")
    return value


def _ssl_reason(exc: ssl.SSLError) -> str:
    # OpenSSL names its reason for most errors, but not for a key it cannot read ("PEM lib").
    return str(exc.reason or exc.args[-1])


def _no_password() -> bytes:
    # An encrypted key would make OpenSSL ask for its password on the terminal.
    return b""


def tls_context(
    certificate: str,
    client_certificate: str,
    client_key: str,
    names: tuple[str, str, str] = ("certificate", "client_certificate", "client_key"),
) -> ssl.SSLContext:
    """The client TLS context of those PEM files (empty: the system's CAs, no client
    certificate); a file OpenSSL cannot load is a ``ValueError`` naming its setting in
    ``names``, so it is found at configuration time, not when the exporter starts."""
    ca_name, cert_name, key_name = names
    try:
        context = ssl.create_default_context(cafile=certificate or None)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{ca_name}={certificate!r}: not a PEM bundle of CA certificates ({_ssl_reason(exc)})"
        ) from None
    if client_key and not client_certificate:
        raise ValueError(
            f"{key_name} is set, but {cert_name} (the certificate it goes with) is not"
        )
    if client_certificate:
        try:
            # The certificate alone first: which of the two files is wrong is then known.
            ssl.create_default_context(cafile=client_certificate)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{cert_name}={client_certificate!r}: not a PEM certificate ({_ssl_reason(exc)})"
            ) from None
        try:
            context.load_cert_chain(client_certificate, client_key or None, _no_password)
        except ssl.SSLError as exc:
            where = (key_name, client_key) if client_key else (cert_name, client_certificate)
            raise ValueError(
                f"{where[0]}={where[1]!r}: no unencrypted PEM private key that matches "
                f"{cert_name} ({_ssl_reason(exc)})"
            ) from None
    return context


@dataclass(frozen=True, repr=False)
class OtlpSettings:
    """Where and how OTLP profiles go; ``from_env`` reads the OTel exporter variables.

    User info in the endpoint (``http://user:pass@host``, percent-encoded) becomes a Basic
    ``Authorization`` header, as the Pyroscope address's does, unless ``headers`` has one (an
    explicit header wins); either way ``endpoint`` keeps no credentials, so it can be logged.
    ``repr`` shows no header values.

    Arguments:
        endpoint: the full URL the requests are posted to.
        headers: extra request headers (e.g. authentication).
        compression: ``"gzip"`` (default) or ``"none"``.
        timeout: seconds one export may take.
        protocol: ``"http/protobuf"`` or ``"grpc"`` (needs grpcio; ``endpoint`` is then
            ``http(s)://host:port`` or ``host:port``, secure unless ``insecure``).
        certificate: CA bundle for https endpoints (default: the system's).
        client_certificate, client_key: a client certificate for mTLS.
        insecure: gRPC without TLS for an endpoint given without a scheme.
    """

    endpoint: str = _DEFAULT_ENDPOINT + OTLP_PROFILES_PATH
    headers: tuple[tuple[str, str], ...] = ()
    compression: str = "gzip"
    timeout: float = 10.0
    protocol: str = "http/protobuf"
    certificate: str = ""
    client_certificate: str = ""
    client_key: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.protocol == "grpc":
            if not grpc_available():
                raise ValueError("protocol: 'grpc' needs grpcio (pip install 'spanprof[grpc]')")
            if "://" in self.endpoint:
                check_url("endpoint", self.endpoint)
            else:
                _check_target("endpoint", self.endpoint)
        else:
            check_url("endpoint", self.endpoint)
        for key, value in self.headers:
            problem = header_name_problem(key)
            if problem is not None:
                raise ValueError(f"headers: {problem}")
            # What http.client refuses would fail every export, in the export thread.
            parse_header_value(f"headers: {key!r}", value)
            problem = grpc_header_problem(key, value) if self.protocol == "grpc" else None
            if problem is not None:
                raise ValueError(f"headers: {problem}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"compression: expected one of {', '.join(COMPRESSIONS)}, got {self.compression!r}"
            )
        if not 0 < self.timeout <= 600:
            raise ValueError(f"timeout: expected 0 < seconds <= 600, got {self.timeout!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"protocol: expected one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        for name in ("certificate", "client_certificate", "client_key"):
            _check_file(name, getattr(self, name))
        tls_context(self.certificate, self.client_certificate, self.client_key)
        endpoint, user, password = self.endpoint, "", ""
        if "://" in endpoint:
            endpoint, user, password = split_credentials(endpoint)
        headers = tuple(self.headers)
        if (user or password) and not any(k.lower() == "authorization" for k, _ in headers):
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            headers += (("Authorization", f"Basic {token}"),)
        # Frozen, so the endpoint without its user info goes in this way.
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "headers", headers)

    def __repr__(self) -> str:
        # Header values are often secrets: API keys, or the Basic token of the endpoint's user.
        shown: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["endpoint"] = redact_url(self.endpoint)
        shown["headers"] = tuple((key, "***") for key, _ in self.headers)
        return f"OtlpSettings({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OtlpSettings:
        """The settings the ``OTEL_EXPORTER_OTLP_[PROFILES_]*`` variables give.

        ``…_PROFILES_ENDPOINT`` is the full URL; ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base to
        which ``/v1development/profiles`` is appended (default ``http://localhost:4318``).
        ``…_HEADERS`` (``k=v,k2=v2``), ``…_COMPRESSION`` (``gzip`` default, ``none``),
        ``…_TIMEOUT`` (milliseconds, default 10000), ``…_PROTOCOL`` (``http/protobuf``),
        ``…_CERTIFICATE``, ``…_CLIENT_CERTIFICATE``, ``…_CLIENT_KEY``. The profiles-specific
        variable wins over the generic one. A bad value raises ``ValueError`` naming it.

        With ``…_PROTOCOL=grpc`` (grpcio installed) no path is appended: the endpoint
        (default ``http://localhost:4317``) is ``http(s)://host:port``, or ``host:port`` made
        plain-text by ``…_INSECURE=true``.
        """
        env = os.environ if environ is None else environ
        name, protocol = _variable(env, "PROTOCOL")
        protocol = protocol.lower() or "http/protobuf"
        if protocol not in PROTOCOLS:
            raise ValueError(f"{name}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if protocol == "grpc" and not grpc_available():
            raise ValueError(f"{name}=grpc needs grpcio: pip install 'spanprof[grpc]'")
        name, raw_insecure = _variable(env, "INSECURE")
        insecure = parse_bool(name, raw_insecure) if raw_insecure else False
        specific = env_value(env, "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT").strip()
        if protocol == "grpc":
            name = "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT"
            endpoint = specific or env_value(env, "OTEL_EXPORTER_OTLP_ENDPOINT").strip()
            if not specific:
                name = "OTEL_EXPORTER_OTLP_ENDPOINT"
            endpoint = endpoint or _DEFAULT_GRPC_ENDPOINT
            if "://" in endpoint:
                check_url(name, endpoint)
            else:
                _check_target(name, endpoint)
        elif specific:
            endpoint = check_url("OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT", specific)
        else:
            base = env_value(env, "OTEL_EXPORTER_OTLP_ENDPOINT").strip() or _DEFAULT_ENDPOINT
            check_url("OTEL_EXPORTER_OTLP_ENDPOINT", base)
            if "?" in base:
                # The signal's path goes after the base: it would land inside the query.
                raise ValueError(
                    f"OTEL_EXPORTER_OTLP_ENDPOINT={redact_url(base)!r}: the base endpoint must "
                    "not have a ?query (a full URL with one goes in "
                    "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT)"
                )
            endpoint = base.rstrip("/") + OTLP_PROFILES_PATH
        name, raw_headers = _variable(env, "HEADERS")
        headers = parse_headers(name, raw_headers)
        for key, value in headers if protocol == "grpc" else ():
            problem = grpc_header_problem(key, value)
            if problem is not None:
                raise ValueError(f"{name} (with protocol grpc): {problem}")
        name, compression = _variable(env, "COMPRESSION")
        compression = compression.lower() or "gzip"
        if compression not in COMPRESSIONS:
            raise ValueError(f"{name}={compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        name, raw_timeout = _variable(env, "TIMEOUT")
        timeout_ms = parse_int(name, raw_timeout or "10000", minimum=1, maximum=600_000)
        ca_name, certificate = _variable(env, "CERTIFICATE")
        cert_name, client_certificate = _variable(env, "CLIENT_CERTIFICATE")
        key_name, client_key = _variable(env, "CLIENT_KEY")
        _check_file(ca_name, certificate)
        _check_file(cert_name, client_certificate)
        _check_file(key_name, client_key)
        tls_context(certificate, client_certificate, client_key, (ca_name, cert_name, key_name))
        return cls(
            endpoint=endpoint,
            headers=headers,
            compression=compression,
            timeout=timeout_ms / 1000,
            protocol=protocol,
            certificate=certificate,
            client_certificate=client_certificate,
            client_key=client_key,
            insecure=insecure,
        )


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    value = value.strip()
    # isdigit() alone takes "²" and other digits float() refuses: a header the server sent
    # must never raise in the export thread, which would drop the window instead of retrying.
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
        seconds = when.timestamp()
    except (TypeError, ValueError, OverflowError, OSError):  # a year past datetime's range...
        return None
    wall = time.time() if now is None else now
    return max(0.0, seconds - wall)


def rejected_profiles(body: bytes) -> tuple[int, str]:
    """``(rejected_profiles, error_message)`` of an ``ExportProfilesServiceResponse``."""
    rejected, message = 0, ""
    try:
        for field, _wire, value in iter_fields(body):
            if field != 1:  # partial_success
                continue
            for sub, _w, sub_value in iter_fields(as_bytes(value)):
                if sub == 1:
                    rejected = as_int(sub_value)
                elif sub == 2:
                    message = as_str(sub_value)
    except ProtoDecodeError:
        return 0, ""
    return rejected, message


class OtlpEncoderFactory(Protocol):
    """Makes the request encoder of one window (``OtlpEncoder``, ``OtlpMemoryEncoder``...)."""

    def __call__(
        self,
        window: Window,
        *,
        resource: bytes,
        scope: bytes,
        attributes: Iterable[tuple[str, str]],
    ) -> OtlpRequestEncoder[Any]: ...


class OtlpExporter(IntervalExporter):
    """Encodes windows as OTLP profiles and posts them from a daemon thread.

    Arguments:
        settings: the endpoint and its options (``OtlpSettings``).
        upload_interval: seconds between exports.
        attributes: attributes of every profile (the backend's static tags).
        resource_attributes: returns the resource's attributes at each export (default: the
            global tracer provider's, as ``current_resource_attributes``).
        max_pending: windows kept while the endpoint is away; the oldest is dropped beyond that.
        backoff_initial, backoff_max: seconds before the first retry, and the cap of the
            doubling back-off (a ``Retry-After`` may ask for longer, up to ``retry_after_max``).
        flush_timeout: how long ``stop()`` may spend on the last window and pending retries.
        max_response_bytes: at most this much of an answer is read (the rest is discarded
            with the connection, and a partial success in it is not seen).
        encoder: makes the encoder of a window (default: CPU profiles, ``OtlpEncoder``); the
            memory profiles' exporter passes ``OtlpMemoryEncoder`` with its period.
    """

    thread_name = "spanprof-otlp-exporter"
    wording = Wording(
        key="otlp",
        window="an OTLP profile window",
        windows="OTLP profile windows",
        post="an OTLP profile export",
        sending="exporting profiles",
        sender="exporter",
        peer="endpoint",
        dropped_key="otlp_dropped",
    )

    def __init__(
        self,
        settings: OtlpSettings,
        *,
        upload_interval: float = 10.0,
        attributes: Iterable[tuple[str, str]] = (),
        resource_attributes: Callable[[], Mapping[str, object]] = current_resource_attributes,
        max_pending: int = 6,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        retry_after_max: float = 300.0,
        flush_timeout: float = 5.0,
        max_response_bytes: int = 64 * 1024,
        encoder: OtlpEncoderFactory = OtlpEncoder,
    ) -> None:
        self.settings = settings
        self._encoder = encoder
        self._grpc = GrpcTransport(settings) if settings.protocol == "grpc" else None
        parts = urlsplit(settings.endpoint if self._grpc is None else "http://grpc")
        self.url = redact_url(settings.endpoint)
        self.attributes = list(attributes)
        self._resource_attributes = resource_attributes
        self._resource: tuple[dict[str, object], bytes] | None = None
        self._scope = encode_scope()
        self.retry_after_max = retry_after_max
        self._headers = {
            "Content-Type": OTLP_CONTENT_TYPE,
            "User-Agent": f"spanprof/{__version__}",
            **dict(settings.headers),
        }
        # gRPC compresses on its own (grpc.Compression.Gzip).
        self._gzip = settings.compression == "gzip" and self._grpc is None
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            context = tls_context(
                settings.certificate, settings.client_certificate, settings.client_key
            )
        self._poster = Poster(
            https=parts.scheme == "https",
            host=parts.hostname or "",
            port=parts.port,
            path=(parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
            headers=self._headers,
            ssl_context=context,
            max_response_bytes=max_response_bytes,
            answer_headers=("Retry-After",),
        )
        self._init_interval(
            upload_interval=upload_interval,
            timeout=settings.timeout,
            flush_timeout=flush_timeout,
            max_pending=max_pending,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )
        self.rejected_profiles = 0
        self.raw_bytes = 0

    def stats(self) -> dict[str, float]:
        """Export counters and the longest export step, each key prefixed ``otlp_``."""
        return {
            "otlp_uploads": self.uploads,
            "otlp_failures": self.failures,
            "otlp_retries": self.retries,
            "otlp_dropped": self.dropped,
            "otlp_rejected": self.rejected,
            "otlp_rejected_profiles": self.rejected_profiles,
            "otlp_errors": self.errors,
            "otlp_pending": len(self._queue),
            "otlp_bytes_sent": self.bytes_sent,
            "otlp_raw_bytes": self.raw_bytes,
            **self._steps.stats("otlp_"),
        }

    # --- the export thread ----------------------------------------------------------------------

    def _cut(self, deadline: float) -> None:
        super()._cut(deadline)
        if self._grpc is not None:
            self._grpc.wake()  # it reads _stop_deadline again

    def _finish(self) -> None:
        if self._grpc is not None:
            self._grpc.close()

    def _resource_bytes(self) -> bytes:
        attributes = dict(self._resource_attributes())
        cached = self._resource
        if cached is None or cached[0] != attributes:
            cached = self._resource = (attributes, encode_resource(attributes))
        return cached[1]

    def encode(self, window: Window) -> bytes:
        """The request body for ``window`` (compressed as configured), encoded in timed steps."""
        encoder = self._encoder(
            window, resource=self._resource_bytes(), scope=self._scope, attributes=self.attributes
        )
        while not encoder.done:
            self._steps.run(encoder.step)
        self.raw_bytes += len(encoder.request)
        if self._gzip:
            return gzipped(encoder.request)
        return encoder.request

    def _encode(self, window: Window) -> bytes:
        return self.encode(window)

    def _post(self, body: bytes) -> tuple[Outcome, str, float | None]:
        if self._grpc is not None:
            # gRPC's timeout is one deadline already; stop() cuts a call in flight (cut()).
            timeout = min(self.timeout, max(0.001, self._stop_deadline - time.monotonic()))
            outcome, detail, wait, grpc_answer = self._grpc.export(
                body, timeout, lambda: self._stop_deadline
            )
            if outcome == "ok":
                self._partial_success(grpc_answer)
            return outcome, detail, self._capped(wait)
        answer = self._post_http(body)
        if isinstance(answer, str):
            return "retry", answer, None
        status = answer.status
        if 200 <= status < 300:
            if answer.complete:
                self._partial_success(answer.body)
            return "ok", str(status), None
        if status in RETRYABLE_STATUSES:
            return (
                "retry",
                f"HTTP {status}",
                self._capped(retry_after(answer.headers.get("Retry-After"))),
            )
        return "reject", f"HTTP {status}", None

    def _capped(self, wait: float | None) -> float | None:
        # A Retry-After of an hour is not waited for: at most retry_after_max.
        return None if wait is None else min(wait, self.retry_after_max)

    def _partial_success(self, answer: bytes) -> None:
        count, message = rejected_profiles(answer)
        if count:
            self.rejected_profiles += count
            log_once(
                "otlp-partial",
                f"spanprof: {self.url} rejected {count} profile(s): {message} (logged once)",
                exc_info=False,
            )
