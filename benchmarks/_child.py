"""Benchmarks with the real Pyroscope agent run in a child process.

``pyroscope.configure`` works once per process and the agent's sampler thread loads every
variant measured beside it, so the variants that need the agent, and the baseline they are
compared with, run together in a child process whose agent pushes to a ``PushReceiver`` in
this (parent) process. The receiver decodes uploads outside the measured process, and its
contents prove that the agent really ran and received labels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spanprof import PyroscopeBackend
from spanprof._local._receiver import PushReceiver

__all__ = [
    "ROOT",
    "SinkCheck",
    "child_main",
    "pyroscope_backend",
    "receiver_child_arguments",
    "receiver_process",
    "run_child",
    "run_receiver_child",
]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SinkCheck:
    """What the receiver got from the child's agent."""

    pushes: int
    weight: int
    labelled_weight: int

    def describe(self) -> str:
        """One sentence for the report."""
        share = self.labelled_weight / self.weight if self.weight else 0.0
        return (
            f"The agent pushed {self.pushes} uploads ({self.weight / 1e7:.0f} CPU ticks) to the "
            f"receiver; {share:.0%} of the sampled CPU carried a `span_id` label."
        )


def run_child(
    module: str, args: list[str], *, timeout: float = 300.0
) -> tuple[dict[str, Any], SinkCheck]:
    """Run ``python -m module --child ...`` with an agent pushing to a local receiver."""
    with PushReceiver() as receiver, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [
            sys.executable, "-m", module, "--child",
            "--pyroscope", receiver.url, "--out", str(out), *args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'middleware'}"}
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        data: dict[str, Any] = json.loads(out.read_text())
        # The child flushed its last window synchronously in shutdown(), before exiting.
        samples = receiver.samples()
        errors = receiver.errors
        if errors:
            raise RuntimeError(f"the receiver rejected uploads: {errors[:3]}")
        check = SinkCheck(
            pushes=receiver.pushes,
            weight=sum(s.value for s in samples),
            labelled_weight=sum(s.value for s in samples if s.label_values("span_id")),
        )
    return data, check


def pyroscope_backend(url: str) -> PyroscopeBackend:
    """The agent configuration of every child: 1 s uploads to the parent's receiver."""
    return PyroscopeBackend(
        server_address=url, application_name="spanprof-bench", upload_interval=1
    )


def child_main(
    description: str, run: Callable[[argparse.Namespace, PyroscopeBackend], dict[str, Any]]
) -> Callable[[list[str] | None], None]:
    """A ``main(argv)`` for a benchmark module's child mode (and its ``--child`` flag only).

    ``run(args, backend)`` gets the started agent's backend and returns JSON-able results; the
    agent is shut down (last window flushed) afterwards.
    """

    def main(argv: list[str] | None = None) -> None:
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("--child", action="store_true", required=True)
        parser.add_argument("--pyroscope", required=True, help="receiver URL")
        parser.add_argument("--out", required=True, type=Path)
        parser.add_argument("--rounds", type=int, required=True)
        parser.add_argument("--size", type=int, required=True)
        args = parser.parse_args(argv)
        backend = pyroscope_backend(args.pyroscope)
        backend.start()
        try:
            result = run(args, backend)
        finally:
            backend.shutdown()
        args.out.write_text(json.dumps(result))

    return main


def receiver_child_arguments(argv: list[str]) -> argparse.Namespace:
    """The flags ``run_receiver_child`` passes: ``--receiver URL --out PATH --rounds --size``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--receiver", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    return parser.parse_args(argv)


def run_receiver_child(
    module: str, rounds: int, size: int, *, timeout: float = 900.0
) -> tuple[dict[str, Any], PushReceiver]:
    """Run ``python -m module --child ...`` whose exact profiler pushes to a receiver here.

    Returns the JSON the child wrote to ``--out`` and the (closed) receiver, whose uploads
    prove the profiler ran; a failed child or a rejected upload raises ``RuntimeError``.
    """
    with PushReceiver() as receiver, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [
            sys.executable, "-m", module, "--child",
            "--receiver", receiver.url, "--out", str(out),
            "--rounds", str(rounds), "--size", str(size),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'middleware'}"}
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        data: dict[str, Any] = json.loads(out.read_text())
        if receiver.errors:
            raise RuntimeError(f"the receiver rejected uploads: {receiver.errors[:3]}")
    return data, receiver


@contextmanager
def receiver_process() -> Iterator[str]:
    """A ``PushReceiver`` in a process of its own, for as long as the block runs: its URL.

    Under callgrind, which does not follow child processes, the receiver's decoding of what
    the profiler sends is then not counted as the measured process's work."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._child", "receiver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert process.stdout is not None
    assert process.stdin is not None
    try:
        url = process.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the receiver process said {url!r}")
        yield url
    finally:
        process.stdin.close()  # it serves until its stdin ends
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _serve_receiver() -> None:
    with PushReceiver() as receiver:
        print(receiver.url, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1:] != ["receiver"]:
        raise SystemExit("usage: python -m benchmarks._child receiver")
    _serve_receiver()
