"""spanprof: exact per-request profile labels for Python web apps.

Profiles and traces point at each other: every sample of a request carries its ``span_id``,
``trace_id`` and route, and its server span carries ``pyroscope.profile.id``.

What applications call lives here. ``spanprof.testing`` helps their tests; ``spanprof.engine``
switches the label engine for code that runs without the middlewares.
"""

from __future__ import annotations

import typing as _typing

from . import engine as engine
from . import testing as testing
from ._labels._backend import ProfilerBackend
from ._labels._greenlets import install_greenlet_labels, uninstall_greenlet_labels
from ._labels._labelset import LabelSet
from ._labels._recorder import RecorderBackend
from ._labels._scope import current_labels, profile_labels
from ._profiling._choose import FROM_ENV, FromEnv
from ._profiling._exact import ExactBackend
from ._profiling._pyroscope import PyroscopeBackend
from ._signals._prometheus import PrometheusMetrics
from ._signals._slo import SloPolicy
from ._version import __version__ as __version__
from ._web._asgi import ProfilingMiddleware
from ._web._options import ProfilingOptions
from ._web._wsgi import WSGIProfilingMiddleware
from ._web._wsgi_routes import django_route_resolver, flask_route_resolver

__all__ = [
    "ExactBackend",
    "FROM_ENV",
    "FromEnv",
    "LabelSet",
    "ProfilerBackend",
    "ProfilingMiddleware",
    "ProfilingOptions",
    "PrometheusMetrics",
    "PyroscopeBackend",
    "RecorderBackend",
    "SloPolicy",
    "WSGIProfilingMiddleware",
    "current_labels",
    "django_route_resolver",
    "flask_route_resolver",
    "install_greenlet_labels",
    "profile_labels",
    "uninstall_greenlet_labels",
]

# Report the public path (spanprof.ProfilingMiddleware), not the private module that defines it,
# in reprs, tracebacks and documentation tools.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or (callable(_obj) and hasattr(_obj, "__module__")):
        _obj.__module__ = __name__
del _name, _obj

# Earlier releases exported the engine's switch here; it lives in spanprof.engine now.
_MOVED_TO_ENGINE = frozenset(
    {"install_label_engine", "installed_backend", "uninstall_label_engine"}
)


# Hidden from type checkers, so that code still using the old names gets a type error too.
if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> _typing.Any:
        if name in _MOVED_TO_ENGINE:
            import warnings

            warnings.warn(
                f"spanprof.{name} moved to spanprof.engine.{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(engine, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
