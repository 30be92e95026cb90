"""pyroscope-io is optional (it has no CPython 3.15 build): only its backend needs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spanprof import PyroscopeBackend

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
