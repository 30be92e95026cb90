"""Run the benchmarks and write ``docs/benchmarks.md``.

```sh
python -m benchmarks.run [--quick] [--only NAME ...] [--write PATH] [--strict]
```

Without ``--write`` the Markdown goes to stdout; progress goes to stderr. With ``--strict``
it exits 1 when a budget fails (after writing the report).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import (
    bench_accuracy,
    bench_breakdown,
    bench_engine,
    bench_exact,
    bench_exemplar,
    bench_faults,
    bench_hold,
    bench_instructions,
    bench_mechanisms,
    bench_memory,
    bench_otlp,
    bench_pairs,
    bench_request,
    bench_servers,
)
from ._report import Section, machine_info, render

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS: dict[str, Callable[[bool], Section]] = {
    "request": bench_request.run,
    "engine": bench_engine.run,
    "mechanisms": bench_mechanisms.run,
    "exemplar": bench_exemplar.run,
    "faults": bench_faults.run,
    "exact": bench_exact.run,
    "pairs": bench_pairs.run,
    "breakdown": bench_breakdown.run,
    "hold": bench_hold.run,
    "otlp": bench_otlp.run,
    "memory": bench_memory.run,
    "accuracy": bench_accuracy.run,
    "servers": bench_servers.run,
    "instructions": bench_instructions.run,
}


def _command(argv: list[str]) -> str:
    executable = Path(sys.executable)
    try:
        shown = str(executable.relative_to(Path.cwd()))
    except ValueError:
        shown = "python" if executable.parent == Path(sys.prefix) / "bin" else str(executable)
    return shlex.join([shown, "-m", "benchmarks.run", *argv])


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks; write or print the report."""
    args_list = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME", help="run only these"
    )
    parser.add_argument("--write", type=Path, metavar="PATH", help="write the Markdown here")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a budget fails")
    args = parser.parse_args(args_list)
    names = args.only or list(BENCHMARKS)
    machine = machine_info()
    started = time.perf_counter()
    sections = []
    for name in names:
        print(f"benchmark {name}...", file=sys.stderr, flush=True)
        section_started = time.perf_counter()
        section = BENCHMARKS[name](args.quick)
        section.seconds = time.perf_counter() - section_started
        sections.append(section)
        for verdict in section.verdicts:
            print("  " + verdict.line(), file=sys.stderr, flush=True)
        print(f"  ({section.seconds:.0f} s)", file=sys.stderr, flush=True)
    report = render(
        sections,
        command=_command(args_list),
        machine=machine,
        total_seconds=time.perf_counter() - started,
        quick=args.quick,
    )
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(report, encoding="utf-8")
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(report)
    failed = [v for s in sections for v in s.verdicts if not v.passed]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
