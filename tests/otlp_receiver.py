"""An OTLP/HTTP metrics receiver on loopback, built on the recording server."""

from __future__ import annotations

import gzip

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from .recording_server import PostedRequest, RecordingServer

__all__ = ["OtlpReceiver"]


class OtlpReceiver(RecordingServer):
    """Collects ``ExportMetricsServiceRequest`` messages posted to ``/v1/metrics``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.errors: list[str] = []

    def respond(self, request: PostedRequest) -> int:
        if request.path != "/v1/metrics":
            return 404
        body = request.body
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            message = ExportMetricsServiceRequest.FromString(body)
        except Exception as exc:
            with self._lock:
                self.errors.append(repr(exc))
            return 400
        with self._lock:
            self.metrics.append(message)
        return 200
