"""``spanprof dev`` under hostile input: every attack of issue #15 against one running process.

Any web page the developer visits, and any process on the machine, can reach local mode's
receiver and page on loopback. One ``spanprof dev`` subprocess takes each attack in turn; each
gets a 4xx (or, for input that is valid but huge, a bounded 200), the page and the app keep
answering after each, each kind of rejection is logged once, and the process's peak resident
memory stays within 150 MiB of its idle size.
"""

from __future__ import annotations

import gzip
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware, current_labels
from spanprof._profiling._encoders._memory import MEMORY_PERIOD_TYPE, MEMORY_SAMPLE_TYPES
from spanprof._profiling._encoders._pprof import ProfileBuilder
from spanprof._profiling._encoders._push import PUSH_CONTENT_TYPE, PUSH_PATH, encode_push_request
from spanprof._profiling._samplers._signal import MAX_DEPTH
from spanprof._profiling._window import Frame

from .e2e.server import free_port, serve, wait_ready
from .test_local_mode import SLO_SECONDS, frame_names, get_json, settle

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
BUDGET_KIB = 150 * 1024
REQUESTS = 50_000
CONNECTIONS = 8
TRACES = 5
DEEP_REQUEST = 900


# -- the app -----------------------------------------------------------------------------------


def deep_leaf(seconds: float) -> int:
    """Burn CPU at the bottom of the deep request's stack (its name is what the test looks for)."""
    end = time.thread_time() + seconds
    spins = 0
    while time.thread_time() < end:
        spins += 1
    return spins


def _descend(depth: int, seconds: float) -> int:
    return deep_leaf(seconds) if depth <= 0 else _descend(depth - 1, seconds) + 0


async def _deep(request: Request) -> Response:
    _descend(int(request.path_params["depth"]), float(request.query_params.get("seconds", "0.3")))
    return JSONResponse(dict(current_labels()))


async def _health(request: Request) -> Response:
    return PlainTextResponse("ok")


def make_app() -> ProfilingMiddleware:
    """What ``spanprof dev --factory`` serves: a health route and a deeply recursing one."""
    routes = [Route("/health", _health), Route("/deep/{depth:int}", _deep)]
    return ProfilingMiddleware(Starlette(routes=routes))


# -- helpers -----------------------------------------------------------------------------------


@contextmanager
def spanprof_dev(tmp: Path) -> Iterator[tuple[int, str, str, Path]]:
    """``spanprof dev`` of ``make_app``; yields (pid, app URL, page URL, log path)."""
    port, ui_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "spanprof", "dev", "tests.test_local_hostile:make_app", "--factory",
        "--port", str(port), "--ui-port", str(ui_port), "--slo", str(SLO_SECONDS),
    ]  # fmt: skip
    log = tmp / "spanprof-dev.log"
    with serve(argv, health_url=f"http://127.0.0.1:{port}/health", env={}, log_path=log) as proc:
        ui = f"http://127.0.0.1:{ui_port}"
        wait_ready(f"{ui}/api/status", proc)
        yield proc.pid, f"http://127.0.0.1:{port}", ui, log


def _memory_kib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak so far) of ``pid``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _still_serving(app: str, ui: str) -> None:
    assert httpx.get(f"{app}/health", timeout=30).status_code == 200
    assert httpx.get(f"{ui}/api/status", timeout=30).status_code == 200


def _post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, content=body, headers=headers, timeout=30)


def _gzip_bomb(inflated_mib: int) -> bytes:
    """Concatenated gzip members of 1 MiB of zeros each: ~1 KB per inflated MiB."""
    return gzip.compress(bytes(MIB), compresslevel=9) * inflated_mib


def _deep_push(
    span_ids: list[str], depth: int, *, memory: bool = False, service: str = "attacker"
) -> bytes:
    """One gzip'd push whose samples, one per span id, are each ``depth`` frames deep (a
    memory series of ``service``, allocated and in use, when ``memory``)."""
    builder = (
        ProfileBuilder(MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, 524288)
        if memory
        else ProfileBuilder(period=10_000_000)
    )
    frames = [Frame(f"level_{i}", "deep.py", i) for i in range(3)]
    for n, span_id in enumerate(span_ids):
        stack = [Frame(f"attack_leaf_{n}", "deep.py", 1)]
        stack += (frames[i % 3] for i in range(depth - 2))
        stack.append(Frame("attack_root", "deep.py", 2))
        value: int | tuple[int, ...] = (10, 10_000_000, 10, 10_000_000) if memory else 10_000_000
        builder.add(stack, value, [("span_id", span_id)])
    name = "memory" if memory else "process_cpu"
    series = [([("__name__", name), ("service_name", service)], [builder.build()])]
    return gzip.compress(encode_push_request(series))


def _status_line(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        return sock.makefile("rb").readline()


def _flood(app: str, total: int) -> None:
    """``total`` requests over keep-alive connections, in a few client-chosen traces."""
    host, _, port = app.removeprefix("http://").rpartition(":")
    query = b"q=" + b"x" * 2000
    errors: list[BaseException] = []

    def connection(index: int) -> None:
        try:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                reader = sock.makefile("rb")
                for n in range(index, total, CONNECTIONS):
                    # One request at a time: pipelined requests are not what a browser sends.
                    parent = b"00-%032x-%016x-01" % (0xABC0 + n % TRACES, n + 1)
                    sock.sendall(
                        b"GET /health?" + query + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"traceparent: " + parent + b"\r\n\r\n"
                    )
                    status = reader.readline()
                    assert status.startswith(b"HTTP/1.1 200"), status
                    length = 0
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.partition(b":")[2])
                    reader.read(length)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=connection, args=(i,)) for i in range(CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def _span_flame(ui: str, span_id: str, timeout: float = 30.0) -> Any:
    """The span's CPU flame graph once its samples are in (or the last answer at ``timeout``).

    Two more uploads are not enough to wait for: the CPU and memory profiles of one interval
    count as two, and the exact profiler holds a request's samples until its verdict, into the
    next window."""
    deadline = time.monotonic() + timeout
    settle(ui)
    while True:
        flame = _deep_json(f"{ui}/api/flamegraph?span_id={span_id}")
        if flame["root"]["children"] or time.monotonic() > deadline:
            return flame
        time.sleep(0.5)


def _deep_json(url: str) -> Any:
    """GET ``url`` and decode JSON nested deeper than ``json.loads`` recurses by default.

    In a thread with a 256 MiB stack and a raised recursion limit (restored afterwards), as
    the browser's iterative JSON.parse would not need.
    """
    text = httpx.get(url, timeout=30).raise_for_status().text
    result: list[Any] = []
    limit = sys.getrecursionlimit()
    old_stack = threading.stack_size(256 * MIB)
    try:
        sys.setrecursionlimit(20_000)
        thread = threading.Thread(target=lambda: result.append(json.loads(text)))
        thread.start()
        thread.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(old_stack)
    return result[0]


def _leaf_to_root(node: dict[str, Any]) -> list[str]:
    """The frame names along the heaviest path of a flame-graph tree, root first."""
    names = []
    while node["children"]:
        node = node["children"][0]
        names.append(node["name"])
    return names


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_local_mode_survives_every_attack_within_its_memory_budget(tmp_path: Path) -> None:
    """Bomb, bad chunks, cross-site pushes, deep stacks, 50k grouped requests: bounded, served."""
    with spanprof_dev(tmp_path) as (pid, app, ui, log):
        assert httpx.get(f"{app}/deep/10", params={"seconds": 0.05}, timeout=30).status_code == 200
        settle(ui)
        receiver = get_json(f"{ui}/api/status")["receiver_url"]
        port = int(receiver.rpartition(":")[2])
        push_url = receiver + PUSH_PATH
        proto = {"Content-Type": PUSH_CONTENT_TYPE}
        idle_kib = _memory_kib(pid, "VmRSS")

        # 1. A 1 MB body that inflates to 1 GiB, with and without Content-Encoding.
        bomb = _gzip_bomb(1024)
        assert len(bomb) < 2 * MIB
        assert _post(push_url, bomb, proto).status_code == 413
        assert _post(push_url, bomb, {**proto, "Content-Encoding": "gzip"}).status_code == 413
        _still_serving(app, ui)

        # 2. A negative chunk size, the connection left open.
        head = (
            b"POST " + PUSH_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/proto\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"
        )
        assert _status_line(port, head).startswith(b"HTTP/1.1 400")
        _still_serving(app, ui)

        # 3. What another origin's page can send: a no-cors fetch, a rebinding Host.
        body = _deep_push(["00000000000000ff"], 10)
        assert _post(push_url, body, {"Origin": "https://evil.example"}).status_code == 403
        assert _post(push_url, body, {**proto, "Host": "evil.example"}).status_code == 403
        assert httpx.post(push_url, content=body, headers={}, timeout=30).status_code == 415
        foreign = {"Origin": "https://evil.example"}
        assert httpx.get(f"{ui}/api/status", headers=foreign, timeout=30).status_code == 403
        _still_serving(app, ui)

        # 4. Small pushes of very deep stacks, one new span id each.
        deep_spans = [f"{0xDEE0000 + i:016x}" for i in range(60)]
        for i in range(0, len(deep_spans), 2):
            push = _deep_push(deep_spans[i : i + 2], 50_000)
            assert len(push) < 200_000
            assert _post(push_url, push, {**proto, "Content-Encoding": "gzip"}).status_code == 200
        _still_serving(app, ui)
        tree = _deep_json(f"{ui}/api/flamegraph?span_id={deep_spans[0]}")["root"]
        path = _leaf_to_root(tree)
        assert path[0] == "attack_root"
        assert path[-1] == "attack_leaf_0"
        assert len(path) <= 2048
        assert any(name.endswith("frames elided]") for name in path)

        # 4b. The same as memory pushes, each of a new series (a snapshot of its own).
        for i in range(0, len(deep_spans), 2):
            push = _deep_push(deep_spans[i : i + 2], 50_000, memory=True, service=f"attacker{i}")
            assert len(push) < 200_000
            assert _post(push_url, push, {**proto, "Content-Encoding": "gzip"}).status_code == 200
        _still_serving(app, ui)
        memory = get_json(f"{ui}/api/status")["memory"]
        assert memory["kept_bytes"] <= 16 * MIB, memory
        assert memory["inuse_snapshots"] <= 16, memory
        for kind in ("alloc_space", "inuse_space"):
            url = f"{ui}/api/flamegraph?span_id={deep_spans[-1]}&kind={kind}"
            path = _leaf_to_root(_deep_json(url)["root"])
            assert (path[0], path[-1]) == ("attack_root", "attack_leaf_1")  # 2nd of its push
            assert len(path) <= 2048
            assert any(name.endswith("frames elided]") for name in path)

        # 5. 50,000 requests with 2 KB URLs in five client-chosen traces.
        started = time.monotonic()
        _flood(app, REQUESTS)
        flood_s = time.monotonic() - started
        _still_serving(app, ui)
        status = get_json(f"{ui}/api/status")
        assert status["spans"] >= REQUESTS
        assert status["kept"]["evicted_requests"] > 0

        # 6. A request 900 frames deep renders its flame graph, leaf included.
        labels = httpx.get(f"{app}/deep/{DEEP_REQUEST}", timeout=60).json()
        flame = _span_flame(ui, labels["span_id"])
        assert "deep_leaf" in frame_names(flame["root"])
        # The exact sampler keeps a stack's MAX_DEPTH leaf-most frames (pyroscope-io all).
        assert len(_leaf_to_root(flame["root"])) >= min(DEEP_REQUEST, MAX_DEPTH)

        peak_kib = _memory_kib(pid, "VmHWM")
        growth_kib = peak_kib - idle_kib
        print(
            f"idle {idle_kib / 1024:.0f} MiB, peak {peak_kib / 1024:.0f} MiB, "
            f"growth {growth_kib / 1024:.0f} MiB; {REQUESTS} requests in {flood_s:.1f} s"
        )
        assert growth_kib < BUDGET_KIB, (idle_kib, peak_kib)

    text = log.read_text()
    # Two bombs, two cross-site pushes: one line per kind of rejection, not per request.
    for kind in ("push too large", "refused a request with Origin", "refused a request for Host",
                 "unsupported Content-Type", "invalid chunked encoding"):  # fmt: skip
        assert text.count(f"spanprof receiver: {kind}") == 1, (kind, text[-2000:])
    assert text.count("spanprof local page: refused a request from Origin") == 1
    assert "Traceback" not in text, text[-2000:]
