"""End to end: uvicorn + Starlette + the default profiler's memory profiles, 16 requests at once."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from spanprof._local._receiver import PushReceiver, ReceivedSample
from spanprof._profiling._samplers._memory import memory_unavailable_reason

from .conftest import MEMORY_VERSIONS, require
from .e2e.memory_app import BLOCK, KEEP_EVERY, alloc_index
from .e2e.server import free_port, serve, uvicorn_argv
from .otlp_profiles import (
    MEMORY_PROFILE_TYPES,
    OtlpProfilesReceiver,
    memory_samples,
    profile_type,
    resource_attributes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.engine, MEMORY_VERSIONS]

CONCURRENCY = 16
SAMPLE_BYTES = 64 * 1024
KEYS = ("span_id", "trace_id", "span_name")


async def _fire(base: str, count: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/alloc/{i}") for i in range(count)))
        stats = (await client.get("/stats")).json()
    for response in responses:
        response.raise_for_status()
    return {i: response.json() for i, response in enumerate(responses)}, stats


def _bound(truth_bytes: float, sigmas: float = 4.0) -> float:
    """Relative error of a bytes estimate from blocks of BLOCK bytes sampled at SAMPLE_BYTES."""
    p = -math.expm1(-BLOCK / SAMPLE_BYTES)
    expected_samples = truth_bytes / BLOCK * p
    # + 2%: the kept lists' arrays, allocated in the same functions.
    return sigmas * math.sqrt((1 - p) / expected_samples) + 0.02


def _serve(
    loop: str, tmp_path: Path, env: dict[str, str]
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """The memory app under uvicorn with ``env``, 16 requests at once: their answers, stats."""
    require(sys.platform.startswith("linux"), "the exact profiler needs Linux")
    reason = memory_unavailable_reason()
    require(reason is None, reason or "")
    port = free_port()
    env = {
        **env,
        "PYROSCOPE_UPLOAD_INTERVAL": "1",
        # More samples than the default 512 KiB, so that per-request bounds are tight.
        "SPANPROF_ALLOC_SAMPLE_BYTES": str(SAMPLE_BYTES),
    }
    with serve(
        uvicorn_argv("tests.e2e.memory_app:app", port, loop),
        health_url=f"http://127.0.0.1:{port}/health",
        env=env,
        log_path=tmp_path / "server.log",
    ):
        return asyncio.run(_fire(f"http://127.0.0.1:{port}", CONCURRENCY))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_memory_samples_carry_the_allocating_requests_labels(loop: str, tmp_path: Path) -> None:
    """>= 99% of request bytes carry exactly their request's labels; estimates match the truth."""
    with PushReceiver() as receiver:
        env = {
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "e2e-memory",
        }
        results, stats = _serve(loop, tmp_path, env)
        pushes = receiver.received_pushes()
        samples = receiver.samples("memory")
        assert receiver.errors == []
    last = next(
        push
        for push in reversed(pushes)
        if any(series.label("__name__") == "memory" for series in push.series)
    )
    _check(loop, tmp_path, results, stats, samples, _memory_samples(last))


def test_otlp_memory_profiles_link_each_requests_allocations_to_its_span(tmp_path: Path) -> None:
    """SPANPROF_PROFILES_EXPORTER=otlp: the same, as OTLP memory profiles decoded with
    opentelemetry-proto's classes, the model's rules kept, each allocation's Link its span."""
    with OtlpProfilesReceiver() as receiver:
        env = {
            "SPANPROF_PROFILES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT": receiver.url,
            "OTEL_SERVICE_NAME": "e2e-memory-otlp",
        }
        results, stats = _serve("asyncio", tmp_path, env)
        requests = receiver.requests()
        assert receiver.errors == []
    memory = [
        request
        for request in requests
        if any(profile_type(request, p) in MEMORY_PROFILE_TYPES for p in _profiles_of(request))
    ]
    assert memory, requests
    assert {resource_attributes(r)["service.name"] for r in memory} == {"e2e-memory-otlp"}
    # (stats are read before the flush at shutdown, which sends most of the memory)
    assert stats["memory_otlp_dropped"] == stats["memory_otlp_rejected"] == 0, stats
    samples = [s for request in memory for s in memory_samples(request)]
    _check("otlp", tmp_path, results, stats, samples, memory_samples(memory[-1]))


def _profiles_of(request: Any) -> list[Any]:
    return [p for rp in request.resource_profiles for sp in rp.scope_profiles for p in sp.profiles]


def _check(
    loop: str,
    tmp_path: Path,
    results: dict[int, dict[str, Any]],
    stats: dict[str, Any],
    samples: list[ReceivedSample],
    last: list[ReceivedSample],
) -> None:
    """Every upload's memory ``samples`` and the ``last`` upload's (the flush at shutdown)
    against what each request says it allocated and kept."""
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log
    assert stats["mode"] == "exact", stats
    assert stats["memory_dropped"] == 0, stats
    assert stats["memory_lost_frees"] == 0, stats
    expected = {i: result["labels"] for i, result in results.items()}
    assert len({labels["span_id"] for labels in expected.values()}) == CONCURRENCY

    exact = wrong = unlabelled = double = background = background_labelled = 0
    slo_labelled = 0
    allocated: dict[int, int] = {}
    for sample in samples:
        alloc_space = sample.values[1]
        spans = sample.label_values("span_id")
        if len(spans) > 1:
            double += alloc_space
        names = [frame.function for frame in sample.stack]
        if "background_alloc" in names:
            background += alloc_space
            if spans:
                background_labelled += alloc_space
            continue
        index = alloc_index(names)
        if index is None:
            continue
        allocated[index] = allocated.get(index, 0) + alloc_space
        # The request's allocations waited for its SLO verdict (and in-use memory, a snapshot,
        # carries none).
        if tuple(sample.label_values("slo")) in (("ok",), ("breached",)):
            slo_labelled += alloc_space
        elif sample.label_values("slo"):
            wrong += alloc_space
        want = expected[index]
        if not spans:
            unlabelled += alloc_space
        elif all(sample.label_values(key) == (want[key],) for key in KEYS):
            exact += alloc_space
        else:
            wrong += alloc_space
    summary = (
        f"exact {exact}, wrong {wrong}, unlabelled {unlabelled}, double {double}, "
        f"background {background_labelled}/{background} labelled; {stats}"
    )
    print(loop, summary)
    request_total = exact + wrong + unlabelled
    assert request_total > 0, summary
    assert exact / request_total >= 0.99, summary
    assert slo_labelled / request_total >= 0.99, (slo_labelled, summary)
    assert double == 0, summary
    assert background > 0, summary
    assert background_labelled == 0, summary

    truth = {i: result["allocated"] for i, result in results.items()}
    for i in range(CONCURRENCY):
        assert allocated.get(i, 0) == pytest.approx(truth[i], rel=_bound(truth[i])), (i, summary)
    # Each span ended with what its sampled allocations stand for: the same samples as the
    # profiles' (all of them, the marker functions and the rest of the request's work).
    by_span: dict[str, int] = {}
    for sample in samples:
        spans = sample.label_values("span_id")
        if len(spans) == 1:
            by_span[spans[0]] = by_span.get(spans[0], 0) + sample.values[1]
    span_alloc = stats["span_alloc_bytes"]
    matched = 0
    for i in range(CONCURRENCY):
        span_id = expected[i]["span_id"]
        alloc_bytes = span_alloc[span_id]
        assert isinstance(alloc_bytes, int), (i, span_alloc)
        # All the request's sampled bytes: its marker functions' (checked against the truth
        # above) and the rest of its work.
        assert alloc_bytes >= allocated.get(i, 0) - 4 * (SAMPLE_BYTES + 1024), (i, alloc_bytes)
        # What the request allocates after its span ends (sending the last body chunk, ending
        # the span) is in the profiles only: now and then a sample of a small block there, each
        # weighing about SAMPLE_BYTES. Otherwise the two agree to the profiles' rounding.
        after = by_span[span_id] - alloc_bytes
        assert -16 <= after <= 4 * (SAMPLE_BYTES + 1024), (i, alloc_bytes, by_span[span_id])
        matched += abs(after) <= 16
    assert matched >= CONCURRENCY // 2, (matched, span_alloc, by_span)
    pooled = sum(truth.values())
    assert sum(allocated.values()) == pytest.approx(pooled, rel=_bound(pooled))

    # In use at the last upload (the flush at shutdown): the kept quarter, not the freed rest.
    inuse: dict[int, int] = {}
    for sample in last:
        index = alloc_index([frame.function for frame in sample.stack])
        if index is not None and sample.label_values("span_id") == (expected[index]["span_id"],):
            inuse[index] = inuse.get(index, 0) + sample.values[3]
    for i in range(CONCURRENCY):
        kept = results[i]["kept"]
        assert kept == truth[i] // KEEP_EVERY
        assert inuse.get(i, 0) == pytest.approx(kept, rel=_bound(kept)), (i, inuse, kept)
    assert sum(inuse.values()) == pytest.approx(pooled / KEEP_EVERY, rel=_bound(pooled / 4))


def _memory_samples(push: Any) -> list[ReceivedSample]:
    out: list[ReceivedSample] = []
    for series in push.series:
        if series.label("__name__") != "memory":
            continue
        for profile in series.profiles:
            for s in profile.samples:
                out.append(ReceivedSample(series.labels, s.stack, s.value, s.labels, 0.0, s.values))
    return out
