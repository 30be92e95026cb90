"""Turns a sampler's ``Window`` into pprof profiles, in slices short enough to share the GIL.

Samples are added to a ``ProfileBuilder`` a few at a time, and the profile is written a slice
at a time too (``build_in_slices``): a window is one profile (up to ``MAX_PROFILE_SAMPLES``
distinct samples), whose locations, functions and strings are written once, and no slice holds
the GIL for long. ``series_labels`` are the push's series labels, exactly as pyroscope-io sends
them.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Generator, Iterator, Mapping, Sequence

from ..._version import __version__
from .._window import Frame, Window
from ._pprof import ProfileBuilder, SharedLocations, next_slice

__all__ = [
    "CPU_TIME",
    "MAX_PROFILE_SAMPLES",
    "PROFILE_NAMES",
    "STEP_BUDGET_NS",
    "WALL_TIME",
    "EncoderEntry",
    "SlicedEncoder",
    "WindowEncoder",
    "series_labels",
]

# Each slice of encoding work stops after this much time.
STEP_BUDGET_NS = 500_000
#: Distinct samples per profile; a bigger window becomes several (Pyroscope refuses profiles of
#: more than 16,000 by default).
MAX_PROFILE_SAMPLES = 4096

#: What a CPU-clock sample's value counts: the CPU its thread used, in nanoseconds.
CPU_TIME = ("cpu", "nanoseconds")
#: What a wall-clock sample's value counts: wall time, waiting included.
WALL_TIME = ("wall", "nanoseconds")
#: The profile (the series' ``__name__``) each kind of time is stored as in Pyroscope:
#: ``process_cpu:cpu:nanoseconds:cpu:nanoseconds`` as pyroscope-io sends, and
#: ``wall:wall:nanoseconds:wall:nanoseconds`` as Pyroscope's Java and Node.js agents send.
PROFILE_NAMES = {CPU_TIME: "process_cpu", WALL_TIME: "wall"}


def series_labels(
    application_name: str, tags: Mapping[str, str], *, name: str = PROFILE_NAMES[CPU_TIME]
) -> list[tuple[str, str]]:
    """The series labels pyroscope-io sends, with spanprof as the instrumentation scope.

    ``name`` is the profile's (``__name__``): see ``PROFILE_NAMES``.
    """
    fixed = [("__name__", name), ("service_name", application_name)]
    labels = sorted([*fixed, *tags.items()])
    labels += [
        ("otel.scope.name", "spanprof"),
        ("otel.scope.version", __version__),
        ("process.runtime.name", sys.implementation.name),
        ("process.runtime.version", platform.python_version()),
    ]
    return labels


#: What a ``SlicedEncoder`` adds: ``(stack, values, labels)``.
EncoderEntry = tuple[Sequence[Frame], int | tuple[int, ...], Sequence[tuple[str, str]]]


class SlicedEncoder:
    """A window into raw pprof profiles, one bounded slice of work per ``step()``.

    ``ProfileBuilder.add`` is called for each of ``_entries()`` (``(stack, values, labels)``)
    until ``budget_ns`` has passed or a profile holds ``max_samples``; a full profile is then
    written in slices (``build_in_slices``) before the next is begun. Subclasses say what a
    window's entries are and make the builder (``_new_builder``).
    """

    def __init__(
        self,
        window: Window,
        *,
        budget_ns: int,
        max_samples: int,
        locations: SharedLocations | None,
    ) -> None:
        self.window = window
        self.budget_ns = budget_ns
        self.max_samples = max_samples
        self.profiles: list[bytes] = []
        self._locations = None if locations is None else locations.claim()
        self._pending = self._entries()
        self._builder = self._new_builder()
        self._building: Generator[None, None, bytes] | None = None
        self._exhausted = False

    def _entries(self) -> Iterator[EncoderEntry]:
        raise NotImplementedError

    def _new_builder(self) -> ProfileBuilder:
        raise NotImplementedError

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
        builder = self._builder
        deadline = time.perf_counter_ns() + self.budget_ns
        for stack, values, labels in self._pending:
            builder.add(stack, values, labels)
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


class WindowEncoder(SlicedEncoder):
    """Turns a ``Window`` into raw pprof time profiles, one bounded slice of work per ``step()``.

    Arguments:
        window: the samples to encode (no longer written by the sampler).
        period_ns: the sampling period written into each profile.
        value_type: what the samples' values count, as the sample type and the period type:
            ``CPU_TIME`` (the default) or ``WALL_TIME``.
        budget_ns: the time after which a slice of ``ProfileBuilder.add`` calls stops.
        max_samples: distinct samples per profile.
        locations: location ids shared with the exporter's other windows (see
            ``SharedLocations``), used when the calling thread can claim them.
    """

    def __init__(
        self,
        window: Window,
        *,
        period_ns: int,
        value_type: tuple[str, str] = CPU_TIME,
        budget_ns: int = STEP_BUDGET_NS,
        max_samples: int = MAX_PROFILE_SAMPLES,
        locations: SharedLocations | None = None,
    ) -> None:
        self.period_ns = period_ns
        self.value_type = value_type
        super().__init__(window, budget_ns=budget_ns, max_samples=max_samples, locations=locations)

    def _entries(self) -> Iterator[EncoderEntry]:
        window = self.window
        for (sid, labels), value in list(window.values.items()):
            yield window.stack(sid), value, labels.items_tuple

    def _new_builder(self) -> ProfileBuilder:
        return ProfileBuilder(
            (self.value_type,),
            self.value_type,
            self.period_ns,
            locations=self._locations,
        )
