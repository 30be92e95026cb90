"""Memory profiles: what allocation sampling costs an allocation-heavy endpoint, and per block.

Throughput: a Starlette ``POST /json`` through ``ProfilingMiddleware`` that decodes a 100 KB JSON
body and encodes it back, driven in-process in a child process; rounds alternate between the
exact profiler with memory sampling at the default rate (``ExactBackend()``, 512 KiB) and the
same profiler with ``memory=False``, each started for its round, 1 s uploads to a receiver in
the parent.

Per block: a tight loop of ``bytes(100)`` allocations (each one block of the OBJ domain)
without the hook, with the hook installed but never sampling (mean 1e15 bytes: the cost every
unsampled allocation pays) and with every block sampled (mean 1 byte: the stack and labels
capture; the drain that turns samples into Python objects is timed separately).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections.abc import Callable, Coroutine, MutableMapping
from itertools import repeat
from typing import Any

from ._child import receiver_child_arguments, receiver_process, run_receiver_child
from ._report import Section, Spread, Verdict, markdown_table, paired_ratios

__all__ = ["drive_json", "main", "run"]

THROUGHPUT_BUDGET = 0.97
# Requests before the counted ones in drive_json: the one window (encoded at stop) then holds
# about every distinct stack already, so its per-window cost (each distinct frame and stack
# encoded once per window) does not grow with the requests counted.
JSON_WARMUP = 60
BODY_BYTES = 100 * 1024


def _body() -> bytes:
    """About 100 KB of JSON: a list of small records, as an API body would be."""
    items = []
    size = 0
    index = 0
    while size < BODY_BYTES:
        item = {"id": index, "name": f"item-{index}", "price": index * 1.25, "tags": ["a", "b"]}
        items.append(item)
        size += len(json.dumps(item)) + 2
        index += 1
    return json.dumps({"items": items}).encode()


def _json_driver() -> Callable[[int], Coroutine[Any, Any, tuple[int, int]]]:
    """``drive(n)``: serve ``n`` ``POST /json`` of the 100 KB body in-process; the driving
    thread's CPU and wall nanoseconds they took."""
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    import spanprof

    async def echo(request: Request) -> Response:
        data = json.loads(await request.body())
        return Response(json.dumps(data), media_type="application/json")

    app = spanprof.ProfilingMiddleware(
        Starlette(routes=[Route("/json", echo, methods=["POST"])]),
        profiler=None,
        tracer_provider=TracerProvider(),
        environ={},
    )
    body = _body()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/json",
        "raw_path": b"/json",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    request_message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request_message

    sent: list[int] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(len(message.get("body", b"")))

    async def drive(count: int) -> tuple[int, int]:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(count):
            await app(dict(scope), receive, send)
        if not sent or sent[-1] < len(body) // 2:
            raise RuntimeError(f"unexpected response bodies {sent[-3:]!r}")
        return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall

    return drive


def drive_json(memory: bool, count: int) -> None:
    """Serve ``count`` JSON requests under the exact profiler, memory sampling ``memory``, with
    no ticks, uploads or drains worth counting until the stop: what ``bench_instructions``
    counts under callgrind, which stretches wall and CPU time about 50x."""
    from spanprof._profiling._exact import ExactBackend
    from spanprof._profiling._runtime import ProfilerRuntime
    from spanprof._profiling._samplers._memory import MemorySampler

    defaults = MemorySampler.__init__.__kwdefaults__
    assert defaults is not None
    defaults["drain_interval"] = 3600.0
    drive = _json_driver()
    with receiver_process() as url:
        runtime = ProfilerRuntime(
            ExactBackend(
                server_address=url,
                application_name="bench-memory-json",
                upload_interval=3600,
                sample_rate=1,
                memory=memory,
            )
        )
        loop = asyncio.new_event_loop()
        runtime.start()
        try:
            loop.run_until_complete(drive(JSON_WARMUP))  # caches, the stacks the window holds
            loop.run_until_complete(drive(count))
        finally:
            runtime.stop()
            loop.close()


def _child(argv: list[str]) -> None:
    """Child mode: memory on vs off under the exact profiler, interleaved; write JSON."""
    from spanprof._profiling._exact import ExactBackend
    from spanprof._profiling._runtime import ProfilerRuntime

    args = receiver_child_arguments(argv)
    drive = _json_driver()
    backends = {
        name: ExactBackend(
            server_address=args.receiver,
            application_name=f"bench-memory-{name}",
            upload_interval=1,
            memory=name == "on",
        )
        for name in ("on", "off")
    }
    runtimes = {name: ProfilerRuntime(backend) for name, backend in backends.items()}

    loop = asyncio.new_event_loop()
    # "off_again" is memory off a second time: off / off_again is the A/A ratio, what the
    # machine's own noise does to a ratio of two rounds side by side.
    arms = ["on", "off", "off_again"]
    results: dict[str, list[float]] = {key: [] for name in arms for key in (name, f"{name}_wall")}
    stats: list[dict[str, float]] = []
    try:
        for name in ("on", "off"):  # warm-up: caches, and the stacks the sampler interns
            runtimes[name].start()
            loop.run_until_complete(drive(20 * args.size))
            runtimes[name].stop()
        for index in range(args.rounds):
            shift = index % len(arms)
            for name in arms[shift:] + arms[:shift]:
                runtime = runtimes["off" if name == "off_again" else name]
                gc.collect()
                runtime.start()
                cpu, wall = loop.run_until_complete(drive(args.size))
                if name == "on":
                    stats.append(backends[name].stats())
                runtime.stop()
                results[name].append(cpu / args.size / 1000)
                results[f"{name}_wall"].append(wall / args.size / 1000)
    finally:
        loop.close()
    args.out.write_text(json.dumps({"results": results, "stats": stats, "body": len(_body())}))


def _throughput(rounds: int, size: int) -> tuple[dict[str, Any], int]:
    data, receiver = run_receiver_child("benchmarks.bench_memory", rounds, size, timeout=1800)
    memory_pushes = sum(1 for s in receiver.series() if s.label("__name__") == "memory")
    return data, memory_pushes


# --- per block -----------------------------------------------------------------------------------


def allocate(count: int) -> None:
    for _ in repeat(None, count):
        bytes(100)


def _loop_ns(count: int) -> float:
    started = time.thread_time_ns()
    allocate(count)
    return (time.thread_time_ns() - started) / count


def per_block(rounds: int, count: int) -> dict[str, Spread]:
    """ns per allocation: no hook, hook never sampling, every block sampled; µs per drain."""
    from spanprof._labels._labelset import LABELS
    from spanprof._profiling._samplers import _alloc
    from spanprof._profiling._samplers._memory import MemorySampler

    off: list[float] = []
    unsampled: list[float] = []
    sampled: list[float] = []
    drain: list[float] = []
    allocate(count)  # warm-up
    for _ in range(rounds):
        gc.collect()
        off.append(_loop_ns(count))
        _alloc.start(LABELS, 1e15, 16, 16, 128, True, 1)
        try:
            unsampled.append(_loop_ns(count))
        finally:
            _alloc.stop()
        # Every block sampled: the capture (stack + labels into the buffer) in the hook.
        sampler = MemorySampler(
            sample_bytes=1, max_samples=count + 1024, max_tracked=1024, drain_interval=3600
        )
        sampler.start()
        try:
            sampled.append(_loop_ns(count))
            started = time.thread_time_ns()
            sampler.drain()
            drain.append((time.thread_time_ns() - started) / count / 1000)
        finally:
            sampler.stop()
    return {
        "off": Spread.of(off),
        "unsampled": Spread.of(unsampled),
        "sampled": Spread.of(sampled),
        "hook": Spread.of([u - o for u, o in zip(unsampled, off, strict=True)]),
        "capture": Spread.of([(s - o) / 1000 for s, o in zip(sampled, off, strict=True)]),
        "drain": Spread.of(drain),
    }


# --- the section ---------------------------------------------------------------------------------


def run(quick: bool) -> Section:
    """Throughput with memory sampling on vs off, then the per-block costs."""
    section = Section("memory", "Memory profiles: the cost of sampling allocations")
    # Short rounds: on this machine the ratio of two identical rounds of a bare JSON loop side
    # by side spreads about 4x as wide at 100 requests as at 5 (IQR 0.86..1.03 against
    # 0.98..1.02), so many short rounds resolve a few percent and a few long ones do not (61
    # rounds of 100 gave IQR 0.81..1.02). The A/A ratio in the table shows each run's
    # resolution.
    rounds, size = (100, 8) if quick else (1000, 8)
    data, memory_pushes = _throughput(rounds, size)
    results = data["results"]
    ratio = paired_ratios(results["off"], results["on"])
    wall_ratio = paired_ratios(results["off_wall"], results["on_wall"])
    same = paired_ratios(results["off"], results["off_again"])
    samples = sum(float(s.get("memory_samples", 0)) for s in data["stats"])
    blocks = per_block(5 if quick else 15, 200_000)
    section.body += [
        f"**Throughput.** A Starlette `POST /json` through `ProfilingMiddleware` that decodes a "
        f"{data['body'] / 1024:.0f} KB JSON body and encodes it back, driven in-process in a "
        f"child process: {rounds} rounds of {size} requests, after {20 * size} of warm-up with "
        "each, rotate between the exact profiler with memory sampling at the default 512 KiB "
        "(`ExactBackend()`), with `memory=False`, and with `memory=False` again (the A/A "
        "control), each started for its round and stopped after it (its window pushed at the "
        f"stop to a receiver: {memory_pushes} memory pushes, {samples:.0f} allocation "
        "samples). Ratio = per-request time off / on, median of per-round ratios. The CPU is "
        "the driving thread's: the hooks and the sampling on the request path; the drains and "
        "the encoding run on the profiler's threads, and the instructions section counts them "
        "with the rest.",
        markdown_table(
            ["measure", "value"],
            [
                ["µs/request, memory off (CPU)", Spread.of(results["off"]).format(1)],
                ["µs/request, memory on (CPU)", Spread.of(results["on"]).format(1)],
                [
                    "throughput ratio, CPU",
                    f"{ratio.median:.3f} (IQR {ratio.q1:.3f}..{ratio.q3:.3f})",
                ],
                [
                    "throughput ratio, wall",
                    f"{wall_ratio.median:.3f} (IQR {wall_ratio.q1:.3f}..{wall_ratio.q3:.3f})",
                ],
                [
                    "A/A ratio, memory off / off again (CPU)",
                    f"{same.median:.3f} (IQR {same.q1:.3f}..{same.q3:.3f})",
                ],
            ],
        ),
        "**Per block.** 200,000 `bytes(100)` per round (thread CPU time): without the hook, with "
        "the hook never sampling, and with every block sampled (stack of ~5 frames here).",
        markdown_table(
            ["measure", "value"],
            [
                ["ns per allocation, no hook", blocks["off"].format(1)],
                ["ns per allocation, hook installed, unsampled", blocks["unsampled"].format(1)],
                ["extra ns per unsampled allocation", blocks["hook"].format(1)],
                ["extra µs per sampled allocation (capture)", blocks["capture"].format(2)],
                ["µs per sample to drain (to Python, estimates)", blocks["drain"].format(2)],
            ],
        ),
    ]
    section.verdicts.append(
        Verdict(
            f"throughput of a 100 KB JSON decode+encode endpoint with memory sampling >= "
            f"{THROUGHPUT_BUDGET} x without (in-process A/B, CPU)",
            ratio.median >= THROUGHPUT_BUDGET,
            f"{ratio.median:.3f} x (IQR {ratio.q1:.3f}..{ratio.q3:.3f}); unsampled allocation "
            f"+{blocks['hook'].median:.1f} ns, sampled +{blocks['capture'].median:.2f} µs",
        )
    )
    return section


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench_memory [--quick]`` prints the section."""
    args = sys.argv[1:] if argv is None else argv
    if "--child" in args:
        _child(args)
        return 0
    section = run("--quick" in args)
    print("\n\n".join(section.body))
    for verdict in section.verdicts:
        print(verdict.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
