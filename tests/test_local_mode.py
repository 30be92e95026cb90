"""Local mode (``spanprof dev``): real agent pushes in, breaches, flame graphs, traces, pprof out.

The end-to-end tests run ``python -m spanprof dev`` in a subprocess (the pyroscope-io agent
starts once per process) serving ``make_app`` below: one deliberately slow request burns CPU in
its own marker function among fast ones burning in theirs.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels
from spanprof._local import (
    LocalMode,
    SampleStore,
    SpanStore,
    UiServer,
    detect_interface,
    import_app,
)
from spanprof._local._cli import main as cli_main
from spanprof._local._compare import SloComparison
from spanprof._local._receiver import ReceivedPush
from spanprof._local._slo import policy_env, policy_from
from spanprof._local._ui import _tree_json
from spanprof._logging import reset_log_once
from spanprof._profiling._encoders._memory import MEMORY_PERIOD_TYPE, MEMORY_SAMPLE_TYPES
from spanprof._profiling._encoders._pprof import ProfileBuilder, decode_profile
from spanprof._profiling._encoders._protowire import (
    as_bytes,
    as_int,
    as_str,
    iter_fields,
    put_bytes_field,
    put_packed_varints_field,
    unpack_varints,
)
from spanprof._profiling._encoders._push import (
    PUSH_CONTENT_TYPE,
    PUSH_PATH,
    PushSeries,
    encode_push_request,
)
from spanprof._profiling._window import Frame
from spanprof._web._routes import span_name_label

from .conftest import require
from .e2e.markers import MARKER_PREFIX, MARKERS
from .e2e.server import ROOT, free_port, serve, wait_ready

T = TypeVar("T")

SLO_SECONDS = 0.4
SLOW = 7
SLOW_CPU = 0.6
FAST = (1, 2, 3, 4, 5, 6)
FAST_CPU = 0.02
STEP = 0.01
# The slow request also allocates this much (in HOARD_BLOCK blocks) and keeps a quarter of it.
ALLOC_MB = 32
HOARD_BLOCK = 4000
KEEP_EVERY = 4
HOARD = "hoard_request_memory"
# What the slow request keeps: in use for the life of the subprocess, at every upload.
_KEPT: list[bytes] = []


def hoard_request_memory(megabytes: int) -> int:
    """Allocate ``megabytes`` in small blocks, keeping one in ``KEEP_EVERY`` (the in-use part)."""
    blocks = megabytes * 1_000_000 // HOARD_BLOCK
    for n in range(blocks):
        block = bytes(HOARD_BLOCK)
        if n % KEEP_EVERY == 0:
            _KEPT.append(block)
    return blocks


# -- the app the subprocess serves ------------------------------------------------------------


async def _work(request: Request) -> Response:
    marker = MARKERS[int(request.path_params["index"])]
    seconds = float(request.query_params.get("seconds", "0.02"))
    spent = 0.0
    while spent < seconds:  # 10 ms CPU steps, yielding so the requests interleave
        marker(STEP)
        spent += STEP
        await asyncio.sleep(0)
    megabytes = int(request.query_params.get("alloc_mb", "0"))
    if megabytes:  # last: the fast requests beside it are done by then, not held up
        hoard_request_memory(megabytes)
    return JSONResponse(dict(current_labels()))


async def _health(request: Request) -> Response:
    return PlainTextResponse("ok")


def make_app() -> ProfilingMiddleware:
    """The ASGI app ``spanprof dev --factory`` serves: each request burns in its own marker."""
    routes = [Route("/work/{index:int}", _work), Route("/health", _health)]
    return ProfilingMiddleware(Starlette(routes=routes))


def make_wsgi_app() -> Any:
    """The WSGI app for the local mode's WSGI path: the same markers, run by a thread."""
    from spanprof import WSGIProfilingMiddleware

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = str(environ.get("PATH_INFO", ""))
        if path == "/health":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        index = int(path.rpartition("/")[2])
        query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
        MARKERS[index](float(query.get("seconds", ["0.02"])[0]))
        megabytes = int(query.get("alloc_mb", ["0"])[0])
        if megabytes:
            hoard_request_memory(megabytes)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(dict(current_labels())).encode()]

    def route(environ: dict[str, Any]) -> str | None:
        return "/work/{index}" if str(environ.get("PATH_INFO", "")).startswith("/work/") else None

    return WSGIProfilingMiddleware(app, route_resolver=route)


# -- running it --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalRun:
    """A running ``spanprof dev`` and the labels each of its requests reported."""

    app: str
    ui: str
    labels: dict[int, dict[str, str]]


def get_json(url: str) -> Any:
    """GET ``url`` and decode its JSON body (raises for non-2xx)."""
    response = httpx.get(url, timeout=10)
    response.raise_for_status()
    return response.json()


@contextmanager
def running_local_mode(tmp: Path, spec: str, *extra: str) -> Iterator[tuple[str, str]]:
    """``python -m spanprof dev SPEC --factory`` on free ports; yields (app URL, page URL)."""
    port, ui_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "spanprof", "dev", spec, "--factory",
        "--port", str(port), "--ui-port", str(ui_port), "--slo", str(SLO_SECONDS),
        "--service-name", "local-mode-test", *extra,
    ]  # fmt: skip
    log = tmp / f"spanprof-dev-{port}.log"
    with serve(argv, health_url=f"http://127.0.0.1:{port}/health", env={}, log_path=log) as proc:
        ui = f"http://127.0.0.1:{ui_port}"
        wait_ready(f"{ui}/api/status", proc)
        yield f"http://127.0.0.1:{port}", ui
    text = log.read_text()
    assert "Traceback" not in text, text


def fire(
    app: str, requests: dict[int, float], alloc_mb: dict[int, int] | None = None
) -> dict[int, dict[str, str]]:
    """Send ``index -> CPU seconds`` requests at once (request ``i`` also allocating
    ``alloc_mb[i]`` MB); return each request's labels."""
    alloc = alloc_mb or {}

    def params(i: int, seconds: float) -> dict[str, float | int]:
        return {"seconds": seconds, **({"alloc_mb": alloc[i]} if i in alloc else {})}

    async def send() -> dict[int, dict[str, str]]:
        async with httpx.AsyncClient(base_url=app, timeout=60) as client:
            responses = await asyncio.gather(
                *(client.get(f"/work/{i}", params=params(i, s)) for i, s in requests.items())
            )
        for response in responses:
            response.raise_for_status()
        return {i: r.json() for i, r in zip(requests, responses, strict=True)}

    return asyncio.run(send())


def settle(ui: str, uploads: int = 2, timeout: float = 20.0) -> dict[str, Any]:
    """Wait until ``uploads`` more profile uploads arrived (every sample so far is in)."""
    start = get_json(f"{ui}/api/status")["profiles"]["pushes"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict[str, Any] = get_json(f"{ui}/api/status")
        if status["profiles"]["pushes"] >= start + uploads:
            return status
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {uploads} profile uploads in {timeout} s")


def pushes(ui: str) -> int:
    """How many profile uploads local mode has taken in so far."""
    count: int = get_json(f"{ui}/api/status")["profiles"]["pushes"]
    return count


def at_one_upload(ui: str, read: Callable[[], T], attempts: int = 20) -> T:
    """``read()`` done with no upload arriving meanwhile, so its views agree with each other.

    ``settle`` waits for two more uploads, but on a busy machine a span's last samples can come
    later still; two reads that straddle such an upload see different samples.
    """
    for _ in range(attempts):
        before = pushes(ui)
        value = read()
        if pushes(ui) == before:
            return value
    raise TimeoutError(f"an upload arrived during each of {attempts} reads")


def _flamegraph_and_pprof(ui: str, span_id: str) -> tuple[dict[str, Any], bytes]:
    tree = get_json(f"{ui}/api/flamegraph?span_id={span_id}")
    raw = httpx.get(f"{ui}/api/pprof", params={"span_id": span_id}, timeout=10)
    raw.raise_for_status()
    return tree, raw.content


@contextmanager
def local_run(tmp: Path) -> Iterator[LocalRun]:
    """The ASGI test app in local mode, after one slow (allocating ``ALLOC_MB``) and six fast
    requests settled."""
    with running_local_mode(tmp, "tests.test_local_mode:make_app") as (app, ui):
        labels = fire(app, {SLOW: SLOW_CPU, **dict.fromkeys(FAST, FAST_CPU)}, {SLOW: ALLOC_MB})
        settle(ui)
        yield LocalRun(app, ui, labels)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRun]:
    """One local-mode subprocess for the end-to-end API tests of this module."""
    with local_run(tmp_path_factory.mktemp("local")) as result:
        yield result


def frame_names(node: dict[str, Any]) -> set[str]:
    """Every frame name in a d3-flame-graph tree, root excluded."""
    names: set[str] = set()
    stack = list(node["children"])
    while stack:
        child = stack.pop()
        names.add(child["name"])
        stack.extend(child["children"])
    return names


def markers_in(names: set[str]) -> set[str]:
    """The request marker functions among ``names``."""
    return {name for name in names if name.startswith(MARKER_PREFIX)}


# pyroscope-io reads a thread's tags ~0.2 ms after its stack: a sample at the very end of one
# request's step can carry the next request's span id. One tick, or 5%, is that lag, not a leak.
TICK_NS = 10_000_000


def lag_bound(total_ns: int) -> float:
    """How much foreign CPU a span's profile may show from the agent's tag lag."""
    return max(TICK_NS, 0.05 * total_ns)


def foreign_ns(node: dict[str, Any], own: str) -> int:
    """CPU under request markers other than ``own`` in a d3-flame-graph tree."""
    total = 0
    stack = list(node["children"])
    while stack:
        child = stack.pop()
        if child["name"].startswith(MARKER_PREFIX):
            if child["name"] != own:
                total += int(child["value"])
            continue
        stack.extend(child["children"])
    return total


def marker_name(index: int) -> str:
    """The marker function of request ``index``."""
    return MARKERS[index].__name__


# -- end to end: the real agent, the receiver and the APIs -----------------------------------


@pytest.mark.e2e
def test_receiver_decodes_real_pyroscope_pushes(run: LocalRun) -> None:
    """pyroscope-io's uploads arrive every second, decode, and carry the requests' span ids."""
    status = get_json(f"{run.ui}/api/status")
    profiles = status["profiles"]
    assert status["receiver_errors"] == []
    assert profiles["pushes"] >= 2
    assert profiles["services"] == ["local-mode-test"]
    assert profiles["period_ns"] == 10_000_000
    assert profiles["double_labelled_ns"] == 0
    assert profiles["labelled_ns"] >= 0.5 * (SLOW_CPU + len(FAST) * FAST_CPU) * 1e9, profiles
    assert status["interface"] == "asgi"
    assert status["requests"] >= len(FAST) + 1  # and the readiness probes


@pytest.mark.e2e
def test_breaches_list_the_slow_request_and_only_it(run: LocalRun) -> None:
    """/api/breaches holds the slow request (ids, route, duration over its SLO), no fast one."""
    slow = run.labels[SLOW]
    breaches = get_json(f"{run.ui}/api/breaches")["breaches"]
    by_span = {b["span_id"]: b for b in breaches}
    assert slow["span_id"] in by_span, breaches
    breach = by_span[slow["span_id"]]
    assert breach["trace_id"] == slow["trace_id"]
    assert breach["route"] == "/work/{index:int}"
    assert breach["threshold_s"] == pytest.approx(SLO_SECONDS)
    assert breach["duration_s"] >= SLOW_CPU > SLO_SECONDS
    assert breach["profile_ns"] >= 0.5 * SLOW_CPU * 1e9
    assert {run.labels[i]["span_id"] for i in FAST}.isdisjoint(by_span)

    points = get_json(f"{run.ui}/api/latency")["points"]
    flagged = {p["span_id"]: p["breached"] for p in points if p["route"] != "/health"}
    assert flagged == {labels["span_id"]: i == SLOW for i, labels in run.labels.items()}


@pytest.mark.e2e
def test_flamegraph_of_a_span_holds_only_its_own_samples(run: LocalRun) -> None:
    """Each request's flame graph has its own marker and no other request's marker."""
    slow = get_json(f"{run.ui}/api/flamegraph?span_id={run.labels[SLOW]['span_id']}")
    assert slow["total_ns"] >= 0.5 * SLOW_CPU * 1e9, slow["total_ns"]
    assert slow["span"]["name"] == "GET /work/{index:int}"
    assert marker_name(SLOW) in markers_in(frame_names(slow["root"]))
    assert foreign_ns(slow["root"], marker_name(SLOW)) <= lag_bound(slow["total_ns"])
    for index in FAST:
        tree = get_json(f"{run.ui}/api/flamegraph?span_id={run.labels[index]['span_id']}")
        assert foreign_ns(tree["root"], marker_name(index)) <= lag_bound(tree["total_ns"])
    # The tree holds exactly the span's samples: all of them at the root, and those with at
    # least one frame below it (the agent occasionally sends a labelled sample without frames).
    tree, raw = at_one_upload(
        run.ui, lambda: _flamegraph_and_pprof(run.ui, run.labels[SLOW]["span_id"])
    )
    samples = decode_profile(raw).samples
    root = tree["root"]
    assert root["value"] == sum(s.value for s in samples)
    assert sum(child["value"] for child in root["children"]) == sum(
        s.value for s in samples if s.stack
    )


def function_value(node: dict[str, Any], name: str) -> int:
    """The value under frames of function ``name`` in a d3-flame-graph tree (outermost ones)."""
    total = 0
    stack = list(node["children"])
    while stack:
        child = stack.pop()
        if child["name"] == name:
            total += int(child["value"])
        else:
            stack.extend(child["children"])
    return total


def memory_flamegraph(ui: str, span_id: str, kind: str, timeout: float = 20.0) -> dict[str, Any]:
    """``span_id``'s ``kind`` flame graph once it has samples (allocations wait for the
    request's SLO verdict, one upload or two), or as it is at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = get_json(f"{ui}/api/flamegraph?span_id={span_id}&kind={kind}")
        if body["total"] > 0 or time.monotonic() > deadline:
            return body
        time.sleep(0.3)


@pytest.mark.e2e
def test_memory_flame_graphs_show_what_the_slow_request_allocated_and_kept(run: LocalRun) -> None:
    """The exact profiler's memory pushes, through local mode: the slow request's allocated and
    in-use flame graphs hold its allocating function, in bytes; other requests' do not; its
    route's comparison ranks that function among the first by extra bytes per breaching
    request."""
    from spanprof._profiling._samplers._memory import memory_unavailable_reason

    reason = memory_unavailable_reason()
    require(reason is None, reason or "")
    span_id = run.labels[SLOW]["span_id"]
    truth = ALLOC_MB * 1_000_000 // HOARD_BLOCK * sys.getsizeof(bytes(HOARD_BLOCK))
    alloc = memory_flamegraph(run.ui, span_id, "alloc_space")
    assert (alloc["kind"], alloc["unit"]) == ("alloc_space", "bytes")
    # One sample per 512 kB on average: ~64 samples of a 32 MB truth, within +-50%. (The CPU
    # burn allocates too: every int it counts past 256 is a new object.)
    hoarded = function_value(alloc["root"], HOARD)
    assert 0.5 * truth <= hoarded <= 1.5 * truth, (hoarded, truth, alloc["total"])
    assert alloc["alloc_bytes"] == alloc["total"]
    inuse = memory_flamegraph(run.ui, span_id, "inuse_space")
    # A quarter kept (16 samples on average): well below what was allocated, well above zero.
    kept = function_value(inuse["root"], HOARD)
    assert 0.05 * truth <= kept <= 0.6 * truth, (kept, truth, inuse["total"])
    for index in FAST:
        fast = get_json(
            f"{run.ui}/api/flamegraph?span_id={run.labels[index]['span_id']}&kind=alloc_space"
        )
        assert function_value(fast["root"], HOARD) == 0
    route = alloc["span"]["name"]
    compared = get_json(f"{run.ui}/api/compare?kind=alloc_space&route={route}")
    assert compared["unit"] == "bytes"
    # Ranked among the first (the CPU burn allocates too: every int it counts past 256).
    top = {row["function"]: row for row in compared["functions"][:3]}
    assert HOARD in top, compared["functions"][:3]
    assert top[HOARD]["extra"] > 0.5 * truth, top[HOARD]


@pytest.mark.e2e
def test_trace_api_returns_the_requests_spans(run: LocalRun) -> None:
    """/api/trace lists the slow request's server span under its trace id."""
    slow = run.labels[SLOW]
    spans = get_json(f"{run.ui}/api/trace?trace_id={slow['trace_id']}")["spans"]
    servers = [s for s in spans if s["kind"] == "SERVER"]
    assert [s["span_id"] for s in servers] == [slow["span_id"]]
    assert servers[0]["name"] == slow["span_name"] == "GET /work/{index:int}"
    assert servers[0]["breached"] is True
    assert all(s["trace_id"] == slow["trace_id"] for s in spans)


def _check_pprof_structure(raw: bytes) -> None:
    strings: list[str] = []
    function_ids: list[int] = []
    location_ids: list[int] = []
    used_functions: set[int] = set()
    used_locations: set[int] = set()
    for field, _wire, value in iter_fields(raw):
        if field == 6:
            strings.append(as_str(value))
        elif field == 5:
            function_ids += [as_int(v) for f, _w, v in iter_fields(as_bytes(value)) if f == 1]
        elif field == 4:
            for f, _w, v in iter_fields(as_bytes(value)):
                if f == 1:
                    location_ids.append(as_int(v))
                elif f == 4:
                    used_functions |= {
                        as_int(lv) for lf, _lw, lv in iter_fields(as_bytes(v)) if lf == 1
                    }
        elif field == 2:
            for f, _w, v in iter_fields(as_bytes(value)):
                if f == 1:
                    used_locations.update(unpack_varints(v))
    assert strings[0] == ""
    assert function_ids == list(range(1, len(function_ids) + 1))
    assert location_ids == list(range(1, len(location_ids) + 1))
    assert used_functions <= set(function_ids)
    assert used_locations <= set(location_ids)


@pytest.mark.e2e
def test_pprof_download_decodes_to_the_spans_samples(run: LocalRun) -> None:
    """/api/pprof is a gzipped, well-formed pprof of exactly the flame graph's samples."""
    span_id = run.labels[SLOW]["span_id"]
    response = httpx.get(f"{run.ui}/api/pprof", params={"span_id": span_id}, timeout=10)
    assert response.status_code == 200
    assert f"spanprof-{span_id}.pb.gz" in response.headers["Content-Disposition"]
    assert response.content[:2] == b"\x1f\x8b"
    _check_pprof_structure(gzip.decompress(response.content))
    profile = decode_profile(response.content)
    assert profile.sample_types == (("cpu", "nanoseconds"),)
    assert profile.period_type == ("cpu", "nanoseconds")
    assert profile.period == 10_000_000
    assert profile.duration_nanos > 0
    assert {s.label("span_id") for s in profile.samples} == {span_id}
    assert {s.label("trace_id") for s in profile.samples} == {run.labels[SLOW]["trace_id"]}
    names = {frame.function for s in profile.samples for frame in s.stack}
    assert marker_name(SLOW) in markers_in(names)
    foreign = sum(
        s.value
        for s in profile.samples
        if markers_in({f.function for f in s.stack}) - {marker_name(SLOW)}
    )
    assert foreign <= lag_bound(profile.total())
    tree, raw = at_one_upload(run.ui, lambda: _flamegraph_and_pprof(run.ui, span_id))
    assert decode_profile(raw).total() == tree["total_ns"]

    unknown = httpx.get(f"{run.ui}/api/pprof", params={"span_id": "0" * 16}, timeout=10)
    assert unknown.status_code == 404


@pytest.mark.e2e
def test_page_is_served_with_its_assets(run: LocalRun) -> None:
    """The page, every script and style it loads, and the vendored licenses are served."""
    page = httpx.get(f"{run.ui}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert {
        "/static/vendor/d3.min.js",
        "/static/vendor/d3-flamegraph.min.js",
        "/static/vendor/d3-flamegraph.css",
        "/static/app.js",
        "/static/style.css",
    } <= set(assets)
    expected_types = {".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}
    licenses = ["/static/vendor/LICENSE-d3.txt", "/static/vendor/LICENSE-d3-flame-graph.txt"]
    for path in [*assets, *licenses]:
        asset = httpx.get(f"{run.ui}{path}", timeout=10)
        assert asset.status_code == 200, path
        assert asset.headers["Content-Type"].startswith(expected_types[Path(path).suffix]), path
        assert len(asset.content) > 100, path
    assert "flamegraph" in httpx.get(f"{run.ui}/static/vendor/d3-flamegraph.min.js").text


@pytest.mark.e2e
def test_apis_reject_bad_ids_and_foreign_hosts(run: LocalRun) -> None:
    """Malformed ids get 400, unknown paths 404, and a non-loopback Host header 403."""
    assert httpx.get(f"{run.ui}/api/flamegraph?span_id=nothex").status_code == 400
    assert httpx.get(f"{run.ui}/api/trace?trace_id=123").status_code == 400
    assert httpx.get(f"{run.ui}/api/pprof?span_id=../../etc").status_code == 400
    assert httpx.get(f"{run.ui}/static/../_ui.py").status_code == 404
    rebound = httpx.get(f"{run.ui}/api/breaches", headers={"Host": "attacker.example:80"})
    assert rebound.status_code == 403


@pytest.mark.e2e
def test_wsgi_apps_run_in_local_mode_too(tmp_path: Path) -> None:
    """A WSGIProfilingMiddleware app: served by threads, profiled by the exact sampler (which
    `auto` would not pick for a threaded server), so its slow request's CPU and memory flame
    graphs and its route's breach comparison all work."""
    from spanprof._profiling._samplers._memory import memory_unavailable_reason

    require(
        _importable("spanprof._web._wsgi"),
        "spanprof._web._wsgi (WSGIProfilingMiddleware) is missing",
    )
    reason = memory_unavailable_reason()
    require(reason is None, reason or "")
    with running_local_mode(tmp_path, "tests.test_local_mode:make_wsgi_app") as (app, ui):
        slow = httpx.get(
            f"{app}/work/9", params={"seconds": 0.5, "alloc_mb": 16}, timeout=30
        ).json()
        fast = httpx.get(f"{app}/work/3", params={"seconds": 0.02}, timeout=30).json()
        settle(ui)
        status = get_json(f"{ui}/api/status")
        breaches = get_json(f"{ui}/api/breaches")["breaches"]
        tree = get_json(f"{ui}/api/flamegraph?span_id={slow['span_id']}")
        alloc = memory_flamegraph(ui, slow["span_id"], "alloc_space")
        compared = get_json(f"{ui}/api/compare?route={alloc['span']['name']}")
    # Labelled memory samples come only from the exact profiler (pyroscope-io's carry none).
    truth = 16 * 1_000_000 // HOARD_BLOCK * sys.getsizeof(bytes(HOARD_BLOCK))
    assert 0.4 * truth <= function_value(alloc["root"], HOARD) <= 1.6 * truth, alloc["total"]
    # And so do the `slo` labels the comparison splits on (a 404 without them).
    assert compared["requests"]["breached"] == 1, compared
    assert compared["sampled"]["breached"] >= 0.25e9, compared
    assert status["interface"] == "wsgi"
    assert status["receiver_errors"] == []
    assert [b["span_id"] for b in breaches] == [slow["span_id"]]
    assert breaches[0]["route"] == "/work/{index}"
    assert fast["span_id"] != slow["span_id"]
    assert tree["total_ns"] >= 0.25e9
    assert markers_in(frame_names(tree["root"])) == {marker_name(9)}


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.e2e
def test_demo_serves_two_services_and_stops_by_itself(tmp_path: Path) -> None:
    """`python -m sample_app.demo --duration`: traffic, a two-service trace, then a clean exit."""
    require(
        _importable("fastapi") and _importable("flask") and _importable("spanprof._web._wsgi"),
        "the demo needs fastapi, flask and spanprof._web._wsgi (pip install -e '.[demo]')",
    )
    port, ui_port = free_port(), free_port()
    ui = f"http://127.0.0.1:{ui_port}"
    argv = [sys.executable, "-m", "sample_app.demo", "--duration", "12"]
    argv += ["--port", str(port), "--ui-port", str(ui_port), "--concurrency", "3"]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"{ui}/api/status", process)
            # Generous on a busy two-core machine: the first cross-service trace can take seconds.
            trace = _wait_for_cross_service_trace(ui, timeout=10.0)
            status = settle(ui, uploads=1, timeout=5.0)
        finally:
            returncode = process.wait(timeout=30)
    output = log.read_text()
    assert returncode == 0, output
    assert "Traceback" not in output, output
    assert f"open {ui}/" in output
    assert re.search(r"traffic: \d+ sent {2}\d+ errors", output), output
    assert status["requests"] >= 3  # read mid-run: traffic flows (the count depends on load)
    assert status["profiles"]["labelled_ns"] > 0
    flask_server = next(s for s in trace if s["service"] == "sample-flask")
    client = next(s for s in trace if s["span_id"] == flask_server["parent_id"])
    assert client["service"] == "sample-fastapi"
    assert client["kind"] == "CLIENT"


def _wait_for_cross_service_trace(ui: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for point in get_json(f"{ui}/api/latency")["points"]:
            if point["service"] == "sample-flask":
                spans: list[dict[str, Any]] = get_json(
                    f"{ui}/api/trace?trace_id={point['trace_id']}"
                )["spans"]
                if {s["service"] for s in spans} == {"sample-fastapi", "sample-flask"}:
                    return spans
        time.sleep(0.3)
    raise TimeoutError("no trace through both sample services")


# -- the pieces, in process ----------------------------------------------------------------------


def _span(
    provider: TracerProvider, route: str, seconds: float, **attributes: Any
) -> tuple[str, str]:
    tracer = provider.get_tracer("test")
    start = time.time_ns()
    span = tracer.start_span(
        f"GET {route}",
        kind=SpanKind.SERVER,
        start_time=start,
        attributes={"http.route": route, **attributes},
    )
    span.end(end_time=start + int(seconds * 1e9))
    ctx = span.get_span_context()
    return format(ctx.span_id, "016x"), format(ctx.trace_id, "032x")


def test_span_store_trusts_the_middlewares_verdict() -> None:
    """A span marked by the middleware keeps its verdict and threshold, whatever its length."""
    store = SpanStore(policy_from({}, slo="0.5"))
    provider = TracerProvider()
    provider.add_span_processor(store)
    marked, _ = _span(
        provider,
        "/a",
        0.01,
        **{"spanprof.slo.breached": True, "spanprof.slo.threshold_s": 0.005},
    )
    cleared, _ = _span(provider, "/b", 2.0, **{"spanprof.slo.breached": False})
    breaches = {r.span_id: r for r in store.breaches()}
    assert set(breaches) == {marked}
    assert breaches[marked].threshold_s == 0.005
    assert breaches[marked].verdict_source == "span"
    assert store.span(cleared) is not None
    assert store.span(cleared).breached is False  # type: ignore[union-attr]


def test_span_store_judges_unmarked_spans_by_route_slo() -> None:
    """Without the attribute, the duration is compared with the route's SLO, else the default."""
    store = SpanStore(policy_from({"SPANPROF_SLO_SECONDS": "0.5"}, route_slo="/checkout=0.25"))
    provider = TracerProvider()
    provider.add_span_processor(store)
    slow_checkout, _ = _span(provider, "/checkout", 0.3)
    _span(provider, "/checkout", 0.2)
    _span(provider, "/search", 0.3)
    slow_search, _ = _span(provider, "/search", 0.6)
    breaches = store.breaches()
    assert [r.span_id for r in breaches] == [slow_search, slow_checkout]
    assert [r.threshold_s for r in breaches] == [0.5, 0.25]
    assert {r.verdict_source for r in breaches} == {"local"}
    assert store.request_count() == 4


@pytest.mark.parametrize(
    "route", ["/files/<any(json,xml):fmt>", "/caf\u00e9/{item_id}", "/q/{k}=" + "x" * 300]
)
def test_comparison_counts_the_requests_of_a_route_its_label_had_to_sanitize(route: str) -> None:
    """The comparison's route is the ``span_name`` label; its requests are counted under it too.

    The label replaces ``,``, ``=``, quotes and non-ASCII and cuts at 256 characters: counted
    under the raw span name, such a route had 0 requests per side and every number 0.
    """
    store = SpanStore(policy_from({}, slo="0.05"))
    provider = TracerProvider()
    provider.add_span_processor(store)
    comparison = SloComparison()
    label = span_name_label(f"GET {route}")  # what the middleware labels the samples with
    for seconds, side in ((0.1, "breached"), (0.01, "ok"), (0.01, "ok")):
        _span(provider, route, seconds)
        comparison.add((Frame("work", "app.py", 1),), 4_000_000, label, side)
    ui = UiServer(store, SampleStore(), comparison=comparison)
    _, body, _, _ = ui._compare({})
    [listed] = json.loads(body)["routes"]
    assert listed["route"] == label
    assert listed["requests"] == {"breached": 1, "ok": 2}
    _, body, _, _ = ui._compare({"route": label})
    [work] = json.loads(body)["functions"]
    assert (work["breached_us"], work["ok_us"]) == (4000.0, 4000.0)


def test_span_store_keeps_bounded_traces() -> None:
    """The oldest traces are dropped first once ``max_traces`` are kept."""
    store = SpanStore(policy_from({}), max_traces=3, max_requests=2)
    provider = TracerProvider()
    provider.add_span_processor(store)
    traces = [_span(provider, "/x", 0.001)[1] for _ in range(5)]
    assert [len(store.trace(t)) for t in traces] == [0, 0, 1, 1, 1]
    assert store.request_count() == 2
    assert store.spans_seen == 5


def test_span_store_is_bounded_by_bytes_whatever_trace_ids_clients_pick() -> None:
    """Requests grouped into a few client-chosen traces, with huge URLs, keep max_bytes."""
    store = SpanStore(policy_from({}, slo="10"), max_bytes=1024 * 1024)
    provider = TracerProvider()
    provider.add_span_processor(store)
    tracer = provider.get_tracer("test")
    url = "http://127.0.0.1/x?" + "q" * 50_000
    parents = [
        trace.set_span_in_context(
            trace.NonRecordingSpan(
                trace.SpanContext(0xAB00 + t, 0xCD, is_remote=True, trace_flags=trace.TraceFlags(1))
            )
        )
        for t in range(4)
    ]
    tracemalloc.start()
    try:
        for i in range(3000):
            span = tracer.start_span(
                "GET /x" + "n" * 5000,
                context=parents[i % 4],
                kind=SpanKind.SERVER,
                attributes={"http.route": "/x", "url.full": url},
            )
            span.end()
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    counters = store.counters()
    assert counters["kept_bytes"] <= 2 * 1024 * 1024
    assert counters["evicted_requests"] > 0
    assert kept < 6 * 1024 * 1024, kept  # unbounded, it was 3,000 x 55 KB = 165 MB
    newest = store.requests()[-1]
    assert len(newest.name) <= 1025
    assert len(dict(newest.attributes)["url.full"]) <= 1025
    assert newest.route == "/x"


def _push(*samples: tuple[tuple[Frame, ...], int, tuple[tuple[str, str], ...]]) -> ReceivedPush:
    builder = ProfileBuilder((("cpu", "nanoseconds"),), period=10_000_000)
    for stack, value, labels in samples:
        builder.add(stack, value, labels)
    # Decoded whole: these tests check the store's own cut, not the one local mode's receiver
    # makes first.
    profile = decode_profile(builder.build(), max_depth=100_000)
    series = PushSeries((("__name__", "process_cpu"), ("service_name", "svc")), (profile,))
    return ReceivedPush(time.time(), "test", (series,))


def test_sample_store_splits_uploads_by_span_id() -> None:
    """Samples go to their span id's tree (merged by frame); unlabelled ones are only counted."""
    leaf_a, leaf_b, root = Frame("a", "m.py", 1), Frame("b", "m.py", 2), Frame("main", "m.py", 9)
    span, other = "00000000000000aa", "00000000000000bb"
    store = SampleStore()
    store.ingest(
        _push(
            ((leaf_a, root), 30_000_000, (("span_id", span), ("span_name", "GET /x"))),
            ((leaf_b, root), 10_000_000, (("span_id", span), ("span_name", "GET /x"))),
            ((leaf_b, root), 50_000_000, (("span_id", other),)),
            ((leaf_a, root), 70_000_000, ()),
        )
    )
    store.ingest(_push(((leaf_a, root), 20_000_000, (("span_id", span),))))
    tree = store.flamegraph(span)
    assert tree["name"] == "GET /x"
    assert tree["value"] == 60_000_000
    [main] = tree["children"]
    assert (main["name"], main["value"]) == ("main", 60_000_000)
    assert [(c["name"], c["value"]) for c in main["children"]] == [
        ("a", 50_000_000),
        ("b", 10_000_000),
    ]
    status = store.status()
    assert status["pushes"] == 2
    assert status["samples_ns"] == 180_000_000
    assert status["labelled_ns"] == 110_000_000
    assert status["services"] == ["svc"]
    assert store.flamegraph("0" * 16)["value"] == 0
    assert store.pprof("0" * 16) is None


def test_sample_store_bounds_span_ids() -> None:
    """Only the most recently updated ``max_spans`` span ids keep their samples."""
    store = SampleStore(max_spans=2)
    frame = (Frame("f", "m.py", 1),)
    for span in ("01" * 8, "02" * 8, "03" * 8):
        store.ingest(_push((frame, 10_000_000, (("span_id", span),))))
    totals = [store.sample_total(s) for s in ("01" * 8, "02" * 8, "03" * 8)]
    assert totals == [0, 10_000_000, 10_000_000]


def _deep_stack(depth: int, leaf: str = "leaf_fn") -> tuple[Frame, ...]:
    """A leaf-first stack of ``depth`` frames: ``leaf``, recursion frames, then ``main``."""
    middle = tuple(Frame("recurse", "m.py", 10 + i % 3) for i in range(depth - 2))
    return (Frame(leaf, "m.py", 1), *middle, Frame("main", "m.py", 99))


def test_sample_store_cuts_deep_stacks_keeping_leaf_and_root() -> None:
    """A 50,000-frame stack is kept as max_depth frames: leaf end, an elision marker, root end."""
    store = SampleStore(max_depth=100)
    span = "00000000000000aa"
    store.ingest(_push((_deep_stack(50_000), 10_000_000, (("span_id", span),))))
    profile = store.span(span)
    assert profile is not None
    [stack] = profile.stacks
    assert len(stack) == 100
    assert (stack[0].function, stack[-1].function) == ("leaf_fn", "main")
    assert stack[50].function == "[49901 frames elided]"
    assert store.status()["kept_bytes"] < 10_000
    # Below the cap a stack is kept whole.
    whole = _deep_stack(99)
    store.ingest(_push((whole, 10_000_000, (("span_id", span),))))
    assert whole in store.span(span).stacks  # type: ignore[union-attr]


def test_sample_store_is_bounded_by_bytes_and_counts_evictions() -> None:
    """Uploads with long names and many distinct stacks keep max_bytes, dropping oldest spans."""
    store = SampleStore(max_bytes=512 * 1024)
    long_name = "f" * 5_000
    spans = [f"{i:016x}" for i in range(200)]
    tracemalloc.start()
    try:
        for n, span in enumerate(spans):
            labels = (("span_id", span),)
            unique = [(Frame(f"{long_name}{n}.{k}", long_name, k),) for k in range(10)]
            store.ingest(_push(*((f + _deep_stack(50), 1, labels) for f in unique)))
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    status = store.status()
    assert status["kept_bytes"] <= 512 * 1024
    assert status["evicted_spans"] > 0
    assert store.sample_total(spans[0]) == 0
    assert store.sample_total(spans[-1]) == 10
    # The estimate tracks what is really held (the uploads themselves are freed by now):
    # 200 spans of 10 names of 10 KB would be 20 MB.
    assert kept < 2 * 1024 * 1024, kept


def test_sample_store_shares_frames_between_uploads() -> None:
    """The same code uploaded a thousand times costs one set of frames, not a thousand."""
    store = SampleStore()
    for i in range(1000):
        store.ingest(_push((_deep_stack(50), 1, (("span_id", f"{i:016x}"),))))
    profiles = [store.span(f"{i:016x}") for i in (0, 999)]
    first, last = (next(iter(p.stacks)) for p in profiles if p is not None)
    assert all(a is b for a, b in zip(first, last, strict=True))


def _ui(samples: SampleStore) -> UiServer:
    return UiServer(SpanStore(policy_from({})), samples, port=0)


@pytest.mark.parametrize("depth", [900, 2048, 5000])
def test_flamegraph_api_renders_stacks_of_any_depth(depth: int) -> None:
    """/api/flamegraph answers 200 for a deep recursion, with its leaf at the tree's bottom."""
    samples = SampleStore()
    span = "00000000000000aa"
    samples.ingest(_push((_deep_stack(depth), 10_000_000, (("span_id", span),))))
    ui = _ui(samples).start()
    try:
        response = httpx.get(f"http://127.0.0.1:{ui.port}/api/flamegraph?span_id={span}")
    finally:
        ui.stop()
    assert response.status_code == 200, response.text[:300]
    # json.loads recurses per level like json.dumps did: read the single chain as text.
    body = response.text
    assert body.count('"children": [') == min(depth, 2048) + 1
    last = body.rpartition('{"name": ')[2]
    assert last.startswith('"leaf_fn", "file": "m.py", "value": 10000000, "children": []}')
    assert body.endswith("]}" * (min(depth, 2048) + 1) + "}")


def test_tree_json_writes_any_depth_as_json_would() -> None:
    """The flame-graph encoder matches json.dumps, and goes on where json.dumps recurses out."""
    samples = SampleStore(max_depth=30_000)
    samples.ingest(_push((_deep_stack(40), 5, (("span_id", "00" * 8),))))
    samples.ingest(_push((_deep_stack(20_000), 7, (("span_id", "01" * 8),))))
    shallow = samples.flamegraph("00" * 8)
    assert json.loads(_tree_json(shallow)) == shallow
    deep = samples.flamegraph("01" * 8)
    if sys.version_info < (3, 14):
        with pytest.raises(RecursionError):
            json.dumps(deep)
    encoded = _tree_json(deep)
    if sys.version_info >= (3, 14):  # its recursion limit now counts C stack, not levels
        assert encoded == json.dumps(deep)
    assert encoded.count('"children": [') == 20_001
    assert encoded.endswith(
        '"leaf_fn", "file": "m.py", "value": 7, "children": []' + "}]" * 20_000 + "}"
    )


@contextmanager
def _page(host: str = "127.0.0.1", samples: SampleStore | None = None) -> Iterator[str]:
    """A started UiServer on ``host`` and a free port; yields its ``host:port``."""
    ui = UiServer(SpanStore(policy_from({})), samples or SampleStore(), host=host, port=0)
    ui.start()
    try:
        yield f"{host}:{ui.port}"
    finally:
        ui.stop()


def _get(authority: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"http://{authority}{path}", headers=headers or {}, timeout=10)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_page_answers_its_own_address_and_origin_only(
    host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its own Host and Origin get 200; a rebinding name or another origin 403, logged once."""
    reset_log_once()
    with _page(host) as authority, caplog.at_level(logging.WARNING, logger="spanprof"):
        port = authority.rpartition(":")[2]
        assert _get(authority, "/api/status").status_code == 200
        assert _get(authority, "/", {"Host": f"localhost:{port}"}).status_code == 200
        own = {"Origin": f"http://{authority}"}
        assert _get(authority, "/api/status", own).status_code == 200
        for _ in range(3):
            evil = _get(authority, "/api/status", {"Origin": "https://evil.example"})
            assert evil.status_code == 403
            rebound = _get(authority, "/api/status", {"Host": f"evil.example:{port}"})
            assert rebound.status_code == 403
        posted = httpx.post(f"http://{authority}/api/status", content=b"x", timeout=10)
        assert posted.status_code == 405
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2, refusals  # one per kind, not one per request


def test_page_on_every_interface_accepts_addresses_but_not_names() -> None:
    """On 0.0.0.0 any IP literal Host is fine (it cannot be rebound), a foreign name is not."""
    with _page("0.0.0.0") as authority:
        port = authority.rpartition(":")[2]
        for host in (f"127.0.0.1:{port}", f"192.0.2.7:{port}", f"[::1]:{port}"):
            assert _get(f"127.0.0.1:{port}", "/api/status", {"Host": host}).status_code == 200
        foreign = _get(f"127.0.0.1:{port}", "/api/status", {"Host": "evil.example"})
        assert foreign.status_code == 403


def test_cli_warns_loudly_when_the_page_leaves_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    """--ui-host 0.0.0.0 prints a warning naming the exposure; the default prints none."""
    argv = ["dev", "tests.test_local_mode:nothing_here", "--ui-port", "0", "--port", "0"]
    assert cli_main([*argv, "--ui-host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert "WARNING" in err
    assert "every interface" in err
    assert cli_main(argv) == 1
    assert "WARNING" not in capsys.readouterr().err


def _raw_get(authority: str, target: bytes) -> bytes:
    """GET ``target`` exactly as given (httpx would normalise ``..``); the whole response."""
    host, _, port = authority.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"GET " + target + b" HTTP/1.1\r\nHost: " + authority.encode() + b"\r\n"
            b"Connection: close\r\n\r\n"
        )
        return b"".join(iter(lambda: sock.recv(65536), b""))


def test_static_lookup_does_not_traverse() -> None:
    """Dot segments, encoded or not, never reach files outside the static folder."""
    with _page() as authority:
        for target in (
            b"/static/../_ui.py",
            b"/static/%2e%2e/_ui.py",
            b"/static/..%2f_ui.py",
            b"/static//etc/passwd",
            b"/../../../../etc/passwd",
        ):
            response = _raw_get(authority, target)
            assert response.startswith(b"HTTP/1.1 404"), (target, response[:100])
            assert b"import" not in response
            assert b"root:" not in response


def test_nothing_a_client_sends_is_served_as_html_or_script() -> None:
    """Error answers echoing a request are JSON or plain text, nosniff, never HTML."""
    with _page() as authority:
        not_found = _raw_get(authority, b"/%3Cscript%3Ealert(1)%3C/script%3E?x=%3Cimg%3E")
        unparsable = _raw_get(authority, b"/<script>alert(1)</script> <img src=x>")
    head, _, body = not_found.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404")
    headers = head.decode().lower()
    assert "content-type: application/json" in headers
    assert "x-content-type-options: nosniff" in headers
    assert "script-src 'self';" in headers
    assert json.loads(body)["error"] == "no such page: /%3Cscript%3Ealert(1)%3C/script%3E"
    head, _, body = unparsable.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert "content-type: text/plain" in head.decode().lower()
    assert b"<script>" not in body


def test_page_script_never_writes_html_from_data() -> None:
    """app.js puts every name, path and label into the DOM as text, never as markup."""
    script = (ROOT / "middleware/spanprof/_local/static/app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", ".html("):
        assert sink not in script, sink
    assert "textContent" in script
    index = (ROOT / "middleware/spanprof/_local/static/index.html").read_text()
    assert "<script>" not in index
    assert "onclick" not in index.lower()


def test_page_survives_a_thousand_half_open_connections() -> None:
    """1,000 connections that send half a request open at once and leave the page answering."""
    with _page() as authority:
        host, _, port = authority.rpartition(":")
        sockets = []
        started = time.monotonic()
        try:
            for _ in range(1000):
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(b"GET /api/status HTTP/1.1\r\nHost: ")
                sockets.append(sock)
            assert _get(authority, "/api/status").status_code == 200
            # With socketserver's backlog of 5, dropped SYNs made this take 150 s.
            assert time.monotonic() - started < 20
        finally:
            for sock in sockets:
                sock.close()


def test_slo_flags_override_the_environment_and_round_trip() -> None:
    """--slo/--route-slo win over SPANPROF_*; the policy's env gives the middleware the same."""
    env = {"SPANPROF_SLO_SECONDS": "2", "SPANPROF_ROUTE_SLO": "/a=1"}
    assert policy_from(env).default == 2.0
    policy = policy_from(env, slo="0.3", route_slo="/checkout=0.25,/search=1")
    assert policy.default == 0.3
    assert dict(policy.routes) == {"/checkout": 0.25, "/search": 1.0}
    assert policy_from(policy_env(policy)) == policy
    with pytest.raises(ValueError, match="SPANPROF_SLO_SECONDS"):
        policy_from({}, slo="fast")
    with pytest.raises(ValueError, match="SPANPROF_ROUTE_SLO"):
        policy_from({}, route_slo="/checkout")


def test_app_loading_and_interface_detection() -> None:
    """module:attribute imports (or calls a factory); async callables are ASGI, others WSGI."""
    assert detect_interface(import_app("tests.test_local_mode:make_app", factory=True)) == "asgi"

    def wsgi(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        return []

    assert detect_interface(wsgi) == "wsgi"
    assert detect_interface(_work) == "asgi"
    with pytest.raises(ValueError, match="module:attribute"):
        import_app("tests.test_local_mode")
    with pytest.raises(ValueError, match="no attribute"):
        import_app("tests.test_local_mode:nothing_here")


def test_cli_never_prints_the_password_of_the_configured_address(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line saying where profiles do not go shows PYROSCOPE_SERVER_ADDRESS redacted: its
    user info is basic auth, never logged (README, "Configuration")."""
    secret = "glc_s3cr3t%2Ftoken"
    address = f"https://123456:{secret}@profiles.example.com"
    monkeypatch.setenv("PYROSCOPE_SERVER_ADDRESS", address)
    argv = ["dev", "tests.test_local_mode:nothing_here", "--ui-port", "0", "--port", "0"]
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert "not to https://123456:***@profiles.example.com" in out
    assert "s3cr3t" not in out + err


def test_cli_reports_a_bad_app_and_a_bad_slo(capsys: pytest.CaptureFixture[str]) -> None:
    """`spanprof dev` exits non-zero with a message naming the problem."""
    assert cli_main(["dev", "tests.test_local_mode:nothing_here", "--ui-port", "0"]) == 1
    assert "cannot import" in capsys.readouterr().err
    assert cli_main(["dev", "x:app", "--slo", "-1", "--ui-port", "0"]) == 2
    assert "--slo" in capsys.readouterr().err


def test_local_mode_sets_and_restores_the_environment() -> None:
    """start() points PYROSCOPE_* at its receiver and SPANPROF_* at its policy; stop() undoes it."""
    env = {"PYROSCOPE_UPLOAD_INTERVAL": "10", "UNRELATED": "1"}
    local = LocalMode(ui_port=0, environ=env, policy=policy_from({}, slo="0.3"))
    with local:
        page = local.ui_url
        assert env["PYROSCOPE_SERVER_ADDRESS"] == local.receiver.url
        assert env["OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT"] == (
            local.receiver.url + "/v1development/profiles"
        )
        assert env["PYROSCOPE_UPLOAD_INTERVAL"] == "1"
        assert env["PYROSCOPE_APPLICATION_NAME"] == "spanprof-dev"
        assert policy_from(env).default == 0.3
        with urllib.request.urlopen(f"{local.ui_url}api/status", timeout=5) as response:
            assert json.load(response)["slo"]["default_s"] == 0.3
    assert env == {"PYROSCOPE_UPLOAD_INTERVAL": "10", "UNRELATED": "1"}
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{page}api/status", timeout=1)


def test_local_mode_samples_cpu_when_the_environment_asks_for_the_wall_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The page shows CPU profiles: SPANPROF_PROFILE_CLOCK=wall, whose profiles are wall
    profiles it would not show, is set to cpu while local mode runs (said once), then put back."""
    env = {"SPANPROF_PROFILE_CLOCK": "wall"}
    with (
        caplog.at_level(logging.WARNING, logger="spanprof"),
        LocalMode(ui_port=0, environ=env, policy=policy_from({})),
    ):
        assert env["SPANPROF_PROFILE_CLOCK"] == "cpu"
    assert env["SPANPROF_PROFILE_CLOCK"] == "wall"
    assert [
        r.getMessage() for r in caplog.records if "SPANPROF_PROFILE_CLOCK" in r.getMessage()
    ] == [
        "spanprof dev: the page shows CPU profiles; SPANPROF_PROFILE_CLOCK=wall is set to cpu "
        "while it runs"
    ]
    env = {"SPANPROF_PROFILE_CLOCK": "cpu"}
    with LocalMode(ui_port=0, environ=env, policy=policy_from({})):
        assert env["SPANPROF_PROFILE_CLOCK"] == "cpu"
    # A value that is neither is not turned into cpu: the backend's configuration error says it.
    env = {"SPANPROF_PROFILE_CLOCK": "sundial"}
    with LocalMode(ui_port=0, environ=env, policy=policy_from({})):
        assert env["SPANPROF_PROFILE_CLOCK"] == "sundial"


def _with_bad_samples(profile: bytes, *values: list[int]) -> bytes:
    """``profile`` plus a sample of its first location per item of ``values``, carrying
    those values whatever the profile's sample types are."""
    out = bytearray(profile)
    for sample_values in values:
        sample = bytearray()
        put_packed_varints_field(sample, 1, [1])
        if sample_values:
            put_packed_varints_field(sample, 2, sample_values)
        put_bytes_field(out, 2, sample)
    return bytes(out)


def test_malformed_samples_are_skipped_and_no_push_stays_in_the_receiver(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU sample with no value (or two for one type) and a memory sample with one value
    for four types are skipped and counted, the rest of the push is kept, and the receiver
    lets go of every push: an IndexError used to stop ingest before it cleared the receiver,
    which then held every such upload for good (33 -> 243 MiB for 100 of them)."""
    reset_log_once()
    span = "00000000000000aa"
    labels = (("span_id", span), ("span_name", "GET /x"))
    leaf = (Frame("leaf", "m.py", 1),)
    cpu = ProfileBuilder((("cpu", "nanoseconds"),), period=10_000_000)
    cpu.add(leaf, 30_000_000, labels)
    memory = ProfileBuilder(MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, 512 * 1024)
    memory.add(leaf, (2, 4096, 0, 0), labels)
    body = encode_push_request([
        ([("__name__", "process_cpu"), ("service_name", "svc")],
         [_with_bad_samples(cpu.build(), [], [5, 6])]),
        ([("__name__", "memory"), ("service_name", "svc")],
         [_with_bad_samples(memory.build(), [7])]),
    ])  # fmt: skip
    with (
        caplog.at_level(logging.WARNING, logger="spanprof"),
        LocalMode(ui_port=0, environ={}) as local,
    ):
        for _ in range(3):
            request = urllib.request.Request(
                local.receiver.url + PUSH_PATH,
                data=body,
                headers={"Content-Type": PUSH_CONTENT_TYPE},
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200
        assert local.receiver.pushes == 0
        assert local.receiver.errors == []
        profiles, memory_status = local.samples.status(), local.samples.memory.status()
        assert profiles["pushes"] == 3
        assert profiles["malformed_samples"] == 6
        assert local.samples.sample_total(span) == 3 * 30_000_000
        assert memory_status["malformed_samples"] == 3
        assert local.samples.allocated_bytes(span) == 3 * 4096
    skipped = [r.getMessage() for r in caplog.records if "skipped a" in r.getMessage()]
    assert len(skipped) == 2, skipped


def test_the_page_names_profiles_after_otel_service_name_before_the_module() -> None:
    """Spans carry OTEL_SERVICE_NAME; the profiles the page gets must carry the same name (the
    span-to-profile link matches on it), so the module name is only the last resort."""
    from spanprof._local._cli import _parser, service_name

    args = _parser().parse_args(["dev", "shop.main:app"])
    assert service_name(args, {"OTEL_SERVICE_NAME": "shop"}) == "shop"
    assert service_name(args, {"OTEL_SERVICE_NAME": "  "}) == "shop.main"
    assert service_name(args, {}) == "shop.main"
    named = _parser().parse_args(["dev", "shop.main:app", "--service-name", "cart"])
    assert service_name(named, {"OTEL_SERVICE_NAME": "shop"}) == "cart"


def test_a_client_hanging_up_with_a_reset_prints_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A browser tab closed mid-connection resets it: ordinary, not a traceback on the
    developer's terminal."""
    ui = _ui(SampleStore()).start()
    try:
        conn = socket.create_connection(("127.0.0.1", ui.port), timeout=5)
        try:
            conn.sendall(f"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\n\r\n".encode())
            assert conn.recv(12).startswith(b"HTTP/1.1 200")
            # Linger 0: close sends RST, which the handler's wait for the next request reads.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            conn.close()
        time.sleep(1.0)  # the handler thread reads the reset meanwhile
    finally:
        ui.stop()
    assert capsys.readouterr().err == ""


def test_a_push_the_store_fails_on_does_not_stay_in_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever makes ingest fail (here an injected fault), the receiver still lets go of the
    push and the failure shows up among the receiver's errors on the page."""
    local = LocalMode(ui_port=0, environ={})

    def broken(push: ReceivedPush) -> None:
        raise RuntimeError("injected ingest fault")

    monkeypatch.setattr(local.samples, "ingest", broken)
    body = encode_push_request([([("__name__", "process_cpu")], [])])
    with local:
        for _ in range(2):
            request = urllib.request.Request(
                local.receiver.url + PUSH_PATH,
                data=body,
                headers={"Content-Type": PUSH_CONTENT_TYPE},
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200
        assert local.receiver.pushes == 0
        errors = local._status()["receiver_errors"]
        assert any("injected ingest fault" in e for e in errors), errors


@pytest.mark.parametrize("factory", ["make_wsgi_app", "make_app"])
def test_cli_reports_an_app_port_in_use_without_a_traceback(factory: str) -> None:
    """`spanprof dev` on a port another process listens on says so and exits 1, WSGI and ASGI
    alike, before claiming the app answers (it used to print the URL, then a traceback, or for
    ASGI exit 3 after uvicorn's own log line)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "spanprof", "dev", f"tests.test_local_mode:{factory}",
                "--factory", "--port", str(port), "--ui-port", "0", "--duration", "5"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"}
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"spanprof dev: cannot listen for the app on 127.0.0.1:{port}: " in done.stderr
    assert "Address already in use" in done.stderr
    assert "Traceback" not in done.stderr
    assert "spanprof dev: app " not in done.stdout


@pytest.mark.parametrize("factory", ["make_wsgi_app", "make_app"])
@pytest.mark.parametrize("duration", ["0", "0.001"])
def test_cli_stops_after_a_duration_shorter_than_its_start(factory: str, duration: str) -> None:
    """`--duration` stops the run even when it ends before the app server serves: the stop
    request made then is kept for serve (it used to be lost, and the run never ended)."""
    argv = [sys.executable, "-m", "spanprof", "dev", f"tests.test_local_mode:{factory}",
            "--factory", "--port", "0", "--ui-port", "0", "--duration", duration]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("duration", ["-1", "nan", "inf", "1e309"])
def test_cli_refuses_a_duration_that_is_not_a_finite_number_of_seconds(
    duration: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative, NaN or infinite --duration is a usage error naming the option (NaN and -1
    used to run forever, inf to print an OverflowError from the timer thread)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["dev", "x:app", "--duration", duration])
    assert exit_info.value.code == 2
    assert "argument --duration: expected" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--port", "--ui-port"])
def test_cli_refuses_a_port_out_of_range(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A port past 65535 is a usage error naming the option, not an OverflowError from bind."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["dev", "x:app", option, "70000"])
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a port number 0-65535, got 70000" in (
        capsys.readouterr().err
    )


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_a_wsgi_app_listens_on_an_ipv6_host_with_a_bracketed_url() -> None:
    """`--host ::1` serves a WSGI app as it serves an ASGI one (wsgiref's server is IPv4 only:
    it failed with "Address family for hostname not supported"), and the app's URL brackets
    the address (it printed http://::1:PORT)."""
    require(_ipv6_loopback(), "an IPv6 loopback address (::1)")

    def hello(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    local = LocalMode(host="::1", port=0, ui_port=0, environ={})
    with local:
        local.listen(hello, "wsgi")
        assert local.app_url == f"http://[::1]:{local.port}"
        serving = threading.Thread(target=local.serve, args=(hello, "wsgi"))
        serving.start()
        try:
            assert httpx.get(local.app_url + "/", timeout=10).text == "hello"
        finally:
            local.request_stop()
            serving.join(10)
        assert not serving.is_alive()
