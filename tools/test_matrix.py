"""Run the label-engine tests on every CPython >= 3.10 on this machine, each in its own venv.

The engine patches asyncio internals that differ between versions (eager tasks from 3.12,
``Task.get_context`` from 3.12, the C ``Handle`` scheduling), so one green interpreter proves
little. Interpreters come from pyenv (``$PYENV_ROOT/versions``) and from ``python3.X`` on PATH.
Under CI (``CI=true``) finding fewer than two interpreters is a failure, not a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_DEPS = [
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "anyio>=4.4",
    "httpx>=0.27",
    "hypercorn>=0.17",
    "hypothesis>=6.100",
    "trio>=0.25",
    "uvloop>=0.19",
    "uvicorn>=0.30",
]


def interpreters() -> dict[str, Path]:
    found: dict[str, Path] = {}
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted((pyenv_root / "versions").glob("3.*/bin/python3")):
        match = re.match(r"3\.(\d+)\.\d+$", candidate.parent.parent.name)
        if match and int(match.group(1)) >= 10:
            found.setdefault(f"3.{match.group(1)}", candidate)
    for minor in range(10, 20):
        exe = shutil.which(f"python3.{minor}")
        if exe and f"3.{minor}" not in found:
            found[f"3.{minor}"] = Path(exe)
    return found


def engine_test_files() -> list[str]:
    """Only the modules that hold engine tests: the others import the whole dev toolchain
    (Flask, Django, PyYAML...), which the matrix venvs deliberately do not carry."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.engine" in path.read_text()
    )


def run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kwargs)  # type: ignore[call-overload]


def main() -> int:
    found = interpreters()
    print("interpreters:", ", ".join(f"{v} ({p})" for v, p in sorted(found.items())))
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if ci and len(found) < 2:
        print("CI needs at least two CPython >= 3.10 for the engine matrix", file=sys.stderr)
        return 1
    failures = []
    for version, exe in sorted(found.items(), key=lambda kv: int(kv[0].split(".")[1])):
        venv = ROOT / f".venv-{version}"
        py = venv / "bin" / "python"
        stamp = venv / ".installed"
        # The editable install also builds the C extensions: redo it when a source changes.
        sources = [
            ROOT / "pyproject.toml",
            ROOT / "middleware" / "spanprof" / "_labels" / "_cproxy.c",
            ROOT / "middleware" / "spanprof" / "_profiling" / "_samplers" / "_alloc.c",
        ]
        newest = max(source.stat().st_mtime for source in sources)
        if not stamp.exists() or stamp.stat().st_mtime < newest:
            run([str(exe), "-m", "venv", "--clear", str(venv)])
            run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "-e",
                    ".",
                    *TEST_DEPS,
                ]
            )
            stamp.touch()
        result = subprocess.run(
            [
                str(py),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "engine",
                "-W",
                "ignore::DeprecationWarning",
                *engine_test_files(),
            ],
            cwd=ROOT,
        )
        print(f"engine tests on CPython {version}: exit {result.returncode}", flush=True)
        if result.returncode != 0:
            failures.append(version)
    if failures:
        print("engine tests failed on:", ", ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
