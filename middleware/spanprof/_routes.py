"""Route templates: the bounded name of a request, resolved before the handler runs.

Labels are set when the request enters the middleware, before the router has run, so the
middleware matches the scope against the app's routes itself (as Starlette's router will) to
name the request ``GET /items/{item_id}`` from its first sample on. Raw paths never become
labels: an unmatched request is named ``GET <unmatched>``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._labelset import sanitize_value

__all__ = [
    "UNMATCHED",
    "RouteResolver",
    "known_method",
    "span_name",
    "starlette_route_template",
]

UNMATCHED = "<unmatched>"

RouteResolver = Callable[[dict[str, Any]], "str | None"]

_KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "WEBSOCKET"}
)
_MAX_NAMES = 10_000
_names: dict[tuple[str, str], str] = {}


def known_method(method: str) -> str:
    """The method if it is a standard one, else ``_OTHER`` (bounded, as OTel does)."""
    return method if method in _KNOWN_METHODS else "_OTHER"


def span_name(method: str, template: str) -> str:
    """``"GET /items/{item_id}"``: a known method (else ``_OTHER``) and the sanitized template."""
    key = (method, template)
    name = _names.get(key)
    if name is None:
        name = sanitize_value(f"{known_method(method)} {template}")
        if len(_names) < _MAX_NAMES:  # bounded: templates are few, but a custom resolver may lie
            _names[key] = name
    return name


def _routes_of(app: Any) -> Sequence[Any] | None:
    router = getattr(app, "router", None)
    routes = getattr(router, "routes", None)
    if routes is None:
        routes = getattr(app, "routes", None)
    return routes if isinstance(routes, Sequence) else None


def _match(routes: Sequence[Any], scope: dict[str, Any]) -> str | None:
    from starlette.routing import Host, Match, Mount

    partial: tuple[Any, dict[str, Any]] | None = None
    for route in routes:
        try:
            match, child = route.matches(scope)
        except Exception:  # a custom route that cannot match this scope
            continue
        if match is Match.FULL:
            chosen: tuple[Any, dict[str, Any]] = (route, child)
            break
        if match is Match.PARTIAL and partial is None:
            partial = (route, child)
    else:
        if partial is None:
            return None
        chosen = partial
    route, child = chosen
    if isinstance(route, Mount | Host):
        child_scope = {**scope, **child}
        inner = _routes_of(route.app) if isinstance(route, Host) else route.routes
        sub = _match(inner, child_scope) if inner else None
        prefix = route.path if isinstance(route, Mount) else ""
        return prefix + (sub if sub is not None else "/{path:path}")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


def starlette_route_template(scope: dict[str, Any], app: Any = None) -> str | None:
    """The template of the Starlette/FastAPI route that will handle ``scope``, if any.

    Looks for routes on ``scope["app"]`` (set when the middleware runs inside a Starlette app)
    and then on ``app`` (the app the middleware wraps).
    """
    for candidate in (scope.get("app"), app):
        if candidate is None:
            continue
        routes = _routes_of(candidate)
        if routes:
            return _match(routes, scope)
    return None
