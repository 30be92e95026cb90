"""What every benchmark hands back, the statistics it uses, and the Markdown they become."""

from __future__ import annotations

import os
import platform
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata

__all__ = [
    "Section",
    "Spread",
    "Verdict",
    "machine_info",
    "markdown_table",
    "paired_ratios",
    "render",
]

# Packages that shape the numbers besides spanprof's own runtime dependencies.
_BENCH_PACKAGES = ("pyroscope-otel", "uvloop", "uvicorn", "anyio", "httpx")


@dataclass(frozen=True)
class Spread:
    """Median and spread of repeated measurements of one quantity."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Summarise ``values`` (at least one)."""
        if not values:
            raise ValueError("Spread.of: no values")
        ordered = sorted(values)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(
            median=statistics.median(ordered),
            q1=q1,
            q3=q3,
            low=ordered[0],
            high=ordered[-1],
            count=len(ordered),
        )

    def format(self, digits: int = 1) -> str:
        """``median (IQR q1..q3; min..max)`` with ``digits`` decimals."""
        f = f"{{:.{digits}f}}"
        return (
            f"{f.format(self.median)} (IQR {f.format(self.q1)}..{f.format(self.q3)}; "
            f"{f.format(self.low)}..{f.format(self.high)})"
        )


def paired_ratios(values: Sequence[float], baseline: Sequence[float]) -> Spread:
    """Round-by-round ratios of ``values`` to ``baseline``, summarised.

    Variants run interleaved, so round ``i`` of both saw the same machine load: pairing them
    cancels slow drift that would bias a ratio of two medians.
    """
    if len(values) != len(baseline):
        raise ValueError("paired_ratios: the series have different lengths")
    return Spread.of([v / b for v, b in zip(values, baseline, strict=True)])


@dataclass(frozen=True)
class Verdict:
    """One budget, judged: ``PASS``/``FAIL`` and the numbers behind it."""

    budget: str
    passed: bool
    detail: str

    def line(self) -> str:
        """The Markdown bullet for the report."""
        return f"- **{'PASS' if self.passed else 'FAIL'}** {self.budget}: {self.detail}"


@dataclass
class Section:
    """One benchmark's results: Markdown body (prose and tables) and its verdicts."""

    name: str
    title: str
    body: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    seconds: float = 0.0


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _dependency_names() -> list[str]:
    names: list[str] = []
    try:
        requirements = metadata.requires("spanprof") or []
    except metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        if "extra ==" in requirement:
            continue
        match = re.match(r"[A-Za-z0-9._-]+", requirement)
        if match:
            names.append(match.group(0))
    names.extend(_BENCH_PACKAGES)
    return names


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> list[tuple[str, str]]:
    """What the numbers were measured on: CPU, cores, OS, Python and package versions."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    packages = ", ".join(f"{name} {_version(name)}" for name in _dependency_names())
    return [
        ("CPU", _cpu_model()),
        ("cores", f"{os.cpu_count()} ({usable} usable by this process)"),
        ("OS", platform.platform()),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("spanprof", _version("spanprof")),
        ("packages", packages),
        ("load average at start (1, 5, 15 min)", load),
    ]


def render(
    sections: Sequence[Section],
    *,
    command: str,
    machine: Sequence[tuple[str, str]],
    total_seconds: float,
    quick: bool,
) -> str:
    """The whole ``docs/benchmarks.md``."""
    out = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/run.py`; do not edit by hand. Every ratio compares "
        "measurements taken **in the same run, interleaved round by round** (so load drift "
        "hits all variants alike); speed is measured only here, never in timed tests.",
        "",
        "> These numbers were produced on a shared, possibly busy machine. Regenerate the "
        "final numbers with `make bench` on a quiet machine before quoting them.",
        "",
        "## Run",
        "",
        "```sh",
        command,
        "```",
        "",
    ]
    if quick:
        out += ["`--quick`: fewer rounds and cases; for smoke runs, not for quoting.", ""]
    out += [f"Wall time: {total_seconds:.0f} s.", ""]
    out += [markdown_table(["machine", ""], [(key, value) for key, value in machine]), ""]
    verdicts = [v for section in sections for v in section.verdicts]
    if verdicts:
        out += ["## Verdicts", ""]
        out += [v.line() for v in verdicts]
        out.append("")
    for section in sections:
        out += [f"## {section.title}", ""]
        for block in section.body:
            out += [block, ""]
        if section.verdicts:
            out += [v.line() for v in section.verdicts]
            out.append("")
        out += [f"_Section wall time: {section.seconds:.0f} s._", ""]
    return "\n".join(out).rstrip() + "\n"
