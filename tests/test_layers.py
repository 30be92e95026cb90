"""The package's layers, checked from its imports: nothing reaches up a floor or behind a door.

spanprof reads top to bottom along the data path (request -> span -> labels -> sampler ->
exporter; response -> duration -> exemplar). Each module sits on a floor, and may import only
from its own floor or lower ones. Nothing inside the package imports the package face
(``spanprof/__init__.py``), and no module reads another module's private names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "middleware" / "spanprof"

# Floors of the package, lowest first. A module's floor is its longest matching prefix.
FLOORS: dict[str, int] = {
    "_types": 0,
    "_config": 0,
    "_env": 0,
    "_logging": 0,
    "_process": 0,
    "_version": 0,
    "_labels": 1,
    "_profiling": 2,
    "_signals": 2,
    "_web": 3,
    "_local": 4,
    "__init__": 5,
    "__main__": 5,
    "engine": 5,
    "testing": 5,
}

# Inside profiling the data moves samplers -> the SLO hold -> encoders -> exporters -> backends
# -> the chooser.
PROFILING_FLOORS: dict[str, int] = {
    "_window": 0,
    "_samplers": 1,
    "_settings": 1,
    "_hold": 2,
    "_verdicts": 2,
    "_encoders": 2,
    "_exporters": 3,
    "_pyroscope": 4,
    "_exact": 5,
    "_runtime": 5,
    "_choose": 6,
}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"spanprof.{self.module}:{self.line}: {self.why}"


def _floor(module: str) -> tuple[str, int, int]:
    """(room, floor, floor inside the room) of a module path like ``_web._asgi``."""
    parts = module.split(".")
    room = parts[0]
    inner = PROFILING_FLOORS.get(parts[1], 0) if room == "_profiling" and len(parts) > 1 else 0
    return room, FLOORS[room], inner


def _is_module(module: str) -> bool:
    path = PACKAGE.joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").exists() or path.with_suffix(".pyi").exists()


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def check_module(module: str, source: str, *, is_package: bool = False) -> Iterator[Violation]:
    """Every layering rule ``source`` (the text of ``spanprof.<module>``) breaks."""
    tree = ast.parse(source)
    here_room, here_floor, here_inner = _floor(module)
    modules_bound: set[str] = set()
    for node in ast.walk(tree):
        targets: list[tuple[str, list[str]]] = []
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module is None or not (
                    node.module == "spanprof" or node.module.startswith("spanprof.")
                ):
                    continue
                absolute = node.module.removeprefix("spanprof").lstrip(".")
            else:
                absolute = _resolve(module, is_package, node.level, node.module)
            names = [alias.name for alias in node.names]
            if absolute == "":
                submodules = [name for name in names if _is_module(name)]
                for name in set(names) - set(submodules):
                    yield Violation(module, node.lineno, f"imports {name} from the package face")
                targets = [(name, []) for name in submodules]
                modules_bound.update(
                    alias.asname or alias.name for alias in node.names if alias.name in submodules
                )
            else:
                plain: list[str] = []
                for alias in node.names:
                    if _is_module(f"{absolute}.{alias.name}"):
                        targets.append((f"{absolute}.{alias.name}", []))
                        modules_bound.add(alias.asname or alias.name)
                    else:
                        plain.append(alias.name)
                if plain:
                    targets.append((absolute, plain))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("spanprof."):
                    targets.append((alias.name.removeprefix("spanprof."), []))
        for target, names in targets:
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    yield Violation(module, line, f"reads private {name} of {target}")
            if not target or target.split(".")[0] not in FLOORS:
                continue
            room, floor, inner = _floor(target)
            if floor > here_floor:
                yield Violation(module, line, f"imports {target} from a higher floor")
            elif floor == here_floor and room != here_room and here_floor < 5:
                yield Violation(module, line, f"imports {target} across the floor")
            elif room == here_room == "_profiling" and inner > here_inner:
                yield Violation(module, line, f"imports {target} from a later stage")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield Violation(module, node.lineno, f"reads private {node.value.id}.{node.attr}")


def package_modules() -> Iterator[tuple[str, Path, bool]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1] or ("__init__",)
        yield ".".join(parts), path, is_package


def test_no_import_breaks_the_layers() -> None:
    """No module imports a higher floor, the package face, or another module's private names."""
    violations = [
        str(violation)
        for module, path, is_package in package_modules()
        for violation in check_module(module, path.read_text(), is_package=is_package)
    ]
    assert violations == []


def test_every_module_sits_on_a_floor() -> None:
    """A new top-level room must be given a floor here, or the check above would skip it."""
    rooms = {module.split(".")[0] for module, _, _ in package_modules()}
    assert rooms <= set(FLOORS), rooms - set(FLOORS)
    profiling = {
        module.split(".")[1]
        for module, _, _ in package_modules()
        if module.startswith("_profiling.")
    }
    assert profiling <= set(PROFILING_FLOORS), profiling - set(PROFILING_FLOORS)


@pytest.mark.parametrize(
    ("module", "source", "why"),
    [
        ("_signals._duration", "from .. import __version__\n", "from the package face"),
        ("_labels._engine", "from .._web._asgi import ProfilingMiddleware\n", "higher floor"),
        ("_signals._slo", "from .._profiling._exact import ExactBackend\n", "across the floor"),
        ("_labels._greenlets", "from . import _engine\n_engine._tls\n", "private _engine._tls"),
        ("_web._asgi", "from .._labels._engine import _tls\n", "private _tls"),
        ("_profiling._samplers._signal", "from .._exporters._pusher import Pusher\n", "later"),
        ("_labels._scope", "from spanprof._web import _wsgi\n", "higher floor"),
    ],
)
def test_the_check_catches_each_kind_of_break(module: str, source: str, why: str) -> None:
    """Each rule fires on a module that breaks it (so the test above can fail)."""
    found = [str(violation) for violation in check_module(module, source)]
    assert any(why in line for line in found), found


def test_the_face_may_import_every_floor() -> None:
    """The package face and the public modules sit above everything they re-export."""
    assert list(check_module("testing", "from ._labels._recorder import RecorderBackend\n")) == []
