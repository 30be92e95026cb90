"""The label engine's switch, for code that drives a profiler backend without the middlewares.

The middlewares install the engine themselves when their profiler starts, and uninstall it at
shutdown; most applications never call these. Use them to feed a custom ``ProfilerBackend``
from a worker or script that serves no web requests::

    spanprof.engine.install_label_engine(my_backend)
    try:
        with spanprof.profile_labels(job="nightly"):
            run_job()
    finally:
        spanprof.engine.uninstall_label_engine()

Installing patches ``asyncio.Handle._run``, ``ThreadPoolExecutor.submit`` and
``anyio.to_thread.run_sync`` once; uninstalling restores them. On CPython 3.14+,
``install_label_engine(backend, mechanism="watcher")`` follows context switches with a
``PyContext_AddWatcher`` callback instead of the ``Handle._run`` patch and task factories (the
default stays ``"hooks"``, cheaper per step).
"""

from __future__ import annotations

from ._labels._engine import install_label_engine, installed_backend, uninstall_label_engine

__all__ = ["install_label_engine", "installed_backend", "uninstall_label_engine"]
