"""tools/test_matrix.py, run on fake interpreters: discovery, failed installs, CI strictness."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "test_matrix.py"

# Answers the tool's version probe (major minor micro gil_disabled); refuses to make a venv.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = -c ]; then echo "{probe}"; exit 0; fi
echo "fake interpreter: no venv here" >&2
exit 3
"""


def fake_pyenv(root: Path, versions: dict[str, str]) -> Path:
    for name, probe in versions.items():
        exe = root / "versions" / name / "bin" / "python3"
        exe.parent.mkdir(parents=True)
        exe.write_text(FAKE_PYTHON.format(probe=probe))
        exe.chmod(0o755)
    return root


def run_tool(tmp_path: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    pyenv = fake_pyenv(
        tmp_path / "pyenv",
        {"3.98.1": "3 98 1 0", "3.99.0t": "3 99 0 1", "3.9.18": "3 9 18 0"},
    )
    (tmp_path / "bin").mkdir(parents=True)
    env = {
        **{k: v for k, v in os.environ.items() if k != "CI"},
        "PYENV_ROOT": str(pyenv),
        "PATH": str(tmp_path / "bin"),  # no python3.X on PATH
        "SPANPROF_CHROOT": str(tmp_path / "no-chroot"),
        **({"CI": "true"} if ci else {}),
    }
    return subprocess.run(
        [sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("ci", [False, True], ids=["local", "ci"])
def test_a_failed_install_fails_that_version_and_the_matrix_goes_on(
    tmp_path: Path, ci: bool
) -> None:
    """Both fake interpreters fail to install; each is reported, the run exits 1."""
    proc = run_tool(tmp_path, ci=ci)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = proc.stdout.split("interpreters: ")[1].splitlines()[0]
    assert found.startswith("3.98 (pyenv")
    assert "3.9 (" not in found  # too old
    assert "free-threaded: 3.99t" in proc.stdout
    assert "-m venv --clear" in proc.stdout
    summary = proc.stdout.split("engine matrix:")[1]
    assert "3.98   install failed" in summary
    assert "3.99t  install failed" in summary


def test_missing_required_versions_fail_only_under_ci(tmp_path: Path) -> None:
    """Without 3.14 and 3.15, CI lists them among the failures; a local run only reports them."""
    local = run_tool(tmp_path / "local", ci=False)
    ci = run_tool(tmp_path / "ci", ci=True)
    assert "engine tests failed on: 3.98, 3.99t\n" in local.stderr
    assert "engine tests failed on: 3.98, 3.99t, 3.14, 3.15\n" in ci.stderr
    assert "3.14   missing" in local.stdout
    assert "not required outside CI" in local.stdout
    assert "required under CI" in ci.stdout
    assert "no chroot at" in ci.stdout
