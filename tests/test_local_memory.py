"""Local mode's memory flame graphs: real memory pushes and OTLP memory profiles in, per kind out.

The windows are encoded by the profiler's own encoders and sent by its own exporters (the
Pyroscope pusher, the OTLP exporter) to a started ``LocalMode`` (its hardened receiver, its
stores and its page, no app), and read back through the page's APIs.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
import subprocess
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from spanprof._labels._labelset import EMPTY, LabelSet
from spanprof._local import LocalMode, MemoryStore
from spanprof._local._receiver import ReceivedPush
from spanprof._profiling._encoders._memory import (
    MEMORY_PERIOD_TYPE,
    MEMORY_SAMPLE_TYPES,
    MemoryEncoder,
    memory_series_labels,
)
from spanprof._profiling._encoders._otlp_memory import OtlpMemoryEncoder
from spanprof._profiling._encoders._pprof import Profile, Sample, decode_profile
from spanprof._profiling._encoders._push import PushSeries
from spanprof._profiling._exporters._pusher import Pusher
from spanprof._profiling._window import Frame, MemoryWindow, StackTables

from .conftest import require
from .test_otlp import _exporter

PERIOD = 524288
SPAN = "00000000000000a1"
OTHER = "00000000000000b2"


def hoard(n: int) -> list[bytes]:
    """The leaf that keeps what it allocates (a frame of the test windows)."""
    return [bytes(n)]


def churn(n: int) -> None:
    """The leaf that frees what it allocates (a frame of the test windows)."""
    bytes(n)


def handler() -> None:
    """The root frame of the test windows."""


def _labels(span_id: str, route: str = "GET /items", **extra: str) -> LabelSet:
    return LabelSet(
        {"span_id": span_id, "trace_id": "0" * 16 + span_id, "span_name": route, **extra}
    )


class _Window:
    """Builds a ``MemoryWindow`` over real frames: allocations and in-use per (leaf, labels)."""

    def __init__(self) -> None:
        self.tables = StackTables()
        self.values: dict[tuple[int, LabelSet], int] = {}
        self.objects: dict[tuple[int, LabelSet], int] = {}
        self.inuse: dict[tuple[int, LabelSet], tuple[int, int]] = {}

    def stack(self, leaf: Any) -> int:
        tables = self.tables
        frames = tuple(
            tables.raw_frame(f.__code__, 0, f.__code__.co_firstlineno) for f in (leaf, handler)
        )
        return tables.stack_of(frames)

    def alloc(self, leaf: Any, labels: LabelSet, nbytes: int, objects: int) -> _Window:
        key = (self.stack(leaf), labels)
        self.values[key] = self.values.get(key, 0) + nbytes
        self.objects[key] = self.objects.get(key, 0) + objects
        return self

    def keep(self, leaf: Any, labels: LabelSet, nbytes: int, objects: int) -> _Window:
        self.inuse[(self.stack(leaf), labels)] = (objects, nbytes)
        return self

    def build(self) -> MemoryWindow:
        return MemoryWindow(
            1_000,
            self.tables,
            values=self.values,
            end_ns=2_000_000_000,
            alloc_objects=self.objects,
            inuse=self.inuse,
        )


@pytest.fixture
def local() -> Iterator[LocalMode]:
    """A started local mode (receiver and page, no app), its environment a private dict."""
    mode = LocalMode(port=0, ui_port=0, environ={})
    mode.start()
    try:
        yield mode
    finally:
        mode.stop()


def push(local: LocalMode, window: MemoryWindow, *, service: str = "shop", **encoder: Any) -> None:
    """``window`` sent the way the exact profiler sends memory: its pusher, one upload."""
    pusher = Pusher(
        server_address=local.receiver.url,
        labels=memory_series_labels(service, {}),
        period_ns=PERIOD,
        upload_interval=3600,
        encoder=lambda w: MemoryEncoder(w, period=PERIOD, **encoder),
    )
    pusher.start(lambda: window)
    pusher.stop()  # uploads the window; the receiver stored it before it answered
    assert pusher.uploads == 1, pusher.stats()


def export_otlp(local: LocalMode, window: MemoryWindow) -> None:
    """``window`` sent as OTLP memory profiles, by the profiler's OTLP exporter."""
    exporter = _exporter(
        local.receiver.url + "/v1development/profiles",
        encoder=functools.partial(OtlpMemoryEncoder, period=PERIOD),
    )
    exporter.start(lambda: window)
    exporter.stop()


def flamegraph(local: LocalMode, span_id: str, kind: str | None = None) -> dict[str, Any]:
    params = {"span_id": span_id} if kind is None else {"span_id": span_id, "kind": kind}
    response = httpx.get(f"{local.ui_url}api/flamegraph", params=params, timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def leaves(tree: dict[str, Any]) -> dict[str, int]:
    """``{leaf function: value}`` of a tree whose stacks are (leaf, handler)."""
    out: dict[str, int] = {}
    for root_frame in tree["children"]:
        assert root_frame["name"] == "handler"
        for leaf in root_frame["children"]:
            out[leaf["name"]] = leaf["value"]
    return out


def test_a_memory_push_gives_each_span_its_allocated_and_in_use_flame_graphs(
    local: LocalMode,
) -> None:
    """One real memory push: the span's tree per kind, in that kind's unit; CPU stays empty."""
    window = (
        _Window()
        .alloc(hoard, _labels(SPAN), 4 * 1024 * 1024, 40)
        .alloc(churn, _labels(SPAN), 1024 * 1024, 10)
        .alloc(churn, _labels(OTHER), 999, 1)
        .alloc(churn, EMPTY, 12345, 3)
        .keep(hoard, _labels(SPAN), 2 * 1024 * 1024, 20)
        .build()
    )
    push(local, window)
    assert local.receiver.errors == []
    alloc = flamegraph(local, SPAN, "alloc_space")
    assert (alloc["kind"], alloc["unit"]) == ("alloc_space", "bytes")
    assert alloc["total"] == 5 * 1024 * 1024
    assert alloc["root"]["value"] == 5 * 1024 * 1024
    assert leaves(alloc["root"]) == {"hoard": 4 * 1024 * 1024, "churn": 1024 * 1024}
    assert alloc["stacks"] == 2
    assert alloc["alloc_bytes"] == 5 * 1024 * 1024
    objects = flamegraph(local, SPAN, "alloc_objects")
    assert (objects["unit"], leaves(objects["root"])) == ("count", {"hoard": 40, "churn": 10})
    inuse = flamegraph(local, SPAN, "inuse_space")
    assert (inuse["unit"], leaves(inuse["root"])) == ("bytes", {"hoard": 2 * 1024 * 1024})
    assert inuse["inuse_at"] == pytest.approx(time.time(), abs=30)
    assert leaves(flamegraph(local, SPAN, "inuse_objects")["root"]) == {"hoard": 20}
    # The other span has its own; CPU (the default kind) has nothing of memory.
    assert leaves(flamegraph(local, OTHER, "alloc_space")["root"]) == {"churn": 999}
    cpu = flamegraph(local, SPAN)
    assert (cpu["kind"], cpu["unit"], cpu["total"], cpu["total_ns"]) == ("cpu", "nanoseconds", 0, 0)
    status = httpx.get(f"{local.ui_url}api/status", timeout=10).json()
    assert status["memory"]["alloc_bytes"] == 5 * 1024 * 1024 + 999 + 12345
    assert status["memory"]["labelled_alloc_bytes"] == 5 * 1024 * 1024 + 999
    assert status["profiles"]["samples_ns"] == 0


def test_in_use_is_the_latest_snapshot_per_series_and_allocations_add_up(
    local: LocalMode,
) -> None:
    """Each upload's in-use replaces the series' previous one (an empty one too); allocations
    are summed; two series (processes) each keep their own snapshot."""
    labels = _labels(SPAN)
    push(local, _Window().alloc(hoard, labels, 4096, 4).keep(hoard, labels, 3000, 3).build())
    push(local, _Window().alloc(hoard, labels, 4096, 4).keep(hoard, labels, 1000, 1).build())
    assert leaves(flamegraph(local, SPAN, "inuse_space")["root"]) == {"hoard": 1000}
    assert leaves(flamegraph(local, SPAN, "inuse_objects")["root"]) == {"hoard": 1}
    assert leaves(flamegraph(local, SPAN, "alloc_space")["root"]) == {"hoard": 8192}
    # Another process's series: its snapshot is added, not swapped for the first one's.
    push(local, _Window().keep(churn, labels, 500, 1).build(), service="worker-2")
    assert leaves(flamegraph(local, SPAN, "inuse_space")["root"]) == {"hoard": 1000, "churn": 500}
    # The first series' memory is all freed: its next upload has none of it in use.
    push(local, _Window().alloc(churn, _labels(OTHER), 10, 1).build())
    assert leaves(flamegraph(local, SPAN, "inuse_space")["root"]) == {"churn": 500}
    assert leaves(flamegraph(local, SPAN, "alloc_space")["root"]) == {"hoard": 8192}
    memory = httpx.get(f"{local.ui_url}api/status", timeout=10).json()["memory"]
    assert (memory["inuse_snapshots"], memory["inuse_bytes"]) == (2, 500)


def test_a_snapshot_sliced_into_many_profiles_is_kept_whole(local: LocalMode) -> None:
    """The encoder slices a big window into several profiles of one push: every slice's in-use
    memory is in the snapshot, not only the last slice's."""
    window = _Window()
    spans = [f"{i + 1:016x}" for i in range(10)]
    for span in spans:
        window.keep(hoard, _labels(span), 1000, 1).alloc(churn, _labels(span), 10, 1)
    push(local, window.build(), max_samples=3)
    series = local.samples.memory.status()
    assert series["pushes"] == 1
    assert series["inuse_bytes"] == 10_000
    for span in spans:
        assert leaves(flamegraph(local, span, "inuse_space")["root"]) == {"hoard": 1000}


def test_otlp_memory_profiles_draw_the_same_flame_graphs_as_the_push(local: LocalMode) -> None:
    """OTLP memory profiles (four profiles, one sample type each) give every kind's tree the
    Pyroscope memory push of the same window gives."""
    window = (
        _Window()
        .alloc(hoard, _labels(SPAN), 40_960, 40)
        .alloc(churn, _labels(SPAN), 8_192, 8)
        .keep(hoard, _labels(SPAN), 10_240, 10)
        .build()
    )
    export_otlp(local, window)
    assert local.receiver.errors == []
    kinds = ("alloc_space", "alloc_objects", "inuse_space", "inuse_objects")
    by_otlp = {kind: leaves(flamegraph(local, SPAN, kind)["root"]) for kind in kinds}
    assert by_otlp == {
        "alloc_space": {"hoard": 40_960, "churn": 8_192},
        "alloc_objects": {"hoard": 40, "churn": 8},
        "inuse_space": {"hoard": 10_240},
        "inuse_objects": {"hoard": 10},
    }
    # The same window pushed (another series): allocations double, in-use adds its snapshot.
    push(local, window)
    assert leaves(flamegraph(local, SPAN, "alloc_space")["root"]) == {
        "hoard": 2 * 40_960,
        "churn": 2 * 8_192,
    }
    assert leaves(flamegraph(local, SPAN, "inuse_space")["root"]) == {"hoard": 2 * 10_240}


def test_a_span_s_memory_downloads_as_a_pprof_go_tool_pprof_reads(
    local: LocalMode, tmp_path: Path
) -> None:
    """``/api/pprof?kind=<memory kind>``: the span's allocations and in-use memory in one pprof
    (Go's heap profile types, period ``space/bytes``), the kind asked for shown first, every
    sample labelled with the span; read by our decoder and by ``go tool pprof``."""
    window = (
        _Window()
        .alloc(hoard, _labels(SPAN), 4 * 1024 * 1024, 40)
        .alloc(churn, _labels(SPAN), 1024 * 1024, 10)
        .alloc(churn, _labels(OTHER), 999, 1)
        .keep(hoard, _labels(SPAN), 2 * 1024 * 1024, 20)
        .build()
    )
    push(local, window)
    response = httpx.get(
        f"{local.ui_url}api/pprof", params={"span_id": SPAN, "kind": "inuse_space"}, timeout=10
    )
    assert response.status_code == 200, response.text
    assert f"spanprof-{SPAN}-memory.pb.gz" in response.headers["content-disposition"]
    profile = decode_profile(gzip.decompress(response.content))
    assert profile.sample_types == MEMORY_SAMPLE_TYPES
    assert (profile.period_type, profile.period) == (MEMORY_PERIOD_TYPE, PERIOD)
    assert profile.default_sample_type == "inuse_space"
    by_leaf = {sample.stack[0].function: sample.values for sample in profile.samples}
    assert by_leaf == {
        "hoard": (40, 4 * 1024 * 1024, 20, 2 * 1024 * 1024),
        "churn": (10, 1024 * 1024, 0, 0),
    }
    assert all(("span_id", SPAN) in sample.labels for sample in profile.samples)
    # No memory of a span, or no such kind: said, not an empty file.
    missing = httpx.get(
        f"{local.ui_url}api/pprof",
        params={"span_id": "00000000000000c3", "kind": "alloc_space"},
        timeout=10,
    )
    assert missing.status_code == 404
    assert "no memory samples" in missing.json()["error"]

    go = shutil.which("go")
    require(go is not None, "go tool pprof (Debian's golang-go) is not installed")
    assert go is not None
    path = tmp_path / "memory.pb.gz"
    path.write_bytes(response.content)
    result = subprocess.run(
        [go, "tool", "pprof", "-top", "-sample_index=inuse_space", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        # go keeps its caches under HOME; a fresh one keeps the test hermetic.
        env={**os.environ, "HOME": str(tmp_path), "GOTOOLCHAIN": "local"},
    )
    assert result.returncode == 0, result.stderr
    assert "hoard" in result.stdout
    assert "churn" not in result.stdout  # nothing of it is in use
    assert "2MB" in result.stdout.replace(" ", ""), result.stdout


@pytest.mark.parametrize("path", ["/api/flamegraph", "/api/compare", "/api/pprof"])
@pytest.mark.parametrize("kind", ["CPU", "alloc", "inuse_space ", "heap", "x" * 5000])
def test_flame_graph_apis_reject_an_unknown_kind(local: LocalMode, path: str, kind: str) -> None:
    """A kind that is not one of the five is a 400 that names the five, not a CPU graph (an
    empty ``kind=`` is no kind, like every empty parameter of these APIs)."""
    response = httpx.get(
        f"{local.ui_url}{path[1:]}",
        params={"span_id": SPAN, "route": "GET /items", "kind": kind},
        timeout=10,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith(
        "kind: expected one of cpu, alloc_space, alloc_objects, inuse_space, inuse_objects, got "
    )
    assert len(error) < 300


def _server_span(provider: TracerProvider, route: str, breached: bool) -> str:
    """A finished server span of ``route`` with the middleware's verdict; its span id."""
    tracer = provider.get_tracer("test")
    span = tracer.start_span(route, kind=SpanKind.SERVER)
    span.set_attribute("http.route", route.partition(" ")[2])
    span.set_attribute("spanprof.slo.breached", breached)
    span.end()
    return f"{span.get_span_context().span_id:016x}"


def test_each_route_compares_breaching_requests_memory_with_the_others(local: LocalMode) -> None:
    """Per route and request: allocations sided by their slo label, in-use memory (which has
    none) by the span store's verdict; functions ranked by extra bytes per breaching request."""
    provider = TracerProvider()
    local.install_tracing(provider)
    route = "GET /items"
    slow = [_server_span(provider, route, True) for _ in range(2)]
    fast = [_server_span(provider, route, False) for _ in range(4)]
    window = _Window()
    for span in slow:
        window.alloc(hoard, _labels(span, slo="breached"), 3_000_000, 30)
        window.keep(hoard, _labels(span), 1_000_000, 10)
    for span in fast:
        window.alloc(churn, _labels(span, slo="ok"), 100_000, 1)
        window.keep(churn, _labels(span), 1_000, 1)
    push(local, window.build())

    def compare(kind: str, **params: str) -> dict[str, Any]:
        response = httpx.get(
            f"{local.ui_url}api/compare", params={"kind": kind, **params}, timeout=10
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    for kind in ("alloc_space", "inuse_space"):
        [listed] = compare(kind)["routes"]
        assert listed["route"] == route
        assert listed["requests"] == {"breached": 2, "ok": 4}
    assert compare("alloc_space")["routes"][0]["sampled"] == {"breached": 6_000_000, "ok": 400_000}
    assert compare("cpu")["routes"] == []
    alloc = compare("alloc_space", route=route)
    assert (alloc["kind"], alloc["unit"]) == ("alloc_space", "bytes")
    top = alloc["functions"][0]
    assert (top["function"], top["breached"], top["ok"]) == ("hoard", 3_000_000, 0)
    assert top["extra"] == 3_000_000
    assert "extra_us" not in top
    assert alloc["flamegraph"]["value"] == 3_000_000  # a breaching request's average
    inuse = compare("inuse_space", route=route)
    rows = {f["function"]: (f["breached"], f["ok"]) for f in inuse["functions"]}
    assert rows == {"hoard": (1_000_000, 0), "churn": (0, 1_000)}
    objects = compare("alloc_objects", route=route)
    assert objects["unit"] == "count"
    assert objects["functions"][0]["breached"] == 30
    missing = httpx.get(
        f"{local.ui_url}api/compare", params={"kind": "inuse_space", "route": "GET /x"}, timeout=10
    )
    assert missing.status_code == 404


def _hostile_push(n: int, *, depth: int, names: int, series: int) -> ReceivedPush:
    """A memory push no profiler sends: long names, deep stacks, new span ids and series."""
    long_name = "f" * 5_000
    samples = []
    for k in range(names):
        stack = (
            Frame(f"{long_name}{n}.{k}", long_name, k),
            *(Frame("recurse", "m.py", i % 3) for i in range(depth)),
        )
        labels = (("span_id", f"{n * names + k:016x}"), ("span_name", f"route{n % 100}"))
        samples.append(Sample(stack, (1, 1000, 1, 1000), labels))
    samples.append(Sample((Frame("neg", "m.py", 1),), (-5, -(2**62), -1, -(2**62)), labels))
    profile = Profile(MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, PERIOD, 0, 0, tuple(samples))
    labels_of = (("__name__", "memory"), ("service_name", f"svc{n % series}" + "s" * 3000))
    return ReceivedPush(time.time(), "hostile", (PushSeries(labels_of, (profile,)),))


def test_memory_store_stays_within_its_bounds_under_hostile_pushes() -> None:
    """Pushes of new span ids, series, long names and deep stacks: the counts, the estimate and
    what is really held stay bounded; negative values count as nothing."""
    store = MemoryStore(max_bytes=512 * 1024, max_spans=500, max_series=4, max_depth=64)
    tracemalloc.start()
    try:
        for n in range(200):
            store.ingest(_hostile_push(n, depth=500, names=10, series=50))
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    status = store.status()
    assert status["kept_bytes"] <= 512 * 1024, status
    assert status["inuse_snapshots"] <= 4
    assert status["spans_with_allocations"] <= 500
    assert status["evicted_spans"] > 0
    assert status["evicted_snapshots"] > 0
    assert status["alloc_bytes"] == 200 * 10 * 1000  # the negative ones added nothing
    # The newest span kept its (cut) stack; the oldest went.
    newest = store.stacks(f"{199 * 10 + 9:016x}", "alloc_space")
    [(stack, value)] = newest.items()
    assert value == 1000
    assert len(stack) == 64
    assert store.stacks(f"{0:016x}", "alloc_space") == {}
    # 2,000 spans of 10 KB names and 500-frame stacks would be tens of MB.
    assert kept < 3 * 1024 * 1024, kept


def test_memory_store_bounds_stacks_per_span_and_per_snapshot() -> None:
    """Past max_stacks_per_span a span's new stacks (allocated or in use) fold into one
    [truncated] stack, their values kept."""
    store = MemoryStore(max_stacks_per_span=5)
    samples = tuple(
        Sample((Frame(f"f{i}", "m.py", i),), (1, 10, 1, 20), (("span_id", SPAN),))
        for i in range(50)
    )
    profile = Profile(MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, PERIOD, 0, 0, samples)
    store.ingest(ReceivedPush(0.0, "t", (PushSeries((("__name__", "memory"),), (profile,)),)))
    for kind, each in (("alloc_space", 10), ("inuse_space", 20)):
        stacks = store.stacks(SPAN, kind)
        assert len(stacks) == 6
        assert stacks[(Frame("[truncated]", "", 0),)] == 45 * each
        assert sum(stacks.values()) == 50 * each
