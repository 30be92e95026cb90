"""The process id the request path checks is this process's, in forked children too, and is
read without a system call per request."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from spanprof._labels._backend import ProfilerBackend
from spanprof._labels._labelset import LabelSet
from spanprof._process import current_pid
from spanprof._profiling._runtime import ProfilerRuntime


class _Backend(ProfilerBackend):
    def __init__(self) -> None:
        self.starts: list[int] = []

    def start(self) -> None:
        self.starts.append(os.getpid())

    def shutdown(self) -> None:
        pass

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        pass


def _in_child(report: Callable[[], str]) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, report().encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0
    return answer


def test_the_id_is_this_processs_and_a_forked_childs_own() -> None:
    assert current_pid() == os.getpid()
    answer = _in_child(lambda: f"{current_pid()} {os.getpid()}")
    cached, real = answer.split()
    assert cached == real
    assert int(cached) != os.getpid()
    assert current_pid() == os.getpid()


def test_ensure_started_makes_no_system_call_once_started(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = ProfilerRuntime(_Backend())
    runtime.ensure_started()
    calls: list[None] = []
    real = os.getpid

    def counting() -> int:
        calls.append(None)
        return real()

    monkeypatch.setattr(os, "getpid", counting)
    try:
        for _ in range(100):
            runtime.ensure_started()
        assert runtime.started
    finally:
        monkeypatch.undo()
        runtime.stop()
    # Two per request, before: os.getpid() is a system call (~0.16 µs).
    assert calls == []


def test_a_forked_child_starts_the_backend_again_on_its_first_request() -> None:
    backend = _Backend()
    runtime = ProfilerRuntime(backend)
    runtime.ensure_started()
    try:

        def child() -> str:
            runtime.ensure_started()
            runtime.ensure_started()
            return " ".join(map(str, backend.starts))

        starts = [int(pid) for pid in _in_child(child).split()]
    finally:
        runtime.stop()
    assert starts[0] == os.getpid()
    assert len(starts) == 2, starts
    assert starts[1] != os.getpid(), starts
