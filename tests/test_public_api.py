"""The public surface is exactly spanprof.__all__, sorted, each name documented."""

from __future__ import annotations

import inspect

import spanprof


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted and lists every public attribute of the package (and only those)."""
    public = {
        name
        for name, value in vars(spanprof).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert spanprof.__all__ == sorted(spanprof.__all__)
    assert set(spanprof.__all__) == public


def test_public_objects_have_docstrings() -> None:
    """Every public class and function says what it is for."""
    for name in spanprof.__all__:
        value = getattr(spanprof, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), name


def test_importing_patches_nothing() -> None:
    """Importing spanprof installs no patch: the engine is off until installed explicitly."""
    import subprocess
    import sys

    code = (
        "import asyncio, concurrent.futures; h = asyncio.Handle._run; "
        "s = concurrent.futures.ThreadPoolExecutor.submit; import spanprof; "
        "assert asyncio.Handle._run is h and concurrent.futures.ThreadPoolExecutor.submit is s; "
        "assert spanprof.installed_backend() is None"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
