"""Turns a ``MemoryWindow`` into one OTLP ``ExportProfilesServiceRequest``, in bounded slices.

OTLP ``v1development`` gives each ``Profile`` one ``sample_type``, so the window becomes four
profiles under one ``ScopeProfiles``, named as in pprof and Pyroscope's ``memory`` type:
``alloc_objects/count`` and ``alloc_space/bytes`` (allocated during the window),
``inuse_objects/count`` and ``inuse_space/bytes`` (still in use at its end), each with period
type ``space/bytes`` and the mean sample size as period. Values are already estimates (objects
and bytes, scaled up from the samples), not counts of samples. The four profiles share one
``ProfilesDictionary`` (``OtlpTables``, as the CPU encoder builds it): a stack, span link or
attribute is written once however many profiles use it. A sample's span is its ``Link``; its
other labels are attributes; a profile leaves out the samples whose value in it is zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..._labels._labelset import LabelSet
from .._window import MemoryWindow, Window
from ._memory import MEMORY_PERIOD_TYPE, MEMORY_SAMPLE_TYPES
from ._otlp import OtlpRequestEncoder, put_sample
from ._window import STEP_BUDGET_NS

__all__ = ["OtlpMemoryEncoder"]

_Key = tuple[int, LabelSet]


class OtlpMemoryEncoder(OtlpRequestEncoder[_Key]):
    """Encodes a ``MemoryWindow`` as an ``ExportProfilesServiceRequest``, one slice per ``step()``.

    Arguments:
        window: the allocations and in-use snapshot to encode (a plain ``Window`` has neither
            and encodes to four empty profiles).
        period: the mean sample size in bytes, written as each profile's period.
        resource: an encoded ``Resource`` (``encode_resource``).
        scope: an encoded ``InstrumentationScope`` (``encode_scope``).
        attributes: attributes of every profile (the backend's static tags).
        budget_ns: the time after which a slice stops.
    """

    def __init__(
        self,
        window: Window,
        *,
        period: int,
        resource: bytes,
        scope: bytes,
        attributes: Iterable[tuple[str, str]] = (),
        budget_ns: int = STEP_BUDGET_NS,
    ) -> None:
        if isinstance(window, MemoryWindow):
            self._alloc_objects = window.alloc_objects
            self._inuse = window.inuse
            keys = [*window.values, *(key for key in window.inuse if key not in window.values)]
        else:
            self._alloc_objects, self._inuse, keys = {}, {}, []
        super().__init__(
            window,
            keys,
            resource=resource,
            scope=scope,
            attributes=attributes,
            budget_ns=budget_ns,
        )
        self.period = period
        #: One profile id per sample type, in ``MEMORY_SAMPLE_TYPES`` order.
        self.profile_ids = [os.urandom(16) for _ in MEMORY_SAMPLE_TYPES]
        self._samples = [bytearray() for _ in MEMORY_SAMPLE_TYPES]

    def _add(self, key: _Key) -> None:
        inuse_objects, inuse_space = self._inuse.get(key, (0, 0))
        values = (
            self._alloc_objects.get(key, 0),
            self.window.values.get(key, 0),
            inuse_objects,
            inuse_space,
        )
        if not any(values):
            return
        tables = self.tables
        stack = tables.stack(self.window, key[0])
        labels = tables.sample_labels(key[1])
        for samples, value in zip(self._samples, values, strict=True):
            if value:
                put_sample(samples, stack, labels, value)
                self.samples += 1

    def _profiles(self) -> list[list[bytes | bytearray]]:
        return [
            self._profile(
                sample_type,
                samples,
                period_type=MEMORY_PERIOD_TYPE,
                period=self.period,
                profile_id=profile_id,
            )
            for sample_type, samples, profile_id in zip(
                MEMORY_SAMPLE_TYPES, self._samples, self.profile_ids, strict=True
            )
        ]
