"""The SLO hold: samples wait for their span's verdict, then leave labelled, bounded and whole."""

from __future__ import annotations

import random
import tracemalloc

from spanprof._labels._labelset import LabelSet
from spanprof._profiling._hold import SloHold
from spanprof._profiling._verdicts import MAX_GENERATIONS, Verdicts
from spanprof._profiling._window import Frame, MemoryWindow, StackTables, Window

BACKGROUND = LabelSet({"job": "cron"})


def _labels(span: int) -> LabelSet:
    return LabelSet({"span_id": f"{span:016x}", "span_name": "GET /checkout"})


class _Source:
    """Windows a test fills by hand, handed out like the sampler's ``take_window``."""

    def __init__(self) -> None:
        self.tables = StackTables()
        self.next = Window(0, self.tables)
        self.taken = 0

    def stack(self, *names: str) -> int:
        return self.tables.add_stack(
            tuple(self._frame(name) for name in names),
        )

    def _frame(self, name: str) -> int:
        self.tables.frames.append(Frame(name, "app.py", 1))
        return len(self.tables.frames) - 1

    def add(self, sid: int, labels: LabelSet, weight: int) -> None:
        key = (sid, labels)
        self.next.values[key] = self.next.values.get(key, 0) + weight

    def swap_tables(self) -> None:
        assert not self.next.values
        self.tables = StackTables()
        self.next = Window(0, self.tables)

    def take(self) -> Window:
        window, self.next = self.next, Window(0, self.tables)
        self.taken += 1
        return window


def _by_slo(window: Window) -> dict[tuple[str | None, str | None], int]:
    out: dict[tuple[str | None, str | None], int] = {}
    for (_sid, labels), weight in window.values.items():
        key = (labels.get("span_id"), labels.get("slo"))
        out[key] = out.get(key, 0) + weight
    return out


def test_samples_of_ended_spans_carry_their_verdict() -> None:
    """A span that ended before the upload: its samples go out with slo=breached or ok."""
    source = _Source()
    hold = SloHold(source.take)
    sid = source.stack("handler")
    source.add(sid, _labels(1), 10)
    source.add(sid, _labels(2), 20)
    source.add(sid, BACKGROUND, 5)
    hold.end_span(_labels(1)["span_id"], True)
    hold.end_span(_labels(2)["span_id"], False)
    out = _by_slo(hold.take_window())
    assert out == {
        (_labels(1)["span_id"], "breached"): 10,
        (_labels(2)["span_id"], "ok"): 20,
        (None, None): 5,
    }


def test_in_flight_samples_are_held_until_the_span_ends() -> None:
    """Samples of a running span wait; when it ends they go out labelled, in the next upload."""
    source = _Source()
    hold = SloHold(source.take, max_windows=3)
    sid = source.stack("handler")
    span = _labels(7)
    source.add(sid, span, 10)
    assert _by_slo(hold.take_window()) == {}
    source.add(sid, span, 30)
    assert _by_slo(hold.take_window()) == {}
    hold.end_span(span["span_id"], True)
    source.add(sid, span, 5)  # booked after the end, before the upload
    assert _by_slo(hold.take_window()) == {(span["span_id"], "breached"): 45}
    # A late residual of the same span, one upload later, still finds the verdict.
    source.add(sid, span, 1)
    assert _by_slo(hold.take_window()) == {(span["span_id"], "breached"): 1}
    assert hold.stats()["slo_held_spans"] == 0


def test_a_span_longer_than_the_hold_goes_out_unlabelled_and_stays_so() -> None:
    """Past max_windows uploads the samples leave without slo; the late verdict labels nothing."""
    source = _Source()
    hold = SloHold(source.take, max_windows=2)
    sid = source.stack("handler")
    span = _labels(3)
    source.add(sid, span, 10)
    assert _by_slo(hold.take_window()) == {}  # waits one upload
    assert _by_slo(hold.take_window()) == {}  # and a second
    assert _by_slo(hold.take_window()) == {(span["span_id"], None): 10}
    hold.end_span(span["span_id"], False)
    source.add(sid, span, 4)
    # Samples taken after the expiry but before the end: labelled by the verdict now known.
    assert _by_slo(hold.take_window()) == {(span["span_id"], "ok"): 4}
    assert hold.stats()["slo_expired_ms"] == 10 / 1e6


def test_nothing_is_lost_or_counted_twice() -> None:
    """Random spans, ends and uploads: every booked nanosecond leaves exactly once."""
    rng = random.Random(19)
    source = _Source()
    hold = SloHold(source.take, max_windows=2, max_held=50)
    sids = [source.stack(f"f{i}") for i in range(8)]
    booked: dict[str, int] = {}
    sent: dict[str, int] = {}
    live: list[int] = []
    ended: dict[str, bool] = {}
    next_span = 0
    for _round in range(400):
        for _ in range(rng.randrange(1, 8)):
            if not live or rng.random() < 0.3:
                next_span += 1
                live.append(next_span)
            span = rng.choice(live)
            labels = _labels(span)
            weight = rng.randrange(1, 1000)
            source.add(rng.choice(sids), labels, weight)
            booked[labels["span_id"]] = booked.get(labels["span_id"], 0) + weight
        for span in list(live):
            if rng.random() < 0.2:
                live.remove(span)
                verdict = rng.random() < 0.25
                ended[_labels(span)["span_id"]] = verdict
                hold.end_span(_labels(span)["span_id"], verdict)
        if rng.random() < 0.3:
            for (_sid, labels), weight in hold.take_window().values.items():
                span_id = labels["span_id"]
                sent[span_id] = sent.get(span_id, 0) + weight
                slo = labels.get("slo")
                if slo is not None:
                    # A label, when there is one, is the span's own verdict.
                    assert slo == ("breached" if ended[span_id] else "ok")
    hold.close()
    for (_sid, labels), weight in hold.take_window().values.items():
        sent[labels["span_id"]] = sent.get(labels["span_id"], 0) + weight
    assert sent == booked
    assert hold.stats()["slo_held_samples"] == 0


def test_the_hold_is_bounded() -> None:
    """Past max_held held pairs, new in-flight samples pass through unlabelled (counted)."""
    source = _Source()
    hold = SloHold(source.take, max_windows=5, max_held=100)
    sid = source.stack("handler")
    for span in range(1, 10_001):
        source.add(sid, _labels(span), 1)
    out = hold.take_window()
    assert hold.stats()["slo_held_samples"] == 100
    assert sum(out.values.values()) == 9_900
    assert hold.stats()["slo_overflow_ms"] == 9_900 / 1e6


def test_the_verdicts_are_bounded_and_rotate() -> None:
    """Verdicts are kept for two uploads and at most max_verdicts per upload."""
    source = _Source()
    hold = SloHold(source.take, max_verdicts=1000)
    for span in range(5000):
        hold.end_span(f"{span:016x}", True)
    assert hold.stats()["slo_verdicts_dropped"] == 4000
    hold.take_window()
    hold.take_window()
    sid = source.stack("handler")
    source.add(sid, _labels(1), 10)
    hold.take_window()
    # Forgotten after two uploads: the span is held as in flight again.
    assert hold.stats()["slo_held_spans"] == 1


def test_two_holds_share_one_store_of_verdicts_each_on_its_own_clock() -> None:
    """The CPU and the memory hold read one store: a verdict recorded once labels both, over
    each hold's own last two uploads however their takes interleave."""
    verdicts = Verdicts()
    cpu_source, memory_source = _Source(), _Source()
    cpu = SloHold(cpu_source.take, verdicts=verdicts)
    memory = SloHold(memory_source.take, verdicts=verdicts)
    cpu_sid, memory_sid = cpu_source.stack("handler"), memory_source.stack("handler")
    early, late = _labels(1), _labels(2)
    verdicts.record(early["span_id"], True)
    # The CPU hold takes three times before the memory hold takes at all.
    cpu_source.add(cpu_sid, early, 10)
    assert _by_slo(cpu.take_window()) == {(early["span_id"], "breached"): 10}
    cpu.take_window()
    verdicts.record(late["span_id"], False)
    cpu.take_window()
    # The memory hold has not taken since the first verdict: it sees both.
    memory_source.add(memory_sid, early, 100)
    memory_source.add(memory_sid, late, 200)
    assert _by_slo(memory.take_window()) == {
        (early["span_id"], "breached"): 100,
        (late["span_id"], "ok"): 200,
    }
    # The CPU hold still has the late verdict (its last upload's); the early one is gone for
    # it, two uploads on: that span's samples are held as in flight again.
    cpu_source.add(cpu_sid, late, 1)
    cpu_source.add(cpu_sid, early, 1)
    assert _by_slo(cpu.take_window()) == {(late["span_id"], "ok"): 1}
    assert cpu.stats()["slo_held_spans"] == 1
    # Written once: both holds count the same drops.
    assert cpu.verdicts is memory.verdicts


def test_a_hold_that_stops_taking_keeps_at_most_a_few_generations_alive() -> None:
    """A reader that never takes again (its exporter stuck) bounds what the store keeps."""
    verdicts = Verdicts()
    source = _Source()
    active = SloHold(source.take, verdicts=verdicts)
    stuck = SloHold(_Source().take, verdicts=verdicts)
    stuck.take_window()
    for upload in range(50):
        verdicts.record(f"{upload:016x}", True)
        active.take_window()
    assert len(verdicts._sealed) <= MAX_GENERATIONS
    # The active hold still labels with what ended in its last upload.
    sid = source.stack("handler")
    source.add(sid, _labels(49), 3)
    assert _by_slo(active.take_window()) == {(_labels(49)["span_id"], "breached"): 3}
    # The stuck one lost the oldest verdicts but still finds the newest kept.
    stuck_source = _Source()
    stuck._take = stuck_source.take
    stuck_sid = stuck_source.stack("handler")
    stuck_source.add(stuck_sid, _labels(48), 5)
    assert _by_slo(stuck.take_window()) == {(_labels(48)["span_id"], "breached"): 5}


def test_a_verdict_recorded_during_a_take_is_found_at_the_next_one() -> None:
    """A request that read the store's current generation just before a take sealed it writes
    into the sealed one: the next take still finds that verdict."""
    verdicts = Verdicts()
    source = _Source()
    hold = SloHold(source.take, verdicts=verdicts)
    sid = source.stack("handler")
    span = _labels(3)
    late_reader = verdicts.current  # what a request read before the take
    source.add(sid, span, 7)
    assert _by_slo(hold.take_window()) == {}  # in flight: held
    late_reader[span["span_id"]] = False  # its write lands in the sealed generation
    assert _by_slo(hold.take_window()) == {(span["span_id"], "ok"): 7}


def test_held_stacks_survive_a_swap_of_the_stack_tables() -> None:
    """A span held across the sampler's table reset still names its frames."""
    source = _Source()
    hold = SloHold(source.take)
    old = source.stack("checkout", "handler")
    span = _labels(9)
    source.add(old, span, 12)
    hold.take_window()
    source.swap_tables()
    source.stack("other")  # id 0 in the new tables means something else
    hold.end_span(span["span_id"], True)
    out = hold.take_window()
    [(sid, labels)] = list(out.values)
    assert sid < 0
    assert labels["slo"] == "breached"
    assert [frame.function for frame in out.stack(sid)] == ["checkout", "handler"]


def test_close_releases_everything() -> None:
    """At shutdown nothing waits for a verdict that would come too late."""
    source = _Source()
    hold = SloHold(source.take)
    sid = source.stack("handler")
    source.add(sid, _labels(1), 10)
    hold.take_window()
    source.add(sid, _labels(2), 3)
    hold.close()
    assert _by_slo(hold.take_window()) == {
        (_labels(1)["span_id"], None): 10,
        (_labels(2)["span_id"], None): 3,
    }


def test_memory_of_the_hold_under_10000_concurrent_slow_requests() -> None:
    """10,000 in-flight requests with 4 stacks each: the hold keeps well under 16 MB."""
    source = _Source()
    hold = SloHold(source.take)
    sids = [source.stack(f"f{i}") for i in range(4)]
    for span in range(1, 10_001):
        labels = _labels(span)
        for sid in sids:
            source.add(sid, labels, 1)
    window = source.next
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        hold.take_window()
        del window
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert hold.stats()["slo_held_samples"] == 40_000
    print(f"hold: {held / 1e6:.1f} MB for 10,000 spans x 4 stacks")
    assert held < 16 * 1024 * 1024


def test_memory_windows_hold_allocations_and_pass_in_use_memory_on() -> None:
    """Allocated bytes and objects wait and get slo together; in-use memory is untouched."""
    tables = StackTables()
    tables.frames.append(Frame("alloc", "app.py", 1))
    sid = tables.add_stack((0,))
    span = _labels(5)
    first = MemoryWindow(
        0,
        tables,
        values={(sid, span): 4096},
        alloc_objects={(sid, span): 4},
        inuse={(sid, span): (2, 2048)},
    )
    second = MemoryWindow(
        0, tables, values={(sid, span): 1024}, alloc_objects={(sid, span): 1}, inuse={}
    )
    windows = iter([first, second])
    hold = SloHold(lambda: next(windows))
    out = hold.take_window()
    assert isinstance(out, MemoryWindow)
    assert out.values == {}
    assert out.alloc_objects == {}
    assert out.inuse == {(sid, span): (2, 2048)}
    hold.end_span(span["span_id"], True)
    out = hold.take_window()
    assert isinstance(out, MemoryWindow)
    labelled = span.merged({"slo": "breached"})
    assert out.values == {(sid, labelled): 5120}
    assert out.alloc_objects == {(sid, labelled): 5}


def test_a_span_still_running_across_a_table_swap_is_counted() -> None:
    """Its new samples go out at once, unlabelled, and the hold says how many spans did so."""
    source = _Source()
    hold = SloHold(source.take, max_windows=3)
    span = _labels(11)
    source.add(source.stack("before"), span, 5)
    hold.take_window()
    source.swap_tables()
    source.add(source.stack("after"), span, 7)
    assert _by_slo(hold.take_window()) == {(span["span_id"], None): 7}
    assert hold.stats()["slo_swapped_spans"] == 1
    hold.end_span(span["span_id"], False)
    assert _by_slo(hold.take_window()) == {(span["span_id"], "ok"): 5}
