"""pyroscope-io is optional (it has no CPython 3.15 build): only its backend needs it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spanprof import ExactBackend, ProfilingMiddleware, PyroscopeBackend
from spanprof._types import Receive, Scope, Send

from .conftest import AGENT_HAS_A_BUILD, NO_AGENT_BUILD

# ``sys.modules[name] = None`` makes ``import name`` raise ImportError, as if not installed.
WITHOUT_PYROSCOPE = "import sys; sys.modules['pyroscope'] = None\n"


def test_spanprof_imports_without_pyroscope_io() -> None:
    """The package, its middleware and the exact backend import without the agent installed."""
    code = WITHOUT_PYROSCOPE + (
        "import spanprof\n"
        "assert 'pyroscope' not in {m for m, v in sys.modules.items() if v is not None}\n"
        "print(spanprof.ProfilingMiddleware.__name__, spanprof.ExactBackend.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ProfilingMiddleware", "ExactBackend"]


def test_pyroscope_backend_without_pyroscope_io_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Choosing the pyroscope backend without the agent raises a RuntimeError naming the fix."""
    monkeypatch.setitem(sys.modules, "pyroscope", None)
    with pytest.raises(RuntimeError, match=r"pip install pyroscope-io") as info:
        PyroscopeBackend(server_address="http://pyroscope:4040", application_name="checkout")
    assert isinstance(info.value.__cause__, ImportError)


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    return None


@pytest.mark.skipif(AGENT_HAS_A_BUILD, reason="pyroscope-io has a build for this CPython")
def test_where_the_agent_has_no_build_auto_is_exact_and_pyroscope_says_why() -> None:
    """3.15+: no agent installed; the default profiler is exact, asking for the agent errs."""
    # pyproject.toml's marker kept pyroscope-io (and its Rust build) out of this install.
    assert importlib.util.find_spec("pyroscope") is None
    base = {"PYROSCOPE_SERVER_ADDRESS": "http://pyroscope:4040"}
    default = ProfilingMiddleware(_app, environ=base).profiler
    assert isinstance(default, ExactBackend)
    assert default.auto
    with pytest.raises(RuntimeError, match=r"pip install pyroscope-io") as info:
        ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "pyroscope"})
    message = str(info.value)
    assert "no build for CPython 3.15" in message
    assert "leave SPANPROF_PROFILER unset" in message
    assert isinstance(info.value.__cause__, ImportError)


_HIDDEN_AGENT_TEST = """
import sys

import pytest

sys.modules["pyroscope"] = None  # as if pyroscope-io were not installed


@pytest.mark.needs_agent
def test_uses_the_agent() -> None:
    import pyroscope  # noqa: F401
"""


@pytest.mark.parametrize("ci", [False, True], ids=["local", "ci"])
def test_needs_agent_goes_by_the_version_not_by_a_failed_import(tmp_path: Path, ci: bool) -> None:
    """A missing agent skips a needs_agent test only where pyroscope-io has no build, or locally."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = needs_agent: the agent\n")
    (tmp_path / "test_hidden_agent.py").write_text(_HIDDEN_AGENT_TEST)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout
    if not AGENT_HAS_A_BUILD:
        assert proc.returncode == 0, out
        assert "1 skipped" in out, out
        assert NO_AGENT_BUILD in out, out
    elif ci:
        assert proc.returncode == 1, out
        assert "1 error" in out, out
        assert "missing under CI: pyroscope-io (the Pyroscope agent) is not installed" in out, out
    else:
        assert proc.returncode == 0, out
        assert "1 skipped" in out, out
        assert "pyroscope-io (the Pyroscope agent) is not installed" in out, out
