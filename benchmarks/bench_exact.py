"""The exact profiler: attribution side by side with pyroscope-io, and what it costs.

Attribution: ``tests/e2e/exact_app.py`` under a real uvicorn, 16 concurrent requests burning
CPU in 0.5 ms steps between awaits, in child tasks and in the thread pool, once with
``SPANPROF_PROFILER=exact`` and once with pyroscope-io and the label engine, both at their
default 100 Hz, pushing to a ``PushReceiver``.

Cost: a trivial Starlette endpoint driven in-process (as in ``bench_request``) in a child
process, with no profiler and with the exact profiler (100 Hz, its default 10 s uploads to a
receiver in the parent: each round's stop flushes one), interleaved round by round; the child
also reports the sampler's per-tick stall percentiles and the longest single export step. Then
over HTTP: uvicorn servers without a profiler, with the default one, and with the default taken
apart (allocation hooks that never sample, memory off, memory off at 1 Hz), two processes each,
all loaded at once (``_throughput``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import selectors
import socket
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
from ._report import Section, Spread, Verdict, markdown_table, paired_ratios

__all__ = ["CONCURRENCY", "main", "run"]

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
        # Started before the clock (a request would start it on its way in).
        runtime.start()
        try:
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

_HEALTH = b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n"


def _load(ports: list[int], seconds: float, connections: int = 8) -> dict[int, int]:
    """Responses each server completed in ``seconds``, all loaded at once, per port.

    Each server gets ``connections`` keep-alive connections with one request in flight each, so
    every server is busy for the whole period and what its threads do meanwhile (drains,
    uploads) is paid out of load, as on a server that is never idle. A raw-socket client costs
    a small fraction of what a server spends per request, so the servers stay the bottleneck.
    """
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    owners: dict[socket.socket, int] = {}
    done = dict.fromkeys(ports, 0)
    try:
        for port in ports:
            for _ in range(connections):
                conn = socket.create_connection(("127.0.0.1", port))
                buffers[conn] = bytearray()
                owners[conn] = port
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_HEALTH)
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ, data=conn)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for key, _events in selector.select(0.1):
                conn = key.data
                buffer = buffers[conn]
                buffer += conn.recv(65536)
                while (end := buffer.find(b"\r\n\r\n")) >= 0:
                    head = bytes(buffer[:end]).lower()
                    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    if len(buffer) < end + 4 + length:
                        break
                    del buffer[: end + 4 + length]
                    done[owners[conn]] += 1
                    conn.sendall(_HEALTH)
    finally:
        for conn in buffers:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            conn.close()
        selector.close()
    return done


def _process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far (Linux schedstat, nanoseconds)."""
    return sum(_threads_cpu_ns(pid))


def _threads_cpu_ns(pid: int) -> tuple[int, int]:
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


@dataclass(frozen=True)
class HttpRun:
    """The HTTP throughput run: per-round ratios and the profiler's CPU share."""

    ratios: list[float]
    # Per configuration other than "off": no profiler's CPU per response over its, per round.
    cpu_ratios: dict[str, list[float]]
    # Per configuration, the mean of its servers' CPU per response in each round.
    cpu_per_response_us: dict[str, list[float]]
    # Per server (configuration and index), its CPU per response over the whole run.
    server_us: dict[str, float]
    # The default profiler's servers' CPU per response over the whole run: their loop
    # threads, their other threads.
    loop_thread_us: float
    other_threads_us: float
    profiler_cpu_share: float
    stats: dict[str, Any]


#: Servers per configuration: fresh processes of one configuration differ by up to several
#: percent in CPU per response (memory layout, hash seeds), as much as what is measured here.
SERVERS_PER_VARIANT = 2

#: The largest mean gap between allocation samples: the hooks run, and almost never sample.
_NEVER_SAMPLE_BYTES = 1 << 40

#: The HTTP run's configurations besides no profiler ("off"): the default, then the default
#: taken apart, each row one part less than the one before.
HTTP_VARIANTS = {
    "exact": "the default profiler",
    "hooks": "the default with allocation hooks that (almost) never sample "
    f"(`SPANPROF_ALLOC_SAMPLE_BYTES={_NEVER_SAMPLE_BYTES}`)",
    "nomem": "the default with `SPANPROF_MEMORY=false`",
    "nomem_1hz": "the same at 1 Hz (`PYROSCOPE_SAMPLE_RATE=1`): the request path, the label "
    "engine and the upload thread, with almost no ticks",
}

#: Seconds each round loads every server: one default upload interval, so each profiled
#: server uploads about once a round.
HTTP_ROUND_SECONDS = 10.0


def _throughput(rounds: int, seconds: float, workdir: Path) -> HttpRun:
    """Per-round ratios of the servers' CPU per response, no profiler over each configuration,
    all servers loaded at once (and responses served, default over none).

    A CPU-bound server's throughput is the inverse of its CPU per response. Every server is
    loaded for the whole round, so a profiler thread's periodic work (drains every 0.25 s,
    uploads every 10 s) is paid out of load as on a busy server, instead of being charged to
    the 1 s in which a server was loaded while the others waited (as this run did before). Each
    configuration runs in ``SERVERS_PER_VARIANT`` processes; a round's figure for it is the
    mean of its servers'.
    """
    with PushReceiver() as receiver:
        common = {"E2E_BACKGROUND": "0", "PYROSCOPE_APPLICATION_NAME": "bench-exact-http"}
        # SPANPROF_PROFILER unset: the default (auto), which runs the exact sampler here, with
        # its default 10 s uploads.
        profiled = {**common, "PYROSCOPE_SERVER_ADDRESS": receiver.url}
        nomem = {**profiled, "SPANPROF_MEMORY": "false"}
        variants = {
            "off": common,
            "exact": profiled,
            "hooks": {**profiled, "SPANPROF_ALLOC_SAMPLE_BYTES": str(_NEVER_SAMPLE_BYTES)},
            "nomem": nomem,
            "nomem_1hz": {**nomem, "PYROSCOPE_SAMPLE_RATE": "1"},
        }
        servers = [(name, i) for i in range(SERVERS_PER_VARIANT) for name in variants]
        ports = {server: free_port() for server in servers}
        all_ports = [ports[server] for server in servers]
        pids: dict[tuple[str, int], int] = {}
        with contextlib.ExitStack() as stack:
            for server in servers:
                name, i = server
                pids[server] = stack.enter_context(
                    serve(
                        uvicorn_argv("tests.e2e.exact_app:app", ports[server], "asyncio"),
                        health_url=f"http://127.0.0.1:{ports[server]}/health",
                        env=variants[name],
                        log_path=workdir / f"http-{name}-{i}.log",
                    )
                ).pid
            _load(all_ports, 3.0)  # warm-up
            profiled_servers = [server for server in servers if server[0] != "off"]
            default_servers = [server for server in servers if server[0] == "exact"]
            stats_url = "http://127.0.0.1:{}/stats"
            before = [
                httpx.get(stats_url.format(ports[s]), timeout=10).json() for s in default_servers
            ]
            threads_before = [_threads_cpu_ns(pids[server]) for server in default_servers]
            total_before = {server: _process_cpu_ns(pid) for server, pid in pids.items()}
            served = dict.fromkeys(servers, 0)
            ratios: list[float] = []
            per_response: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(rounds):
                cpu = {server: _process_cpu_ns(pid) for server, pid in pids.items()}
                by_port = _load(all_ports, seconds)
                counts = {server: by_port[ports[server]] for server in servers}
                used = {
                    server: (_process_cpu_ns(pid) - cpu[server]) / counts[server] / 1e3
                    for server, pid in pids.items()
                }
                for server, count in counts.items():
                    served[server] += count
                for name in variants:
                    mine = [us for server, us in used.items() if server[0] == name]
                    per_response[name].append(statistics.fmean(mine))
                ratios.append(
                    statistics.fmean(c for s, c in counts.items() if s[0] == "exact")
                    / statistics.fmean(c for s, c in counts.items() if s[0] == "off")
                )
            threads_after = [_threads_cpu_ns(pids[server]) for server in default_servers]
            server_us = {
                f"{name} {i + 1}": (_process_cpu_ns(pids[(name, i)]) - total_before[(name, i)])
                / served[(name, i)]
                / 1e3
                for name, i in servers
            }
            checks = {
                s: httpx.get(stats_url.format(ports[s]), timeout=10).json()
                for s in profiled_servers
            }
            after = [checks[s] for s in default_servers]
        if receiver.errors:
            raise RuntimeError(f"the receiver rejected uploads: {receiver.errors[:3]}")
        for (name, _), stats in checks.items():
            if stats.get("mode") != "exact" or not stats.get("uploads"):
                raise RuntimeError(f"the exact profiler did not run or upload ({name}): {stats!r}")
            sampling = any(key.startswith("memory_") for key in stats)
            if sampling != (name in ("exact", "hooks")):
                raise RuntimeError(f"memory sampling was not as configured ({name}): {stats!r}")
    spent = sum(
        float(a[k]) - float(b[k])
        for a, b in zip(after, before, strict=True)
        for k in ("handler_cpu_ms", "export_cpu_ms")
    )
    loop_ns = sum(a[0] - b[0] for a, b in zip(threads_after, threads_before, strict=True))
    others_ns = sum(a[1] - b[1] for a, b in zip(threads_after, threads_before, strict=True))
    default_served = sum(served[server] for server in default_servers)
    cpu_ratios = {
        name: [off / x for off, x in zip(per_response["off"], per_response[name], strict=True)]
        for name in HTTP_VARIANTS
    }
    return HttpRun(
        ratios=ratios,
        cpu_ratios=cpu_ratios,
        cpu_per_response_us=per_response,
        server_us=server_us,
        loop_thread_us=loop_ns / default_served / 1e3,
        other_threads_us=others_ns / default_served / 1e3,
        profiler_cpu_share=spent / ((loop_ns + others_ns) / 1e6),
        # The first default server's counters, for the stall and export-step figures.
        stats=after[0],
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
    http_rounds = 3 if quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        http_run = _throughput(http_rounds, HTTP_ROUND_SECONDS, Path(tmp))
    http_stats = http_run.stats
    http = Spread.of(http_run.ratios)
    http_cpu = Spread.of(http_run.cpu_ratios["exact"])
    servers = SERVERS_PER_VARIANT * (len(HTTP_VARIANTS) + 1)
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
        "**Throughput over HTTP.** uvicorn servers (asyncio) of the same app with the "
        "background load off and `SPANPROF_PROFILER` unset (the default, `auto`, which runs the "
        "exact sampler with memory sampling here): no profiler (`PYROSCOPE_SERVER_ADDRESS` "
        "unset), the default profiler as configured by default (100 Hz, 10 s uploads to a "
        "`PushReceiver`), and the default taken apart one part at a time (the rows below); each "
        f"configuration in {SERVERS_PER_VARIANT} processes (fresh processes of one "
        "configuration differ by several percent in CPU per response). "
        f"{http_rounds} rounds of {HTTP_ROUND_SECONDS:.0f} s (one upload interval) in which a "
        f"raw-socket client loads all {servers} servers at once (8 keep-alive connections each, "
        "`GET /health`: a 2-byte `PlainTextResponse` through `ProfilingMiddleware`), so every "
        "server is busy all round and its profiler's periodic work is paid out of load, as on "
        "a server that is never idle. Each server's CPU (all threads, "
        "`/proc/PID/task/*/schedstat`) per response it served that round; a round's figure for "
        "a configuration is the mean of its servers'. The servers share two cores, so each runs "
        f"at about 2/{servers} of a core: work a profiler does per second of wall time (about "
        "1.5 ms a second for the default, idle) weighs several times more per response here "
        "than on a server with a core of its own.",
        markdown_table(
            ["configuration", "server CPU µs per response", "throughput x no profiler (CPU)"],
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
                    "responses served, default / no profiler, per round",
                    http.format(3),
                ],
                [
                    "each server's CPU µs per response over the whole run",
                    ", ".join(f"{k}: {v:.1f}" for k, v in http_run.server_us.items()),
                ],
                [
                    "default profiler's servers: CPU µs per response on the loop thread / on "
                    "their other threads (the profiler's: CPU and memory uploads, the "
                    "allocation drain), whole run",
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
        "round's clock and stopped after it (100 Hz; its default 10 s uploads to a receiver in "
        f"the parent, so each round's stop flushes one: {pushes} uploads received). "
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
            "no profiler (uvicorn over HTTP, server CPU per response)",
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
            f"({float(http_stats['stall_p99_us']):.0f} µs wall, {servers} servers on two cores); "
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
