"""Memory profiles over OTLP: the encoder, decoded with opentelemetry-proto's own classes."""

from __future__ import annotations

import functools
import logging
import time

import pytest
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)

from spanprof._labels._labelset import EMPTY
from spanprof._local._receiver import PushReceiver, ReceivedSample
from spanprof._profiling._encoders._otlp import encode_resource, encode_scope
from spanprof._profiling._encoders._otlp_memory import OtlpMemoryEncoder
from spanprof._profiling._exporters._fanout import WindowFanout
from spanprof._profiling._window import MemoryWindow, StackTables, Window

from .conftest import MEMORY_VERSIONS
from .exporting import timed_steps
from .otlp_profiles import (
    MEMORY_PROFILE_TYPES,
    OtlpProfilesReceiver,
    flatten,
    memory_samples,
    model_violations,
    profile_type,
    resource_attributes,
)
from .test_memory_push import FREED, KEPT, _available, _push_memory, check_kept_and_freed
from .test_otlp import RESOURCE, _deep_stacks, _exporter, _labels, _leaf, _root

PERIOD = 524288


def _stack(tables: StackTables) -> int:
    return tables.stack_of(
        tuple(tables.raw_frame(f.__code__, 0, f.__code__.co_firstlineno) for f in (_leaf, _root))
    )


def _memory_window() -> MemoryWindow:
    """Two requests' allocations (one still partly in use), an unlabelled one, and memory a
    request allocated in an earlier window that is still in use."""
    tables = StackTables()
    sid = _stack(tables)
    first, second = (sid, _labels(0)), (sid, _labels(1, tenant="acme"))
    unlabelled, earlier = (sid, EMPTY), (sid, _labels(2))
    return MemoryWindow(
        1_000,
        tables,
        values={first: 40_960, second: 8_192, unlabelled: 512},
        end_ns=1_000 + 10_000_000_000,
        alloc_objects={first: 40, second: 8, unlabelled: 1},
        inuse={first: (10, 10_240), earlier: (3, 3_072)},
    )


def _encode(window: Window) -> ExportProfilesServiceRequest:
    encoder = OtlpMemoryEncoder(
        window,
        period=PERIOD,
        resource=encode_resource(RESOURCE),
        scope=encode_scope(),
        attributes=[("region", "eu")],
    )
    while not encoder.step():
        pass
    request = ExportProfilesServiceRequest()
    request.ParseFromString(encoder.request)
    return request


def test_a_memory_window_is_four_profiles_sharing_one_dictionary() -> None:
    """alloc_objects, alloc_space, inuse_objects, inuse_space: period type space/bytes with the
    sample size, one dictionary (one stack, one link per span), the model's MUSTs kept."""
    window = _memory_window()
    request = _encode(window)
    assert model_violations(request) == []
    assert resource_attributes(request) == RESOURCE
    (rp,) = request.resource_profiles
    (sp,) = rp.scope_profiles
    assert sp.scope.name == "spanprof"
    assert tuple(profile_type(request, p) for p in sp.profiles) == MEMORY_PROFILE_TYPES
    assert {p.period for p in sp.profiles} == {PERIOD}
    assert {(p.time_unix_nano, p.duration_nano) for p in sp.profiles} == {(1_000, 10_000_000_000)}
    ids = [p.profile_id for p in sp.profiles]
    assert all(len(i) == 16 for i in ids)
    assert len(set(ids)) == 4
    strings = request.dictionary.string_table
    for profile in sp.profiles:
        assert [
            strings[request.dictionary.attribute_table[a].key_strindex]
            for a in profile.attribute_indices
        ] == ["region"]
        # One value per sample: the profile's one sample type.
        assert all(len(s.values) == 1 for s in profile.samples)
    # Shared, not repeated per profile: the zero entries, one stack, one link per span.
    assert len(request.dictionary.stack_table) == 2
    assert len(request.dictionary.link_table) == 4
    for link in request.dictionary.link_table[1:]:
        assert (len(link.trace_id), len(link.span_id)) == (16, 8)
    # A profile leaves out the samples whose value in it is zero.
    assert [len(p.samples) for p in sp.profiles] == [3, 3, 2, 2]
    rows = {tuple(sorted(sample.labels)): sample.values for sample in memory_samples(request)}
    assert rows == {
        tuple(sorted(_labels(0).items_tuple)): (40, 40_960, 10, 10_240),
        tuple(sorted(_labels(1, tenant="acme").items_tuple)): (8, 8_192, 0, 0),
        (): (1, 512, 0, 0),
        tuple(sorted(_labels(2).items_tuple)): (0, 0, 3, 3_072),
    }
    assert {f.function for s in flatten(request) for f in s.stack} == {"_leaf", "_root"}


def test_memory_values_are_not_scaled_by_the_period() -> None:
    """Values are objects and bytes already (estimates), not counts of sampling periods."""
    request = _encode(_memory_window())
    alloc_space = [
        s.value
        for s in flatten(request)
        if s.series_label("profile_type") == MEMORY_PROFILE_TYPES[1]
    ]
    assert sorted(alloc_space) == [512, 8_192, 40_960]


def test_a_cpu_window_gives_four_empty_memory_profiles() -> None:
    """A plain Window has no allocation or in-use values: the profiles are there, empty."""
    tables = StackTables()
    window = Window(0, tables, {(_stack(tables), _labels(0)): 5}, end_ns=1)
    request = _encode(window)
    assert model_violations(request) == []
    profiles = request.resource_profiles[0].scope_profiles[0].profiles
    assert [len(p.samples) for p in profiles] == [0, 0, 0, 0]


def test_memory_encoding_steps_stay_short_and_lose_nothing() -> None:
    """4,000 distinct deep keys (half still in use) encode in steps of < 2 ms CPU, intact."""

    def make() -> OtlpMemoryEncoder:
        tables = StackTables()
        window = MemoryWindow(time.time_ns(), tables)
        for n, sid in enumerate(_deep_stacks(tables, 4000)):
            key = (sid, _labels(n))
            window.values[key] = 1024 * (n + 1)
            window.alloc_objects[key] = n + 1
            if n % 2:
                window.inuse[key] = (1, 512 * (n + 1))
        window.end_ns = window.start_ns + 10_000_000_000
        return OtlpMemoryEncoder(
            window, period=PERIOD, resource=encode_resource(RESOURCE), scope=encode_scope()
        )

    encoder, longest, steps = timed_steps(make)
    assert longest < 2_000_000
    assert steps > 2
    request = ExportProfilesServiceRequest.FromString(encoder.request)
    assert model_violations(request) == []
    samples = memory_samples(request)
    assert len(samples) == 4000
    totals = [sum(s.values[i] for s in samples) for i in range(4)]
    assert totals == [
        sum(range(1, 4001)),
        1024 * sum(range(1, 4001)),
        2000,
        512 * sum(range(2, 4001, 2)),
    ]
    assert all(len(s.stack) == 48 for s in samples)
    assert {s.label_values("span_id")[0] for s in samples} == {
        _labels(n)["span_id"] for n in range(4000)
    }


# --- the exporter and the fan-out ----------------------------------------------------------------


def test_the_exporter_sends_memory_windows_even_with_only_memory_in_use() -> None:
    """With the memory encoder, each window is one request of four profiles; a window without
    new allocations still carries what is in use."""
    full = _memory_window()
    inuse_only = MemoryWindow(
        full.end_ns, full.tables, end_ns=full.end_ns + 1_000, inuse=dict(full.inuse)
    )
    empty = MemoryWindow(inuse_only.end_ns, full.tables, end_ns=inuse_only.end_ns + 1)
    windows = iter([full, inuse_only, empty])
    with OtlpProfilesReceiver() as receiver:
        exporter = _exporter(
            receiver.url,
            upload_interval=0.05,
            encoder=functools.partial(OtlpMemoryEncoder, period=PERIOD),
        )
        exporter.start(lambda: next(windows, empty))
        deadline = time.monotonic() + 10
        while len(receiver.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        exporter.stop()
        requests = receiver.requests()
        assert receiver.errors == []
    assert len(requests) == 2
    assert exporter.stats()["otlp_uploads"] == 2
    assert receiver.samples() == []  # none of it is CPU
    later = {tuple(sorted(s.labels)): s.values for s in memory_samples(requests[1])}
    assert later == {
        tuple(sorted(_labels(0).items_tuple)): (0, 0, 10, 10_240),
        tuple(sorted(_labels(2).items_tuple)): (0, 0, 3, 3_072),
    }


def test_fanout_merges_memory_windows_adding_allocations_keeping_the_newest_in_use() -> None:
    """A stuck exporter's memory backlog: allocated objects and bytes add up, in-use memory is
    the newest window's snapshot (adding snapshots would count live blocks twice)."""
    tables = StackTables()
    sid = _stack(tables)
    key = (sid, _labels(0))
    taken = [
        MemoryWindow(
            n,
            tables,
            values={key: 1_000},
            end_ns=n + 1,
            alloc_objects={key: 1},
            inuse={key: (n + 1, 100 * (n + 1))},
        )
        for n in range(3)
    ]
    fanout = WindowFanout(iter(taken).__next__, 2)
    quick, stuck = fanout.collector(0), fanout.collector(1)
    for _ in taken:
        quick()
    merged = stuck()
    assert isinstance(merged, MemoryWindow)
    assert (merged.values, merged.alloc_objects, merged.inuse) == (
        {key: 3_000},
        {key: 3},
        {key: (3, 300)},
    )
    assert (merged.start_ns, merged.end_ns) == (0, 3)


# --- the exact backend ---------------------------------------------------------------------------


@pytest.mark.engine
@MEMORY_VERSIONS
def test_exact_backend_exports_memory_over_otlp_linked_to_the_allocating_span(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """exporters="otlp": allocations and in-use memory per span as OTLP memory profiles, kept
    blocks in use, freed ones not; the CPU profile is a request of its own."""
    _available()
    mean = 16 * 1024
    with OtlpProfilesReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT", receiver.url)
        with caplog.at_level(logging.INFO, logger="spanprof"):
            _push_memory("", mean, exporters="otlp")
        requests = receiver.requests()
        samples = receiver.memory_samples()
        cpu = receiver.samples()
        assert receiver.errors == []
    kinds = sorted(
        tuple(profile_type(r, p) for p in r.resource_profiles[0].scope_profiles[0].profiles)
        for r in requests
    )
    assert kinds == sorted([("samples:count:cpu:nanoseconds",), MEMORY_PROFILE_TYPES])
    assert cpu
    assert any(
        "memory profiles" in r.message and r.message.endswith("exporting to otlp")
        for r in caplog.records
    ), caplog.text
    check_kept_and_freed(samples, mean)
    assert {s.label_values("trace_id") for s in samples if s.label_values("span_id")} == {
        (KEPT["trace_id"],),
        (FREED["trace_id"],),
    }


@pytest.mark.engine
@MEMORY_VERSIONS
def test_both_exporters_send_the_same_memory_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """exporters="pyroscope,otlp": the memory push and the OTLP memory profiles carry exactly
    the same estimates (one sampler, every window to each), and stats() counts both."""
    _available()
    with PushReceiver() as pyroscope, OtlpProfilesReceiver() as otlp:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROFILES_ENDPOINT", otlp.url)
        stats = _push_memory(pyroscope.url, 16 * 1024, exporters="pyroscope,otlp")
        pushed = pyroscope.samples("memory")
        exported = otlp.memory_samples()
        assert pyroscope.errors == []
        assert otlp.errors == []

    def by_span(samples: list[ReceivedSample]) -> dict[tuple[str, ...], list[int]]:
        rows: dict[tuple[str, ...], list[int]] = {}
        for sample in samples:
            row = rows.setdefault(sample.label_values("span_id"), [0, 0, 0, 0])
            for i, value in enumerate(sample.values):
                row[i] += value
        return rows

    assert by_span(pushed)[(KEPT["span_id"],)][1] > 0
    assert by_span(exported) == by_span(pushed)
    # Flushed side by side with the CPU exporters at shutdown, each counted under its prefix.
    assert (stats["memory_push_uploads"], stats["memory_otlp_uploads"]) == (1, 1), stats
    assert (stats["uploads"], stats["otlp_uploads"]) == (1, 1), stats


# --- local mode's receiver -----------------------------------------------------------------------


def test_local_receiver_stores_otlp_memory_as_the_memory_push_would() -> None:
    """The four OTLP memory profiles become one memory series equal to the Pyroscope memory
    push of the same window; nothing of them is CPU, to the receiver or to local mode's store,
    which keeps what each span allocated."""
    from spanprof._local._receiver import ReceivedPush
    from spanprof._local._samples import SampleStore
    from spanprof._profiling._encoders._memory import MemoryEncoder, memory_series_labels
    from spanprof._profiling._exporters._pusher import Pusher

    window = _memory_window()
    pushes: list[ReceivedPush] = []
    with PushReceiver(on_push=pushes.append) as receiver:
        exporter = _exporter(
            receiver.url + "/v1development/profiles",
            encoder=functools.partial(OtlpMemoryEncoder, period=PERIOD),
        )
        exporter.start(lambda: window)
        exporter.stop()
        exported = receiver.samples("memory")
        assert receiver.samples() == []
        receiver.clear()
        pusher = Pusher(
            server_address=receiver.url,
            labels=memory_series_labels("checkout", {}),
            period_ns=PERIOD,
            upload_interval=60,
            encoder=lambda w: MemoryEncoder(w, period=PERIOD),
        )
        pusher.start(lambda: window)
        pusher.stop()
        pushed = receiver.samples("memory")
        assert receiver.errors == []
    (otlp_series,) = pushes[0].series
    assert otlp_series.label("__name__") == "memory"
    assert otlp_series.label("service_name") == "checkout"
    (profile,) = otlp_series.profiles
    assert (profile.period_type, profile.period) == (("space", "bytes"), PERIOD)

    def rows(samples: list[ReceivedSample]) -> dict[object, tuple[int, ...]]:
        return {(s.stack, tuple(sorted(s.labels))): s.values for s in samples}

    assert len(exported) == 4
    assert rows(exported) == rows(pushed)
    store = SampleStore()
    store.ingest(pushes[0])
    assert store.status()["samples_ns"] == 0
    assert store.sample_total(_labels(0)["span_id"]) == 0
    # What each span allocated is kept for the page, the same by OTLP and by push.
    assert store.allocated_bytes(_labels(0)["span_id"]) == 40_960
    assert store.allocated_bytes(_labels(1)["span_id"]) == 8_192
    assert store.allocated_bytes(_labels(2)["span_id"]) == 0  # only in use, not allocated now
    pushed_store = SampleStore()
    pushed_store.ingest(pushes[-1])
    assert pushed_store.allocated_bytes(_labels(0)["span_id"]) == 40_960
