"""Real servers on loopback for end-to-end tests: start, wait until ready, stop gracefully."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out as source ports of outgoing connections (inclusive)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port that was free a moment ago, and that no connection will take meanwhile.

    A port taken from ``bind(0)`` lies in the ephemeral range, so between its release here and
    the server's bind, any outgoing connection (a client, an upload) may get it as its source
    port: gunicorn then gave up with "Connection in use" (seen on 3.14 in CI). Below that range
    only another listener can take it, and the bind checks there is none.
    """
    low, _ = ephemeral_range()
    top = max(low, 2048)
    candidates = list(range(max(1024, top - 16384), top))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below the ephemeral range ({low})")


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200, failing early if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@contextmanager
def serve(
    argv: Sequence[str],
    *,
    health_url: str,
    env: Mapping[str, str],
    log_path: Path,
    stop_signal: int = signal.SIGINT,
    ready_timeout: float = 30.0,
    stop_timeout: float = 30.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server command from the repo root; on exit stop it gracefully (lifespan shutdown).

    ``ready_timeout`` and ``stop_timeout`` bound the wait for its health URL and for its exit
    (a server under valgrind takes minutes for either).
    """
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'middleware'}", **env}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv), cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_ready(health_url, process, ready_timeout)
            yield process
        except BaseException as exc:
            # A server that died mid-test shows up as "connection refused": say it died, how,
            # and what it printed last.
            if process.poll() is not None and hasattr(exc, "add_note"):  # add_note: 3.11+
                log.flush()
                tail = log_path.read_bytes()[-4000:].decode(errors="replace")
                exc.add_note(
                    f"the server exited with {process.returncode} during the test (negative: "
                    f"killed by that signal); the end of {log_path}:\n{tail}"
                )
            raise
        finally:
            if process.poll() is None:
                process.send_signal(stop_signal)
                try:
                    process.wait(timeout=stop_timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def uvicorn_argv(app: str, port: int, loop: str, *extra: str) -> list[str]:
    """A uvicorn command line serving ``app`` on 127.0.0.1 with the given loop."""
    return [
        sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
        "--loop", loop, "--lifespan", "on", "--log-level", "warning", *extra,
    ]  # fmt: skip


def gunicorn_uvicorn_argv(app: str, port: int, *extra: str) -> list[str]:
    """A gunicorn command line serving ASGI ``app`` on 127.0.0.1 with one uvicorn worker
    (``uvicorn.workers.UvicornWorker``: the worker runs the event loop in its main thread)."""
    return [
        sys.executable, "-m", "gunicorn", app, "--bind", f"127.0.0.1:{port}", "--workers", "1",
        "--worker-class", "uvicorn.workers.UvicornWorker", "--config",
        "tests/e2e/gunicorn_conf.py", "--graceful-timeout", "10", "--log-level", "warning",
        *extra,
    ]  # fmt: skip


def hypercorn_argv(app: str, port: int, worker_class: str, *extra: str) -> list[str]:
    """A hypercorn command line serving ``app`` on 127.0.0.1 (asyncio, uvloop or trio)."""
    return [
        sys.executable, "-m", "hypercorn", app, "--bind", f"127.0.0.1:{port}",
        "--worker-class", worker_class, "--log-level", "warning", *extra,
    ]  # fmt: skip
