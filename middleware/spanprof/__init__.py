"""spanprof: exact per-request profile labels for Python web apps.

Profiles and traces point at each other: every sample of a request carries its ``span_id``,
``trace_id`` and route, and its server span carries ``pyroscope.profile.id``.
"""

from __future__ import annotations

from ._asgi import ProfilingMiddleware
from ._backend import ProfilerBackend
from ._engine import install_label_engine, installed_backend, uninstall_label_engine
from ._exact import ExactBackend
from ._greenlets import install_greenlet_labels, uninstall_greenlet_labels
from ._labelset import LabelSet
from ._prometheus import PrometheusMetrics
from ._pyroscope import PyroscopeBackend
from ._recorder import RecorderBackend
from ._scope import current_labels, profile_labels
from ._settings import FROM_ENV
from ._slo import SloPolicy
from ._wsgi import WSGIProfilingMiddleware
from ._wsgi_routes import django_route_resolver, flask_route_resolver

__all__ = [
    "ExactBackend",
    "FROM_ENV",
    "LabelSet",
    "ProfilerBackend",
    "ProfilingMiddleware",
    "PrometheusMetrics",
    "PyroscopeBackend",
    "RecorderBackend",
    "SloPolicy",
    "WSGIProfilingMiddleware",
    "current_labels",
    "django_route_resolver",
    "flask_route_resolver",
    "install_greenlet_labels",
    "install_label_engine",
    "installed_backend",
    "profile_labels",
    "uninstall_greenlet_labels",
    "uninstall_label_engine",
]

__version__ = "0.1.0"
