"""SLO-breach exemplars: slow requests link the duration histogram to their exact span."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from spanprof import ProfilingMiddleware, SloPolicy

from .conftest import histogram_points


async def _sleepy(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("sleep", "0")))
    return PlainTextResponse("ok")


async def _fail(request: Request) -> Response:
    raise ValueError("nope")


async def _stream(request: Request) -> Response:
    async def body() -> Any:
        for _ in range(3):
            await asyncio.sleep(0.03)
            yield b"chunk"

    return StreamingResponse(body())


def _app() -> Starlette:
    return Starlette(
        routes=[
            Route("/checkout", _sleepy),
            Route("/search", _sleepy),
            Route("/fail", _fail),
            Route("/stream", _stream),
        ]
    )


def _server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


def _run(app: Any, requests: list[str]) -> list[int]:
    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get(path)).status_code for path in requests]

    return asyncio.run(main())


def test_spans_near_their_threshold_carry_the_verdict_the_short_ones_none(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """Past half its threshold a good span says ``breached=false``: a reader comparing the
    span's own duration (which ends after the last body message) takes the middleware's word;
    a short request carries no SLO attribute at all."""
    app = ProfilingMiddleware(
        _app(),
        profiler=None,
        tracer_provider=tracer_provider,
        route_slos={"/checkout": 0.1},
        environ={},
    )
    sleeps = ["0", "0.07", "0.15"]  # short, within but near, breached
    assert _run(app, [f"/checkout?sleep={s}" for s in sleeps]) == [200] * 3
    spans = sorted(
        _server_spans(span_exporter), key=lambda s: (s.end_time or 0) - (s.start_time or 0)
    )
    marks = [
        (
            (s.attributes or {}).get("spanprof.slo.breached"),
            (s.attributes or {}).get("spanprof.slo.threshold_s"),
        )
        for s in spans
    ]
    assert marks == [(None, None), (False, None), (True, 0.1)]


def test_exemplars_exactly_for_breaching_requests(
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Fast and slow requests on two routes with different SLOs: exemplars only for breaches."""
    app = ProfilingMiddleware(
        _app(),
        profiler=None,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        slo_seconds=0.2,
        route_slos={"/checkout": 0.05},
        environ={},
    )
    statuses = _run(
        app,
        [
            "/checkout?sleep=0",  # within 0.05
            "/checkout?sleep=0.08",  # breach (0.05)
            "/search?sleep=0.08",  # within 0.2
            "/search?sleep=0",  # within
            "/search?sleep=0.25",  # breach (0.2)
        ],
    )
    assert statuses == [200] * 5
    spans = _server_spans(span_exporter)
    assert len(spans) == 5
    breached = {
        s.context.span_id: s for s in spans if (s.attributes or {}).get("spanprof.slo.breached")
    }
    assert len(breached) == 2
    for span in breached.values():
        assert span.attributes is not None
        threshold = span.attributes["spanprof.slo.threshold_s"]
        assert threshold == (0.05 if span.attributes["http.route"] == "/checkout" else 0.2)
    points = histogram_points(metric_reader, "http.server.request.duration")
    assert sum(p.count for p in points) == 5  # exactly one stream entry per request
    exemplars = [e for p in points for e in p.exemplars]
    assert {e.span_id for e in exemplars} == set(breached)
    for exemplar in exemplars:
        span = breached[exemplar.span_id]
        assert exemplar.trace_id == span.context.trace_id
        assert exemplar.value > float(span.attributes["spanprof.slo.threshold_s"])  # type: ignore[arg-type,index]
    routes = {(p.attributes or {})["http.route"] for p in points}
    assert routes == {"/checkout", "/search"}
    for point in points:
        assert point.attributes is not None
        assert point.attributes["http.request.method"] == "GET"
        assert point.attributes["http.response.status_code"] == 200
        assert "error.type" not in point.attributes


def test_failures_carry_error_type_and_streaming_counts_in_full(
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A raising handler records error.type and 500; a streaming body's time is included."""
    app = ProfilingMiddleware(
        _app(),
        profiler=None,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        environ={},
    )
    assert _run(app, ["/fail", "/stream"]) == [500, 200]
    points = {
        (p.attributes or {})["http.route"]: p
        for p in histogram_points(metric_reader, "http.server.request.duration")
    }
    fail = points["/fail"]
    assert fail.attributes is not None
    assert fail.attributes["error.type"] == "ValueError"
    assert fail.attributes["http.response.status_code"] == 500
    assert points["/stream"].sum >= 0.09


@pytest.mark.parametrize("mode", ["", "http", "http/dup"])
def test_one_duration_stream_in_every_semconv_mode(
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Whatever OTEL_SEMCONV_STABILITY_OPT_IN says, only spanprof's histogram is recorded."""
    from opentelemetry.instrumentation import _semconv
    from opentelemetry.metrics import set_meter_provider  # noqa: F401 - documents the global

    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", mode)
    monkeypatch.setattr(_semconv._OpenTelemetrySemanticConventionStability, "_initialized", False)
    app = ProfilingMiddleware(
        _app(),
        profiler=None,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        environ={},
    )
    _run(app, ["/search", "/search"])
    data = metric_reader.get_metrics_data()
    assert data is not None
    names = [m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert names == ["http.server.request.duration"]


def test_users_own_histogram_keeps_its_exemplars(
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Another instrument in the same provider still gets exemplars for fast requests."""
    user_histogram = meter_provider.get_meter("user").create_histogram("user.work")

    async def work(request: Request) -> Response:
        user_histogram.record(1.0)  # inside the (sampled) server span: default filter keeps it
        return PlainTextResponse("ok")

    app = ProfilingMiddleware(
        Starlette(routes=[Route("/work", work)]),
        profiler=None,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        slo_seconds=10,
        environ={},
    )
    assert _run(app, ["/work"]) == [200]
    (user_point,) = histogram_points(metric_reader, "user.work")
    assert len(user_point.exemplars) == 1
    assert user_point.exemplars[0].span_id is not None
    (ours,) = histogram_points(metric_reader, "http.server.request.duration")
    assert ours.exemplars == []


@pytest.mark.parametrize(
    ("kwargs", "environ", "setting"),
    [
        ({"slo_seconds": 0}, {}, "slo_seconds"),
        ({"slo_seconds": float("nan")}, {}, "slo_seconds"),
        ({}, {"SPANPROF_SLO_SECONDS": "fast"}, "SPANPROF_SLO_SECONDS"),
        ({}, {"SPANPROF_ROUTE_SLO": "/checkout:0.25"}, "SPANPROF_ROUTE_SLO"),
        ({}, {"SPANPROF_ROUTE_SLO": "checkout=0.25"}, "SPANPROF_ROUTE_SLO"),
        ({}, {"SPANPROF_ROUTE_SLO": "/checkout=-1"}, "SPANPROF_ROUTE_SLO"),
        ({"route_slos": {"/x": "soon"}}, {}, "route_slos"),
    ],
)
def test_bad_slo_settings_name_the_setting(
    kwargs: dict[str, Any], environ: dict[str, str], setting: str
) -> None:
    """Bad SLO options and variables raise ValueError naming the setting."""
    with pytest.raises(ValueError, match=setting):
        ProfilingMiddleware(_app(), profiler=None, environ=environ, **kwargs)


def test_slo_policy_reads_the_environment() -> None:
    """SPANPROF_SLO_SECONDS and SPANPROF_ROUTE_SLO configure the thresholds."""
    policy = SloPolicy.build(
        slo_seconds=None,
        route_slos=None,
        environ={"SPANPROF_SLO_SECONDS": "0.3", "SPANPROF_ROUTE_SLO": "/checkout=0.25, /s/{q}=1"},
    )
    assert policy.threshold(None) == 0.3
    assert policy.threshold("/other") == 0.3
    assert policy.threshold("/checkout") == 0.25
    assert policy.threshold("/s/{q}") == 1.0
    assert SloPolicy.build(slo_seconds=None, route_slos=None, environ={}).default == 0.5


def test_an_slo_in_code_that_the_environment_contradicts_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`spanprof dev` passes its SLO through the environment, which an SLO in code beats.

    Its page then judges the requests the middleware leaves unmarked (a 0.8 s request against
    a 2 s SLO) by the environment's 0.5 s: a breach on the page, none in the exemplars or the
    samples' ``slo`` label. The middleware says so once, naming both.
    """
    env = {"SPANPROF_SLO_SECONDS": "0.5", "SPANPROF_ROUTE_SLO": ""}
    with caplog.at_level("WARNING", logger="spanprof"):
        ProfilingMiddleware(_app(), profiler=None, slo_seconds=0.5, environ=env)
        ProfilingMiddleware(_app(), profiler=None, environ=env)
        assert not caplog.records  # the same SLO, or none in code: nothing to say
        ProfilingMiddleware(_app(), profiler=None, slo_seconds=2, environ=env)
        ProfilingMiddleware(_app(), profiler=None, slo=SloPolicy(default=3), environ=env)
    [record] = caplog.records
    assert "SPANPROF_SLO_SECONDS" in record.getMessage()
    assert "code: 2.0 s" in record.getMessage()
    assert "environment: 0.5 s" in record.getMessage()


def test_otlp_exporter_carries_the_breach_exemplars(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """The real OTLP/HTTP metric exporter sends exemplars with the breaching spans' ids."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from .otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{receiver.url}/v1/metrics"),
            export_interval_millis=60_000,
        )
        provider = MeterProvider(metric_readers=[reader])
        app = ProfilingMiddleware(
            _app(),
            profiler=None,
            tracer_provider=tracer_provider,
            meter_provider=provider,
            route_slos={"/checkout": 0.05},
            environ={},
        )
        assert _run(app, ["/checkout?sleep=0", "/checkout?sleep=0.08", "/search"]) == [200] * 3
        provider.force_flush()
        provider.shutdown()
        assert receiver.errors == []
        messages = list(receiver.metrics)
    exemplars = [
        exemplar
        for message in messages
        for rm in message.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "http.server.request.duration"
        for point in metric.histogram.data_points
        for exemplar in point.exemplars
    ]
    (breach,) = [
        s for s in _server_spans(span_exporter) if (s.attributes or {}).get("spanprof.slo.breached")
    ]
    assert len(exemplars) == 1
    assert exemplars[0].span_id == breach.context.span_id.to_bytes(8, "big")
    assert exemplars[0].trace_id == breach.context.trace_id.to_bytes(16, "big")
    assert exemplars[0].as_double > 0.05


def _prometheus_app(
    tracer_provider: TracerProvider, mount: bool = False, slo_seconds: float = 10
) -> tuple[Any, Any]:
    from starlette.routing import Mount

    from spanprof import PrometheusMetrics

    metrics = PrometheusMetrics()
    endpoint = (
        Mount("/metrics", app=metrics.asgi_app())
        if mount
        else Route("/metrics", metrics.asgi_app())
    )
    app = ProfilingMiddleware(
        Starlette(routes=[Route("/checkout", _sleepy), endpoint]),
        profiler=None,
        tracer_provider=tracer_provider,
        slo_seconds=slo_seconds,
        prometheus=metrics,
        environ={},
    )
    return app, metrics


def _scrape_routes(metrics: Any) -> set[str]:
    """The http_route label values of the histogram's observed series."""
    return {
        sample.labels["http_route"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name.endswith("_count") and sample.value > 0
    }


def test_prometheus_route_serves_metrics_exactly_and_scrapes_are_not_observed(
    tracer_provider: TracerProvider,
) -> None:
    """GET /metrics answers 200 (not a 307 to /metrics/); scrapes stay out of the histogram."""
    app, metrics = _prometheus_app(tracer_provider)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.get(p) for p in ("/checkout", "/metrics", "/metrics", "/metrics")]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 200, 200]
    assert "http_server_request_duration_seconds_bucket" in responses[-1].text
    assert 'http_route="/metrics"' not in responses[-1].text
    assert _scrape_routes(metrics) == {"/checkout"}


def test_prometheus_scrapes_through_an_old_style_mount_are_not_observed(
    tracer_provider: TracerProvider,
) -> None:
    """Apps still mounting the endpoint do not count its scrapes as /metrics/{path:path}."""
    app, metrics = _prometheus_app(tracer_provider, mount=True)
    assert _run(app, ["/metrics/", "/checkout"]) == [200, 200]
    assert _scrape_routes(metrics) == {"/checkout"}


def test_prometheus_exemplars_only_for_sampled_traces(tracer_provider: TracerProvider) -> None:
    """A breach in a sampled-out trace leaves no exemplar: its span is never exported, so the
    exemplar would point at a trace no backend has, and Prometheus keeps one exemplar per
    bucket: it replaced the sampled breach's. (The OTel histogram's filter already did this.)"""
    app, _metrics = _prometheus_app(tracer_provider, slo_seconds=1e-9)
    sampled, sampled_out = "ab" * 15 + "01", "ab" * 15 + "00"

    async def main() -> str:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for trace_id, flags in ((sampled, "01"), (sampled_out, "00")):
                parent = f"00-{trace_id}-cdcdcdcdcdcdcdcd-{flags}"
                response = await client.get("/checkout", headers={"traceparent": parent})
                assert response.status_code == 200
            accept = {"accept": "application/openmetrics-text; version=1.0.0"}
            return (await client.get("/metrics", headers=accept)).text

    text = asyncio.run(main())
    assert f'trace_id="{sampled}"' in text
    assert sampled_out not in text


def test_prometheus_path_must_be_a_route() -> None:
    """A path that is not a route (or is the root) is a ValueError naming ``path``."""
    from spanprof import PrometheusMetrics

    for bad in ("metrics", "/", ""):
        with pytest.raises(ValueError, match="path"):
            PrometheusMetrics(path=bad)


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ("/a=0.1,/a=5", r"SPANPROF_ROUTE_SLO=.*: the route '/a' is given twice"),
        (
            "/checkout=0.25;/search=1",
            r"SPANPROF_ROUTE_SLO: route '/checkout=0.25;/search' contains.*','",
        ),
        ("/a;b=1", r"SPANPROF_ROUTE_SLO: route '/a;b' contains.*','"),
    ],
)
def test_a_duplicate_route_or_a_wrong_separator_is_refused(routes: str, message: str) -> None:
    """SPANPROF_ROUTE_SLO refuses a route twice, or pairs glued together by ';'."""
    with pytest.raises(ValueError, match=message):
        SloPolicy.build(slo_seconds=None, route_slos=None, environ={"SPANPROF_ROUTE_SLO": routes})
