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
from collections.abc import Generator, Mapping

from ..._version import __version__
from .._window import Window
from ._pprof import ProfileBuilder, SharedLocations, next_slice

__all__ = ["MAX_PROFILE_SAMPLES", "STEP_BUDGET_NS", "WindowEncoder", "series_labels"]

# Each slice of encoding work stops after this much time.
STEP_BUDGET_NS = 500_000
#: Distinct samples per profile; a bigger window becomes several (Pyroscope refuses profiles of
#: more than 16,000 by default).
MAX_PROFILE_SAMPLES = 4096


def series_labels(application_name: str, tags: Mapping[str, str]) -> list[tuple[str, str]]:
    """The series labels pyroscope-io sends, with spanprof as the instrumentation scope."""
    fixed = [("__name__", "process_cpu"), ("service_name", application_name)]
    labels = sorted([*fixed, *tags.items()])
    labels += [
        ("otel.scope.name", "spanprof"),
        ("otel.scope.version", __version__),
        ("process.runtime.name", sys.implementation.name),
        ("process.runtime.version", platform.python_version()),
    ]
    return labels


class WindowEncoder:
    """Turns a ``Window`` into raw pprof profiles, one bounded slice of work per ``step()``.

    Arguments:
        window: the samples to encode (no longer written by the sampler).
        period_ns: the sampling period written into each profile.
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
        budget_ns: int = STEP_BUDGET_NS,
        max_samples: int = MAX_PROFILE_SAMPLES,
        locations: SharedLocations | None = None,
    ) -> None:
        self.window = window
        self._locations = None if locations is None else locations.claim()
        self.period_ns = period_ns
        self.budget_ns = budget_ns
        self.max_samples = max_samples
        self.profiles: list[bytes] = []
        self._items = iter(list(window.values.items()))
        self._builder = self._new_builder()
        self._building: Generator[None, None, bytes] | None = None
        self._exhausted = False

    def _new_builder(self) -> ProfileBuilder:
        return ProfileBuilder(
            (("cpu", "nanoseconds"),),
            ("cpu", "nanoseconds"),
            self.period_ns,
            locations=self._locations,
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
        deadline = time.perf_counter_ns() + self.budget_ns
        for (sid, labels), value in self._items:
            builder.add(window.stack(sid), value, labels.items_tuple)
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
