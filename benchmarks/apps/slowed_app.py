"""The exact section's HTTP app, with the allocation drain's wall-clock period stretched.

For a server run under callgrind (``benchmarks/_callgrind_http.py``), which runs it about 50
times slower: the drain thread wakes every ``0.25 s * SLOWDOWN`` of wall time instead of 0.25 s,
so that it wakes about as often per response as natively (an idle wake-up costs thousands of
instructions; at 50 times the rate it would be counted as part of every response). What a drain
does per sample is the same either way. The upload interval and the tick rate are stretched
through the environment (``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``).
"""

from __future__ import annotations

from spanprof._profiling._samplers._memory import MemorySampler

from .._callgrind_http import SLOWDOWN

_defaults = MemorySampler.__init__.__kwdefaults__
assert _defaults is not None
_defaults["drain_interval"] = _defaults["drain_interval"] * SLOWDOWN

from tests.e2e.exact_app import app  # noqa: E402  (after the defaults it must see)

__all__ = ["app"]
