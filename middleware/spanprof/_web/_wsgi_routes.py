"""Route templates for WSGI apps, resolved from the environ before the app runs.

Labels are set when the request enters the middleware, before the framework has routed it, so
the middleware matches the request itself, the way the framework is about to, and names it
``GET /items/<int:item_id>`` from its first sample on:

- Flask: the app's ``url_map``, bound as ``Flask.create_url_adapter`` binds it; the template is
  the matching rule's ``rule``;
- Django: the ``ROOT_URLCONF`` resolver; the template is the ``ResolverMatch.route`` (Django
  writes routes relative to the root: spanprof adds the leading ``/``);
- anything else: a ``route_resolver`` callable, else ``<unmatched>``.

Raw paths never become templates.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

__all__ = [
    "WSGIRouteResolver",
    "default_route_resolver",
    "django_route_resolver",
    "flask_route_resolver",
]

WSGIRouteResolver = Callable[["WSGIEnvironment"], "str | None"]
"""``environ -> route template``, or ``None`` when no route matches."""


def flask_route_resolver(app: Any) -> WSGIRouteResolver:
    """Resolve requests against a Flask app's URL map, as Flask will route them.

    A request whose path matches a rule for other methods only (a 405) is named after that
    rule; redirects (strict slashes) and 404s have no template.

    Arguments:
        app: the ``flask.Flask`` application.
    """
    from werkzeug.exceptions import HTTPException, MethodNotAllowed

    url_map = app.url_map

    def resolve(environ: WSGIEnvironment) -> str | None:
        # Flask.create_url_adapter, minus its trusted-hosts check (Flask raises that itself).
        server_name = app.config.get("SERVER_NAME")
        subdomain = None
        if url_map.host_matching:
            server_name = None
        elif not app.subdomain_matching:
            subdomain = url_map.default_subdomain or ""
        if subdomain is None and server_name is not None:
            # Werkzeug works the subdomain out itself, and warns when the host does not end in
            # SERVER_NAME; Flask's own binding already warns for this request, and under
            # ``-W error`` a second warning would fail the resolution. Work it out the same way.
            subdomain = _subdomain(environ, server_name)
        adapter = url_map.bind_to_environ(environ, server_name=server_name, subdomain=subdomain)
        try:
            rule, _ = adapter.match(return_rule=True)
        except MethodNotAllowed as exc:
            if not exc.valid_methods:
                return None
            try:
                rule, _ = adapter.match(method=sorted(exc.valid_methods)[0], return_rule=True)
            except HTTPException:
                return None
        except HTTPException:  # NotFound, RequestRedirect
            return None
        template = getattr(rule, "rule", None)
        return template if isinstance(template, str) else None

    return resolve


def _subdomain(environ: WSGIEnvironment, server_name: str) -> str:
    """The subdomain ``Map.bind_to_environ`` derives from the host, without its warning."""
    from werkzeug.wsgi import get_host

    host = get_host(environ).lower()
    configured = server_name.lower()
    # get_host() drops the scheme's standard port; so does werkzeug from SERVER_NAME.
    default_port = ":443" if environ.get("wsgi.url_scheme") == "https" else ":80"
    configured = configured.removesuffix(default_port)
    current, real = host.split("."), configured.split(".")
    offset = -len(real)
    if current[offset:] != real:
        return "<invalid>"  # werkzeug's value: only wildcard subdomain rules match it
    return ".".join(filter(None, current[:offset]))


def django_route_resolver(urlconf: str | None = None) -> WSGIRouteResolver:
    """Resolve requests against Django's URLconf (default: ``settings.ROOT_URLCONF``).

    A ``request.urlconf`` set by a middleware is not known before the request runs; such
    requests are named after the root URLconf's match.

    Arguments:
        urlconf: the URLconf module to resolve against.
    """
    from django.core.handlers.wsgi import get_path_info
    from django.urls import Resolver404, get_resolver

    def resolve(environ: WSGIEnvironment) -> str | None:
        try:
            match = get_resolver(urlconf).resolve(get_path_info(environ))
        except Resolver404:
            return None
        route = getattr(match, "route", None)
        if not isinstance(route, str):
            return None
        return "/" + route.removeprefix("^")

    return resolve


def _inner(app: Any) -> list[Any]:
    # How wrappers keep the app they wrap: a bound method (``app.wsgi_app``), decorators
    # (``__wrapped__``), closures (FlaskInstrumentor's wrapper), and middleware attributes
    # (``.app`` for werkzeug's ProxyFix and most others, ``.application`` for WhiteNoise,
    # ``.wsgi`` for OpenTelemetry's).
    found = [
        getattr(app, name, None)
        for name in ("__self__", "__wrapped__", "app", "application", "wsgi")
    ]
    for cell in getattr(app, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return [item for item in found if item is not None and callable(item)]


def _find_framework_app(app: Any, depth: int = 4) -> tuple[str, Any] | None:
    flask = sys.modules.get("flask")
    handlers = sys.modules.get("django.core.handlers.wsgi")
    seen: set[int] = set()
    layer = [app]
    for _ in range(depth):
        following: list[Any] = []
        for candidate in layer:
            if id(candidate) in seen:
                continue
            seen.add(id(candidate))
            if flask is not None and isinstance(candidate, flask.Flask):
                return "flask", candidate
            if handlers is not None and isinstance(candidate, handlers.WSGIHandler):
                return "django", candidate
            following.extend(_inner(candidate))
        layer = following
    return None


def default_route_resolver(app: Any) -> WSGIRouteResolver | None:
    """The resolver for the Flask app or Django handler that ``app`` is or wraps, if any.

    Looks through a few layers of wrapping (bound methods, decorators, closures, middleware
    ``.app`` / ``.application`` / ``.wsgi`` attributes) for a ``flask.Flask`` or Django's
    ``WSGIHandler``. Apps behind middleware that rewrites ``PATH_INFO`` (mounts) need an
    explicit resolver.
    """
    found = _find_framework_app(app)
    if found is None:
        return None
    kind, framework_app = found
    return flask_route_resolver(framework_app) if kind == "flask" else django_route_resolver()
