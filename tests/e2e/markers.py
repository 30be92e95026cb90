"""CPU burners with one function name per request, so a sample's stack says whose it is."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["MARKERS", "background_burn", "marker_index"]

MARKER_PREFIX = "burn_request_"

_SOURCE = """
def {name}(seconds):
    end = time.thread_time() + seconds
    spins = 0
    while time.thread_time() < end:
        spins += 1
    return spins
"""


def _make(name: str) -> Callable[[float], int]:
    namespace: dict[str, object] = {"time": time}
    exec(_SOURCE.format(name=name), namespace)
    function = namespace[name]
    assert callable(function)
    return function


MARKERS: list[Callable[[float], int]] = [_make(f"{MARKER_PREFIX}{i:02d}") for i in range(64)]


def background_burn(seconds: float) -> int:
    """CPU burnt by an unlabelled background task."""
    end = time.thread_time() + seconds
    spins = 0
    while time.thread_time() < end:
        spins += 1
    return spins


def marker_index(function_names: list[str] | tuple[str, ...]) -> int | None:
    """The request marker in a stack, if any."""
    for name in function_names:
        if name.startswith(MARKER_PREFIX):
            return int(name[len(MARKER_PREFIX) :])
    return None
