"""The exact profiler backend: spanprof's own sampler and uploader.

``ExactBackend`` samples with spanprof's own signal-driven sampler (``_sampler``), which reads a
thread's stack and its labels at the same instant, and uploads with ``_pusher`` to the same
Pyroscope endpoint, in the same format and with the same series labels as pyroscope-io, so
dashboards and Grafana's trace-to-profile links work unchanged.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from .._config import parse_bool, parse_int
from .._env import env_value
from .._labels._backend import SpanUsage, span_usage
from .._labels._labelset import LabelSet
from .._logging import logger
from ._encoders._memory import MemoryEncoder, memory_series_labels
from ._encoders._otlp import OtlpEncoder
from ._encoders._otlp_memory import OtlpMemoryEncoder
from ._encoders._pprof import SharedLocations
from ._encoders._window import CPU_TIME, PROFILE_NAMES, WALL_TIME, series_labels
from ._exporters._fanout import WindowExporter, WindowFanout, stop_all
from ._exporters._otlp import OtlpEncoderFactory, OtlpExporter, OtlpSettings
from ._exporters._pusher import Pusher, StepEncoder
from ._hold import SloHold
from ._pyroscope import PyroscopeBackend
from ._samplers._memory import (
    DEFAULT_SAMPLE_BYTES,
    MemorySampler,
    MemorySamplerUnavailable,
    ignore_profiler_thread,
)
from ._samplers._signal import (
    CLOCKS,
    Sampler,
    SamplerUnavailable,
    SignalInUse,
    in_main_os_thread,
    os_thread_ident,
    unavailable_reason,
)
from ._settings import PyroscopeSettings, WithPyroscopeSettings
from ._verdicts import Verdicts
from ._window import Window

__all__ = ["EXPORTERS", "ExactBackend", "parse_exporters"]

#: Values of ``SPANPROF_PROFILES_EXPORTER`` / ``exporters=``, comma-separated.
EXPORTERS = ("pyroscope", "otlp")
# Said at start-up when requests run on pool threads (a threaded server).
_THREADED = (
    " (requests run on pool threads: the handler the WSGI middleware installed in the main "
    "thread reads their stacks with the labels each thread runs under, and sees a pool thread "
    "only when it hands over the GIL, so much of its CPU lands on the frame that released it)"
)
_AGENT_MISSING = (
    "; chosen by SPANPROF_PROFILER=auto because pyroscope-io, which auto prefers on threaded "
    "servers, is not installed (it has no build for CPython 3.15)"
)
_THREADED_AGENT = (
    "requests run on pool threads (a threaded server), where auto prefers pyroscope-io: the "
    "exact sampler would read a pool thread's stack only when that thread hands over the GIL, "
    "putting 22-73% of request CPU on the frame that released it instead of the function that "
    "burnt it (docs/benchmarks.md, attribution per WSGI server model), while pyroscope-io's "
    "per-thread tags are right because a request owns its thread. Samples carry no slo label "
    "and spans no spanprof.cpu_time_s; SPANPROF_PROFILER=exact gives both, and labelled memory, "
    "with the exact sampler"
)
# server_address is not used without the pyroscope exporter; settings still need a valid one.
_UNUSED_ADDRESS = "http://localhost:4040"


def parse_exporters(name: str, value: str | Sequence[str]) -> tuple[str, ...]:
    """``pyroscope``, ``otlp`` or both (``pyroscope,otlp``), in that order, without repeats."""
    if not isinstance(value, str) and not (
        isinstance(value, Sequence) and all(isinstance(item, str) for item in value)
    ):
        raise TypeError(
            f"{name}: expected a comma-separated str or a sequence of str, "
            f"got {type(value).__name__} {value!r}"
        )
    items = value.split(",") if isinstance(value, str) else list(value)
    chosen = {item.strip().lower() for item in items if item.strip()}
    if not chosen or not chosen <= set(EXPORTERS):
        raise ValueError(
            f"{name}={value!r}: expected {', '.join(EXPORTERS)} or both, comma-separated"
        )
    return tuple(e for e in EXPORTERS if e in chosen)


def _ignore(previous: LabelSet, current: LabelSet) -> None:
    return None


class ExactBackend(WithPyroscopeSettings):
    """Profiles with exact per-sample labels, even when requests switch every 100 µs.

    A ``SIGPROF`` timer (``timer_create`` on the process CPU clock, directed at the main thread;
    ``sample_rate`` ticks per second of process CPU) runs a handler in the main thread that
    reads every thread's stack together with the labels it runs under: the event loop's running
    task's labels straight from its context, thread-pool work's labels as the label engine
    recorded them when the job started. Samples weigh the CPU each thread used; threads
    waiting on a lock, a queue or a socket are not counted as running.
    Uploads go to ``{server_address}/push.v1.PusherService/Push`` every ``upload_interval``
    seconds, exactly like pyroscope-io's (and/or, with ``exporters="otlp"``, as OTLP profiles
    whose samples link to their spans, to the endpoint the ``OTEL_EXPORTER_OTLP_*`` variables
    name), from a background thread that encodes in slices of
    under a millisecond, retries with back-off and drops (and counts) windows the server never
    took; ``shutdown()`` flushes the last one.

    ```python
    app.add_middleware(spanprof.ProfilingMiddleware, profiler=spanprof.ExactBackend(
        server_address="http://pyroscope:4040", application_name="shop"))
    ```

    Requirements: Linux, the GIL, and ``start()`` in the main thread (the middleware starts it at
    lifespan startup, so the event loop must run in the main thread: uvicorn, gunicorn workers,
    hypercorn), or in any thread after ``prepare()`` ran in the main thread (the WSGI
    middleware calls it when built, for threaded servers whose first request runs on a pool
    thread). Otherwise it logs why at start-up and falls back to pyroscope-io with the label
    engine. Chosen by ``auto`` and started off the main thread after ``prepare()``, it also runs
    pyroscope-io when that is installed: the handler sees pool threads only when they hand over
    the GIL, which misplaces much of their CPU on the frame that yielded (the start-up line says
    so). It uses ``SIGPROF`` (``SIGALRM`` with ``clock="wall"``) and refuses to start, raising
    ``RuntimeError``, when that signal already has a handler. The timer signals the main thread
    only: no other thread is interrupted or has to block the signal.

    With ``memory=True`` (the default) it also samples allocations (about one per
    ``alloc_sample_bytes`` allocated) with the stack and labels of the code that allocated them:
    allocated objects and bytes per upload window, in-use objects and bytes at upload, each
    sample labelled with the allocating span. The ``pyroscope`` exporter pushes them as
    Pyroscope's ``memory`` profile type, the ``otlp`` one as four OTLP profiles
    (``alloc_objects``, ``alloc_space``, ``inuse_objects``, ``inuse_space``) whose samples link
    to their spans, in a request of their own.

    Arguments:
        server_address: Pyroscope URL, e.g. ``http://pyroscope:4040``.
        application_name: the ``service_name`` the profiles are stored under.
        upload_interval: whole seconds between uploads (default 10).
        sample_rate: timer ticks per second (default 100; Linux delivers at most ~250).
        tenant_id: tenant for multi-tenant servers (``X-Scope-OrgID``).
        basic_auth_username, basic_auth_password: basic auth for the server.
        tags: static labels on every sample of this process.
        clock: ``"cpu"`` (default: on-CPU samples) or ``"wall"`` (every thread, waiting
            included, weighted by wall time; uses ``SIGALRM``).
        exporters: ``"pyroscope"`` (default), ``"otlp"`` or ``"pyroscope,otlp"``. The OTLP
            exporter reads ``OTEL_EXPORTER_OTLP_[PROFILES_]*`` here (``OtlpSettings``) and sends
            the traces' resource; ``server_address`` may be empty without ``pyroscope``.
        auto: chosen by ``SPANPROF_PROFILER=auto`` (the default) rather than asked for: the
            start-up line saying which profiler runs, fallback included, is INFO, not WARNING.
        memory: sample allocations for memory profiles (default ``True``).
        alloc_sample_bytes: mean bytes allocated between two allocation samples (default
            524288, as pyroscope-io and Go).
    """

    def __init__(
        self,
        *,
        server_address: str = "",
        application_name: str = "python-app",
        upload_interval: int = 10,
        sample_rate: int = 100,
        tenant_id: str = "",
        basic_auth_username: str = "",
        basic_auth_password: str = "",
        tags: Mapping[str, str] | None = None,
        clock: str = "cpu",
        auto: bool = False,
        exporters: str | Sequence[str] = "pyroscope",
        memory: bool = True,
        alloc_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    ) -> None:
        self.exporters = parse_exporters("exporters", exporters)
        if not server_address and "pyroscope" not in self.exporters:
            server_address = _UNUSED_ADDRESS
        self._otlp = OtlpSettings.from_env() if "otlp" in self.exporters else None
        self._settings = PyroscopeSettings(
            server_address=server_address,
            application_name=application_name,
            upload_interval=upload_interval,
            sample_rate=sample_rate,
            tenant_id=tenant_id,
            basic_auth_username=basic_auth_username,
            basic_auth_password=basic_auth_password,
            tags=tags or {},
        )
        if clock not in CLOCKS:
            raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
        self.clock = clock
        for name, flag in (("auto", auto), ("memory", memory)):
            # "false" is a true value: only a real bool says what was meant.
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name}: expected True or False, got {type(flag).__name__} {flag!r}"
                )
        self.auto = auto
        if not isinstance(alloc_sample_bytes, int) or isinstance(alloc_sample_bytes, bool):
            raise TypeError(
                f"alloc_sample_bytes: expected int, got {type(alloc_sample_bytes).__name__} "
                f"{alloc_sample_bytes!r}"
            )
        if not 1 <= alloc_sample_bytes <= 1 << 40:
            raise ValueError(
                f"alloc_sample_bytes: expected 1 to 2**40 bytes, got {alloc_sample_bytes!r}"
            )
        self.memory = memory
        self.alloc_sample_bytes = alloc_sample_bytes
        self._memory_sampler: MemorySampler | None = None
        # The memory exporters, each with the prefix of its keys in stats().
        self._memory_exporters: list[tuple[str, WindowExporter]] = []
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._sampler: Sampler | None = None
        self._idle_sampler: Sampler | None = None
        self._idle_pid: int | None = None
        self._exporters: list[WindowExporter] = []
        self._hold: SloHold | None = None
        self._memory_hold: SloHold | None = None
        # The sampler's per-span CPU, ``take(span_id, 0)``, for the request path (None: not
        # sampling exactly); the memory sampler's per-span bytes (None: no memory sampling).
        self._take_span_cpu: Callable[[str, int], int] | None = None
        self._take_span_bytes: Callable[[str], int] | None = None
        self._fallback: PyroscopeBackend | None = None
        self._sink = _ignore
        # The thread whose labels the sampler reads itself (0: none, e.g. in fallback mode).
        self._context_thread = 0
        self._ident = os_thread_ident()
        self._atexit_registered = False
        self._last_stats: dict[str, float] = {}
        # Why prepare() installed no handler for a start off the main thread (None: it did).
        self._prepare_refusal: str | None = None

    @property
    def otlp_settings(self) -> OtlpSettings | None:
        """Where OTLP profiles go (``None`` without the ``otlp`` exporter)."""
        return self._otlp

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, auto: bool = False
    ) -> ExactBackend | None:
        """A backend configured from the same variables as ``PyroscopeBackend.from_env``.

        ``PYROSCOPE_SERVER_ADDRESS`` (unset: ``None``), ``PYROSCOPE_APPLICATION_NAME`` (default
        ``OTEL_SERVICE_NAME``), ``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``,
        ``PYROSCOPE_TENANT_ID``, ``PYROSCOPE_BASIC_AUTH_USER``, ``PYROSCOPE_BASIC_AUTH_PASSWORD``,
        ``PYROSCOPE_LABELS``, plus ``SPANPROF_PROFILE_CLOCK`` (``cpu`` or ``wall``) and
        ``SPANPROF_PROFILES_EXPORTER`` (``pyroscope``, ``otlp`` or ``pyroscope,otlp``; with
        ``otlp`` the ``OTEL_EXPORTER_OTLP_*`` variables, and no Pyroscope address is needed),
        ``SPANPROF_MEMORY`` (``true``) and ``SPANPROF_ALLOC_SAMPLE_BYTES`` (``524288``). A bad
        value raises ``ValueError`` naming the variable.
        """
        env = os.environ if environ is None else environ
        exporters = parse_exporters(
            "SPANPROF_PROFILES_EXPORTER", env_value(env, "SPANPROF_PROFILES_EXPORTER", "pyroscope")
        )
        otlp = OtlpSettings.from_env(env) if "otlp" in exporters else None
        if "pyroscope" not in exporters and not env_value(env, "PYROSCOPE_SERVER_ADDRESS"):
            env = {**env, "PYROSCOPE_SERVER_ADDRESS": _UNUSED_ADDRESS}
        # One parser for both backends: the variables mean exactly the same thing.
        settings = PyroscopeSettings.from_env(env)
        if settings is None:
            return None
        clock = env_value(env, "SPANPROF_PROFILE_CLOCK", "cpu").strip().lower()
        if clock not in CLOCKS:
            raise ValueError(
                f"SPANPROF_PROFILE_CLOCK={clock!r}: expected one of {', '.join(CLOCKS)}"
            )
        memory = parse_bool("SPANPROF_MEMORY", env_value(env, "SPANPROF_MEMORY", "true"))
        sample_bytes = parse_int(
            "SPANPROF_ALLOC_SAMPLE_BYTES",
            env_value(env, "SPANPROF_ALLOC_SAMPLE_BYTES", str(DEFAULT_SAMPLE_BYTES)),
            minimum=1,
            maximum=1 << 40,
        )
        backend = cls(
            **settings.arguments(),
            clock=clock,
            auto=auto,
            memory=memory,
            alloc_sample_bytes=sample_bytes,
        )
        backend.exporters, backend._otlp = exporters, otlp
        return backend

    # --- what runs -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"exact"``, ``"pyroscope"`` (the fallback) or ``"stopped"`` in this process."""
        if self._pid != os.getpid():
            return "stopped"
        return "pyroscope" if self._fallback is not None else "exact"

    @property
    def needs_step_hooks(self) -> bool:
        """Whether the label engine must push labels on every step of a main-thread event loop.

        Not when sampling exactly: the sampler reads the main thread's labels from its context,
        so the engine gives loops there no task factory (uvloop, eager tasks). Thread-pool jobs,
        and loops in other threads, still push theirs.
        """
        return self.mode != "exact"

    def stats(self) -> dict[str, float]:
        """Sampler and uploader counters: ticks, stall percentiles (µs), uploads, drops..."""
        sampler, exporters, hold = self._sampler, self._exporters, self._hold
        if sampler is None or hold is None or not exporters or self._pid != os.getpid():
            return dict(self._last_stats)
        return {**self._stats_of(sampler, hold, exporters), **self._memory_stats()}

    @staticmethod
    def _stats_of(
        sampler: Sampler, hold: SloHold, exporters: list[WindowExporter]
    ) -> dict[str, float]:
        stats = sampler.stats()
        stats.update(hold.stats())
        for exporter in exporters:
            stats.update(exporter.stats())
        return stats

    def _memory_stats(self) -> dict[str, float]:
        sampler, exporters = self._memory_sampler, self._memory_exporters
        if sampler is None or not exporters:
            return {}
        stats = {f"memory_{name}": value for name, value in sampler.stats().items()}
        for prefix, exporter in exporters:
            stats.update((prefix + name, value) for name, value in exporter.stats().items())
        return stats

    # --- ProfilerBackend -----------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling and uploading in this process (again after a fork; else once).

        Raises ``RuntimeError`` when the sampler's signal is taken. Falls back to pyroscope-io,
        with a warning saying why, when this process cannot be sampled exactly.
        """
        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                return
            # After a fork the parent's objects are here, but not its threads or timer.
            self._sampler = self._fallback = self._hold = self._memory_hold = None
            self._take_span_cpu = self._take_span_bytes = None
            self._exporters = []
            self._memory_exporters = []
            self._sink = _ignore
            self._context_thread = 0
            sampler = self._idle_sampler
            if sampler is None or (self._idle_pid != pid and not sampler.prepared):
                # (A sampler prepared before a fork is the child's too: its handler is here.)
                sampler = Sampler(sample_rate=self.sample_rate, clock=self.clock)
            # Restarted in the same process: keep its interned frames and stacks warm.
            self._idle_sampler, self._idle_pid = sampler, pid
            in_main = in_main_os_thread()
            agent_missing = ""
            if (
                not in_main
                and self.auto
                and self.exporters == ("pyroscope",)
                and self.clock == "cpu"
                and sampler.prepared
            ):
                # A threaded server: auto prefers the agent where it is installed (see _THREADED).
                # Not for OTLP or a wall clock, which only the exact sampler gives (the agent
                # would send CPU profiles in place of the wall ones asked for, saying nothing).
                # Only where the exact sampler could run instead (prepared in the main thread):
                # otherwise its start below fails and the fallback says what would make it run,
                # not advise SPANPROF_PROFILER=exact, which could not run here either.
                try:
                    agent = PyroscopeBackend(**self._settings.arguments())
                except RuntimeError:
                    agent_missing = _AGENT_MISSING
                else:
                    self._start_fallback(agent, pid, _THREADED_AGENT)
                    sampler.stop()  # a handler prepared in the main thread goes: not needed
                    self._pid = pid
                    self._register_atexit()
                    return
            # Everything that can fail comes before the timer is armed, and whatever fails after
            # is undone: a failed start leaves no timer, no handler and no thread behind.
            exporters = self._new_exporters(sampler)
            # Between sampler and exporters: samples wait for their request's SLO verdict.
            hold = SloHold(sampler.take_window, max_windows=2)
            fanout = WindowFanout(hold.take_window, len(exporters))
            for i, exporter in enumerate(exporters):
                exporter.start(fanout.collector(i), ignore_profiler_thread)
            try:
                sampler.start()  # armed last
            except SamplerUnavailable as exc:
                stop_all(exporters)
                if not in_main and self._prepare_refusal is not None:
                    exc = SamplerUnavailable(f"{exc}; {self._prepare_refusal}")
                if "pyroscope" not in self.exporters:
                    logger.warning(
                        "spanprof: the exact sampler cannot run in this process (pid %d): %s. "
                        "The OTLP exporter needs it: no profiles are sent",
                        pid,
                        exc,
                    )
                    return
                try:
                    fallback = PyroscopeBackend(**self._settings.arguments())
                except RuntimeError:  # no agent (CPython 3.15): say both reasons, once
                    logger.warning(
                        "spanprof: no profiler can run in this process (pid %d): the exact "
                        "sampler cannot run here, %s; and pyroscope-io, its fallback, is not "
                        "installed (%s). Requests are served without profiles. To profile them "
                        "exactly, build the WSGI middleware in the main thread (at import) of a "
                        "threaded server, or serve from an event loop, gevent or a sync worker",
                        pid,
                        exc,
                        "it has no build for CPython 3.15 yet"
                        if sys.version_info >= (3, 15)
                        else "pip install pyroscope-io",
                    )
                    return
                self._start_fallback(
                    fallback,
                    pid,
                    "the exact sampler cannot run here, "
                    f"{exc}. Its samples may carry the labels of whatever ran ~0.2 ms after the "
                    "stack was read; serve requests from an event loop, gevent or a sync worker "
                    "in the main thread, or build the WSGI middleware in the main thread (at "
                    "import) of a threaded server, to profile them exactly. Samples carry no "
                    "slo label (breached/ok) and spans no spanprof.cpu_time_s: both need the "
                    "exact sampler"
                    + (
                        ""
                        if self.clock == "cpu"
                        else "; and they count CPU time: SPANPROF_PROFILE_CLOCK=wall (a wall "
                        "profile) needs the exact sampler too"
                    ),
                )
            except BaseException:
                stop_all(exporters)
                sampler.stop()
                raise
            else:
                self._sampler, self._exporters, self._hold = sampler, exporters, hold
                self._take_span_cpu = sampler.span_cpu_taker()
                # end_span records the verdict before it takes the CPU: a span with a verdict
                # has had its CPU taken, and later samples of it are not kept for it.
                sampler.span_ended = hold.verdicts.ended
                self._sink = sampler.set_thread_labels
                self._ident = sampler.ident
                # The main thread's labels are read from its context, not pushed.
                self._context_thread = sampler.main_ident
                logger.info(
                    "spanprof: profiling with the exact sampler (pid %d, %s): stack and labels "
                    "read at one instant in the main thread%s%s; exporting to %s",
                    pid,
                    f"SPANPROF_PROFILER={'auto' if self.auto else 'exact'}",
                    "" if in_main else _THREADED + agent_missing,
                    "" if self.clock == "cpu" else ", wall clock",
                    " and ".join(self.exporters),
                )
                if self.memory:
                    self._start_memory(pid, hold.verdicts)
            self._pid = pid
            self._register_atexit()

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            # Like pyroscope-io: the last window is sent even without a lifespan shutdown.
            atexit.register(self.shutdown)
            self._atexit_registered = True

    def _start_fallback(self, fallback: PyroscopeBackend, pid: int, why: str) -> None:
        # pyroscope-io and the label engine instead of the exact sampler, saying why.
        level = logging.INFO if self.auto else logging.WARNING
        logger.log(
            level,
            "spanprof: profiling with pyroscope-io and the label engine (pid %d, %s): %s",
            pid,
            f"SPANPROF_PROFILER={'auto' if self.auto else 'exact'}",
            why,
        )
        fallback.start()
        self._fallback = fallback
        self._sink = fallback.set_thread_labels
        if self.memory:
            logger.log(
                level,
                "spanprof: memory samples are not labelled under the pyroscope-io fallback "
                "(pid %d): spanprof samples allocations only with its exact sampler, and "
                "pyroscope-io's memory profiles carry no labels",
                pid,
            )

    def prepare(self) -> None:
        """In the main thread: install the sampler's signal handler (idle) for a later ``start``.

        A threaded WSGI server (gunicorn gthread, waitress) imports the app in the main thread
        and serves requests on pool threads, where the first request starts the profiler and
        ``signal.signal`` is not allowed. ``WSGIProfilingMiddleware`` calls this when it is
        built, so that ``start`` can then arm the timer from a pool thread; the handler is
        inherited by forked workers and removed by ``shutdown``. Elsewhere, or where the
        sampler cannot run, it does nothing: ``start`` says why.
        """
        with self._lock:
            pid = os.getpid()
            if self._pid == pid or unavailable_reason() is not None:
                return
            if "uwsgi" in sys.modules:
                # uWSGI's main thread runs Python code only while it serves a request itself:
                # between requests it waits in C, and the handler would run late.
                self._prepare_refusal = (
                    "under uWSGI the main thread runs Python code only while it serves a "
                    "request itself, so no handler is prepared there"
                )
                return
            sampler = self._idle_sampler
            if sampler is None or self._idle_pid != pid:
                sampler = Sampler(sample_rate=self.sample_rate, clock=self.clock)
                self._idle_sampler, self._idle_pid = sampler, pid
            try:
                sampler.prepare()
            except (SamplerUnavailable, SignalInUse):
                return  # start() raises or falls back, and says why
            self._prepare_refusal = None
            self._register_atexit()

    def _new_exporters(self, sampler: Sampler) -> list[WindowExporter]:
        exporters: list[WindowExporter] = []
        period_ns = 1_000_000_000 // self.sample_rate
        # A wall-clock sampler's values are wall time: a profile of its own kind, never CPU.
        value_type = WALL_TIME if self.clock == "wall" else CPU_TIME
        if "pyroscope" in self.exporters:
            exporters.append(
                self._pusher(
                    series_labels(self.application_name, self.tags, name=PROFILE_NAMES[value_type]),
                    period_ns=period_ns,
                    value_type=value_type,
                )
            )
        if self._otlp is not None:
            exporters.append(
                self._otlp_exporter(
                    self._otlp,
                    functools.partial(OtlpEncoder, wall_period_ns=period_ns)
                    if value_type == WALL_TIME
                    else OtlpEncoder,
                )
            )
        return exporters

    def _pusher(
        self,
        labels: list[tuple[str, str]],
        *,
        period_ns: int,
        value_type: tuple[str, str] = CPU_TIME,
        encoder: Callable[[Window], StepEncoder] | None = None,
    ) -> Pusher:
        return Pusher(
            server_address=self.server_address,
            labels=labels,
            period_ns=period_ns,
            value_type=value_type,
            upload_interval=self.upload_interval,
            tenant_id=self.tenant_id,
            basic_auth_username=self.basic_auth_username,
            basic_auth_password=self.basic_auth_password,
            # Within ProfilerRuntime's 5 s shutdown budget, even with the server away.
            flush_timeout=2.0,
            encoder=encoder,
        )

    def _otlp_exporter(
        self, settings: OtlpSettings, encoder: OtlpEncoderFactory = OtlpEncoder
    ) -> OtlpExporter:
        return OtlpExporter(
            settings,
            upload_interval=self.upload_interval,
            attributes=sorted(self.tags.items()),
            flush_timeout=2.0,
            encoder=encoder,
        )

    def _start_memory(self, pid: int, verdicts: Verdicts) -> None:
        # Allocation sampling with exporters of its own: memory is a Pyroscope series of its own,
        # and an OTLP request of its own (its failures and drops are not the CPU profiles').
        sampler = self._memory_sampler
        if sampler is None:
            sampler = self._memory_sampler = MemorySampler(sample_bytes=self.alloc_sample_bytes)
        try:
            sampler.start()
        except MemorySamplerUnavailable as exc:
            logger.log(
                logging.INFO if self.auto else logging.WARNING,
                "spanprof: no memory profiles (pid %d): %s; CPU profiles are unaffected "
                "(SPANPROF_MEMORY=false turns memory profiles off)",
                pid,
                exc,
            )
            return
        period = self.alloc_sample_bytes
        exporters: list[tuple[str, WindowExporter]] = []
        if "pyroscope" in self.exporters:
            # A stack's location ids stay encoded from one window to the next.
            locations = SharedLocations()
            pusher = self._pusher(
                memory_series_labels(self.application_name, self.tags),
                period_ns=period,
                encoder=lambda window: MemoryEncoder(window, period=period, locations=locations),
            )
            exporters.append(("memory_push_", pusher))
        if self._otlp is not None:
            otlp = self._otlp_exporter(
                self._otlp, functools.partial(OtlpMemoryEncoder, period=period)
            )
            exporters.append(("memory_", otlp))  # its keys start with otlp_ already
        # Allocations wait for their request's SLO verdict too: the CPU hold's, taken on
        # this hold's own clock.
        hold = SloHold(sampler.take_window, max_windows=2, verdicts=verdicts)
        fanout = WindowFanout(hold.take_window, len(exporters))
        for i, (_prefix, exporter) in enumerate(exporters):
            exporter.start(fanout.collector(i), ignore_profiler_thread)
        self._memory_exporters = exporters
        self._memory_hold = hold
        self._take_span_bytes = sampler.span_bytes_taker()
        logger.info(
            "spanprof: memory profiles (pid %d): one allocation sampled per %d bytes on average, "
            "labelled with the allocating span; exporting to %s",
            pid,
            period,
            " and ".join(self.exporters),
        )

    def shutdown(self) -> None:
        """Stop sampling, upload the last window and stop the uploader (from any thread).

        Off the main thread (``ProfilerRuntime`` flushes from a helper thread) the timer stops
        at once and the main thread puts the previous signal handler back the next time it
        runs Python code (see ``Sampler.stop``).
        """
        with self._lock:
            idle = self._idle_sampler
            if idle is not None and idle.prepared and not idle.running:
                idle.stop()  # prepared, not sampling (never started, or the agent runs)
            if self._pid != os.getpid():
                return
            self._pid = None
            self._sink = _ignore
            self._context_thread = 0
            sampler, exporters, fallback = self._sampler, self._exporters, self._fallback
            hold, memory_hold = self._hold, self._memory_hold
            self._memory_hold = None
            self._take_span_cpu = self._take_span_bytes = None
            if memory_hold is not None:
                memory_hold.close()
            memory_exporters = [exporter for _prefix, exporter in self._memory_exporters]
            self._sampler = self._fallback = self._hold = None
            self._exporters = []
            if sampler is not None:
                sampler.stop()
            if hold is not None:
                hold.close()  # the last upload carries what waits for a verdict too
            if memory_exporters and self._memory_sampler is not None:
                self._memory_sampler.stop()
            # All exporters flush at once, CPU and memory: shutdown stays within one flush budget.
            stop_all([*exporters, *memory_exporters])
            if sampler is not None and hold is not None and exporters:
                self._last_stats = {
                    **self._stats_of(sampler, hold, exporters),
                    **self._memory_stats(),
                }
            self._memory_exporters = []
            if fallback is not None:
                fallback.shutdown()

    def end_span(self, span_id: str, breached: bool | None) -> SpanUsage | None:
        """A request's span ends: label its samples with the verdict; the CPU they hold, and
        the bytes its sampled allocations stand for (``None`` without allocation sampling).

        ``None`` when not sampling exactly (the pyroscope-io fallback has no hold).
        """
        take_cpu, hold = self._take_span_cpu, self._hold
        if take_cpu is None or hold is None:
            return None
        # One store for both holds (CPU and memory), the span's CPU and bytes straight from C:
        # the request path pays for every Python frame here (about 1,000 instructions each).
        hold.verdicts.record(span_id, breached)
        take_bytes = self._take_span_bytes
        return span_usage(take_cpu(span_id, 0), None if take_bytes is None else take_bytes(span_id))

    def set_thread_labels(self, previous: LabelSet, current: LabelSet) -> None:
        """The calling thread switched labels (thread-pool job start or end, mostly)."""
        # The sampler reads the main thread's labels from its context: skip its pushes here,
        # before any further call (the middleware pushes twice per request).
        if self._ident() != self._context_thread:
            self._sink(previous, current)
