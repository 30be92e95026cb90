"""Turns a ``MemoryWindow`` into Pyroscope ``memory`` profiles, in slices like the CPU windows.

Pyroscope's memory profile type, as pyroscope-io 1.4 pushes it: a series of its own
(``__name__=memory``), four sample types ``alloc_objects/count``, ``alloc_space/bytes``,
``inuse_objects/count``, ``inuse_space/bytes``, period type ``space/bytes`` with the mean sample
size as period. Allocation values are per upload window and in-use values a snapshot at upload,
so the series says ``__delta__="false"``: the server must not subtract consecutive uploads. Every
sample carries its labels (``span_id``, ``trace_id``, ``span_name`` and the user's), which
pyroscope-io's memory samples lack.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .._window import MemoryWindow, Window
from ._pprof import ProfileBuilder, SharedLocations
from ._window import (
    MAX_PROFILE_SAMPLES,
    STEP_BUDGET_NS,
    EncoderEntry,
    SlicedEncoder,
    series_labels,
)

__all__ = ["MEMORY_PERIOD_TYPE", "MEMORY_SAMPLE_TYPES", "MemoryEncoder", "memory_series_labels"]

MEMORY_SAMPLE_TYPES = (
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
)
MEMORY_PERIOD_TYPE = ("space", "bytes")
_NOTHING_IN_USE = (0, 0)


def memory_series_labels(application_name: str, tags: Mapping[str, str]) -> list[tuple[str, str]]:
    """The memory series' labels: the CPU series' with ``__name__=memory``, ``__delta__=false``."""
    labels = [
        ("__name__", "memory") if name == "__name__" else (name, value)
        for name, value in series_labels(application_name, tags)
    ]
    return [("__delta__", "false"), *labels]


class MemoryEncoder(SlicedEncoder):
    """Turns a ``MemoryWindow`` into raw pprof profiles, one bounded slice of work per ``step()``.

    Arguments:
        window: the allocations and in-use snapshot to encode (a plain ``Window`` has neither
            and encodes to nothing).
        period: the mean sample size in bytes, written as each profile's period.
        budget_ns: the time after which a slice of ``ProfileBuilder.add`` calls stops.
        max_samples: distinct samples per profile.
        locations: location ids shared with the exporter's other windows (see
            ``SharedLocations``), used when the calling thread can claim them.
    """

    def __init__(
        self,
        window: Window,
        *,
        period: int,
        budget_ns: int = STEP_BUDGET_NS,
        max_samples: int = MAX_PROFILE_SAMPLES,
        locations: SharedLocations | None = None,
    ) -> None:
        self.period = period
        super().__init__(window, budget_ns=budget_ns, max_samples=max_samples, locations=locations)

    def _entries(self) -> Iterator[EncoderEntry]:
        window = self.window
        if not isinstance(window, MemoryWindow):
            return
        alloc_space = window.values
        alloc_objects = window.alloc_objects
        inuse = window.inuse
        stack = window.stack
        # Each key is looked up as few times as it can be: a key's hash calls the label set's
        # __hash__, a Python method (a span-labelled sample's key is met once per window).
        # Over copies, as before: this generator runs in slices between other threads' work.
        for key, space in list(alloc_space.items()):
            inuse_objects, inuse_space = (
                inuse.get(key, _NOTHING_IN_USE) if inuse else _NOTHING_IN_USE
            )
            values = (alloc_objects.get(key, 0), space, inuse_objects, inuse_space)
            if any(values):
                yield stack(key[0]), values, key[1].items_tuple
        for key, (inuse_objects, inuse_space) in list(inuse.items()):
            if key not in alloc_space and (inuse_objects or inuse_space):
                yield stack(key[0]), (0, 0, inuse_objects, inuse_space), key[1].items_tuple

    def _new_builder(self) -> ProfileBuilder:
        return ProfileBuilder(
            MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, self.period, locations=self._locations
        )
