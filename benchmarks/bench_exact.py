"""The exact profiler: attribution side by side with pyroscope-io, and what it costs.

Attribution: ``tests/e2e/exact_app.py`` under a real uvicorn, 16 concurrent requests burning
CPU in 0.5 ms steps between awaits, in child tasks and in the thread pool, once with
``SPANPROF_PROFILER=exact`` and once with pyroscope-io and the label engine, both at their
default 100 Hz, pushing to a ``PushReceiver``.

Cost: a trivial Starlette endpoint driven in-process (as in ``bench_request``) in a child
process, with no profiler and with the exact profiler (100 Hz, its default 10 s uploads to a
receiver in the parent: each round's stop flushes one), interleaved round by round; the child
also reports the sampler's per-tick stall percentiles and the longest single export step. Then
over HTTP: uvicorn servers that switch between no profiler, the default one, and the default
taken apart (allocation hooks that never sample, memory off, memory off at 1 Hz) from round to
round, all loaded at once, each configuration compared within servers (``_throughput``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tests.e2e.analysis import Attribution, attribute
from tests.e2e.server import free_port, serve, uvicorn_argv

from spanprof._local._receiver import PushReceiver

from ._child import receiver_child_arguments, run_receiver_child
from ._load import load
from ._report import Section, Spread, Verdict, markdown_table, paired_ratios
from .apps.switch_app import CONFIGURATIONS, NEVER_SAMPLE_BYTES

__all__ = [
    "CONCURRENCY",
    "HTTP_VARIANTS",
    "THROUGHPUT_BUDGET",
    "main",
    "profiler_stats",
    "run",
    "start_switch_apps",
    "switch_to",
    "threads_cpu_ns",
]

CONCURRENCY = 16
# The exact profiler is the default (#13 asks 0.98 x of the default, memory sampling on).
THROUGHPUT_BUDGET = 0.98
STALL_BUDGET_US = 300.0
EXPORT_BUDGET_US = 2000.0


# --- attribution, side by side -----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One uvicorn run of the exact-app scenario."""

    profiler: str
    loop: str
    attribution: Attribution
    share_error: float
    sampled_over_measured: float
    stats: dict[str, Any]


async def _fire(base: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        responses = await asyncio.gather(*(client.get(f"/work/{i}") for i in range(CONCURRENCY)))
        stats = (await client.get("/stats")).json()
    for response in responses:
        response.raise_for_status()
    return {i: response.json() for i, response in enumerate(responses)}, stats


def _attribution_case(profiler: str, loop: str, workdir: Path) -> Outcome:
    port = free_port()
    log = workdir / f"{profiler}-{loop}.log"
    with PushReceiver() as receiver:
        env = {
            "SPANPROF_PROFILER": profiler,
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
            "PYROSCOPE_APPLICATION_NAME": "bench-exact",
            "PYROSCOPE_UPLOAD_INTERVAL": "1",
        }
        with serve(
            uvicorn_argv("tests.e2e.exact_app:app", port, loop),
            health_url=f"http://127.0.0.1:{port}/health",
            env=env,
            log_path=log,
        ):
            results, stats = asyncio.run(_fire(f"http://127.0.0.1:{port}"))
        samples = receiver.samples()
        if receiver.errors:
            raise RuntimeError(f"{profiler}/{loop}: rejected uploads: {receiver.errors[:3]}")
    if "Traceback" in log.read_text():
        raise RuntimeError(f"{profiler}/{loop}: the server logged an error: {log.read_text()}")
    expected = {i: result["labels"] for i, result in results.items()}
    attribution = attribute(samples, expected, keys=("span_id", "trace_id", "span_name"))
    measured = {i: float(result["cpu"]) for i, result in results.items()}
    sampled_total = sum(attribution.per_request.values()) or 1
    measured_total = sum(measured.values())
    share_error = max(
        abs(attribution.per_request.get(i, 0) / sampled_total - cpu / measured_total)
        for i, cpu in measured.items()
    )
    return Outcome(
        profiler,
        loop,
        attribution,
        share_error,
        sampled_total / 1e9 / measured_total,
        stats,
    )


def _attribution_rows(outcomes: list[Outcome]) -> list[list[str]]:
    rows = []
    for o in outcomes:
        a = o.attribution
        total = a.request_total or 1
        rows.append(
            [
                o.profiler,
                o.loop,
                f"{a.request_total / 1e9:.2f}",
                f"{a.exact / total:.1%}",
                f"{a.wrong / total:.1%}",
                f"{a.unlabelled / total:.1%}",
                f"{a.double_span / total:.1%}",
                f"{a.background_labelled / 1e9:.2f} of {a.background_total / 1e9:.2f}",
                f"{o.share_error * 100:.1f}",
                f"{o.sampled_over_measured:.2f}",
            ]
        )
    return rows


# --- cost, in a child process --------------------------------------------------------------------


def _child(argv: list[str]) -> None:
    """Child mode: measure no profiler vs the default (exact) profiler, interleaved; write JSON."""
    from opentelemetry.sdk.trace import TracerProvider

    import spanprof
    from spanprof._profiling._exact import ExactBackend

    # The per-request benchmark's app and request, so both measure the same thing.
    from .bench_request import SCOPE, _discard, _receive, _starlette

    args = receiver_child_arguments(argv)

    apps = {
        "off": spanprof.ProfilingMiddleware(
            _starlette(), profiler=None, tracer_provider=TracerProvider(), environ={}
        ),
        # The profiler the middleware owns, as in an app: the request path tells it each span's
        # end (the SLO hold's verdict, the span's CPU and bytes back on the span).
        "exact": spanprof.ProfilingMiddleware(
            _starlette(),
            profiler=ExactBackend(
                server_address=args.receiver,
                application_name="bench-exact-cost",
            ),
            tracer_provider=TracerProvider(),
            environ={},
        ),
    }
    runtime = apps["exact"]._runtime
    backend = apps["exact"].profiler
    assert isinstance(backend, ExactBackend)

    async def drive(name: str, count: int) -> tuple[int, int]:
        app = apps[name]
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(count):
            await app(dict(SCOPE), _receive, _discard)
        return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall

    loop = asyncio.new_event_loop()

    def serve_round(name: str) -> tuple[int, int, dict[str, float] | None]:
        """One round through ``name``'s app: its CPU and wall ns, and the profiler's stats (the
        profiler runs for the round only)."""
        if name != "exact":
            return (*loop.run_until_complete(drive(name, args.size)), None)
        # Started before the clock (a request would start it on its way in), and run through
        # as many requests again before it: a fresh profiler's first ticks and allocation
        # samples intern every stack they meet (a key-cache miss, a Python walk, each), which a
        # long-running server pays once and a round of a tenth of a second would pay whole.
        runtime.start()
        try:
            loop.run_until_complete(drive(name, args.size))
            cpu, wall = loop.run_until_complete(drive(name, args.size))
            return cpu, wall, backend.stats()
        finally:
            runtime.stop()

    results: dict[str, list[float]] = {"off": [], "exact": [], "off_wall": [], "exact_wall": []}
    stalls: list[dict[str, float]] = []
    try:
        for name in apps:  # warm-up
            serve_round(name)
        for index in range(args.rounds):
            order = ["off", "exact"] if index % 2 else ["exact", "off"]
            for name in order:
                gc.collect()
                cpu, wall, stats = serve_round(name)
                if stats is not None:
                    stalls.append(stats)
                results[name].append(cpu / args.size / 1000)
                results[f"{name}_wall"].append(wall / args.size / 1000)
    finally:
        loop.close()
    args.out.write_text(json.dumps({"results": results, "stats": stalls}))


def _cost(rounds: int, size: int) -> tuple[dict[str, list[float]], list[dict[str, float]], int]:
    data, receiver = run_receiver_child("benchmarks.bench_exact", rounds, size)
    return data["results"], data["stats"], receiver.pushes


# --- throughput over HTTP ------------------------------------------------------------------------


def threads_cpu_ns(pid: int) -> tuple[int, int]:
    """CPU time so far of process ``pid``'s main thread, and of its other threads together."""
    main = others = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just exited
            used = int((task / "schedstat").read_text().split()[0])
            if task.name == str(pid):
                main += used
            else:
                others += used
    return main, others


def start_switch_apps(
    stack: contextlib.ExitStack, count: int, env: dict[str, str], log_prefix: Path
) -> tuple[list[int], list[int]]:
    """Start ``count`` uvicorn servers of ``benchmarks/apps/switch_app.py`` (asyncio), each
    stopped when ``stack`` closes, logging to ``{log_prefix}-{i}.log``: their ports and pids."""
    ports = [free_port() for _ in range(count)]
    pids = [
        stack.enter_context(
            serve(
                uvicorn_argv("benchmarks.apps.switch_app:app", port, "asyncio"),
                health_url=f"http://127.0.0.1:{port}/health",
                env=env,
                log_path=log_prefix.with_name(f"{log_prefix.name}-{i}.log"),
            )
        ).pid
        for i, port in enumerate(ports)
    ]
    return ports, pids


def switch_to(port: int, name: str) -> None:
    """Route the switch app on ``port`` through configuration ``name`` from now on."""
    httpx.get(f"http://127.0.0.1:{port}/switch?{name}", timeout=60).raise_for_status()


def profiler_stats(port: int, name: str) -> dict[str, Any]:
    """The counters of configuration ``name``'s profiler in the switch app on ``port``."""
    answer = httpx.get(f"http://127.0.0.1:{port}/stats?{name}", timeout=60)
    answer.raise_for_status()
    found: dict[str, Any] = answer.json()
    return found


@dataclass(frozen=True)
class HttpRun:
    """The HTTP throughput run: per-round ratios and the profiler's CPU share."""

    # Responses served, default over no profiler, per round (server effects taken out).
    ratios: list[float]
    # Per configuration other than "off": no profiler's CPU per response over its, per round,
    # server effects taken out.
    cpu_ratios: dict[str, list[float]]
    # Per configuration, the mean CPU per response of its servers in each round.
    cpu_per_response_us: dict[str, list[float]]
    # Per server: its CPU per response over the mean of all servers in the same rounds and
    # configurations (its process's own speed, which the design takes out).
    server_effects: list[float]
    # The default's rounds: CPU per response on the loop thread, on the other threads.
    loop_thread_us: float
    other_threads_us: float
    profiler_cpu_share: float
    stats: dict[str, Any]


#: Servers: each configuration runs on ``SERVERS // len(CONFIGURATIONS)`` of them in every round,
#: and each server runs every configuration in turn.
SERVERS = 10

#: The HTTP run's configurations besides no profiler ("off"): the default, then the default
#: taken apart, each row one part less than the one before.
HTTP_VARIANTS = {
    "exact": "the default profiler",
    "hooks": "the default with allocation hooks that (almost) never sample "
    f"(`SPANPROF_ALLOC_SAMPLE_BYTES={NEVER_SAMPLE_BYTES}`)",
    "nomem": "the default with `SPANPROF_MEMORY=false`",
    "nomem_1hz": "the same at 1 Hz (`PYROSCOPE_SAMPLE_RATE=1`): the request path, the label "
    "engine and the upload thread, with almost no ticks",
}

#: Seconds each round loads every server after the switch has settled: a little over one
#: default upload interval, so that one steady upload (20 s after the profiler's start) falls
#: within the round.
HTTP_ROUND_SECONDS = 10.5

#: Seconds every server is loaded after each switch before the round's clocks are read: a
#: profiler's start-up (its first ticks and allocation samples intern every stack, its first
#: upload writes every string and location anew: about 15 to 20 ms of a server's CPU over the
#: default's first 10 s, measured on one server with a core of its own) and the previous
#: configuration's leftovers (its garbage, its stop) fall here. A long-running server pays
#: them once; a round that began at the switch paid them every round, about 1% of the 2 s of
#: CPU a server gets in a round here.
HTTP_SETTLE_SECONDS = 10.5


def _schedule(rounds: int) -> list[list[str]]:
    """Each round's configuration per server: server ``s`` runs configuration ``(s + t) % k``
    in round ``t``, so every round runs each configuration on as many servers, and over ``k``
    rounds every server runs each configuration once (a Latin square, repeated)."""
    names = list(CONFIGURATIONS)
    return [[names[(s + t) % len(names)] for s in range(SERVERS)] for t in range(rounds)]


def _server_effects(cells: list[list[float]]) -> list[float]:
    """Each server's effect on ``cells[t][s]`` (logs), with the servers' mean at zero.

    The schedule is balanced (every configuration equally often in every round and, over the
    run, on every server), so a server's mean over the run is its effect plus a constant that
    all servers share.
    """
    rounds, servers = len(cells), len(cells[0])
    grand = statistics.fmean(v for row in cells for v in row)
    return [statistics.fmean(cells[t][s] for t in range(rounds)) - grand for s in range(servers)]


def _throughput(rounds: int, seconds: float, workdir: Path) -> HttpRun:
    """Per-round ratios of CPU per response, no profiler over each configuration, with each
    server's own speed taken out.

    ``SERVERS`` uvicorn processes serve ``benchmarks/apps/switch_app.py``; before each round,
    each switches to its configuration of the round (``_schedule``): its previous profiler
    stops, the new one starts. All are loaded for ``HTTP_SETTLE_SECONDS`` (the new profiler's
    start-up, unmeasured), then at once for ``seconds``, so a profiler thread's periodic work
    (drains every 0.25 s, an upload every 10 s) is paid out of load, as on a busy server. A
    CPU-bound server's throughput is the inverse of its CPU per response. Fresh processes
    differ by several percent in it (memory layout, hash seeds), so a configuration's ratio
    in a round compares the servers running it with those running no profiler, each corrected
    by its server's effect over the whole run (``_server_effects``).
    """
    names = list(CONFIGURATIONS)
    if SERVERS % len(names) or rounds % len(names):
        raise ValueError(f"servers and rounds must be multiples of {len(names)}")
    schedule = _schedule(rounds)
    with PushReceiver() as receiver:
        # SPANPROF_PROFILER unset: the default (auto), which runs the exact sampler here, with
        # its default 10 s uploads.
        env = {
            "PYROSCOPE_APPLICATION_NAME": "bench-exact-http",
            "PYROSCOPE_SERVER_ADDRESS": receiver.url,
        }
        with contextlib.ExitStack() as stack:
            ports, pids = start_switch_apps(stack, SERVERS, env, workdir / "http")

            def switch(round_names: list[str]) -> None:
                for port, name in zip(ports, round_names, strict=True):
                    switch_to(port, name)

            # Warm-up: every server through every configuration once.
            for t in range(len(names)):
                switch(schedule[t])
                load(ports, seconds=2.0)
            cpu_us: list[list[float]] = []
            served: list[list[float]] = []
            loop_ns = others_ns = spent_ns = default_served = 0
            last_stats: dict[str, Any] = {}
            running: dict[str, dict[str, Any]] = {}
            for t in range(rounds):
                switch(schedule[t])
                load(ports, seconds=HTTP_SETTLE_SECONDS)
                defaults = [s for s, name in enumerate(schedule[t]) if name == "exact"]
                before_stats = {s: profiler_stats(ports[s], "exact") for s in defaults}
                threads = [threads_cpu_ns(pid) for pid in pids]
                by_port = load(ports, seconds=seconds)
                after = [threads_cpu_ns(pid) for pid in pids]
                counts = [by_port[port] for port in ports]
                cpu_us.append(
                    [(sum(after[s]) - sum(threads[s])) / counts[s] / 1e3 for s in range(SERVERS)]
                )
                served.append([float(c) for c in counts])
                for name in set(schedule[t]) - {"off"}:
                    running[name] = profiler_stats(ports[schedule[t].index(name)], name)
                for s in defaults:
                    now = profiler_stats(ports[s], "exact")
                    spent_ns += round(
                        sum(
                            (float(now[k]) - float(before_stats[s][k])) * 1e6
                            for k in ("handler_cpu_ms", "export_cpu_ms")
                        )
                    )
                    loop_ns += after[s][0] - threads[s][0]
                    others_ns += after[s][1] - threads[s][1]
                    default_served += counts[s]
                    last_stats = now
            switch(["off"] * SERVERS)
            # Stopped, each has flushed its last upload.
            stopped = {name: profiler_stats(ports[0], name) for name in running}
        if receiver.errors:
            raise RuntimeError(f"the receiver rejected uploads: {receiver.errors[:3]}")
    for name, found in running.items():
        # A profiler with samples uploads them, at its first interval or at its stop.
        uploaded = stopped[name].get("uploads") or not stopped[name].get("samples")
        if found.get("mode") != "exact" or not uploaded:
            raise RuntimeError(f"the exact profiler did not run or upload ({name}): {found!r}")
        sampling = any(key.startswith("memory_") for key in found)
        if sampling != (name in ("exact", "hooks")):
            raise RuntimeError(f"memory sampling was not as configured ({name}): {found!r}")
    logs = [[math.log(v) for v in row] for row in cpu_us]
    cpu_server = _server_effects(logs)
    served_logs = [[math.log(v) for v in row] for row in served]
    served_server = _server_effects(served_logs)

    def within(values: list[list[float]], server: list[float], name: str) -> list[float]:
        # Per round: the mean over the servers running ``name`` of its log, its servers'
        # effects taken out.
        return [
            statistics.fmean(
                values[t][s] - server[s] for s in range(SERVERS) if schedule[t][s] == name
            )
            for t in range(rounds)
        ]

    off_cpu = within(logs, cpu_server, "off")
    cpu_ratios = {
        name: [
            math.exp(o - x) for o, x in zip(off_cpu, within(logs, cpu_server, name), strict=True)
        ]
        for name in HTTP_VARIANTS
    }
    ratios = [
        math.exp(x - o)
        for o, x in zip(
            within(served_logs, served_server, "off"),
            within(served_logs, served_server, "exact"),
            strict=True,
        )
    ]
    per_response = {
        name: [
            statistics.fmean(cpu_us[t][s] for s in range(SERVERS) if schedule[t][s] == name)
            for t in range(rounds)
        ]
        for name in names
    }
    return HttpRun(
        ratios=ratios,
        cpu_ratios=cpu_ratios,
        cpu_per_response_us=per_response,
        server_effects=[math.exp(e) for e in cpu_server],
        loop_thread_us=loop_ns / default_served / 1e3,
        other_threads_us=others_ns / default_served / 1e3,
        profiler_cpu_share=spent_ns / (loop_ns + others_ns),
        stats=last_stats,
    )


# --- the section ---------------------------------------------------------------------------------


def run(quick: bool) -> Section:
    """Attribution side by side, then the cost budgets."""
    loops = ["asyncio"] if quick else ["asyncio", "uvloop"]
    section = Section("exact", "The exact profiler: attribution at 0.5 ms steps, and its cost")
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = [
            _attribution_case(profiler, loop, Path(tmp))
            for loop in loops
            for profiler in ("exact", "pyroscope")
        ]
    rounds, size = (41, 300) if quick else (161, 600)
    results, stats, pushes = _cost(rounds, size)
    http_rounds = len(CONFIGURATIONS) if quick else 2 * len(CONFIGURATIONS)
    with tempfile.TemporaryDirectory() as tmp:
        http_run = _throughput(http_rounds, HTTP_ROUND_SECONDS, Path(tmp))
    http_stats = http_run.stats
    http = Spread.of(http_run.ratios)
    http_cpu = Spread.of(http_run.cpu_ratios["exact"])
    ratio = paired_ratios(results["off"], results["exact"])
    wall_ratio = paired_ratios(results["off_wall"], results["exact_wall"])
    p99s = [s["stall_p99_us"] for s in stats]
    cpu_p99s = [s["stall_cpu_p99_us"] for s in stats]
    exports = (
        [s["max_export_step_us"] for s in stats]
        + [float(http_stats["max_export_step_us"])]
        + [float(o.stats.get("max_export_step_us", 0.0)) for o in outcomes if o.profiler == "exact"]
    )
    e2e_p99s = [float(o.stats["stall_p99_us"]) for o in outcomes if o.profiler == "exact"]
    # There the pool threads burn CPU in pure Python: a handler that loses the GIL to one of
    # them waits out its switch interval (5 ms), so its wall time is mostly that wait, and its
    # own CPU says what it cost the loop.
    e2e_cpu_p99s = [float(o.stats["stall_cpu_p99_us"]) for o in outcomes if o.profiler == "exact"]
    section.body += [
        f"**Attribution.** uvicorn serving {CONCURRENCY} concurrent `GET /work/{{i}}` of "
        "`tests/e2e/exact_app.py`: request *i* burns `1 + i % 2` units, each 25 ms of handler "
        "steps and 2 x 5 ms of child-task steps, all **0.5 ms** between `await "
        "asyncio.sleep(0)`, plus 16 x 5 ms jobs split between `run_in_threadpool` and "
        "`run_in_executor`, every burn in the request's own marker function and measured with "
        "`time.thread_time`. An unlabelled lifespan task and an unlabelled thread burn 2 ms "
        "every 10 ms. Both profilers at their default 100 Hz with 1 s uploads to a "
        "`PushReceiver`: **exact** is `SPANPROF_PROFILER=exact` (SIGPROF sampler, stack and "
        "labels read at one instant); **pyroscope** is pyroscope-io with spanprof's label "
        "engine. Shares are of the CPU seconds sampled in request markers; *exact* means "
        "`span_id`, `trace_id` and `span_name` all the request's own. *share error*: the "
        "largest gap, in points, between a request's share of the sampled marker CPU and its "
        "share of the CPU the handlers measured.",
        markdown_table(
            [
                "profiler",
                "loop",
                "request CPU s",
                "exact",
                "wrong",
                "unlabelled",
                "double-labelled",
                "background labelled (s)",
                "share error (pts)",
                "sampled / measured",
            ],
            _attribution_rows(outcomes),
        ),
        "**Throughput over HTTP.** uvicorn servers (asyncio) of `benchmarks/apps/switch_app.py`: "
        "`GET /health`, a 2-byte `PlainTextResponse` through `ProfilingMiddleware`, each "
        "request traced by an SDK tracer provider without an exporter (its span labels the "
        "request's samples, and its end reaches the profiler), with `SPANPROF_PROFILER` unset "
        "(the default, `auto`, which runs the exact sampler with memory sampling here, 100 Hz, "
        "10 s uploads to a `PushReceiver`). Each server holds "
        "one middleware per configuration: no profiler, the default, and the default taken "
        "apart one part at a time (the rows below), and switches between them before each "
        "round (stopping the previous configuration's profiler and starting the next's, as a "
        f"server starting up would). {SERVERS} servers, {http_rounds} rounds of "
        f"{HTTP_ROUND_SECONDS:g} s after a warm-up through every configuration; each round's "
        f"clocks are read after {HTTP_SETTLE_SECONDS:g} s of load since its switch, so that the "
        "profiler runs in its steady state, as on a long-running server: its start-up (the "
        "first ticks and allocation samples intern every stack, the first upload, 10 s after "
        "the start, writes every string and location anew) and the previous configuration's "
        "leftovers fall before the round, and one steady upload, 20 s after the start, within "
        "it. In each round every configuration runs "
        f"on {SERVERS // len(CONFIGURATIONS)} servers, and each server runs every configuration "
        "in turn (a Latin square, repeated). A raw-socket client loads all servers at once (8 "
        "keep-alive connections each), so each is busy all round and its profiler's periodic "
        "work is paid out of load, as on a server that is never idle. Each server's CPU (all "
        "threads, `/proc/PID/task/*/schedstat`) per response it served that round. Fresh "
        "processes differ by several percent in CPU per response (memory layout, hash seeds: "
        "the servers' own effects below), as much as a profiler costs, so a round's ratio for "
        "a configuration compares its servers with those running no profiler in the same "
        "round, each taken out its server's effect over the whole run. The servers share two "
        f"cores, so each runs at about 2/{SERVERS} of a core: work a profiler does per second of "
        "wall time weighs several times more per response here than on a server with a core "
        "of its own.",
        markdown_table(
            [
                "configuration",
                "server CPU µs per response (its servers' mean per round)",
                "throughput x no profiler (CPU, within servers)",
            ],
            [["no profiler", Spread.of(http_run.cpu_per_response_us["off"]).format(1), "—"]]
            + [
                [
                    label,
                    Spread.of(http_run.cpu_per_response_us[name]).format(1),
                    Spread.of(http_run.cpu_ratios[name]).format(3),
                ]
                for name, label in HTTP_VARIANTS.items()
            ],
        ),
        markdown_table(
            ["measure", "value"],
            [
                [
                    "responses served, default / no profiler, per round (within servers)",
                    http.format(3),
                ],
                [
                    "each server's CPU per response over all servers' (its own effect)",
                    ", ".join(f"{e:.3f}" for e in http_run.server_effects),
                ],
                [
                    "default profiler's rounds: CPU µs per response on the loop thread / on "
                    "the other threads (the profiler's: CPU and memory uploads, the "
                    "allocation drain)",
                    f"{http_run.loop_thread_us:.1f} / {http_run.other_threads_us:.1f}",
                ],
                [
                    "the profiler's own counters (signal handler on the loop thread, export "
                    "steps on the upload thread), share of the server's CPU",
                    f"{http_run.profiler_cpu_share:.2%}",
                ],
            ],
        ),
        "The default server's sampler: handler stall "
        f"p50 {float(http_stats['stall_p50_us']):.0f} µs, p99 "
        f"{float(http_stats['stall_p99_us']):.0f} µs wall ("
        f"{float(http_stats['stall_cpu_p99_us']):.0f} µs CPU) over "
        f"{int(http_stats['ticks'])} ticks; longest export step "
        f"{float(http_stats['max_export_step_us']):.0f} µs CPU.",
        "**Cost, in-process.** A one-route Starlette app (`GET /items/{item_id}` answering 7 "
        "bytes) driven in-process in a child process, with two middlewares: "
        "`ProfilingMiddleware(profiler=None)` and `ProfilingMiddleware(profiler=ExactBackend(...))`"
        " (the default's backend, memory sampling on), whose request path tells the profiler "
        "each span's end (the SLO hold's verdict; `spanprof.cpu_time_s` back on the span when a "
        "sample landed in it). "
        f"{rounds} interleaved rounds of {size} requests, the profiler started before the "
        f"round's clock and run through {size} unclocked requests first (its start-up: a fresh "
        "profiler's first ticks and allocation samples intern every stack they meet, which a "
        "long-running server pays once), and stopped after it (100 Hz; its default 10 s "
        "uploads to a receiver in the parent, so each round's stop flushes one: "
        f"{pushes} uploads received). "
        "Throughput ratio = per-request time without / with, "
        "median of per-round ratios (CPU: the driving thread's CPU time, which includes the "
        "signal handler; wall: includes the upload thread's GIL time). The label engine is "
        "installed as `ProfilerRuntime` does; the sampler reads the loop thread's labels from "
        "its context, so the engine pushes nothing for that thread's steps. No server here: over "
        "HTTP the server's own allocations are sampled too (asyncio's transport reads into a "
        "256 KiB buffer, so about every other response takes an allocation sample) and the "
        "profiler's threads drain and upload them.",
        markdown_table(
            ["measure", "value"],
            [
                [
                    "µs/request, no profiler (CPU)",
                    Spread.of(results["off"]).format(2),
                ],
                ["µs/request, exact (CPU)", Spread.of(results["exact"]).format(2)],
                [
                    "throughput ratio, CPU",
                    f"{ratio.median:.3f} (IQR {ratio.q1:.3f}..{ratio.q3:.3f})",
                ],
                [
                    "throughput ratio, wall",
                    f"{wall_ratio.median:.3f} (IQR {wall_ratio.q1:.3f}..{wall_ratio.q3:.3f})",
                ],
                ["handler stall p99 per round, wall µs", Spread.of(p99s).format(0)],
                ["handler stall p99 per round, CPU µs", Spread.of(cpu_p99s).format(0)],
                ["handler stall p99 in the uvicorn runs, wall µs", Spread.of(e2e_p99s).format(0)],
                [
                    "handler stall p99 in the uvicorn runs, CPU µs (the rest of the wall time "
                    "is waiting for the GIL a pool thread holds)",
                    Spread.of(e2e_cpu_p99s).format(0),
                ],
                ["longest export step, CPU µs (all runs)", f"{max(exports):.0f}"],
            ],
        ),
    ]
    for o in outcomes:
        if o.profiler == "exact":
            a = o.attribution
            section.verdicts.append(
                Verdict(
                    f"exact profiler attribution at 0.5 ms steps, {o.loop} (>= 99% exact, "
                    "background unlabelled)",
                    a.exact_share >= 0.99 and a.background_labelled == 0,
                    a.summary(),
                )
            )
    section.verdicts += [
        Verdict(
            f"throughput of a trivial endpoint with the default profiler >= {THROUGHPUT_BUDGET} x "
            "no profiler (uvicorn over HTTP, server CPU per response, within servers)",
            http_cpu.median >= THROUGHPUT_BUDGET,
            f"{http_cpu.median:.3f} x (IQR {http_cpu.q1:.3f}..{http_cpu.q3:.3f}); without its "
            f"allocation samples {statistics.median(http_run.cpu_ratios['hooks']):.3f} x, "
            f"memory off {statistics.median(http_run.cpu_ratios['nomem']):.3f} x, and that at "
            f"1 Hz {statistics.median(http_run.cpu_ratios['nomem_1hz']):.3f} x; responses "
            f"served {http.median:.3f} x",
        ),
        Verdict(
            f"the same >= {THROUGHPUT_BUDGET} x in-process, no server (the middleware's request "
            "path, the sampler, the allocation hooks)",
            ratio.median >= THROUGHPUT_BUDGET,
            f"{ratio.median:.3f} x (IQR {ratio.q1:.3f}..{ratio.q3:.3f}) by the driving thread's "
            "CPU",
        ),
        # The HTTP run's servers share two cores, so a handler's wall time there includes its
        # waits for a core: its CPU says what the handler cost; the in-process rounds (one
        # process, no contention) say its wall time.
        Verdict(
            f"app-thread stall per sample p99 <= {STALL_BUDGET_US:.0f} µs (HTTP throughput run "
            "by CPU; in-process rounds by wall time)",
            float(http_stats["stall_cpu_p99_us"]) <= STALL_BUDGET_US
            and statistics.median(p99s) <= STALL_BUDGET_US,
            f"HTTP {float(http_stats['stall_cpu_p99_us']):.0f} µs CPU "
            f"({float(http_stats['stall_p99_us']):.0f} µs wall, {SERVERS} servers on two cores); "
            f"in-process rounds: median p99 {statistics.median(p99s):.0f} µs wall; 16-request "
            f"0.5 ms-step runs: {max(e2e_p99s):.0f} µs wall, {max(e2e_cpu_p99s):.0f} µs CPU",
        ),
        Verdict(
            f"no export step holds the GIL over {EXPORT_BUDGET_US / 1000:.0f} ms",
            max(exports) <= EXPORT_BUDGET_US,
            f"longest step {max(exports):.0f} µs of CPU",
        ),
    ]
    return section


def main(argv: list[str] | None = None) -> None:
    """``--child`` mode only (the section runs from ``benchmarks.run``)."""
    _child(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
