"""Memory profiles on the wire: the encoder, the exact backend's memory series, go tool pprof."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from itertools import islice, repeat
from pathlib import Path
from typing import Any

import pytest

from spanprof._labels._labelset import LABELS, LabelSet
from spanprof._labels._scope import labels_scope
from spanprof._local._receiver import PushReceiver, ReceivedSample
from spanprof._profiling._encoders._memory import (
    MEMORY_SAMPLE_TYPES,
    MemoryEncoder,
    memory_series_labels,
)
from spanprof._profiling._encoders._pprof import decode_profile
from spanprof._profiling._encoders._push import decode_push_request_raw
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._runtime import ProfilerRuntime
from spanprof._profiling._samplers._memory import MemorySampler, memory_unavailable_reason
from spanprof._profiling._window import MemoryWindow, StackTables, Window

from .conftest import AGENT_ENV, ALLOC_INDICES, MEMORY_VERSIONS, require
from .e2e.markers import MARKERS
from .e2e.server import ROOT
from .recording_server import RecordingServer

LINUX = sys.platform.startswith("linux")
BLOCK = sys.getsizeof(bytes(1000))
KEPT = LabelSet({"span_id": "00000000000000a1", "trace_id": "0" * 31 + "1", "span_name": "k"})
FREED = LabelSet({"span_id": "00000000000000b2", "trace_id": "0" * 31 + "2", "span_name": "f"})


def keeps_memory(count: int) -> list[bytes]:
    # Only the blocks are this function's allocations. A list grown by appends would reallocate
    # its array about 90 times, 1.4 MB for 20,000 items, which on 3.12+ (where the MEM domain
    # is sampled) is 7% over the bytes the tests count; ``range`` would allocate 20,000 ints
    # (2.7%), hence ALLOC_INDICES. One preallocated array is 160 KB (0.8%, 3.12+ only).
    kept = [b""] * count
    for i in islice(ALLOC_INDICES, count):
        kept[i] = bytes(1000)
    return kept


def frees_memory(count: int) -> None:
    for _ in repeat(None, count):
        bytes(1000)


def _window() -> MemoryWindow:
    tables = StackTables()
    code = keeps_memory.__code__
    sid = tables.stack_of((tables.raw_frame(code, 0, code.co_firstlineno + 1),))
    labels = LabelSet({"span_id": "00000000000000a1", "region": "eu"})
    return MemoryWindow(
        1_000,
        tables,
        values={(sid, labels): 4096, (sid, LabelSet()): 512},
        end_ns=2_000,
        alloc_objects={(sid, labels): 4, (sid, LabelSet()): 1},
        inuse={
            (sid, labels): (2, 2048),
            # Allocated in an earlier window, still in use: in-use values only.
            (sid, LabelSet({"span_id": "00000000000000b2"})): (1, 1024),
        },
    )


def test_memory_encoder_writes_pyroscopes_memory_profile_type() -> None:
    """Four sample types, space/bytes period of the sample size, and every sample's labels."""
    encoder = MemoryEncoder(_window(), period=524288)
    while not encoder.done:
        encoder.step()
    assert len(encoder.profiles) == 1
    profile = decode_profile(encoder.profiles[0])
    assert profile.sample_types == MEMORY_SAMPLE_TYPES
    assert profile.period_type == ("space", "bytes")
    assert profile.period == 524288
    assert (profile.time_nanos, profile.duration_nanos) == (1_000, 1_000)
    rows = {sample.labels: sample.values for sample in profile.samples}
    assert rows == {
        (("region", "eu"), ("span_id", "00000000000000a1")): (4, 4096, 2, 2048),
        (): (1, 512, 0, 0),
        (("span_id", "00000000000000b2"),): (0, 0, 1, 1024),
    }
    assert {sample.stack[0].function for sample in profile.samples} == {"keeps_memory"}


def test_memory_encoder_of_a_cpu_window_is_empty() -> None:
    """A plain CPU window has no memory values: nothing to encode."""
    encoder = MemoryEncoder(Window(0, StackTables()), period=1)
    assert encoder.step()
    assert encoder.profiles == []


def test_memory_series_labels_mark_a_non_delta_memory_series() -> None:
    """__name__=memory, __delta__=false, and the CPU series' other labels."""
    labels = dict(memory_series_labels("shop", {"region": "eu"}))
    assert labels["__name__"] == "memory"
    assert labels["__delta__"] == "false"
    assert labels["service_name"] == "shop"
    assert labels["region"] == "eu"
    assert labels["otel.scope.name"] == "spanprof"


def _memory_rows(samples: list[ReceivedSample], function: str) -> dict[str, list[int]]:
    """[alloc objects, alloc bytes, inuse objects, inuse bytes] per span id, ``function`` leaf."""
    out: dict[str, list[int]] = {}
    for sample in samples:
        # Before 3.12 a list comprehension runs in a frame of its own: skip it.
        stack = [f for f in sample.stack if not f.function.endswith("<listcomp>")]
        if not stack or stack[0].function != function:
            continue
        spans = sample.label_values("span_id")
        row = out.setdefault(",".join(spans), [0, 0, 0, 0])
        for i, value in enumerate(sample.values):
            row[i] += value
    return out


def _available() -> None:
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    reason = memory_unavailable_reason()
    require(reason is None, reason or "")


def _push_memory(url: str, sample_bytes: int, **options: Any) -> dict[str, float]:
    """Allocations kept under KEPT and freed under FREED, sent at shutdown by an exact backend
    with ``options`` (e.g. ``exporters=``); its stats after shutdown."""
    backend = ExactBackend(
        server_address=url,
        application_name="unit",
        upload_interval=3600,
        alloc_sample_bytes=sample_bytes,
        **options,
    )
    runtime = ProfilerRuntime(backend)
    runtime.start()
    try:
        assert backend.mode == "exact"
        with labels_scope(KEPT):
            kept = keeps_memory(20_000)
        with labels_scope(FREED):
            frees_memory(20_000)
            MARKERS[5](0.1)  # CPU too, so that both series are pushed
        stats = backend.stats()
    finally:
        runtime.stop()
    assert stats["memory_samples"] > 0, stats
    assert len(kept) == 20_000
    return backend.stats()


@pytest.mark.engine
@MEMORY_VERSIONS
def test_exact_backend_pushes_memory_labelled_by_span() -> None:
    """The memory series: allocations and in-use per span, kept blocks in use, freed ones not."""
    _available()
    mean = 16 * 1024
    with PushReceiver() as receiver:
        _push_memory(receiver.url, mean)
        series = [s for s in receiver.series() if s.label("__name__") == "memory"]
        samples = receiver.samples("memory")
        assert receiver.errors == []
    assert len(series) == 1
    assert series[0].label("__delta__") == "false"
    assert series[0].label("service_name") == "unit"
    check_kept_and_freed(samples, mean)


@pytest.mark.engine
@MEMORY_VERSIONS
def test_the_exporters_own_allocations_are_not_sampled() -> None:
    """The upload threads encode, compress and send windows: what they allocate is the
    profiler's work, nobody's memory, and must not show in the memory profile (the drain
    thread and the CPU sampler's handler are kept out the same way)."""
    _available()
    with PushReceiver() as receiver:
        backend = ExactBackend(
            server_address=receiver.url,
            application_name="unit",
            upload_interval=1,
            alloc_sample_bytes=16 * 1024,
        )
        runtime = ProfilerRuntime(backend)
        runtime.start()
        try:
            with labels_scope(FREED):
                deadline = time.monotonic() + 3.5  # three uploads of CPU and memory each
                while time.monotonic() < deadline:
                    frees_memory(2_000)
                    MARKERS[5](0.02)
        finally:
            runtime.stop()
        samples = receiver.samples("memory")
        assert receiver.errors == []
    assert _memory_rows(samples, "frees_memory"), "the application's allocations are missing"
    # Stacks through an export thread's loop. Not any exporter frame: building the exporters
    # at start allocates in the starting thread, as the application would. Nor the encoders:
    # the receiver here decodes in this process too, with the same modules.
    exporting = sorted(
        {
            " < ".join(f"{f.function} ({Path(f.filename).name})" for f in sample.stack[:3])
            for sample in samples
            if any(
                "_exporters" in frame.filename and frame.function.endswith("_run")
                for frame in sample.stack
            )
        }
    )
    assert exporting == [], exporting


def check_kept_and_freed(samples: list[ReceivedSample], mean: int) -> None:
    """``_push_memory``'s samples: each span's allocations and in-use memory, kept blocks in use,
    freed ones not, every linked sample with its trace."""
    kept = _memory_rows(samples, "keeps_memory")
    freed = _memory_rows(samples, "frees_memory")
    assert set(kept) == {KEPT["span_id"]}, kept
    assert set(freed) == {FREED["span_id"]}, freed
    assert all(s.label_values("trace_id") for s in samples if s.label_values("span_id"))
    truth = 20_000 * BLOCK
    tolerance = 4 / math.sqrt(20_000 * -math.expm1(-BLOCK / mean)) + 0.03
    assert kept[KEPT["span_id"]][1] == pytest.approx(truth, rel=tolerance)
    assert kept[KEPT["span_id"]][3] == pytest.approx(truth, rel=tolerance)
    assert freed[FREED["span_id"]][1] == pytest.approx(truth, rel=tolerance)
    # Freed blocks leave in-use. One full-suite run kept one sample of them (16 KB of 20 MB)
    # in use, unexplained yet (noted on #17); a sampler that misses frees keeps them all.
    assert freed[FREED["span_id"]][3] <= 0.01 * truth, freed


@pytest.mark.engine
@MEMORY_VERSIONS
def test_pushed_profiles_parse_with_go_tool_pprof(tmp_path: Path) -> None:
    """go tool pprof reads the memory and CPU profiles exactly as they went over the wire."""
    _available()
    go = shutil.which("go")
    require(go is not None, "go tool pprof (Debian's golang-go) is not installed")
    assert go is not None
    with RecordingServer() as server:
        _push_memory(server.url, 16 * 1024)
        requests = list(server.requests)
    files: dict[str, list[Path]] = {}
    for n, request in enumerate(requests):
        body = request.body
        for labels, raws in decode_push_request_raw(body, request.headers.get("content-encoding")):
            name = dict(labels)["__name__"]
            for i, (raw, _id) in enumerate(raws):
                path = tmp_path / f"{name}-{n}-{i}.pb"
                path.write_bytes(raw)
                files.setdefault(name, []).append(path)
    assert set(files) == {"memory", "process_cpu"}
    # go keeps its caches under HOME; a fresh one keeps the test hermetic.
    env = {**os.environ, "HOME": str(tmp_path), "GOTOOLCHAIN": "local"}

    def pprof(*args: str) -> str:
        result = subprocess.run(
            [go, "tool", "pprof", *args], capture_output=True, text=True, timeout=120, env=env
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    for path in files["process_cpu"]:
        assert "PeriodType: cpu nanoseconds" in pprof("-raw", str(path))
    tops = []
    for path in files["memory"]:
        text = pprof("-raw", str(path))
        assert "PeriodType: space bytes" in text
        assert "Period: 16384" in text
        assert "alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes" in text
        tops.append(pprof("-top", "-sample_index=inuse_space", str(path)))
    assert any("keeps_memory" in top for top in tops), tops


def test_memory_is_on_by_default_and_configurable_from_the_environment() -> None:
    """SPANPROF_MEMORY and SPANPROF_ALLOC_SAMPLE_BYTES; defaults on and 524288."""
    backend = ExactBackend.from_env(dict(AGENT_ENV))
    assert backend is not None
    assert (backend.memory, backend.alloc_sample_bytes) == (True, 524288)
    backend = ExactBackend.from_env(
        {**AGENT_ENV, "SPANPROF_MEMORY": "false", "SPANPROF_ALLOC_SAMPLE_BYTES": "65536"}
    )
    assert backend is not None
    assert (backend.memory, backend.alloc_sample_bytes) == (False, 65536)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SPANPROF_MEMORY", "maybe"), ("SPANPROF_ALLOC_SAMPLE_BYTES", "0")],
)
def test_bad_memory_settings_name_the_variable(variable: str, value: str) -> None:
    """A bad memory setting raises ValueError naming its variable."""
    with pytest.raises(ValueError, match=variable):
        ExactBackend.from_env({**AGENT_ENV, variable: value})


def test_bad_alloc_sample_bytes_argument_names_the_option() -> None:
    """alloc_sample_bytes=0 is refused with the option's name."""
    with pytest.raises(ValueError, match="alloc_sample_bytes"):
        ExactBackend(server_address="http://x:4040", application_name="a", alloc_sample_bytes=0)


@pytest.mark.engine
@MEMORY_VERSIONS
def test_memory_false_pushes_no_memory_series() -> None:
    """memory=False: the exact backend pushes CPU profiles only and installs no hook."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    with PushReceiver() as receiver:
        backend = ExactBackend(
            server_address=receiver.url,
            application_name="unit",
            upload_interval=3600,
            memory=False,
        )
        runtime = ProfilerRuntime(backend)
        runtime.start()
        try:
            frees_memory(10_000)
            MARKERS[3](0.2)  # some CPU, so that there is a CPU window to push
            assert "memory_samples" not in backend.stats()
        finally:
            runtime.stop()
        names = {s.label("__name__") for s in receiver.series()}
    assert names == {"process_cpu"}


_FALLBACK_SCRIPT = """
import asyncio, logging, sys, threading
from spanprof._profiling._exact import ExactBackend
from spanprof._profiling._runtime import ProfilerRuntime

logging.basicConfig(level=logging.INFO)
backend = ExactBackend(server_address=sys.argv[1], application_name="fallback", upload_interval=1)
runtime = ProfilerRuntime(backend)

async def serve():
    runtime.start()
    print("mode", backend.mode, flush=True)
    runtime.stop()

thread = threading.Thread(target=asyncio.run, args=(serve(),), name="loop-thread")
thread.start()
thread.join()
"""


@pytest.mark.e2e
@pytest.mark.needs_agent
@pytest.mark.timeout(60)
def test_the_fallback_says_memory_samples_are_not_labelled(tmp_path: Path) -> None:
    """Under the pyroscope-io fallback a start-up line says memory is not labelled there."""
    require(LINUX, "the exact sampler needs Linux thread CPU clocks")
    script = tmp_path / "fallback.py"
    script.write_text(textwrap.dedent(_FALLBACK_SCRIPT))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}"}
    with PushReceiver() as receiver:
        proc = subprocess.run(
            [sys.executable, str(script), receiver.url],
            capture_output=True,
            text=True,
            timeout=45,
            env=env,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stderr
    assert "mode pyroscope" in proc.stdout
    assert "memory samples are not labelled under the pyroscope-io fallback" in proc.stderr


@MEMORY_VERSIONS
def test_memory_labels_are_the_allocating_greenlets() -> None:
    """gevent greenlets taking turns on one OS thread: each sample carries its greenlet's labels."""
    _available()
    require(importlib.util.find_spec("gevent") is not None, "gevent is not installed")
    import gevent

    def run(labels: LabelSet, allocate: Callable[[int], object]) -> None:
        LABELS.set(labels)  # each greenlet runs in a context of its own
        for _ in range(300):
            allocate(10)
            gevent.sleep(0)

    sampler = MemorySampler(sample_bytes=2048, drain_interval=3600, seed=7)
    sampler.start()
    try:
        gevent.joinall(
            [gevent.spawn(run, KEPT, keeps_memory), gevent.spawn(run, FREED, frees_memory)]
        )
        window = sampler.take_window()
    finally:
        sampler.stop()
    seen: dict[str, set[str]] = {}
    for sid, labels in window.values:
        stack = [f for f in window.stack(sid) if not f.function.endswith("<listcomp>")]
        if stack and stack[0].function in ("keeps_memory", "frees_memory"):
            seen.setdefault(stack[0].function, set()).add(labels.get("span_id", ""))
    assert seen == {"keeps_memory": {KEPT["span_id"]}, "frees_memory": {FREED["span_id"]}}


@pytest.mark.engine
def test_allocation_sampling_runs_or_says_why_not() -> None:
    """3.10-3.15 sample allocations; later versions refuse, naming the frame layout."""
    reason = memory_unavailable_reason()
    if sys.version_info >= (3, 16):
        assert reason is not None
        assert "frame layout" in reason, reason
    else:
        require(reason is None, reason or "")


_GEVENT_DRAIN_SCRIPT = """
from gevent import monkey; monkey.patch_all()
import sys
import gevent
from spanprof._profiling._samplers import _memory
from spanprof._profiling._samplers._memory import MemorySampler

_memory._SLICE_NS = 0  # the drain yields every 32 samples
sampler = MemorySampler(sample_bytes=64, max_samples=100_000, drain_interval=3600.0, seed=5)
windows = []

def app():
    for _ in range(200):
        bytes(1 << 20)  # sampled with probability 1 - exp(-16384): always, weight 1
        gevent.sleep(0)

def waiter():
    gevent.sleep(0)  # on until the drain below holds the lock
    windows.append(sampler.take_window())  # waits for it, switching to the others

sampler.start()
try:
    backlog = [str(i) * 3 for i in range(20_000)]  # some 20,000 samples: hundreds of slices
    greenlets = [gevent.spawn(waiter), gevent.spawn(app)]
    gevent.sleep(0)
    sampler.drain()  # slices the backlog, switching to the greenlets in between
    gevent.joinall(greenlets, raise_error=True)
    windows.append(sampler.take_window())
    stats = sampler.stats()
finally:
    sampler.stop()
sampled = 0
for window in windows:
    for (sid, _), nbytes in window.values.items():
        stack = window.stack(sid)
        if stack and stack[0].function == "app":
            sampled += nbytes
print(sampled, int(stats["dropped"]), sys.getsizeof(bytes(1 << 20)))
"""


@MEMORY_VERSIONS
def test_greenlets_that_run_while_a_drain_yields_are_sampled() -> None:
    """The ignore flag is the OS thread's: under gevent, a drain that set it and then switched to
    the application's greenlets (its sleep between slices, a wait for the sampler's lock) left
    their allocations unsampled."""
    # Not an engine test: the engine matrix's venvs carry no gevent.
    _available()
    require(importlib.util.find_spec("gevent") is not None, "gevent is not installed")
    result = subprocess.run(
        [sys.executable, "-c", _GEVENT_DRAIN_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    sampled, dropped, block = map(int, result.stdout.split())
    assert dropped == 0, result.stdout
    # Each of the 200 blocks, and little else the loop allocates.
    assert 200 * block <= sampled < 1.01 * 200 * block, result.stdout
