"""tools/test_matrix.py, run on fake interpreters: discovery, failed installs, CI strictness."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "test_matrix.py"
PROVISION = ROOT / "tools" / "provision_pythons.sh"

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
    summary = proc.stdout.split("test matrix:")[1]
    assert "3.98   engine       install failed" in summary
    assert "3.99t  engine       install failed" in summary


def test_missing_required_versions_fail_only_under_ci(tmp_path: Path) -> None:
    """Without 3.14 and 3.15, CI lists them among the failures; a local run only reports them."""
    local = run_tool(tmp_path / "local", ci=False)
    ci = run_tool(tmp_path / "ci", ci=True)
    assert "tests failed on: 3.98, 3.99t\n" in local.stderr
    assert "tests failed on: 3.98, 3.99t, 3.14, 3.15\n" in ci.stderr
    assert "3.14   whole suite  missing" in local.stdout
    assert "not required outside CI" in local.stdout
    assert "required under CI" in ci.stdout
    assert "no chroot at" in ci.stdout


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_matrix_tool_under_test", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.mark.parametrize(
    ("version", "whole"),
    [("3.10", False), ("3.13", False), ("3.14", True), ("3.14t", False), ("3.15", True)],
)
def test_314_and_315_run_the_whole_suite_with_the_dev_extras(version: str, whole: bool) -> None:
    """3.14 and 3.15 run tests/ in a venv like make's; the others the engine tests only."""
    tool = load_tool()
    interp = tool.Interpreter("/usr/bin/python", "chroot", version=version)
    report = Path("/tmp/report.xml")
    args = tool.pytest_args(interp, report)
    install = tool.install_args(interp)
    assert f"--junitxml={report}" in args
    if whole:
        assert args[-1] == "tests"
        assert "engine" not in args
        assert install == ["-e", ".[dev,demo]"]
    else:
        marker = args.index("-m")
        assert args[marker + 1] == "engine"
        assert "tests/test_engine.py" in args[marker + 2 :]
        assert "tests/test_wsgi.py" not in args  # imports Flask and Django
        assert install[:2] == ["-e", "."]
        assert "pytest>=8" in install


def test_the_chroot_path_comes_from_the_provision_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unless SPANPROF_CHROOT says otherwise, the tool looks where the script builds."""
    monkeypatch.delenv("SPANPROF_CHROOT", raising=False)
    built = subprocess.run(
        ["bash", str(PROVISION), "path"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert built.startswith("/")
    assert load_tool().chroot_dir() == Path(built)
    monkeypatch.setenv("SPANPROF_CHROOT", "/elsewhere")
    assert load_tool().chroot_dir() == Path("/elsewhere")


def bash_array(path: Path, name: str) -> set[str]:
    """The words of a multi-line bash array ``name=(...)``, comments dropped."""
    body = re.search(rf"^{name}=\((.*?)^\)", path.read_text(), re.S | re.M)
    assert body is not None, f"no {name}=(...) in {path}"
    return {w for line in body.group(1).splitlines() for w in line.split("#")[0].split()}


def test_the_chroot_carries_the_system_packages_ci_installs_for_the_tests() -> None:
    """The whole suite runs in the chroot too: what .ci/run installs for tests is there."""
    host = bash_array(ROOT / ".ci" / "run", "APT_PACKAGES")
    chroot = bash_array(PROVISION, "PACKAGES")
    # debootstrap builds the chroot; the chroot's Pythons bring their own pythonX.Y-dev.
    host_only = {"debootstrap", "python3-dev"}
    assert {"prometheus", "chromium", "golang-go"} <= host
    assert host - host_only <= chroot
