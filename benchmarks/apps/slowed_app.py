"""The exact section's HTTP app, for a server under callgrind (``benchmarks/_callgrind_http.py``).

callgrind runs the server about ``SLOWDOWN`` times slower. The allocation drain thread wakes
every ``0.25 s * SLOWDOWN`` of wall time here instead of 0.25 s, so that it wakes about as often
per response as natively (an idle wake-up costs thousands of instructions; at 50 times the rate
it would be counted as part of every response). What a drain does per sample is the same either
way. The upload interval and the tick rate are stretched through the environment
(``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``).

The time budgets of the background threads' slices of work are stretched too: an encoder's step
(500 µs, after which it lets the application's thread in) and a drain's slice. Natively a
memory window's step encodes about 30 samples; under callgrind, unstretched, it encoded one,
and each step's fixed cost (timers, the collector's callback, the GIL handed over and taken
back) was counted about 30 times as often per response as a native server pays it (measured:
the memory upload thread's 18,900 instructions a response became 11,100 with the budget
stretched).

The allocation sampler is seeded (``MEMORY_SEED``, as the in-process counts are): which blocks
are sampled is random, and unseeded, a configuration whose path did not change moved by 7,500
instructions a response between two sessions' counts.

``GET /sample-bytes?N`` restarts the allocation sampler with a mean of ``N`` bytes between
samples, and ``GET /sample-bytes?`` with its configured mean, dropping what was sampled
meanwhile (its stacks stay interned): the benchmark's warm-up samples
densely first, so that the sampler meets the allocation stacks a long-running server has met
(interning each stack once for the process's life is start-up work, and at the default rate a
server keeps meeting new ones for tens of thousands of responses).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from spanprof._profiling._encoders._memory import MemoryEncoder
from spanprof._profiling._encoders._window import WindowEncoder
from spanprof._profiling._samplers import _memory
from spanprof._profiling._samplers._memory import MemorySampler

from .._callgrind_http import SLOWDOWN
from ..bench_breakdown import MEMORY_SEED


def _stretch_default(cls: type, name: str) -> None:
    """Multiply the default of ``cls(..., name=...)`` by ``SLOWDOWN``."""
    defaults = cls.__init__.__kwdefaults__  # type: ignore[misc]
    assert defaults is not None
    defaults[name] = defaults[name] * SLOWDOWN


_stretch_default(MemorySampler, "drain_interval")
_sampler_defaults = MemorySampler.__init__.__kwdefaults__
assert _sampler_defaults is not None
_sampler_defaults["seed"] = MEMORY_SEED
_stretch_default(MemoryEncoder, "budget_ns")
_stretch_default(WindowEncoder, "budget_ns")
_memory._SLICE_NS = _memory._SLICE_NS * SLOWDOWN

from tests.e2e.exact_app import app as _exact_app  # noqa: E402  (after the defaults it must see)

__all__ = ["app"]

_configured: list[int] = []


def _resample(query: str) -> str:
    sampler = getattr(_exact_app.profiler, "_memory_sampler", None)
    if not isinstance(sampler, MemorySampler) or not sampler.running:
        return "no allocation sampler"
    if not _configured:
        _configured.append(sampler.sample_bytes)
    # Stopped and started again, the sampler keeps its interned stacks.
    sampler.stop()
    if not query:
        # Back to the configured rate: the dense samples go, so that the last upload carries
        # only what was sampled at that rate (their encoding would otherwise weigh on both
        # counts, by more than a counted response from run to run).
        sampler.take_window()
    sampler.sample_bytes = int(query) if query else _configured[0]
    sampler.start()
    return str(sampler.sample_bytes)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The exact section's app, and ``/sample-bytes``."""
    if scope["type"] == "http" and scope["path"] == "/sample-bytes":
        body = _resample(scope["query_string"].decode()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    await _exact_app(scope, receive, send)
