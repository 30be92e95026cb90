"""The Django project's ``wsgi.py``, served as ``tests.e2e.django_wsgi:application``."""

from __future__ import annotations

from .django_project import configure, django_application
from .wsgi_app import backend_from_env

configure()
application = django_application(profiler=backend_from_env())
