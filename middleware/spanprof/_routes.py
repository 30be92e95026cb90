"""Route templates: the bounded name of a request, resolved before the handler runs.

Labels are set when the request enters the middleware, before the router has run, so the
middleware matches the scope against the app's routes itself (as Starlette's router will) to
name the request ``GET /items/{item_id}`` from its first sample on. Raw paths never become
labels: an unmatched request is named ``GET <unmatched>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._labelset import sanitize_value

__all__ = [
    "UNMATCHED",
    "RouteResolver",
    "known_method",
    "span_name",
    "span_name_label",
    "starlette_route_template",
]

UNMATCHED = "<unmatched>"

RouteResolver = Callable[[Mapping[str, Any]], "str | None"]

_KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "WEBSOCKET"}
)
_MAX_NAMES = 10_000
_names: dict[tuple[str, str], str] = {}
_labels: dict[str, str] = {}


def known_method(method: str) -> str:
    """The method if it is a standard one, else ``_OTHER`` (bounded, as OTel does)."""
    return method if method in _KNOWN_METHODS else "_OTHER"


def span_name(method: str, template: str) -> str:
    """``"GET /items/{item_id}"``: a known method (else ``_OTHER``) and the template as it is.

    The span name keeps the template's own text, as ``http.route`` does: only the profile label
    made from it is sanitized (``span_name_label``), since Pyroscope is what rejects non-ASCII.
    """
    key = (method, template)
    name = _names.get(key)
    if name is None:
        name = f"{known_method(method)} {template}"
        if len(_names) < _MAX_NAMES:  # bounded: templates are few, but a custom resolver may lie
            _names[key] = name
    return name


def span_name_label(name: str) -> str:
    """The ``span_name`` profile label for the span name ``name``: sanitized, memoized."""
    label = _labels.get(name)
    if label is None:
        label = sanitize_value(name)
        if len(_labels) < _MAX_NAMES:
            _labels[name] = label
    return label


def _routes_of(app: Any) -> Sequence[Any] | None:
    router = getattr(app, "router", None)
    routes = getattr(router, "routes", None)
    if routes is None:
        routes = getattr(app, "routes", None)
    if type(routes) is list or isinstance(routes, Sequence):  # list first: skip ABCMeta
        return routes
    return None


def _route_path(scope: Mapping[str, Any]) -> str:
    # Starlette's get_route_path: the path below root_path, which is what routes match.
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


# Compiled route tables, keyed by id() of the routes list (checked by identity and length,
# since apps may add routes after start-up).
_ROUTE, _WEBSOCKET, _MOUNT, _OTHER = range(4)
_Entry = tuple[int, Any, Any, str, Any]
_tables: dict[int, tuple[Sequence[Any], int, tuple[_Entry, ...]]] = {}


def _standard(route: Any, base: Any) -> bool:
    # A subclass that overrides matches() (other than FastAPI's, which only adds to the child
    # scope) may route differently: let it answer for itself.
    matches = type(route).matches
    return matches is base.matches or getattr(matches, "__module__", "").startswith("fastapi")


def _table(routes: Sequence[Any]) -> tuple[_Entry, ...]:
    cached = _tables.get(id(routes))
    if cached is not None and cached[0] is routes and cached[1] == len(routes):
        return cached[2]
    from starlette.routing import Mount, Route, WebSocketRoute

    entries: list[_Entry] = []
    for route in routes:
        if isinstance(route, Route) and _standard(route, Route):
            entries.append((_ROUTE, route.path_regex, route.methods, route.path, route))
        elif isinstance(route, WebSocketRoute) and _standard(route, WebSocketRoute):
            entries.append((_WEBSOCKET, route.path_regex, None, route.path, route))
        elif isinstance(route, Mount) and _standard(route, Mount):
            entries.append((_MOUNT, route.path_regex, None, route.path, route))
        else:
            entries.append((_OTHER, None, None, "", route))
    table = tuple(entries)
    if len(_tables) > 256:  # a process has a handful of routers; never grow without bound
        _tables.clear()
    _tables[id(routes)] = (routes, len(routes), table)
    return table


def _match(routes: Sequence[Any], scope: Mapping[str, Any], path: str) -> str | None:
    """The template of the route Starlette's router would pick for ``path``, if any.

    The same decisions as ``Route.matches`` (full match, or a method-only "partial" match that
    becomes a 405), without building the child scope and converting parameters.
    """
    kind_of_scope = scope["type"]
    partial: str | None = None
    for kind, regex, methods, template, route in _table(routes):
        if kind == _ROUTE:
            if kind_of_scope == "http" and regex.match(path):
                if not methods or scope.get("method") in methods:
                    return template
                if partial is None:
                    partial = template
        elif kind == _WEBSOCKET:
            if kind_of_scope == "websocket" and regex.match(path):
                return template
        elif kind == _MOUNT:
            found = regex.match(path)
            if found:
                remaining = "/" + found.group("path")
                inner = route.routes
                sub = _match(inner, scope, remaining) if inner else None
                return template + (sub if sub is not None else "/{path:path}")
        else:
            result = _generic(route, scope)
            if result is not None:
                return result
    return partial


def _generic(route: Any, scope: Mapping[str, Any]) -> str | None:
    """Hosts and custom routes: ask ``route.matches`` (full matches only)."""
    from starlette.routing import Host, Match

    try:
        match, child = route.matches(scope)
    except Exception:  # a custom route that cannot match this scope
        return None
    if match is not Match.FULL:
        return None
    if isinstance(route, Host):
        child_scope = {**scope, **child}
        inner = _routes_of(route.app)
        return _match(inner, child_scope, _route_path(child_scope)) if inner else None
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


def starlette_route_template(scope: Mapping[str, Any], app: Any = None) -> str | None:
    """The template of the Starlette/FastAPI route that will handle ``scope``, if any.

    Looks for routes on ``scope["app"]`` (set when the middleware runs inside a Starlette app)
    and then on ``app`` (the app the middleware wraps).
    """
    for candidate in (scope.get("app"), app):
        if candidate is None:
            continue
        routes = _routes_of(candidate)
        if routes:
            return _match(routes, scope, _route_path(scope))
    return None
