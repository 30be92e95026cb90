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

import time
from collections.abc import Generator, Mapping

from .._window import MemoryWindow, Window
from ._pprof import ProfileBuilder, SharedLocations, next_slice
from ._window import MAX_PROFILE_SAMPLES, STEP_BUDGET_NS, series_labels

__all__ = ["MEMORY_PERIOD_TYPE", "MEMORY_SAMPLE_TYPES", "MemoryEncoder", "memory_series_labels"]

MEMORY_SAMPLE_TYPES = (
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
)
MEMORY_PERIOD_TYPE = ("space", "bytes")


def memory_series_labels(application_name: str, tags: Mapping[str, str]) -> list[tuple[str, str]]:
    """The memory series' labels: the CPU series' with ``__name__=memory``, ``__delta__=false``."""
    labels = [
        ("__name__", "memory") if name == "__name__" else (name, value)
        for name, value in series_labels(application_name, tags)
    ]
    return [("__delta__", "false"), *labels]


class MemoryEncoder:
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
        self.window = window
        self._locations = None if locations is None else locations.claim()
        self.period = period
        self.budget_ns = budget_ns
        self.max_samples = max_samples
        self.profiles: list[bytes] = []
        if isinstance(window, MemoryWindow):
            self._alloc_objects = window.alloc_objects
            self._inuse = window.inuse
            keys = list(window.values.keys() | window.inuse.keys())
        else:
            self._alloc_objects, self._inuse, keys = {}, {}, []
        self._keys = iter(keys)
        self._builder = self._new_builder()
        self._building: Generator[None, None, bytes] | None = None
        self._exhausted = False

    def _new_builder(self) -> ProfileBuilder:
        return ProfileBuilder(
            MEMORY_SAMPLE_TYPES, MEMORY_PERIOD_TYPE, self.period, locations=self._locations
        )

    @property
    def done(self) -> bool:
        """Whether every sample is in ``profiles``."""
        return self._exhausted and self._building is None

    def step(self) -> bool:
        """Do one slice of work; return ``True`` when the window is fully encoded."""
        if self._building is not None:
            profile = next_slice(self._building)
            if profile is not None:
                self.profiles.append(profile)
                self._building = None
                self._builder = self._new_builder()
            return self.done
        window = self.window
        builder = self._builder
        alloc_space = window.values
        alloc_objects = self._alloc_objects
        inuse = self._inuse
        deadline = time.perf_counter_ns() + self.budget_ns
        for key in self._keys:
            inuse_objects, inuse_space = inuse.get(key, (0, 0))
            values = (
                alloc_objects.get(key, 0),
                alloc_space.get(key, 0),
                inuse_objects,
                inuse_space,
            )
            if any(values):
                builder.add(window.stack(key[0]), values, key[1].items_tuple)
            if len(builder) >= self.max_samples:
                self._build()
                return False
            if time.perf_counter_ns() > deadline:
                return False
        self._exhausted = True
        if len(builder):
            self._build()
        return self.done

    def _build(self) -> None:
        window = self.window
        self._building = self._builder.build_in_slices(
            time_nanos=window.start_ns,
            duration_nanos=max(0, window.end_ns - window.start_ns),
            budget_ns=self.budget_ns,
            release=True,
        )
