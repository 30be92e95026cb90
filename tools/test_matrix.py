"""Run the label-engine tests on every CPython >= 3.10 on this machine, and the whole suite on
3.14 and 3.15, each interpreter in its own venv.

The engine patches asyncio internals that differ between versions (eager tasks from 3.12,
``Task.get_context`` from 3.12, the C ``Handle`` scheduling), so one green interpreter proves
little. On 3.14 and 3.15 more than the engine moved (the context watcher, the current task in
per-thread state, no pyroscope-io build on 3.15) and no other run covers them, so they run
every test, in a venv with the same extras as ``make``'s (``.[dev,demo]``). Interpreters come
from pyenv (``$PYENV_ROOT/versions``), from ``python3.X`` and ``python3.Xt`` on PATH, and from
the Debian unstable chroot that ``tools/provision_pythons.sh`` builds (``$SPANPROF_CHROOT``,
default: ``tools/provision_pythons.sh path``; running in it needs root), which carries the
system components the suite uses too (prometheus, chromium, go...). Free-threaded builds
(``3.14t``) are run too, engine tests only, in venvs of their own.

Each interpreter is asked its version rather than trusted by name. A venv that fails to
install fails that version only; the others still run. Under CI (``CI=true``) a missing
required version (3.14, 3.15) or fewer than two interpreters is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROVISION = ROOT / "tools" / "provision_pythons.sh"
CHROOT_MARKER = ".spanprof-chroot"
REPORTS = ROOT / "test-artifacts" / "matrix"
# Versions CI must run: the ones this machine's Debian lacks come from the chroot.
REQUIRED = ("3.14", "3.15")
# Versions that run the whole suite (tests/), not only the engine tests.
WHOLE_SUITE = ("3.14", "3.15")
# The whole suite imports the dev toolchain (Flask, Django, gunicorn, uwsgi, playwright...):
# those venvs get what ``make``'s venv gets.
WHOLE_SUITE_INSTALL = ["-e", ".[dev,demo]"]
TEST_DEPS = [
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "anyio>=4.4",
    # test_e2e_exact serves its app through gunicorn's uvicorn worker too.
    "gunicorn>=21.2",
    "httpx>=0.27",
    "hypercorn>=0.17",
    "hypothesis>=6.100",
    # The OTLP receivers in the tests decode with opentelemetry-proto's own classes.
    "opentelemetry-proto>=1.30,<2",
    "trio>=0.25",
    "uvloop>=0.19",
    "uvicorn>=0.30",
]
PROBE = (
    "import sys, sysconfig; "
    "print(*sys.version_info[:3], int(bool(sysconfig.get_config_var('Py_GIL_DISABLED'))))"
)


@dataclass(frozen=True)
class Interpreter:
    """One CPython: how to start it (``prefix`` + ``exe``) and where it came from."""

    exe: str
    source: str  # "pyenv", "PATH" or "chroot"
    prefix: tuple[str, ...] = ()  # runs the command elsewhere (the chroot), or nothing
    version: str = ""  # "3.14" or "3.14t", filled in by probing
    full_version: str = ""

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1].rstrip("t"))

    @property
    def venv(self) -> Path:
        where = "chroot-" if self.source == "chroot" else ""
        return ROOT / f".venv-{where}{self.version}"

    @property
    def whole_suite(self) -> bool:
        """Whether this interpreter runs every test, not only the engine tests."""
        return self.version in WHOLE_SUITE

    @property
    def scope(self) -> str:
        return "whole suite" if self.whole_suite else "engine"

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, *args]


@dataclass
class Result:
    version: str
    status: str  # "passed", "failed", "install failed", "missing"
    detail: str = ""
    scope: str = ""  # "engine" or "whole suite"
    counts: dict[str, int] = field(default_factory=dict)
    failed_tests: list[str] = field(default_factory=list)
    skipped_tests: list[str] = field(default_factory=list)
    seconds: float = 0.0


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@functools.cache
def chroot_dir() -> Path:
    """``$SPANPROF_CHROOT``, else where ``tools/provision_pythons.sh`` builds the chroot."""
    configured = os.environ.get("SPANPROF_CHROOT")
    if configured:
        return Path(configured)
    # The script owns the default (it carries the recipe's version): ask it.
    proc = subprocess.run(
        ["bash", str(PROVISION), "path"], capture_output=True, text=True, timeout=60, check=True
    )
    return Path(proc.stdout.strip())


def candidates(notes: list[str]) -> list[Interpreter]:
    """Every interpreter that might be a CPython >= 3.10, before asking it its version."""
    found: list[Interpreter] = []
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for exe in sorted((pyenv_root / "versions").glob("3.*/bin/python3")):
        if re.match(r"3\.\d+\.\d+t?$", exe.parent.parent.name):
            found.append(Interpreter(str(exe), "pyenv"))
    for minor in range(10, 20):
        for name in (f"python3.{minor}", f"python3.{minor}t"):
            on_path = shutil.which(name)
            if on_path:
                found.append(Interpreter(on_path, "PATH"))
    chroot = chroot_dir()
    if (chroot / CHROOT_MARKER).exists():
        if os.geteuid() != 0:
            notes.append(f"chroot {chroot}: its interpreters need root to run")
        else:
            in_chroot = (str(PROVISION), "run")
            for exe in sorted((chroot / "usr" / "bin").glob("python3.*")):
                if re.fullmatch(r"python3\.\d+t?", exe.name):
                    found.append(Interpreter(f"/usr/bin/{exe.name}", "chroot", in_chroot))
    else:
        notes.append(f"no chroot at {chroot} (tools/provision_pythons.sh builds it)")
    return found


def probe(interp: Interpreter) -> Interpreter | None:
    """``interp`` with its version filled in, or ``None`` if it does not run or is too old."""
    try:
        proc = subprocess.run(
            interp.command(interp.exe, "-c", PROBE),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"skipping {interp.exe}: {exc}", file=sys.stderr)
        return None
    fields = proc.stdout.split()
    if proc.returncode != 0 or len(fields) != 4 or not all(f.isdigit() for f in fields):
        print(f"skipping {interp.exe} ({interp.source}): {proc.stderr.strip()}", file=sys.stderr)
        return None
    major, minor, micro, gil_disabled = (int(f) for f in fields)
    if (major, minor) < (3, 10):
        return None
    suffix = "t" if gil_disabled else ""
    return Interpreter(
        interp.exe,
        interp.source,
        interp.prefix,
        version=f"{major}.{minor}{suffix}",
        full_version=f"{major}.{minor}.{micro}{suffix}",
    )


def interpreters(notes: list[str]) -> dict[str, Interpreter]:
    """One interpreter per version (``3.14`` and ``3.14t`` are two): the host's first."""
    found: dict[str, Interpreter] = {}
    for candidate in candidates(notes):
        interp = probe(candidate)
        if interp is not None:
            found.setdefault(interp.version, interp)
    return dict(sorted(found.items(), key=lambda kv: (kv[1].minor, kv[0])))


def engine_test_files() -> list[str]:
    """Only the modules that hold engine tests: the others import the whole dev toolchain
    (Flask, Django, PyYAML...), which the matrix venvs deliberately do not carry."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.engine" in path.read_text()
    )


def install_args(interp: Interpreter) -> list[str]:
    """What ``pip install`` gets in ``interp``'s venv."""
    if interp.whole_suite:
        return list(WHOLE_SUITE_INSTALL)
    return ["-e", ".", *TEST_DEPS]


def pytest_args(interp: Interpreter, report: Path) -> list[str]:
    """The pytest command line (after ``python -m pytest``) for ``interp``."""
    args = [
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        # Third-party packages warn about deprecations on new CPythons; spanprof's own
        # warnings still fail (pyproject's filterwarnings = error).
        "-W",
        "ignore::DeprecationWarning",
        f"--junitxml={report}",
    ]
    if interp.whole_suite:
        return [*args, "tests"]
    return [*args, "-m", "engine", *engine_test_files()]


def run(cmd: Sequence[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def install(interp: Interpreter) -> None:
    """(Re)build ``interp``'s venv when its inputs changed; raises ``CalledProcessError``."""
    py = str(interp.venv / "bin" / "python")
    stamp = interp.venv / ".installed"
    # The editable install also builds spanprof's C extension: redo it when a C source
    # changes, when what is installed changes (the stamp holds it), and for a chroot venv when
    # the chroot was rebuilt.
    sources = [ROOT / "pyproject.toml", *sorted((ROOT / "middleware").rglob("*.c"))]
    if interp.source == "chroot":
        sources.append(chroot_dir() / CHROOT_MARKER)
    newest = max(source.stat().st_mtime for source in sources)
    packages = install_args(interp)
    wanted = "\n".join(packages) + "\n"
    if stamp.exists() and stamp.stat().st_mtime >= newest and stamp.read_text() == wanted:
        return
    stamp.unlink(missing_ok=True)
    run(interp.command(interp.exe, "-m", "venv", "--clear", str(interp.venv)))
    run(
        interp.command(
            py,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *packages,
        )
    )
    stamp.write_text(wanted)


def read_report(path: Path, result: Result) -> None:
    """Counts and the ids of failed and skipped tests, from pytest's JUnit XML."""
    counts = dict.fromkeys(("passed", "failed", "skipped"), 0)
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        result.counts = counts
        return
    for case in tree.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            result.failed_tests.append(test_id)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skipped = case.find("skipped")
            reason = "" if skipped is None else skipped.get("message", "")
            result.skipped_tests.append(f"{test_id}: {reason}")
        else:
            counts["passed"] += 1
    result.counts = counts


def run_tests(interp: Interpreter) -> Result:
    """Install ``interp``'s venv and run its tests (the engine's, or all of them)."""
    started = time.monotonic()
    result = Result(
        interp.version, "passed", f"{interp.full_version}, {interp.source}", scope=interp.scope
    )
    try:
        install(interp)
    except subprocess.CalledProcessError as exc:
        result.status = "install failed"
        result.detail += f"; exit {exc.returncode} from: {' '.join(exc.cmd)}"
        result.seconds = time.monotonic() - started
        return result
    REPORTS.mkdir(parents=True, exist_ok=True)
    kind = "suite" if interp.whole_suite else "engine"
    report = REPORTS / f"{kind}-{interp.venv.name.removeprefix('.venv-')}.xml"
    report.unlink(missing_ok=True)
    cmd = interp.command(
        str(interp.venv / "bin" / "python"), "-m", "pytest", *pytest_args(interp, report)
    )
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, check=False)
    read_report(report, result)
    if proc.returncode != 0:
        result.status = "failed"
        result.detail += f"; pytest exit {proc.returncode}"
    result.seconds = time.monotonic() - started
    print(f"{interp.scope} on CPython {interp.version}: exit {proc.returncode}", flush=True)
    return result


def summary(results: list[Result]) -> str:
    lines = ["test matrix:"]
    for r in results:
        counts = ", ".join(f"{n} {k}" for k, n in r.counts.items()) if r.counts else ""
        line = (
            f"  {r.version:<6} {r.scope:<12} {r.status:<15} {counts:<36} {r.seconds:6.1f} s"
            f"  {r.detail}"
        )
        lines.append(line.rstrip())
        lines.extend(f"      FAILED  {t}" for t in r.failed_tests)
        lines.extend(f"      SKIPPED {t}" for t in r.skipped_tests)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="run only these, e.g. 3.14 3.15t")
    args = parser.parse_args(argv)
    ci = in_ci()
    notes: list[str] = []
    found = interpreters(notes)
    if args.versions:
        found = {v: i for v, i in found.items() if v in args.versions}
    for note in notes:
        print("note:", note)
    print("interpreters:", ", ".join(f"{v} ({i.source}: {i.exe})" for v, i in found.items()))
    free_threaded = [v for v in found if v.endswith("t")]
    print("free-threaded:", ", ".join(free_threaded) if free_threaded else "none found")
    results = [run_tests(interp) for interp in found.values()]
    for version in args.versions or REQUIRED:
        if version not in found:
            why = "required under CI" if ci else "not required outside CI"
            scope = "whole suite" if version in WHOLE_SUITE else "engine"
            results.append(Result(version, "missing", f"not on this machine ({why})", scope=scope))
    print(summary(results), flush=True)
    failed = [r.version for r in results if r.status not in ("passed", "missing")]
    if ci:
        failed += [r.version for r in results if r.status == "missing"]
        if len(found) < 2:
            print("CI needs at least two CPython >= 3.10 for the test matrix", file=sys.stderr)
            return 1
    if failed:
        print("tests failed on:", ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
