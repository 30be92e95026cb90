"""Run the route-naming tests against the oldest and newest Starlette/FastAPI spanprof allows.

spanprof matches requests against the framework's own route objects (and, for FastAPI >= 0.137,
its included-router internals), which change between releases, so the dev venv's one version
proves little. Each axis gets its own virtualenv (``.venv-routes-<axis>``, reused while
``pyproject.toml`` is unchanged) with spanprof installed editable, so pip also checks the
pins against ``pyproject.toml``.

- ``oldest``: ``starlette==0.40.*`` (the floor in ``pyproject.toml``) and the oldest FastAPI
  that accepts it (0.115.2: the ``fastapi>=0.110`` floor of the dev extras pins
  ``starlette<0.37``, so it cannot be installed next to ``starlette>=0.40``); Flask and
  werkzeug 2.3 (the WSGI extra's floor), whose URL matcher spanprof's shadow map must follow;
- ``included``: FastAPI 0.137.0, the first that keeps ``include_router()`` as one route;
- ``newest``: the newest releases of all of them.

Django (whose URL resolver spanprof walks) is installed on every axis.

Usage: ``python tools/route_matrix.py [axis ...]`` (default: every axis).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ["tests/test_routes_real_apps.py"]
TEST_DEPS = [
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "httpx>=0.27",
    "django>=4.2",
    "asgiref>=3.7",
]
# Flask's oldest (2.3, pyproject's floor for the WSGI extra) matches with werkzeug's state
# machine of that release, which spanprof's shadow URL map must agree with.
AXES: dict[str, list[str]] = {
    "oldest": ["starlette==0.40.*", "fastapi==0.115.2", "flask==2.3.*", "werkzeug==2.3.*"],
    "included": ["fastapi==0.137.0", "flask>=3.0"],
    "newest": ["starlette", "fastapi", "flask", "werkzeug", "--upgrade"],
}


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def prepare(axis: str) -> Path:
    """The axis's virtualenv, built or rebuilt when ``pyproject.toml`` is newer than it or the
    axis installs something else (the stamp holds what it installed)."""
    venv = ROOT / f".venv-routes-{axis}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = " ".join([*TEST_DEPS, *AXES[axis]])
    if (
        stamp.exists()
        and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime
        and stamp.read_text() == wanted
    ):
        return python
    run([sys.executable, "-m", "venv", "--clear", str(venv)])
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, "-e", ".", *TEST_DEPS, *AXES[axis]])
    stamp.write_text(wanted)
    return python


def versions(python: Path) -> str:
    names = ("starlette", "fastapi", "flask", "werkzeug", "django")
    script = (
        "import importlib.metadata as m;"
        f"print(', '.join(f'{{p}} {{m.version(p)}}' for p in {names!r}))"
    )
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    return result.stdout.strip()


def main(argv: list[str]) -> int:
    axes = argv or list(AXES)
    unknown = [axis for axis in axes if axis not in AXES]
    if unknown:
        print(f"unknown axis {unknown}; choose from {sorted(AXES)}", file=sys.stderr)
        return 2
    failures = []
    for axis in axes:
        started = time.perf_counter()
        python = prepare(axis)
        built = time.perf_counter()
        result = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_FILES], cwd=ROOT
        )
        done = time.perf_counter()
        print(
            f"routes on {axis} ({versions(python)}): exit {result.returncode}; "
            f"venv {built - started:.0f} s, tests {done - built:.0f} s",
            flush=True,
        )
        if result.returncode != 0:
            failures.append(axis)
    if failures:
        print("route tests failed on:", ", ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
