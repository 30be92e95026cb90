"""Attribution of received profile samples to the requests whose marker they ran in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from spanprof._local._receiver import ReceivedSample

from .markers import marker_index


@dataclass
class Attribution:
    """Sample weights (pprof values) by outcome, pooled over all requests."""

    exact: int = 0
    wrong: int = 0
    unlabelled: int = 0
    double_span: int = 0
    background_total: int = 0
    background_labelled: int = 0
    per_request: dict[int, int] = field(default_factory=dict)

    @property
    def request_total(self) -> int:
        """Weight of all samples taken in request markers."""
        return self.exact + self.wrong + self.unlabelled

    @property
    def exact_share(self) -> float:
        """Share of request samples carrying exactly their own request's ids."""
        return self.exact / self.request_total if self.request_total else 0.0

    def summary(self) -> str:
        """One line for logs and the benchmark table."""
        return (
            f"exact {self.exact_share:.2%} of {self.request_total / 1e7:.0f} ticks; "
            f"wrong {self.wrong / 1e7:.0f}, unlabelled {self.unlabelled / 1e7:.0f}, "
            f"double-labelled {self.double_span / 1e7:.0f}; background "
            f"{self.background_labelled / 1e7:.0f}/{self.background_total / 1e7:.0f} labelled"
        )


def attribute(
    samples: Iterable[ReceivedSample],
    expected: Mapping[int, Mapping[str, str]],
    *,
    keys: tuple[str, ...] = ("span_id", "trace_id"),
    background_function: str = "background_burn",
) -> Attribution:
    """Classify samples: marker ``i`` must carry exactly ``expected[i]``'s ``keys``."""
    result = Attribution()
    for sample in samples:
        spans = sample.label_values("span_id")
        if len(spans) > 1:
            result.double_span += sample.value
        names = [frame.function for frame in sample.stack]
        if background_function in names:
            result.background_total += sample.value
            if spans:
                result.background_labelled += sample.value
            continue
        index = marker_index(names)
        if index is None or index not in expected:
            continue
        want = expected[index]
        result.per_request[index] = result.per_request.get(index, 0) + sample.value
        if not spans:
            result.unlabelled += sample.value
        elif all(sample.label_values(key) == (want[key],) for key in keys):
            result.exact += sample.value
        else:
            result.wrong += sample.value
    return result
