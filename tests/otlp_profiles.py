"""An OTLP profiles receiver on loopback that decodes with opentelemetry-proto's own classes.

``GrpcProfilesReceiver`` is the same over gRPC (grpcio), with a scripted outcome per call.
``OtlpProfilesReceiver`` accepts ``POST /v1development/profiles`` (``application/x-protobuf``,
gzip or not), parses each body as ``ExportProfilesServiceRequest`` with the generated classes,
and records the data-model violations ``model_violations`` finds. ``responses`` scripts what
it answers (status, headers, body), one entry per request, then 200. ``samples()`` flattens
the CPU profiles' samples (``flatten``), ``memory_samples()`` joins the four memory profiles'
samples into pprof-like rows of four values (``memory_samples``).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.profiles.v1development.profiles_pb2 import Profile

from spanprof._local._receiver import ReceivedSample
from spanprof._profiling._window import Frame

__all__ = [
    "CPU_PROFILE_TYPE",
    "MEMORY_PROFILE_TYPES",
    "GrpcProfilesReceiver",
    "OtlpProfilesReceiver",
    "Response",
    "flatten",
    "memory_samples",
    "model_violations",
    "profile_type",
    "resource_attributes",
]

PATH = "/v1development/profiles"


@dataclass(frozen=True)
class Response:
    """What the receiver answers one request with."""

    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


@dataclass(frozen=True)
class Received:
    """One decoded request and the headers it came with (names lower-cased)."""

    headers: dict[str, str]
    raw_size: int
    request: ExportProfilesServiceRequest
    #: The body as it came (compressed, when it was).
    body: bytes


def _any(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def resource_attributes(request: ExportProfilesServiceRequest) -> dict[str, object]:
    """The first resource's attributes, by key."""
    resource = request.resource_profiles[0].resource
    return {kv.key: _any(kv.value) for kv in resource.attributes}


def model_violations(request: ExportProfilesServiceRequest) -> list[str]:
    """Every MUST of the profiles data model (v1development) that ``request`` breaks."""
    problems: list[str] = []
    d = request.dictionary
    tables: dict[str, Any] = {
        "mapping_table": d.mapping_table,
        "location_table": d.location_table,
        "function_table": d.function_table,
        "link_table": d.link_table,
        "attribute_table": d.attribute_table,
        "stack_table": d.stack_table,
    }
    if not d.string_table or d.string_table[0] != "":
        problems.append("string_table[0] is not ''")
    for name, table in tables.items():
        if not table:
            problems.append(f"{name} has no index 0")
            continue
        zero = table[0]
        if name == "link_table":
            if any(zero.trace_id) or any(zero.span_id):
                problems.append("link_table[0] is not the zero link")
        elif zero.ByteSize() != 0:
            problems.append(f"{name}[0] is not the zero value: {zero}")
    n_str = len(d.string_table)

    def strindex(where: str, idx: int) -> None:
        if not 0 <= idx < n_str:
            problems.append(f"{where}: string index {idx} out of range ({n_str})")

    for i, link in enumerate(d.link_table):
        if len(link.trace_id) != 16 or len(link.span_id) != 8:
            problems.append(f"link_table[{i}]: {len(link.trace_id)}/{len(link.span_id)} bytes")
        if i and not any(link.span_id):
            problems.append(f"link_table[{i}]: all-zero span id")
    for i, mapping in enumerate(d.mapping_table):
        strindex(f"mapping_table[{i}]", mapping.filename_strindex)
    for i, function in enumerate(d.function_table):
        for field in ("name_strindex", "system_name_strindex", "filename_strindex"):
            strindex(f"function_table[{i}].{field}", getattr(function, field))
        if i and not (function.name_strindex or function.filename_strindex):
            problems.append(f"function_table[{i}] has neither name nor file")
    for i, location in enumerate(d.location_table):
        if not 0 <= location.mapping_index < len(d.mapping_table):
            problems.append(f"location_table[{i}]: mapping {location.mapping_index}")
        for line in location.lines:
            if not 0 < line.function_index < len(d.function_table):
                problems.append(f"location_table[{i}]: function {line.function_index}")
    for i, attribute in enumerate(d.attribute_table):
        strindex(f"attribute_table[{i}]", attribute.key_strindex)
        strindex(f"attribute_table[{i}].unit", attribute.unit_strindex)
    for i, stack in enumerate(d.stack_table):
        for loc in stack.location_indices:
            if not 0 < loc < len(d.location_table):
                problems.append(f"stack_table[{i}]: location {loc}")
    for rp in request.resource_profiles:
        keys = [kv.key for kv in rp.resource.attributes]
        if len(keys) != len(set(keys)):
            problems.append("duplicate resource attribute keys")
        for sp in rp.scope_profiles:
            for p, profile in enumerate(sp.profiles):
                strindex(f"profile {p} sample_type", profile.sample_type.type_strindex)
                strindex(f"profile {p} sample_type", profile.sample_type.unit_strindex)
                if len(profile.profile_id) != 16 or not any(profile.profile_id):
                    problems.append(f"profile {p}: profile_id {profile.profile_id!r}")
                for a in profile.attribute_indices:
                    if not 0 < a < len(d.attribute_table):
                        problems.append(f"profile {p}: attribute {a}")
                for s, sample in enumerate(profile.samples):
                    where = f"profile {p} sample {s}"
                    if not 0 <= sample.stack_index < len(d.stack_table):
                        problems.append(f"{where}: stack {sample.stack_index}")
                    if not 0 <= sample.link_index < len(d.link_table):
                        problems.append(f"{where}: link {sample.link_index}")
                    if not sample.values and not sample.timestamps_unix_nano:
                        problems.append(f"{where}: neither values nor timestamps")
                    keys_seen: set[int] = set()
                    for a in sample.attribute_indices:
                        if not 0 < a < len(d.attribute_table):
                            problems.append(f"{where}: attribute {a}")
                            continue
                        key = d.attribute_table[a].key_strindex
                        if key in keys_seen:
                            problems.append(f"{where}: duplicate attribute key")
                        keys_seen.add(key)
    return problems


CPU_PROFILE_TYPE = "samples:count:cpu:nanoseconds"
MEMORY_PROFILE_TYPES = tuple(
    f"{name}:{unit}:space:bytes"
    for name, unit in (
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    )
)


def profile_type(request: ExportProfilesServiceRequest, profile: Profile) -> str:
    """``type:unit:period_type:period_unit`` of ``profile``, as Pyroscope names profile types."""
    strings = request.dictionary.string_table
    return ":".join(
        strings[i]
        for i in (
            profile.sample_type.type_strindex,
            profile.sample_type.unit_strindex,
            profile.period_type.type_strindex,
            profile.period_type.unit_strindex,
        )
    )


def _profile_samples(
    request: ExportProfilesServiceRequest, profile: Profile, received_at: float
) -> Iterator[ReceivedSample]:
    d = request.dictionary
    strings = d.string_table
    kind = profile_type(request, profile)
    # As Pyroscope converts it: CPU samples counted in periods become CPU nanoseconds.
    scale = profile.period if kind == CPU_PROFILE_TYPE else 1
    for sample in profile.samples:
        stack = []
        for loc in d.stack_table[sample.stack_index].location_indices:
            for line in d.location_table[loc].lines:
                function = d.function_table[line.function_index]
                stack.append(
                    Frame(
                        strings[function.name_strindex],
                        strings[function.filename_strindex],
                        line.line,
                    )
                )
        labels: list[tuple[str, str]] = []
        for a in sample.attribute_indices:
            attribute = d.attribute_table[a]
            labels.append((strings[attribute.key_strindex], str(_any(attribute.value))))
        if sample.link_index:
            link = d.link_table[sample.link_index]
            labels.append(("span_id", link.span_id.hex()))
            labels.append(("trace_id", link.trace_id.hex()))
        value = sum(sample.values) * scale
        yield ReceivedSample(
            series_labels=(("profile_type", kind),),
            stack=tuple(stack),
            value=value,
            labels=tuple(labels),
            received_at=received_at,
            values=(value,),
        )


def profiles_of(request: ExportProfilesServiceRequest) -> Iterator[Profile]:
    """Every profile of ``request``, in order."""
    for rp in request.resource_profiles:
        for sp in rp.scope_profiles:
            yield from sp.profiles


def flatten(
    request: ExportProfilesServiceRequest, received_at: float = 0.0
) -> Iterator[ReceivedSample]:
    """Each sample as a ``ReceivedSample``: its link as ``span_id``/``trace_id`` hex labels
    (as Pyroscope's OTLP ingest makes them), its string attributes as the other labels, its
    profile's type as the series label ``profile_type``."""
    for profile in profiles_of(request):
        yield from _profile_samples(request, profile, received_at)


def memory_samples(
    request: ExportProfilesServiceRequest, received_at: float = 0.0
) -> list[ReceivedSample]:
    """The memory profiles' samples joined per (stack, labels), as the pprof push carries them:
    ``values`` are (alloc_objects, alloc_space, inuse_objects, inuse_space), 0 where a profile
    has no sample; ``value`` is the first."""
    rows: dict[tuple[tuple[Frame, ...], tuple[tuple[str, str], ...]], list[int]] = {}
    for profile in profiles_of(request):
        kind = profile_type(request, profile)
        if kind not in MEMORY_PROFILE_TYPES:
            continue
        position = MEMORY_PROFILE_TYPES.index(kind)
        for sample in _profile_samples(request, profile, received_at):
            row = rows.setdefault((sample.stack, tuple(sorted(sample.labels))), [0, 0, 0, 0])
            row[position] += sample.value
    return [
        ReceivedSample(
            series_labels=(("__name__", "memory"),),
            stack=stack,
            value=values[0],
            labels=labels,
            received_at=received_at,
            values=tuple(values),
        )
        for (stack, labels), values in rows.items()
    ]


def _samples(
    requests: list[ExportProfilesServiceRequest], kind: str | None
) -> list[ReceivedSample]:
    return [
        s
        for request in requests
        for s in flatten(request)
        if kind is None or s.series_label("profile_type") == kind
    ]


class OtlpProfilesReceiver:
    """A threaded HTTP/1.1 OTLP profiles endpoint on ``127.0.0.1``; use as a context manager."""

    def __init__(self, responses: list[Response] | None = None) -> None:
        self.responses = list(responses or [])
        self.received: list[Received] = []
        self.errors: list[str] = []
        self.attempts = 0
        self.attempt_times: list[float] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                answer = receiver._handle(self.path, headers, body)
                self.send_response(answer.status)
                for name, value in answer.headers:
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> Response:
        with self._lock:
            self.attempts += 1
            self.attempt_times.append(time.monotonic())
            scripted = self.responses.pop(0) if self.responses else None
        if path != PATH:
            return Response(404)
        if headers.get("content-type") != "application/x-protobuf":
            return Response(415)
        if scripted is not None and scripted.status != 200:
            return scripted
        try:
            raw = gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body
            request = ExportProfilesServiceRequest.FromString(raw)
            problems = model_violations(request)
        except Exception as exc:
            with self._lock:
                self.errors.append(repr(exc))
            return Response(400)
        with self._lock:
            self.errors.extend(problems)
            self.received.append(Received(headers, len(raw), request, body))
        return scripted or Response()

    def requests(self) -> list[ExportProfilesServiceRequest]:
        """Every accepted request, oldest first."""
        with self._lock:
            return [r.request for r in self.received]

    def samples(self, kind: str | None = CPU_PROFILE_TYPE) -> list[ReceivedSample]:
        """Every sample of every accepted request's profiles of type ``kind`` (default CPU;
        ``None``: all), flattened."""
        return _samples(self.requests(), kind)

    def memory_samples(self) -> list[ReceivedSample]:
        """Every accepted request's memory samples (``memory_samples``)."""
        return [s for request in self.requests() for s in memory_samples(request)]

    @property
    def url(self) -> str:
        """The profiles endpoint, e.g. ``http://127.0.0.1:PORT/v1development/profiles``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{PATH}"

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``, for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> OtlpProfilesReceiver:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class GrpcProfilesReceiver:
    """A gRPC ProfilesService on loopback answering each Export with the next scripted outcome."""

    def __init__(self, script: list[str] | None = None) -> None:
        import concurrent.futures

        import grpc

        self.script = list(script or [])
        self.requests: list[ExportProfilesServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.times: list[float] = []
        self.errors: list[str] = []
        #: Set to let "hang" calls end (done at exit, so the server stops at once).
        self.release = threading.Event()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.profiles.v1development.ProfilesService",
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self._export, request_deserializer=None, response_serializer=None
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def _export(self, body: bytes, context: Any) -> bytes:
        import grpc
        from google.protobuf.duration_pb2 import Duration
        from google.rpc import error_details_pb2, status_pb2

        self.times.append(time.monotonic())
        outcome = self.script.pop(0) if self.script else "ok"
        if outcome == "hang":
            # Never answers in time: only the caller's deadline, a cancel or stop ends it.
            self.release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung")
        if outcome == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "down for a moment")
        if outcome == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        if outcome in ("exhausted", "throttled"):
            # OTLP/gRPC throttling is UNAVAILABLE with a RetryInfo; RESOURCE_EXHAUSTED is
            # retryable only with one.
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            if outcome == "throttled":
                code = grpc.StatusCode.UNAVAILABLE
            status = status_pb2.Status(code=code.value[0], message="slow down")
            status.details.add().Pack(
                error_details_pb2.RetryInfo(retry_delay=Duration(seconds=1, nanos=0))
            )
            context.set_trailing_metadata(
                (("grpc-status-details-bin", status.SerializeToString()),)
            )
            context.abort(code, "slow down")
        request = ExportProfilesServiceRequest()
        request.ParseFromString(body)
        self.errors.extend(model_violations(request))
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        return b""

    def samples(self, kind: str | None = CPU_PROFILE_TYPE) -> list[ReceivedSample]:
        """Every sample of every accepted request's profiles of type ``kind`` (default CPU;
        ``None``: all), flattened."""
        return _samples(list(self.requests), kind)

    def __enter__(self) -> GrpcProfilesReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.stop(grace=None)
