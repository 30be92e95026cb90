"""Where the exact profiler's per-request cost goes: its parts started one at a time.

The exact section's in-process A/B compares no profiler with the whole exact profiler. Here the
same app and request (``bench_request``'s one-route Starlette app, ``profiler=None``, driven
in-process on an asyncio loop) run with each part alone, interleaved round by round with the
start order rotated: the label engine with a backend that reads the loop thread's labels from its
context (what ``ExactBackend`` says while sampling), the SIGPROF sampler alone at 1 Hz (its hooks
without its ticks) and at 100 Hz, the allocation sampler alone, and the whole exact profiler with
and without memory: started beside the middleware, and owned by it as in an app (``owned``: the
middleware's request path then tells it each span's end, takes the span's CPU and bytes and sets
them on the span when not 0; the difference between the two is those calls). Times are
the driving thread's CPU (``time.thread_time_ns``, signal handler included); differences and
ratios are per round against the no-profiler round.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ._child import receiver_child_arguments, receiver_process, run_receiver_child
from ._report import Section, Spread, markdown_table, paired_ratios

if TYPE_CHECKING:
    from spanprof._profiling._samplers._memory import MemorySampler

__all__ = [
    "MEET_REQUESTS",
    "MEET_SAMPLE_BYTES",
    "PART_WARMUP",
    "VARIANTS",
    "drive_part",
    "main",
    "run",
]

VARIANTS = (
    ("off", "no profiler"),
    ("engine", "label engine, loop thread read from its context"),
    ("sampler_1hz", "SIGPROF sampler alone, 1 Hz"),
    ("sampler", "SIGPROF sampler alone, 100 Hz"),
    ("memory", "allocation sampler alone (512 KiB)"),
    ("exact_nomem", "exact profiler, memory=False"),
    ("exact", "exact profiler (default: memory on)"),
    ("owned_nomem", "exact profiler, memory=False, owned by the middleware"),
    ("owned", "exact profiler (default), owned by the middleware"),
)


# The allocation samplers' random seed in drive_part.
MEMORY_SEED = 20261205
# Requests served before the counted ones, in drive_part.
PART_WARMUP = 2000


class _Part(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def _parts(
    receiver: str, *, upload_interval: int = 1, sample_rate: int = 100
) -> dict[str, _Part | None]:
    """Each variant's part, by name (``None``: no profiler); the exact profiler's ticks at
    ``sample_rate`` per second, its uploads every ``upload_interval`` seconds."""
    from spanprof._labels._engine import install_label_engine, uninstall_label_engine
    from spanprof._labels._labelset import LabelSet
    from spanprof._profiling._exact import ExactBackend
    from spanprof._profiling._runtime import ProfilerRuntime
    from spanprof._profiling._samplers._memory import MemorySampler
    from spanprof._profiling._samplers._signal import Sampler

    class ContextReader:
        needs_step_hooks = False

        def start(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

        def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
            pass

    class Engine:
        def start(self) -> None:
            install_label_engine(ContextReader())

        def stop(self) -> None:
            uninstall_label_engine()

    class SamplerAlone:
        def __init__(self, rate: int) -> None:
            self.rate = rate
            self.sampler: Sampler | None = None

        def start(self) -> None:
            self.sampler = Sampler(sample_rate=self.rate)
            self.sampler.start()

        def stop(self) -> None:
            if self.sampler is not None:
                self.sampler.stop()

    class Runtime:
        def __init__(self, *, owned: bool = False, **options: Any) -> None:
            backend = ExactBackend(
                server_address=receiver, application_name="bench-breakdown",
                upload_interval=upload_interval, sample_rate=sample_rate, **options,
            )  # fmt: skip
            # Owned: the middleware's own runtime, so its request path calls the profiler.
            self.drive = _Drive(backend) if owned else None
            self.runtime = (
                self.drive.runtime if self.drive is not None else ProfilerRuntime(backend)
            )

        def start(self) -> None:
            self.runtime.start()

        def stop(self) -> None:
            self.runtime.stop()

    return {
        "off": None,
        "engine": Engine(),
        "sampler_1hz": SamplerAlone(1),
        "sampler": SamplerAlone(100),
        "memory": MemorySampler(),
        "exact_nomem": Runtime(memory=False),
        "exact": Runtime(),
        "owned_nomem": Runtime(owned=True, memory=False),
        "owned": Runtime(owned=True),
    }


class _Drive:
    """``await drive(n)``: serve ``n`` requests of the one-route app, behind a middleware owning
    ``profiler`` (``None``: no profiler), in-process; the driving thread's CPU nanoseconds they
    took. ``runtime``: the middleware's profiler runtime."""

    def __init__(self, profiler: Any = None) -> None:
        from opentelemetry.sdk.trace import TracerProvider

        import spanprof

        from .bench_request import SCOPE, _discard, _receive, _starlette

        self._scope, self._receive, self._send = SCOPE, _receive, _discard
        self.app = spanprof.ProfilingMiddleware(
            _starlette(), profiler=profiler, tracer_provider=TracerProvider(), environ={}
        )
        self.runtime = self.app._runtime

    async def __call__(self, count: int) -> int:
        app, scope, receive, send = self.app, self._scope, self._receive, self._send
        started = time.thread_time_ns()
        for _ in range(count):
            await app(dict(scope), receive, send)
        return time.thread_time_ns() - started


def _drive_of(part: object, plain: _Drive) -> _Drive:
    """``part``'s own middleware when it has one (an owned profiler), else ``plain``."""
    own = getattr(part, "drive", None)
    return own if isinstance(own, _Drive) else plain


def drive_part(part_name: str, count: int) -> None:
    """Serve ``count`` requests in-process with one part started (no ticks, no uploads): what
    ``bench_instructions`` counts under callgrind, where CPU-timed ticks would come 50x as
    often per request.

    A part with an allocation sampler starts with the stacks a long-running server has already
    met (``_meet_stacks``); ``NAME_cold`` is the part meeting them as it goes."""
    drive = _Drive()
    # The allocation sampler's drain thread wakes 4 times a second of wall time, which under
    # callgrind (about 50x slower) would count as 50x as much work per request as it is: drain
    # only at stop, so that what is counted is what each request pays.
    from spanprof._profiling._samplers._memory import MemorySampler

    defaults = MemorySampler.__init__.__kwdefaults__
    assert defaults is not None
    defaults["drain_interval"] = 3600.0
    # Which blocks are sampled is random: seeded, a count samples the same blocks each run
    # (the meet phase's stacks moved a count by thousands of instructions a request).
    defaults["seed"] = MEMORY_SEED
    base_name, cold, _ = part_name.partition("_cold")
    # The receiver in a process of its own: what it decodes is not the profiler's work.
    with receiver_process() as url:
        # The sampler's 1 Hz variant: its hooks and timer, without ticks worth counting.
        name = "sampler_1hz" if base_name == "sampler" else base_name
        part = _parts(url, upload_interval=3600, sample_rate=1)[name]
        # An owning middleware would start its profiler on its first request: the stacks are
        # met through the plain one.
        measured = _drive_of(part, drive)
        loop = asyncio.new_event_loop()
        met = (
            None if cold or name not in ("memory", "exact", "owned") else _meet_stacks(loop, drive)
        )
        if part is not None:
            part.start()
        try:
            if met is not None:
                _adopt_stacks(part, met)
            # Warm-up: caches, first-request work, and (cold parts) the stacks the allocation
            # sampler meets first: it interns each once for the process's life.
            loop.run_until_complete(measured(PART_WARMUP))
            loop.run_until_complete(measured(count))
        finally:
            if part is not None:
                part.stop()
            loop.close()


# Allocation samples one per this many bytes while meeting the stacks: ~10 a trivial request.
MEET_SAMPLE_BYTES = 4096
MEET_REQUESTS = 2000


def _meet_stacks(loop: asyncio.AbstractEventLoop, drive: Callable[[int], Any]) -> MemorySampler:
    """A stopped sampler whose stack tables have met the request's allocation stacks.

    A trivial request allocates ~50 KB over a few hundred distinct stacks, so at the default
    512 KiB (one sample per ~12 requests) a sampler keeps meeting new ones for tens of
    thousands of requests, interning each (code objects, lines, frames) the first time: a
    start-up cost, which a long-running server has paid. 2,000 requests sampled every 4 KiB
    (~20,000 samples) meet what ~250,000 requests at the default rate would, leaving the
    rest."""
    from spanprof._profiling._samplers._memory import MemorySampler

    sampler = MemorySampler(sample_bytes=MEET_SAMPLE_BYTES, drain_interval=3600.0)
    sampler.start()
    try:
        loop.run_until_complete(drive(MEET_REQUESTS))
    finally:
        sampler.stop()
    return sampler


def _adopt_stacks(part: Any, met: MemorySampler) -> None:
    """Hand ``met``'s interned stacks to ``part``'s (started) allocation sampler."""
    from spanprof._profiling._samplers._memory import MemorySampler

    sampler = part if isinstance(part, MemorySampler) else part.runtime.backend._memory_sampler
    if not isinstance(sampler, MemorySampler):
        raise RuntimeError(f"no allocation sampler in {part!r}")
    with sampler._lock:
        sampler._tables = met._tables
        sampler._stack_ids = met._stack_ids


def _child(argv: list[str]) -> None:
    args = receiver_child_arguments(argv)
    drive = _Drive()
    parts = _parts(args.receiver)
    names = list(parts)
    loop = asyncio.new_event_loop()
    results: dict[str, list[float]] = {name: [] for name in names}
    drives = {name: _drive_of(part, drive) for name, part in parts.items()}
    try:
        loop.run_until_complete(drive(args.size))  # warm-up
        for name, part in parts.items():
            if part is not None and drives[name] is not drive:
                # An owning middleware starts its profiler on a request: warm it up started.
                part.start()
                try:
                    loop.run_until_complete(drives[name](args.size))
                finally:
                    part.stop()
        for index in range(args.rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                part = parts[name]
                gc.collect()
                if part is not None:
                    part.start()
                try:
                    ns = loop.run_until_complete(drives[name](args.size))
                finally:
                    if part is not None:
                        part.stop()
                results[name].append(ns / args.size / 1000)
    finally:
        loop.close()
    args.out.write_text(json.dumps(results))


def _measure(rounds: int, size: int) -> dict[str, list[float]]:
    results, _receiver = run_receiver_child("benchmarks.bench_breakdown", rounds, size)
    return results


def run(quick: bool) -> Section:
    """Each part of the exact profiler alone, against no profiler, in one process."""
    rounds, size = (15, 300) if quick else (61, 600)
    results = _measure(rounds, size)
    base = results["off"]
    rows = []
    for name, description in VARIANTS:
        values = results[name]
        extra = Spread.of([v - b for v, b in zip(values, base, strict=True)])
        ratio = paired_ratios(base, values)
        rows.append(
            [
                description,
                Spread.of(values).format(2),
                "—" if name == "off" else ratio.format(3),
                "—" if name == "off" else extra.format(2),
            ]
        )
    section = Section("breakdown", "The exact profiler's per-request cost, part by part")
    section.body = [
        (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip()
        + f" {rounds} rounds of {size} requests per variant.",
        markdown_table(
            ["variant", "µs/request (CPU)", "throughput x no profiler", "µs over no profiler"],
            rows,
        ),
    ]
    return section


def main(argv: list[str] | None = None) -> None:
    """``--child`` mode only (the section runs from ``benchmarks.run``)."""
    _child(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
