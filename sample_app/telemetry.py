"""Tracing and metrics for the sample services: OTLP when configured, in process otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

__all__ = ["setup_telemetry"]


def setup_telemetry(service_name: str, environ: Mapping[str, str] = os.environ) -> None:
    """Install SDK tracer and meter providers unless the process already has a tracer provider.

    With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans and metrics (the request-duration histogram
    with its SLO-breach exemplars) go out over OTLP/HTTP; without it, spans stay in process
    (``spanprof dev`` adds its own span processor to this provider).
    """
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return  # spanprof dev, a test or an outer setup owns tracing
    named = bool(environ.get("OTEL_SERVICE_NAME"))
    resource = Resource.create({} if named else {"service.name": service_name})
    provider = TracerProvider(resource=resource)
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))
    trace.set_tracer_provider(provider)
