"""Invalid configuration fails at construction with a ValueError naming the setting."""

from __future__ import annotations

import pytest

from spanprof import ProfilingMiddleware, PyroscopeBackend
from spanprof._types import Receive, Scope, Send

from .conftest import AGENT_ENV


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    return None


@pytest.mark.parametrize(
    ("environ", "setting"),
    [
        ({"PYROSCOPE_SERVER_ADDRESS": "pyroscope:4040"}, "PYROSCOPE_SERVER_ADDRESS"),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_UPLOAD_INTERVAL": "fast"},
            "PYROSCOPE_UPLOAD_INTERVAL",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_UPLOAD_INTERVAL": "0"},
            "PYROSCOPE_UPLOAD_INTERVAL",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_SAMPLE_RATE": "-5"},
            "PYROSCOPE_SAMPLE_RATE",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "region"},
            "PYROSCOPE_LABELS",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "span_id=1"},
            "PYROSCOPE_LABELS",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "a-b=1"},
            "PYROSCOPE_LABELS",
        ),
        ({"SPANPROF_TRACE_ID_LABEL": "maybe"}, "SPANPROF_TRACE_ID_LABEL"),
    ],
)
def test_bad_environment_names_the_variable(environ: dict[str, str], setting: str) -> None:
    """Each bad environment value raises ValueError with the variable's name."""
    with pytest.raises(ValueError, match=setting):
        ProfilingMiddleware(_app, environ=environ)


def test_environment_configures_the_pyroscope_backend() -> None:
    """The Pyroscope agents' variables map onto the backend, OTEL_SERVICE_NAME as fallback."""
    backend = PyroscopeBackend.from_env(AGENT_ENV)
    assert backend is not None
    assert backend.server_address == "http://pyroscope:4040"
    assert backend.application_name == "checkout"
    assert backend.upload_interval == 15
    assert backend.sample_rate == 97
    assert backend.tenant_id == "team-a"
    assert (backend.basic_auth_username, backend.basic_auth_password) == ("u", "p")
    assert backend.tags == {"region": "eu-west-1", "zone": "b"}
    named = PyroscopeBackend.from_env(
        {
            "PYROSCOPE_SERVER_ADDRESS": "http://p:4040",
            "PYROSCOPE_APPLICATION_NAME": "svc",
            "OTEL_SERVICE_NAME": "other",
        }
    )
    assert named is not None
    assert named.application_name == "svc"


def test_no_server_address_means_no_profiler() -> None:
    """Without PYROSCOPE_SERVER_ADDRESS the middleware labels but starts no profiler."""
    assert PyroscopeBackend.from_env({}) is None
    assert ProfilingMiddleware(_app, environ={}).profiler is None


def test_profiler_must_be_a_backend() -> None:
    """A profiler= that is not a ProfilerBackend is refused at construction."""
    with pytest.raises(ValueError, match="profiler"):
        ProfilingMiddleware(_app, profiler="pyroscope")  # type: ignore[arg-type]


def test_spanprof_profiler_selects_the_backend() -> None:
    """auto (default) and exact pick ExactBackend, pyroscope the agent; anything else errs."""
    from spanprof import ExactBackend

    base = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040"}
    exact = ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "exact"}).profiler
    assert isinstance(exact, ExactBackend)
    assert not exact.auto
    default = ProfilingMiddleware(_app, environ=base).profiler
    assert isinstance(default, ExactBackend)
    assert default.auto
    auto = ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": " AUTO "}).profiler
    assert auto is default  # one exact backend per configuration and process
    agent = ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "pyroscope"}).profiler
    assert isinstance(agent, PyroscopeBackend)
    with pytest.raises(ValueError, match="SPANPROF_PROFILER"):
        ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "perf"})
