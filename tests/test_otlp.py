"""OTLP profiles: the encoder, the exporter's configuration and transport, the window fan-out."""

from __future__ import annotations

import gzip
import itertools
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesPartialSuccess,
    ExportProfilesServiceRequest,
    ExportProfilesServiceResponse,
)

from spanprof._labels._labelset import EMPTY, LabelSet
from spanprof._profiling._choose import profiler_from_env
from spanprof._profiling._encoders._otlp import (
    OtlpEncoder,
    current_resource_attributes,
    encode_resource,
    encode_scope,
)
from spanprof._profiling._exact import ExactBackend, parse_exporters
from spanprof._profiling._exporters._fanout import WindowFanout
from spanprof._profiling._exporters._otlp import (
    OtlpExporter,
    OtlpSettings,
    parse_headers,
    retry_after,
)
from spanprof._profiling._window import StackTables, Window
from spanprof._version import __version__

from .e2e.server import ROOT, free_port
from .exporting import GZIP_FASTEST, log_messages, timed_steps
from .otlp_profiles import (
    GrpcProfilesReceiver,
    OtlpProfilesReceiver,
    Response,
    flatten,
    model_violations,
    profile_type,
    profiles_of,
    resource_attributes,
)

RESOURCE = {"service.name": "checkout", "service.version": "1.2", "replicas": 3, "ok": True}


def _labels(index: int, **extra: str) -> LabelSet:
    return LabelSet(
        {
            "span_id": f"{index + 1:016x}",
            "trace_id": f"{index + 1:032x}",
            "span_name": "GET /work/{index}",
            **extra,
        }
    )


def _leaf() -> None:
    return None


def _root() -> None:
    return None


def _window(*samples: tuple[LabelSet, int]) -> Window:
    """A window of ``_leaf`` called from ``_root``, one sample per ``(labels, value)``."""
    tables = StackTables()
    sid = tables.stack_of(
        tuple(tables.raw_frame(f.__code__, 0, f.__code__.co_firstlineno) for f in (_leaf, _root))
    )
    window = Window(time.time_ns(), tables)
    for labels, value in samples:
        window.values[(sid, labels)] = value
    window.end_ns = window.start_ns + 1_000_000_000
    return window


def _encode(window: Window, **options: Any) -> ExportProfilesServiceRequest:
    encoder = OtlpEncoder(
        window, resource=encode_resource(RESOURCE), scope=encode_scope(), **options
    )
    while not encoder.step():
        pass
    request = ExportProfilesServiceRequest()
    request.ParseFromString(encoder.request)
    return request


# --- the encoder ---------------------------------------------------------------------------------


def test_encoded_request_decodes_with_the_generated_classes_and_keeps_the_model() -> None:
    """Resource, scope, sample type, links and attributes as the v1development proto says."""
    window = _window(
        (_labels(0), 30_000_000),
        (_labels(1, tenant="acme"), 20_000_000),
        (EMPTY, 7_000_000),
        (LabelSet({"span_name": "cron"}), 1_000),
    )
    request = _encode(window, attributes=[("region", "eu")])
    assert model_violations(request) == []
    assert resource_attributes(request) == RESOURCE
    (rp,) = request.resource_profiles
    (sp,) = rp.scope_profiles
    assert (sp.scope.name, sp.scope.version) == ("spanprof", __version__)
    (profile,) = sp.profiles
    strings = request.dictionary.string_table
    sample_type = profile.sample_type
    period_type = profile.period_type
    assert (strings[sample_type.type_strindex], strings[sample_type.unit_strindex]) == (
        "samples",
        "count",
    )
    assert (strings[period_type.type_strindex], strings[period_type.unit_strindex]) == (
        "cpu",
        "nanoseconds",
    )
    assert profile.period == 1
    assert profile.time_unix_nano == window.start_ns
    assert profile.duration_nano == 1_000_000_000
    assert [
        strings[request.dictionary.attribute_table[a].key_strindex]
        for a in profile.attribute_indices
    ] == ["region"]
    samples = list(flatten(request))
    assert [s.value for s in samples] == [30_000_000, 20_000_000, 7_000_000, 1_000]
    assert [f.function for f in samples[0].stack] == ["_leaf", "_root"]
    assert dict(samples[0].labels) == dict(_labels(0))
    assert dict(samples[1].labels) == dict(_labels(1, tenant="acme"))
    assert samples[2].labels == ()
    assert dict(samples[3].labels) == {"span_name": "cron"}
    # Two requests, two links (plus the zero link); the unlabelled samples link to none.
    assert [s.link_index for s in profile.samples] == [1, 2, 0, 0]
    assert len(request.dictionary.link_table) == 3
    link = request.dictionary.link_table[1]
    assert (link.trace_id.hex(), link.span_id.hex()) == (f"{1:032x}", f"{1:016x}")


def test_a_span_without_trace_id_label_links_with_the_invalid_trace_id() -> None:
    """SPANPROF_TRACE_ID_LABEL=false: the link keeps its 16 bytes, all zero; bad ids stay labels."""
    request = _encode(
        _window(
            (LabelSet({"span_id": "00f067aa0ba902b7", "span_name": "GET /"}), 5),
            (LabelSet({"span_id": "not-a-span-id", "span_name": "GET /"}), 6),
        )
    )
    assert model_violations(request) == []
    first, second = request.resource_profiles[0].scope_profiles[0].profiles[0].samples
    link = request.dictionary.link_table[first.link_index]
    assert (link.trace_id, link.span_id.hex()) == (bytes(16), "00f067aa0ba902b7")
    assert second.link_index == 0
    assert dict(list(flatten(request))[1].labels)["span_id"] == "not-a-span-id"


def test_resource_is_the_global_tracer_providers_when_it_is_an_sdk_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SDK provider's resource is used as is; otherwise Resource.create() (OTEL_SERVICE_NAME)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": "from-provider"}))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    assert current_resource_attributes()["service.name"] == "from-provider"
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert current_resource_attributes()["service.name"] == "from-env"


def test_a_resource_attribute_from_an_undecodable_variable_is_sent_spelled_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES with a byte that is not UTF-8 does not fail every window."""
    from opentelemetry import trace

    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    # What os.environ holds for team=caf\xe9 (surrogateescape), as the SDK reads it.
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=caf\udce9,caf\udce9=1")
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url, resource_attributes=current_resource_attributes)
        exporter.start(_windows(lambda n: _window((_labels(n), 10_000_000))))
        exporter.stop()
        requests = receiver.requests()
    assert exporter.stats()["otlp_errors"] == 0
    (request,) = requests
    attributes = resource_attributes(request)
    assert attributes["team"] == "caf\\xe9"
    assert attributes["caf\\xe9"] == "1"


@pytest.mark.usefixtures("fresh_log_once")
def test_resource_bytes_and_ints_past_int64_are_sent_as_the_sdk_would_and_never_fail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """bytes go as bytes_value (the SDK's encoding, not an array of ints); an int outside int64
    goes as its digits, logged once, instead of failing or wrapping every window's resource."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_resource
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {
        "service.name": "svc",
        "blob": b"a\x00b",
        "big": 2**64,
        "wraps": 2**63,
        "low": -(2**63) - 1,
        "max": 2**63 - 1,
        "min": -(2**63),
        "blobs": (b"x", b"y"),
    }
    with caplog.at_level("WARNING", logger="spanprof"), OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url, resource_attributes=lambda: attributes)
        exporter.start(_windows(lambda n: _window((_labels(n), 10_000_000))))
        exporter.stop()
        requests = receiver.requests()
    assert exporter.stats()["otlp_errors"] == 0
    (request,) = requests
    sent = {kv.key: kv.value for kv in request.resource_profiles[0].resource.attributes}
    # What the SDK's own exporters send for the attributes that fit OTLP as they are.
    sdk = _encode_resource(Resource({k: attributes[k] for k in ("blob", "max", "min", "blobs")}))
    for kv in sdk.attributes:
        assert sent[kv.key] == kv.value, kv.key
    received = resource_attributes(request)
    assert (received["big"], received["wraps"], received["low"]) == (
        str(2**64),
        str(2**63),
        str(-(2**63) - 1),
    )
    assert len(log_messages(caplog, "does not fit in 64 bits")) == 1


def _deep_stacks(tables: StackTables, count: int) -> list[int]:
    """``count`` distinct stacks of 48 frames each."""
    codes = [fn.__code__ for fn in (_leaf, _root, _labels, _window, _encode, flatten)]
    return [
        tables.stack_of(
            tuple(
                tables.raw_frame(codes[(n + depth) % len(codes)], depth * 2 + n % 7, depth + 1)
                for depth in range(48)
            )
        )
        for n in range(count)
    ]


def test_encoding_steps_stay_short_and_lose_nothing() -> None:
    """4,000 distinct deep samples encode in steps of < 2 ms CPU, each sample intact."""

    def make() -> OtlpEncoder:
        tables = StackTables()
        window = Window(time.time_ns(), tables)
        for n, sid in enumerate(_deep_stacks(tables, 4000)):
            window.values[(sid, _labels(n))] = n + 1
        window.end_ns = window.start_ns + 10_000_000_000
        return OtlpEncoder(window, resource=encode_resource(RESOURCE), scope=encode_scope())

    encoder, longest, steps = timed_steps(make)
    assert longest < 2_000_000
    assert steps > 2
    request = ExportProfilesServiceRequest.FromString(encoder.request)
    assert model_violations(request) == []
    samples = list(flatten(request))
    assert len(samples) == 4000
    assert sum(s.value for s in samples) == sum(range(1, 4001))
    assert all(len(s.stack) == 48 for s in samples)
    assert {s.label_values("span_id")[0] for s in samples} == {
        _labels(n)["span_id"] for n in range(4000)
    }


# --- configuration -------------------------------------------------------------------------------


def test_settings_follow_the_otel_exporter_variables() -> None:
    """Generic variables apply, profile-specific ones win; the base endpoint gets the path."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret, x-tenant = a",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
    }
    settings = OtlpSettings.from_env(env)
    assert settings.endpoint == "https://collector:4318/v1development/profiles"
    assert settings.headers == (("api-key", "s=cret"), ("x-tenant", "a"))
    assert (settings.timeout, settings.compression, settings.protocol) == (
        2.5,
        "none",
        "http/protobuf",
    )
    specific = OtlpSettings.from_env(
        {
            **env,
            "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": "http://pyroscope:4040/otlp/profiles",
            "OTEL_EXPORTER_OTLP_PROFILES_COMPRESSION": "gzip",
            "OTEL_EXPORTER_OTLP_PROFILES_HEADERS": "authorization=Bearer t",
        }
    )
    assert specific.endpoint == "http://pyroscope:4040/otlp/profiles"
    assert specific.compression == "gzip"
    assert specific.headers == (("authorization", "Bearer t"),)
    default = OtlpSettings.from_env({})
    assert default.endpoint == "http://localhost:4318/v1development/profiles"
    assert (default.compression, default.timeout) == ("gzip", 10.0)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT", "collector:4318"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector"),
        ("OTEL_EXPORTER_OTLP_PROFILES_HEADERS", "no-equals-sign"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "=value"),
        ("OTEL_EXPORTER_OTLP_PROFILES_COMPRESSION", "zstd"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s"),
        ("OTEL_EXPORTER_OTLP_PROFILES_TIMEOUT", "0"),
        ("OTEL_EXPORTER_OTLP_PROFILES_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc/json"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem"),
    ],
)
def test_bad_settings_raise_naming_the_variable(variable: str, value: str) -> None:
    """Each bad value is a ValueError at configuration time that names its variable."""
    with pytest.raises(ValueError, match=variable):
        OtlpSettings.from_env({variable: value})


@pytest.mark.parametrize(
    "base", ["http://collector:4318/?tenant=a", "http://collector:4318?tenant=a", "http://c:4318/?"]
)
def test_a_base_endpoint_with_a_query_is_refused_naming_the_variable(base: str) -> None:
    """The signal's path would be appended inside the query: refused, as the Pyroscope
    address's query is, while a full profiles endpoint keeps its query."""
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_ENDPOINT.*query"):
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": base})
    full = "http://collector:4318/v1development/profiles?tenant=a"
    settings = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": full})
    assert settings.endpoint == full


# Self-signed test-only certificates and keys (prime256v1, valid for a century), made once with
# the openssl command, so that no test run needs it: client.crt/.key, other.crt/.key, and
# encrypted.key (client.key under the password "pw").
_TLS = Path(__file__).parent / "tls"


def test_tls_files_openssl_cannot_load_are_refused_naming_the_variable(tmp_path: Path) -> None:
    """A CA bundle, client certificate or key that is a file OpenSSL cannot load (or a key not
    of the certificate) is a ValueError naming its variable, not an SSLError at start()."""
    cert, key = _TLS / "client.crt", _TLS / "client.key"
    other_cert, other_key = _TLS / "other.crt", _TLS / "other.key"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    # Encrypted: OpenSSL would ask for its password on the terminal.
    encrypted = _TLS / "encrypted.key"
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318"}
    good = {
        **base,
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert),
        "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_CERTIFICATE": str(cert),
        "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY": str(key),
    }
    settings = OtlpSettings.from_env(good)
    assert (settings.certificate, settings.client_key) == (str(cert), str(key))
    OtlpExporter(settings, resource_attributes=lambda: RESOURCE)  # its TLS context loads
    bad_cases = [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", str(garbage), "OTEL_EXPORTER_OTLP_CERTIFICATE"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", str(key), "OTEL_EXPORTER_OTLP_CERTIFICATE"),
        (
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_CERTIFICATE",
            str(garbage),
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_CERTIFICATE",
        ),
        (
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
            str(garbage),
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
        ),
        (
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
            str(other_key),
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
        ),
        (
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
            str(encrypted),
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
        ),
        (
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_CERTIFICATE",
            str(other_cert),
            "OTEL_EXPORTER_OTLP_PROFILES_CLIENT_KEY",
        ),
    ]
    for variable, value, named in bad_cases:
        with pytest.raises(ValueError, match=named):
            OtlpSettings.from_env({**good, variable: value})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_CLIENT_KEY"):
        OtlpSettings.from_env({**base, "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(key)})
    with pytest.raises(ValueError, match="certificate"):
        OtlpSettings(endpoint="https://collector:4318/v1", certificate=str(garbage))
    with pytest.raises(ValueError, match="client_key"):
        OtlpSettings(
            endpoint="https://collector:4318/v1",
            client_certificate=str(cert),
            client_key=str(other_key),
        )


@pytest.mark.parametrize(
    "value",
    [
        "x-tenánt=a",
        "x tenant=a",
        "x(tenant)=a",
        'x"t"=a',
        "api-key=s3cr3t,x/tenant=a",
        "authorization: Bearer s3cr3t=",
    ],
)
def test_a_header_name_that_is_not_an_http_token_is_refused(value: str) -> None:
    """http.client would refuse it in the export thread, dropping every window: here it is a
    ValueError naming the variable, which shows no header value (they are often secrets)."""
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_HEADERS") as info:
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_HEADERS": value})
    assert "s3cr3t" not in str(info.value)
    assert "HTTP token" in str(info.value)
    with pytest.raises(ValueError, match="headers"):
        OtlpSettings(headers=(("x-tenánt", "a"),))
    assert parse_headers("H", "A1!#$%&'*+-.^_`|~z=1") == (("A1!#$%&'*+-.^_`|~z", "1"),)


def test_headers_and_retry_after_parse_like_the_specs() -> None:
    """Headers are URL-decoded key=value pairs; Retry-After is seconds or an HTTP date."""
    assert parse_headers("H", "a=1,,b=x%20y") == (("a", "1"), ("b", "x y"))
    assert retry_after("7") == 7.0
    assert retry_after(None) is None
    assert retry_after("soon") is None
    assert retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412500.0) == pytest.approx(10.0)


_YEAR_PAST_DATETIME = "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"


@pytest.mark.parametrize("value", ["\xb2", "\u0663", _YEAR_PAST_DATETIME])
def test_a_retry_after_that_does_not_parse_is_none(value: str) -> None:
    """A superscript or Arabic-Indic digit (isdigit() takes it, float() does not), or a date
    past datetime's range, asks for no particular wait."""
    assert retry_after(value) is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("http://collector\x01:4318", "control characters"),
        ("http://collector:4318/otlp /v1", "spaces"),
        ("http://collector:0", "port"),
        ("http://collector:65536", "port"),
        ("http://[::1:4318", "IPv6"),
        ("http://[collector]:4318", "IPv6"),
        ("http://u:s3k/r1t@collector:4318", "percent-encode"),
        ("http://collector:4318/v1/pr\u00f6files", "non-ASCII"),
        ("http://b\u00fccher..example:4318", "internationalized domain name"),
    ],
)
@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT"]
)
def test_an_endpoint_is_checked_like_the_pyroscope_address(
    variable: str, value: str, problem: str
) -> None:
    """What PYROSCOPE_SERVER_ADDRESS refuses, an OTLP endpoint the exporter could not post to
    is refused too, at configuration time, naming the variable and hiding any password."""
    with pytest.raises(ValueError, match=variable) as info:
        OtlpSettings.from_env({variable: value})
    assert problem in str(info.value)
    assert "s3k" not in str(info.value)
    assert "r1t" not in str(info.value)
    with pytest.raises(ValueError, match="endpoint"):
        OtlpSettings(endpoint=value)


def test_exporters_option_and_variable() -> None:
    """exporters= and SPANPROF_PROFILES_EXPORTER take pyroscope, otlp or both; otlp alone
    needs no Pyroscope address."""
    assert parse_exporters("x", "otlp, pyroscope") == ("pyroscope", "otlp")
    assert parse_exporters("x", ["otlp"]) == ("otlp",)
    with pytest.raises(ValueError, match="SPANPROF_PROFILES_EXPORTER"):
        ExactBackend.from_env({"SPANPROF_PROFILES_EXPORTER": "jaeger"})
    with pytest.raises(ValueError, match="exporters"):
        ExactBackend(server_address="http://p:4040", application_name="a", exporters="")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT"):
        ExactBackend.from_env(
            {
                "SPANPROF_PROFILES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": "nope",
            }
        )
    backend = profiler_from_env(
        {
            "SPANPROF_PROFILER": "exact",
            "SPANPROF_PROFILES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        }
    )
    assert isinstance(backend, ExactBackend)
    assert backend.exporters == ("otlp",)
    implied = profiler_from_env({"SPANPROF_PROFILES_EXPORTER": "otlp"})
    assert isinstance(implied, ExactBackend)
    with pytest.raises(ValueError, match="SPANPROF_PROFILES_EXPORTER"):
        profiler_from_env(
            {
                "SPANPROF_PROFILER": "pyroscope",
                "SPANPROF_PROFILES_EXPORTER": "otlp",
                "PYROSCOPE_SERVER_ADDRESS": "http://p:4040",
            }
        )
    both = ExactBackend.from_env(
        {
            "PYROSCOPE_SERVER_ADDRESS": "http://p:4040",
            "SPANPROF_PROFILES_EXPORTER": "pyroscope,otlp",
        }
    )
    assert both is not None
    assert both.exporters == ("pyroscope", "otlp")
    assert ExactBackend.from_env({}) is None


def test_backend_constructed_directly_reads_the_otel_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ExactBackend(exporters="otlp") reads OTEL_EXPORTER_OTLP_* like an OTel exporter would,
    and a bad one fails right there."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    backend = ExactBackend(exporters="otlp")
    assert backend.otlp_settings is not None
    assert backend.otlp_settings.endpoint == "http://collector:4318/v1development/profiles"
    assert ExactBackend(server_address="http://p:4040", application_name="a").otlp_settings is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        ExactBackend(exporters=["otlp"])
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT")
    with pytest.raises(ValueError, match="server_address"):
        ExactBackend(exporters="pyroscope,otlp")


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def test_endpoint_credentials_are_sent_as_basic_auth_and_never_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """user:password@ in the endpoint becomes an Authorization header (percent-decoded), as the
    Pyroscope address's does; the URL requests go to, repr() and the logs keep no trace of it."""
    with OtlpProfilesReceiver() as receiver:
        base = receiver.base_url.replace("://", "://al%40ice:s3cr%2Ft@")
        settings = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": base})
        assert settings.endpoint == receiver.url
        exporter = OtlpExporter(
            settings, upload_interval=60.0, resource_attributes=lambda: RESOURCE
        )
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
        (one,) = receiver.received
    assert one.headers["authorization"] == _basic("al@ice", "s3cr/t")
    assert "s3cr" not in repr(settings)
    assert _basic("al@ice", "s3cr/t") not in repr(settings)
    assert "s3cr" not in exporter.url
    down = OtlpSettings(endpoint=f"http://bob:hunter2@127.0.0.1:{free_port()}/v1", timeout=1.0)
    exporter = OtlpExporter(down, upload_interval=60.0, flush_timeout=1.0, backoff_initial=0.05)
    with caplog.at_level("DEBUG", logger="spanprof"):
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
    assert any("127.0.0.1" in record.getMessage() for record in caplog.records)
    assert not any("hunter2" in record.getMessage() for record in caplog.records)


def test_an_explicit_authorization_header_wins_over_endpoint_credentials() -> None:
    """OTEL_EXPORTER_OTLP_HEADERS=authorization=... is what the collector gets; the endpoint's
    user info is still stripped from the URL."""
    settings = OtlpSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "https://alice:s3cret@collector:4318",
            "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20t",
        }
    )
    assert settings.endpoint == "https://collector:4318/v1development/profiles"
    assert settings.headers == (("Authorization", "Bearer t"),)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT") as info:
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://alice:s3cret%0A@c:4318"})
    assert "s3cret" not in str(info.value)


# --- the exporter --------------------------------------------------------------------------------


def _windows(make: Callable[[int], Window]) -> Callable[[], Window]:
    counter = itertools.count()
    return lambda: make(next(counter))


def _exporter(url: str, **options: Any) -> OtlpExporter:
    settings_options = {
        key: options.pop(key) for key in ("compression", "headers", "timeout") if key in options
    }
    settings = OtlpSettings(endpoint=url, **{"timeout": 2.0, **settings_options})
    defaults: dict[str, Any] = {
        "upload_interval": 60.0,
        "backoff_initial": 0.05,
        "backoff_max": 0.4,
        "flush_timeout": 2.0,
        "resource_attributes": lambda: RESOURCE,
    }
    return OtlpExporter(settings, **{**defaults, **options})


def test_exporter_posts_one_request_per_window_to_the_receiver() -> None:
    """Path, content type, gzip, headers; the body decodes and keeps the model's rules."""
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url, headers=(("authorization", "Bearer t"),))
        exporter.start(_windows(lambda n: _window((_labels(n), 10_000_000))))
        exporter.stop()
        received = list(receiver.received)
        assert receiver.errors == []
    (one,) = received
    assert one.headers["content-type"] == "application/x-protobuf"
    assert one.headers["content-encoding"] == "gzip"
    assert one.body[8] == GZIP_FASTEST  # the gzip header's XFL: compressed at level 1
    assert one.headers["authorization"] == "Bearer t"
    assert one.headers["user-agent"] == f"spanprof/{__version__}"
    assert resource_attributes(one.request)["service.name"] == "checkout"
    (sample,) = flatten(one.request)
    assert dict(sample.labels) == dict(_labels(0))
    stats = exporter.stats()
    assert (stats["otlp_uploads"], stats["otlp_dropped"], stats["otlp_rejected"]) == (1, 0, 0)
    assert 0 < stats["otlp_bytes_sent"] < stats["otlp_raw_bytes"]


def test_exporter_sends_uncompressed_when_told() -> None:
    """OTEL_EXPORTER_OTLP_COMPRESSION=none: no Content-Encoding, plain protobuf."""
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url, compression="none")
        exporter.start(_windows(lambda n: _window((_labels(n), 1))))
        exporter.stop()
        (one,) = receiver.received
    assert "content-encoding" not in one.headers
    assert exporter.stats()["otlp_bytes_sent"] == one.raw_size


def test_exporter_waits_as_long_as_retry_after_says() -> None:
    """A 429 with Retry-After: 1 is retried after about a second, not after the back-off."""
    with OtlpProfilesReceiver([Response(429, (("Retry-After", "1"),))]) as receiver:
        exporter = _exporter(receiver.url, upload_interval=0.1)
        windows = iter([_window((_labels(0), 5))])
        exporter.start(lambda: next(windows, Window(time.time_ns(), StackTables())))
        deadline = time.monotonic() + 10
        while not receiver.received and time.monotonic() < deadline:
            time.sleep(0.02)
        exporter.stop()
    stats = exporter.stats()
    assert (stats["otlp_failures"], stats["otlp_retries"], stats["otlp_uploads"]) == (1, 1, 1)
    first, second = receiver.attempt_times
    # The back-off alone would have waited 0.05 s.
    assert second - first >= 0.95


def test_exporter_retries_only_the_retryable_statuses() -> None:
    """502, 503, 504 are retried with growing back-off; a 500 or 400 drops the window."""
    script = [Response(502), Response(503), Response(504)]
    with OtlpProfilesReceiver(script) as receiver:
        exporter = _exporter(receiver.url, upload_interval=0.1)
        windows = iter([_window((_labels(0), 5))])
        exporter.start(lambda: next(windows, Window(time.time_ns(), StackTables())))
        deadline = time.monotonic() + 10
        while not receiver.received and time.monotonic() < deadline:
            time.sleep(0.02)
        exporter.stop()
    stats = exporter.stats()
    assert (stats["otlp_failures"], stats["otlp_retries"], stats["otlp_uploads"]) == (3, 3, 1)
    gaps = [later - earlier for earlier, later in itertools.pairwise(receiver.attempt_times)]
    # 0.05 s, then 0.1 s, then 0.2 s, each +-20%.
    assert gaps[1] > gaps[0] * 1.3
    assert gaps[2] > gaps[1] * 1.3
    for status in (500, 400):
        with OtlpProfilesReceiver([Response(status)]) as receiver:
            exporter = _exporter(receiver.url)
            exporter.start(_windows(lambda n: _window((_labels(n), 5))))
            exporter.stop()
        assert receiver.attempts == 1
        stats = exporter.stats()
        assert (stats["otlp_rejected"], stats["otlp_retries"], stats["otlp_uploads"]) == (1, 0, 0)


@pytest.mark.usefixtures("fresh_log_once")  # its retries must not silence later tests' logs
@pytest.mark.parametrize("value", ["\xb2", _YEAR_PAST_DATETIME])
def test_an_answer_whose_retry_after_does_not_parse_is_retried(value: str) -> None:
    """A 503 with such a Retry-After is retried after the back-off, not dropped as an error."""
    with OtlpProfilesReceiver([Response(503, (("Retry-After", value),))]) as receiver:
        exporter = _exporter(receiver.url, upload_interval=0.1)
        windows = iter([_window((_labels(0), 5))])
        exporter.start(lambda: next(windows, Window(time.time_ns(), StackTables())))
        deadline = time.monotonic() + 10
        while not receiver.received and time.monotonic() < deadline:
            time.sleep(0.02)
        exporter.stop()
    stats = exporter.stats()
    assert (stats["otlp_errors"], stats["otlp_dropped"]) == (0, 0)
    assert (stats["otlp_retries"], stats["otlp_uploads"]) == (1, 1)


def test_exporter_counts_a_partial_success() -> None:
    """A 200 whose response rejects profiles is an upload, and the rejected count is kept."""
    answer = ExportProfilesServiceResponse(
        partial_success=ExportProfilesPartialSuccess(rejected_profiles=1, error_message="bad")
    ).SerializeToString()
    with OtlpProfilesReceiver([Response(200, body=answer)]) as receiver:
        exporter = _exporter(receiver.url)
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
    stats = exporter.stats()
    assert (stats["otlp_uploads"], stats["otlp_rejected_profiles"]) == (1, 1)


def test_exporter_drops_the_oldest_windows_while_the_endpoint_is_down() -> None:
    """At most max_pending windows wait; older ones are dropped and counted; stop is bounded."""
    exporter = _exporter(
        f"http://127.0.0.1:{free_port()}/v1development/profiles",
        upload_interval=0.05,
        max_pending=2,
        backoff_initial=0.3,
        flush_timeout=0.3,
    )
    exporter.start(_windows(lambda n: _window((_labels(n), 5))))
    deadline = time.monotonic() + 10
    while exporter.stats()["otlp_dropped"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exporter.stats()["otlp_pending"] <= 2
    started = time.monotonic()
    exporter.stop()
    assert time.monotonic() - started < 3.0
    stats = exporter.stats()
    assert stats["otlp_dropped"] >= 3
    assert stats["otlp_failures"] >= 1
    assert (stats["otlp_uploads"], stats["otlp_pending"]) == (0, 0)


@pytest.fixture
def hanging_endpoint() -> Iterator[str]:
    """A listener that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1development/profiles"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def test_stop_is_bounded_when_the_endpoint_hangs(hanging_endpoint: str) -> None:
    """A never-answering endpoint holds stop() no longer than the flush budget allows."""
    exporter = _exporter(hanging_endpoint, flush_timeout=0.5, timeout=5.0)
    exporter.start(_windows(lambda n: _window((_labels(n), 5))))
    started = time.monotonic()
    exporter.stop()
    assert time.monotonic() - started < 2.5
    stats = exporter.stats()
    assert (stats["otlp_uploads"], stats["otlp_dropped"]) == (0, 1)


def test_exporter_measures_its_steps() -> None:
    """Every encoding step is timed: the longest is known and short."""
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(receiver.url)
        body = exporter.encode(_window(*((_labels(n), n + 1) for n in range(500))))
    request = ExportProfilesServiceRequest.FromString(gzip.decompress(body))
    assert len(list(flatten(request))) == 500
    stats = exporter.stats()
    assert stats["otlp_export_steps"] >= 2
    assert 0 < stats["otlp_max_export_step_us"] < 20_000


# --- the fan-out ---------------------------------------------------------------------------------


def _numbered() -> tuple[Callable[[], Window], list[Window]]:
    taken: list[Window] = []
    tables = StackTables()

    def take() -> Window:
        window = Window(len(taken), tables, {(0, LabelSet({"n": str(len(taken))})): 1})
        taken.append(window)
        return window

    return take, taken


def test_fanout_gives_every_exporter_every_window_once() -> None:
    """Alternating exporters each see each window; the sampler is drained once per interval."""
    take, taken = _numbered()
    fanout = WindowFanout(take, 2)
    a, b = fanout.collector(0), fanout.collector(1)
    seen_a = [a(), a()]
    seen_b = [b(), b(), b()]
    seen_a.append(a())
    names_a = [sorted(label["n"] for _sid, label in w.values) for w in seen_a]
    names_b = [sorted(label["n"] for _sid, label in w.values) for w in seen_b]
    # b found windows 0 and 1 waiting (merged into one), then drained the sampler twice (2, 3),
    # which a then found waiting.
    assert names_b == [["0", "1"], ["2"], ["3"]]
    assert names_a == [["0"], ["1"], ["2", "3"]]
    assert len(taken) == 4
    assert fanout.collector(0) is not take
    assert WindowFanout(take, 1).collector(0) is take


def test_fanout_bounds_a_stuck_exporters_backlog() -> None:
    """Windows waiting for a stuck exporter are merged; beyond the bound the oldest go."""
    take, _taken = _numbered()
    fanout = WindowFanout(take, 2, max_backlog=3)
    a, b = fanout.collector(0), fanout.collector(1)
    for _ in range(20):
        a()
    window = b()
    names = sorted(int(label["n"]) for _sid, label in window.values)
    assert names == list(range(20))
    assert fanout.dropped == 0
    fanout.max_backlog = 1
    swaps = [Window(i, StackTables(), {(0, EMPTY): 1}) for i in range(4)]
    fanout._take = iter(swaps).__next__
    for _ in range(4):
        a()
    # Each window had its own tables (a swap each time): only the newest one is kept.
    assert b() is swaps[-1]
    assert fanout.dropped == 3


def test_stop_all_flushes_exporters_side_by_side() -> None:
    """Two exporters that each need 0.5 s to flush stop in about 0.5 s, not 1 s."""
    from spanprof._profiling._exporters._fanout import WindowExporter, stop_all

    stopped: list[str] = []

    class Slow:
        def __init__(self, name: str) -> None:
            self.name = name

        def start(
            self, collect: Callable[[], Window], thread_init: Callable[[], None] | None = None
        ) -> None:
            return None

        def stop(self) -> None:
            time.sleep(0.5)
            stopped.append(self.name)

        def stats(self) -> dict[str, float]:
            return {}

    exporters: list[WindowExporter] = [Slow("a"), Slow("b")]
    started = time.monotonic()
    stop_all(exporters)
    assert time.monotonic() - started < 0.9
    assert sorted(stopped) == ["a", "b"]


# One span's labels, set around the child's work in _run_backend_child.
_CHILD_SPAN = {"span_id": "00f067aa0ba902b7", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}


def _run_backend_child(
    pyroscope_url: str, otlp_url: str, service: str, options: str, work: str
) -> None:
    """Run an ``ExactBackend(server_address=pyroscope_url, application_name=service,
    exporters="pyroscope,otlp", <options>)`` in a child process (its signal handler and OTLP
    variables its own, ``OTEL_SERVICE_NAME=service``) around ``work`` (statements, one per
    line) under ``_CHILD_SPAN``'s labels; it flushes both at its shutdown. The child must exit
    0."""
    body = textwrap.indent(textwrap.dedent(work).strip(), "    ")
    script = (
        "import time\n"
        "import spanprof\n"
        "from spanprof._labels._labelset import LabelSet\n"
        "from spanprof._labels._scope import labels_scope\n"
        "from spanprof._profiling._exact import ExactBackend\n"
        f"backend = ExactBackend(server_address={pyroscope_url!r}, application_name={service!r}, "
        f"exporters='pyroscope,otlp', {options})\n"
        "spanprof.engine.install_label_engine(backend)\n"
        "backend.start()\n"
        f"with labels_scope(LabelSet({_CHILD_SPAN!r})):\n"
        f"{body}\n"
        "backend.shutdown()\n"
    )
    env = {
        "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}",
        "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": otlp_url,
        "OTEL_SERVICE_NAME": service,
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_backend_with_both_exporters_sends_every_sample_to_both(tmp_path: Path) -> None:
    """ExactBackend(exporters="pyroscope,otlp") ships the same samples to both endpoints."""
    from spanprof._local._receiver import PushReceiver

    from .conftest import require

    require(sys.platform.startswith("linux"), "the exact sampler needs Linux")
    with PushReceiver() as pyroscope, OtlpProfilesReceiver() as otlp:
        _run_backend_child(
            pyroscope.url,
            otlp.url,
            "both",
            "upload_interval=1, sample_rate=250",
            """
            end = time.thread_time() + 0.4
            while time.thread_time() < end:
                pass
            """,
        )
        pprof_total = sum(s.value for s in pyroscope.samples() if s.label_values("span_id"))
        otlp_samples = otlp.samples()
        assert otlp.errors == []
    otlp_total = sum(s.value for s in otlp_samples if s.label_values("span_id"))
    assert pprof_total > 200_000_000
    assert otlp_total == pprof_total
    assert {s.label_values("trace_id") for s in otlp_samples if s.label_values("span_id")} == {
        ("4bf92f3577b34da6a3ce929d0e0e4736",)
    }


def test_wall_clock_profiles_are_wall_time_in_both_exporters() -> None:
    """clock="wall": the push is Pyroscope's wall profile (``__name__=wall``, sample and period
    type wall/nanoseconds) and the OTLP profile wall/nanoseconds too; neither is CPU (a labelled
    sleep has wall time and almost no CPU)."""
    from spanprof._local._receiver import PushReceiver

    from .conftest import require

    require(sys.platform.startswith("linux"), "the exact sampler needs Linux")
    with PushReceiver() as pyroscope, OtlpProfilesReceiver() as otlp:
        _run_backend_child(
            pyroscope.url,
            otlp.url,
            "wall",
            'upload_interval=3600, sample_rate=200, clock="wall", memory=False',
            """
            end = time.monotonic() + 0.4
            while time.monotonic() < end:
                time.sleep(0.01)
            """,
        )
        series = pyroscope.series()
        pushed = pyroscope.samples("wall")
        assert pyroscope.samples("process_cpu") == []
        requests = otlp.requests()
        exported = otlp.samples("wall:nanoseconds:wall:nanoseconds")
        assert pyroscope.errors == []
        assert otlp.errors == []
    assert {s.label("__name__") for s in series} == {"wall"}
    profiles = [profile for s in series for profile in s.profiles]
    assert {(p.sample_types, p.period_type, p.period) for p in profiles} == {
        ((("wall", "nanoseconds"),), ("wall", "nanoseconds"), 5_000_000)
    }
    assert [model_violations(r) for r in requests] == [[]]
    kinds = {profile_type(r, p) for r in requests for p in profiles_of(r)}
    assert kinds == {"wall:nanoseconds:wall:nanoseconds"}
    assert [p.period for r in requests for p in profiles_of(r)] == [5_000_000]
    # The sleep's 0.4 s of wall time, on the labelled span, in both.
    pushed_total = sum(s.value for s in pushed if s.label_values("span_id"))
    assert 0.3e9 < pushed_total < 0.6e9
    assert sum(s.value for s in exported if s.label_values("span_id")) == pushed_total


# --- local mode's receiver -----------------------------------------------------------------------


def test_local_receiver_takes_otlp_profiles_as_pyroscope_would() -> None:
    """POST /v1development/profiles: process_cpu series of the resource's service, samples in
    CPU nanoseconds labelled with their link's span_id and trace_id."""
    from spanprof._local._receiver import PushReceiver

    with PushReceiver() as receiver:
        exporter = _exporter(receiver.url + "/v1development/profiles")
        exporter.start(
            _windows(lambda n: _window((_labels(n, tenant="acme"), 30_000_000), (EMPTY, 5)))
        )
        exporter.stop()
        samples = receiver.samples()
        assert receiver.errors == []
        assert exporter.stats()["otlp_uploads"] == 1
    assert {s.series_label("__name__") for s in samples} == {"process_cpu"}
    assert {s.series_label("service_name") for s in samples} == {"checkout"}
    labelled, unlabelled = samples
    assert dict(labelled.labels) == dict(_labels(0, tenant="acme"))
    assert (labelled.value, unlabelled.value, unlabelled.labels) == (30_000_000, 5, ())
    assert [f.function for f in labelled.stack] == ["_leaf", "_root"]


def test_local_receiver_decodes_like_the_generated_classes_and_rejects_garbage() -> None:
    """The hand-written decoder agrees with opentelemetry-proto on a large request; a body
    that is not one is a 400, recorded."""
    import http.client

    from spanprof._local._receiver import PushReceiver
    from spanprof._profiling._encoders._otlp import decode_export_request

    tables = StackTables()
    codes = [fn.__code__ for fn in (_leaf, _root, _labels, _window, _encode, flatten)]
    window = Window(time.time_ns(), tables)
    for n in range(300):
        key = tuple(tables.raw_frame(codes[(n + d) % len(codes)], d, d + 1) for d in range(12))
        window.values[(tables.stack_of(key), _labels(n % 40))] = n + 1
    window.end_ns = window.start_ns + 1
    encoder = OtlpEncoder(window, resource=encode_resource(RESOURCE), scope=encode_scope())
    while not encoder.step():
        pass
    request = ExportProfilesServiceRequest()
    request.ParseFromString(encoder.request)
    ours = [
        (s.stack, s.values[0], sorted(s.labels))
        for series in decode_export_request(encoder.request)
        for p in series.profiles
        for s in p.samples
    ]
    theirs = [(s.stack, s.value, sorted(s.labels)) for s in flatten(request)]
    assert ours == theirs
    with PushReceiver() as receiver:
        conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=5)
        conn.request(
            "POST",
            "/v1development/profiles",
            body=b"\x0a\x05garbage",
            headers={"Content-Type": "application/x-protobuf"},
        )
        status = conn.getresponse().status
        conn.close()
        assert status == 400
        assert len(receiver.errors) == 1
        assert receiver.pushes == 0


# --- gRPC ----------------------------------------------------------------------------------------


def _grpc_exporter(port: int, **options: Any) -> OtlpExporter:
    settings = OtlpSettings(
        endpoint=f"http://127.0.0.1:{port}",
        protocol="grpc",
        timeout=2.0,
        headers=(("Authorization", "Bearer t"),),
    )
    defaults: dict[str, Any] = {
        "upload_interval": 0.1,
        "backoff_initial": 0.05,
        "backoff_max": 0.4,
        "flush_timeout": 2.0,
        "resource_attributes": lambda: RESOURCE,
    }
    return OtlpExporter(settings, **{**defaults, **options})


def _require_grpc() -> None:
    from spanprof._profiling._exporters._otlp_grpc import grpc_available

    from .conftest import require

    require(grpc_available(), "grpcio (the grpc extra) is not installed")


def _grpc_export_one_window(receiver: GrpcProfilesReceiver) -> OtlpExporter:
    """An exporter to ``receiver`` that sends one window (retried as the answers say) and is
    stopped once the receiver has accepted it, or after 10 s."""
    exporter = _grpc_exporter(receiver.port)
    windows = iter([_window((_labels(0), 10_000_000))])
    exporter.start(lambda: next(windows, Window(time.time_ns(), StackTables())))
    deadline = time.monotonic() + 10
    while not receiver.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    exporter.stop()
    return exporter


def test_grpc_export_sends_the_same_request_and_retries_by_the_otlp_grpc_rules() -> None:
    """UNAVAILABLE is retried with back-off, RESOURCE_EXHAUSTED after its RetryInfo delay; the
    request decodes with the generated classes; headers arrive as metadata."""
    _require_grpc()
    with GrpcProfilesReceiver(["unavailable", "exhausted"]) as receiver:
        exporter = _grpc_export_one_window(receiver)
    stats = exporter.stats()
    assert (stats["otlp_failures"], stats["otlp_retries"], stats["otlp_uploads"]) == (2, 2, 1)
    (request,) = receiver.requests
    assert model_violations(request) == []
    (sample,) = flatten(request)
    assert dict(sample.labels) == dict(_labels(0))
    assert receiver.metadata[0]["authorization"] == "Bearer t"
    _unavailable, exhausted, accepted = receiver.times
    assert accepted - exhausted >= 0.95


def test_grpc_export_waits_as_long_as_the_retry_info_of_an_unavailable_says() -> None:
    """OTLP/gRPC throttling is UNAVAILABLE with a RetryInfo: retried after its delay (1 s), as
    a 503's Retry-After is, not after the back-off (0.05 s)."""
    _require_grpc()
    with GrpcProfilesReceiver(["throttled"]) as receiver:
        exporter = _grpc_export_one_window(receiver)
    stats = exporter.stats()
    assert (stats["otlp_failures"], stats["otlp_retries"], stats["otlp_uploads"]) == (1, 1, 1)
    throttled, accepted = receiver.times
    assert accepted - throttled >= 0.95


def test_grpc_export_drops_what_the_server_rejects() -> None:
    """INVALID_ARGUMENT is not retried: the window is dropped and counted as rejected."""
    _require_grpc()
    with GrpcProfilesReceiver(["invalid"]) as receiver:
        exporter = _grpc_exporter(receiver.port, upload_interval=60.0)
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
    stats = exporter.stats()
    assert (stats["otlp_rejected"], stats["otlp_retries"], stats["otlp_uploads"]) == (1, 0, 0)
    assert len(receiver.times) == 1


def test_grpc_settings_from_the_environment() -> None:
    """With protocol grpc the endpoint gets no path; host:port is allowed, secure by default."""
    _require_grpc()
    from spanprof._profiling._exporters._otlp_grpc import GrpcTransport

    settings = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert settings.endpoint == "http://localhost:4317"
    assert (GrpcTransport(settings).target, GrpcTransport(settings).secure) == (
        "localhost:4317",
        False,
    )
    bare = OtlpSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_PROFILES_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317",
        }
    )
    assert (GrpcTransport(bare).target, GrpcTransport(bare).secure) == ("collector:4317", True)
    insecure = OtlpSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": "collector:4317",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }
    )
    assert GrpcTransport(insecure).secure is False
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_INSECURE"):
        OtlpSettings.from_env(
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "maybe"}
        )


@pytest.mark.parametrize(
    "target", ["collector:4317/otlp", "collector:4317//", "collector:4317?x=1"]
)
@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT"]
)
def test_a_grpc_target_with_a_path_is_refused_naming_the_variable(
    variable: str, target: str
) -> None:
    """host:port/path would be the channel's target verbatim and never connect."""
    _require_grpc()
    with pytest.raises(ValueError, match=f"{variable}.*without a path"):
        OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", variable: target})
    with pytest.raises(ValueError, match="endpoint"):
        OtlpSettings(endpoint=target, protocol="grpc")


def test_a_grpc_target_with_one_trailing_slash_connects() -> None:
    """host:port/ is host:port: the export reaches the server."""
    _require_grpc()
    with GrpcProfilesReceiver() as receiver:
        settings = OtlpSettings.from_env(
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"127.0.0.1:{receiver.port}/",
                "OTEL_EXPORTER_OTLP_INSECURE": "true",
            }
        )
        exporter = OtlpExporter(
            settings, upload_interval=60.0, resource_attributes=lambda: RESOURCE
        )
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
    assert exporter.stats()["otlp_uploads"] == 1
    assert len(receiver.requests) == 1


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("x-team=caf%C3%A9", "printable ASCII"),
        ("x-team=a%09b", "printable ASCII"),
        ("x-token-bin=abc", "-bin"),
        ("X-Token-Bin=abc", "-bin"),
        ("x!team=a", "metadata name"),
    ],
)
@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_PROFILES_HEADERS"]
)
def test_grpc_headers_grpcio_would_refuse_are_refused_naming_the_variable(
    variable: str, raw: str, problem: str
) -> None:
    """Over HTTP they are valid headers; as gRPC metadata grpcio refuses them in every call
    (or wants bytes, for '-bin'): with protocol grpc they are a ValueError at configuration."""
    _require_grpc()
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", variable: raw}
    with pytest.raises(ValueError, match=variable) as info:
        OtlpSettings.from_env(env)
    assert problem in str(info.value)
    ((key, value),) = parse_headers(variable, raw)
    with pytest.raises(ValueError, match=r"headers.*" + re.escape(problem)):
        OtlpSettings(endpoint="http://127.0.0.1:4317", protocol="grpc", headers=((key, value),))
    over_http = OtlpSettings.from_env({**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert over_http.headers == ((key, value),)


def test_grpc_client_certificate_holding_its_key_does_not_abort_the_process(
    tmp_path: Path,
) -> None:
    """A client certificate file that holds its key too (no ..._CLIENT_KEY) is accepted, as
    Python's ssl takes it over http/protobuf; over gRPC the key must reach grpcio as well: a
    certificate without one fails a CHECK in gRPC core, which aborts the whole process."""
    _require_grpc()
    import spanprof

    combined = tmp_path / "client-with-key.pem"
    combined.write_text((_TLS / "client.crt").read_text() + (_TLS / "client.key").read_text())
    script = textwrap.dedent(
        """
        from spanprof._profiling._exporters._otlp import OtlpExporter, OtlpSettings
        from tests.test_otlp import RESOURCE, _labels, _window

        exporter = OtlpExporter(
            OtlpSettings.from_env(),
            upload_interval=60.0,
            flush_timeout=1.0,
            resource_attributes=lambda: RESOURCE,
        )
        exporter.start(lambda: _window((_labels(0), 5)))
        exporter.stop()  # the export: nothing listens, so it is retried, then dropped
        print(exporter.stats()["otlp_dropped"])
        """
    )
    env = {
        "PYTHONPATH": f"{Path(spanprof.__file__).parents[1]}:{ROOT}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{free_port()}",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(combined),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_grpc_endpoint_credentials_go_as_authorization_metadata() -> None:
    """Over gRPC the endpoint's user:password@ is the same Basic authorization, as metadata,
    and the channel's target is the bare host:port."""
    _require_grpc()
    with GrpcProfilesReceiver() as receiver:
        settings = OtlpSettings.from_env(
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://alice:s3cret@127.0.0.1:{receiver.port}",
            }
        )
        assert settings.endpoint == f"http://127.0.0.1:{receiver.port}"
        exporter = OtlpExporter(
            settings, upload_interval=60.0, resource_attributes=lambda: RESOURCE
        )
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        exporter.stop()
    assert receiver.metadata[0]["authorization"] == _basic("alice", "s3cret")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT") as info:
        OtlpSettings.from_env(
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "a:s3cret@c:1"}
        )
    assert "s3cret" not in str(info.value)


def test_grpc_stop_cuts_an_export_in_flight_to_the_flush_budget() -> None:
    """stop() while an Export call waits on a server that never answers returns within the
    flush budget, though the call's own timeout is 30 s (gRPC's deadline is set per call, so
    only a cancel can shorten it once it is sent)."""
    _require_grpc()
    with GrpcProfilesReceiver(["hang", "hang", "hang"]) as receiver:
        settings = OtlpSettings(
            endpoint=f"http://127.0.0.1:{receiver.port}", protocol="grpc", timeout=30.0
        )
        exporter = OtlpExporter(
            settings,
            upload_interval=0.1,
            flush_timeout=0.5,
            resource_attributes=lambda: RESOURCE,
        )
        exporter.start(_windows(lambda n: _window((_labels(n), 5))))
        deadline = time.monotonic() + 10
        while not receiver.times and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.times, "the first Export never reached the server"
        thread = exporter._thread
        started = time.monotonic()
        exporter.stop()
        took = time.monotonic() - started
    assert thread is not None
    assert not thread.is_alive()
    # The call in flight and the flush share the 0.5 s budget.
    assert took < 1.2, took
    assert exporter.stats()["otlp_dropped"] >= 1
