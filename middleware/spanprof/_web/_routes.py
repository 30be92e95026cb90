"""Route templates: the bounded name of a request, resolved before the handler runs.

Labels are set when the request enters the middleware, before the router has run, so the
middleware matches the scope against the app's routes itself (as Starlette's router will) to
name the request ``GET /items/{item_id}`` from its first sample on. Raw paths never become
labels: an unmatched request is named ``GET <unmatched>``.

The app may be a Starlette or FastAPI application, a ``Router`` or a bare route, behind any
middleware that keeps it as ``.app``; the matcher follows mounts, hosts, and FastAPI's included
routers (kept as one route since FastAPI 0.137) and ``frontend()`` builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._labels._labelset import sanitize_value
from .._logging import log_once

__all__ = [
    "UNMATCHED",
    "RouteResolver",
    "fastapi_telemetry_naming",
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
        # Bounded: templates are few, but a custom resolver may lie. Only standard methods are
        # remembered: any other is the client's own text, of any length (h11 takes a 16 KiB
        # method), and 10,000 of them were kept for good.
        if method in _KNOWN_METHODS and len(_names) < _MAX_NAMES:
            _names[key] = name
    return name


def resolved_template(template: object) -> str | None:
    """What a user's ``route_resolver`` returned, as a template: a string, else none.

    Anything else (a list, a route object) would fail the request where its name is made; the
    request is named ``UNMATCHED`` instead, and the resolver's mistake is logged once.
    """
    if template is None or isinstance(template, str):
        return template
    log_once(
        "route-resolver-type",
        f"spanprof: the route resolver returned a {type(template).__name__}, not a str or "
        f"None; such requests are named '{UNMATCHED}' (logged once)",
    )
    return None


def span_name_label(name: str) -> str:
    """The ``span_name`` profile label for the span name ``name``: sanitized, memoized."""
    label = _labels.get(name)
    if label is None:
        label = sanitize_value(name)
        if len(_labels) < _MAX_NAMES:
            _labels[name] = label
    return label


def _route_path(scope: Mapping[str, Any]) -> str:
    # Starlette's get_route_path: the path below root_path, which is what routes match.
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


# A match: the template (None when the route that serves the request has no template) and
# whether it is full (a method-only "partial" match becomes a 405 unless a later route matches
# in full).
_Found = tuple["str | None", bool]
# What _resolve answers for an app without routes (a match never has a partial without a name).
_NO_ROUTES: _Found = (None, False)

# Compiled route tables, keyed by id() of the routes sequence (held, so the id stays its own),
# with a copy of the sequence they were compiled from: apps add, insert and replace routes after
# start-up, and comparing the two lists (by identity, in C) catches all of it.
_ROUTE, _WEBSOCKET, _MOUNT, _HOST, _INCLUDED, _OTHER = range(6)
# (kind, path regex, methods, template, FastAPI's template, route)
_Entry = tuple[int, Any, Any, str, str, Any]
_MAX_TABLES = 256
_tables: dict[int, tuple[Sequence[Any], list[Any], tuple[_Entry, ...]]] = {}
_singles: dict[int, tuple[Any, tuple[Any, ...]]] = {}
_MAX_MIDDLEWARE_DEPTH = 8


def _standard(route: Any, base: Any) -> bool:
    # A subclass that overrides matches() (other than FastAPI's, which only adds to the child
    # scope) may route differently: let it answer for itself.
    matches = type(route).matches
    return matches is base.matches or getattr(matches, "__module__", "").startswith("fastapi")


def _entry(item: Any) -> _Entry:
    from starlette.routing import Host, Mount, Route, WebSocketRoute

    # FastAPI >= 0.137 keeps an included router as one route, whose candidates are its routes
    # with the include's prefix applied (``_EffectiveRouteContext``): a Starlette route built
    # for the prefixed path, or, for an APIRoute, the context itself with the prefixed regex.
    route = item
    if hasattr(item, "effective_candidates"):
        return (_INCLUDED, None, None, "", "", item)
    if hasattr(item, "original_route") and hasattr(item, "starlette_route"):
        route = item.starlette_route
        if route is None:
            if getattr(item, "path_regex", None) is None:
                return (_OTHER, None, None, "", "", None)  # a frontend group: low priority
            return (_ROUTE, item.path_regex, item.methods, item.path, item.path_format, item)
    if isinstance(route, Route) and _standard(route, Route):
        return (_ROUTE, route.path_regex, route.methods, route.path, route.path_format, route)
    if isinstance(route, WebSocketRoute) and _standard(route, WebSocketRoute):
        return (_WEBSOCKET, route.path_regex, None, route.path, route.path_format, route)
    if isinstance(route, Mount) and _standard(route, Mount):
        prefix = route.path_format.removesuffix("/{path}")
        return (_MOUNT, route.path_regex, None, route.path, prefix, route)
    if isinstance(route, Host) and _standard(route, Host):
        return (_HOST, None, None, "", "", route)
    return (_OTHER, None, None, "", "", route)


def _table(routes: Sequence[Any]) -> tuple[_Entry, ...]:
    cached = _tables.get(id(routes))
    # list == list compares items by identity first; a route replaced by an equal one
    # (Route.__eq__: same path, endpoint, methods) has the same template anyway.
    if (
        cached is not None
        and cached[0] is routes
        and cached[1] == (routes if type(routes) is list else list(routes))
    ):
        return cached[2]
    snapshot = list(routes)
    table = tuple(_entry(item) for item in snapshot)
    if len(_tables) >= _MAX_TABLES:  # a process has a handful of routers; never grow unbounded
        _tables.clear()
    _tables[id(routes)] = (routes, snapshot, table)
    return table


def _single(route: Any) -> tuple[Any, ...]:
    # A bare route served as the app: a one-route table that keeps its identity between requests.
    cached = _singles.get(id(route))
    if cached is not None and cached[0] is route:
        return cached[1]
    if len(_singles) >= _MAX_TABLES:
        _singles.clear()
    routes = (route,)
    _singles[id(route)] = (route, routes)
    return routes


def _match(
    routes: Sequence[Any], scope: Mapping[str, Any], path: str, fastapi: bool
) -> _Found | None:
    """The template of the route Starlette's (or FastAPI's) router would pick for ``path``.

    The same decisions as ``Route.matches`` (full match, or a method-only "partial" match that
    becomes a 405), without building the child scope and converting parameters. With
    ``fastapi``, templates are the ones FastAPI's telemetry gives the route (``path_format``,
    mounts as ``/prefix/{path}`` unless a FastAPI router below names the route).
    """
    kind_of_scope = scope["type"]
    partial: str | None = None
    for kind, regex, methods, template, ftemplate, route in _table(routes):
        if kind == _ROUTE:
            if kind_of_scope == "http" and regex.match(path):
                name = ftemplate if fastapi else template
                if not methods or scope.get("method") in methods:
                    return name, True
                if partial is None:
                    partial = name
        elif kind == _WEBSOCKET:
            if kind_of_scope == "websocket" and regex.match(path):
                return (ftemplate if fastapi else template), True
        elif kind == _MOUNT:
            found = regex.match(path)
            if found:
                return _mounted(route, scope, "/" + found.group("path"), fastapi, ftemplate), True
        elif kind == _INCLUDED:
            inner = _match(route.effective_candidates(), scope, path, fastapi)
            if inner is not None:
                if inner[1]:
                    return inner
                if partial is None:
                    partial = inner[0]
        else:
            result = _generic(kind, route, scope, path, fastapi)
            if result is not None:
                return result
    return (partial, False) if partial is not None else None


def _mounted(
    mount: Any, scope: Mapping[str, Any], remaining: str, fastapi: bool, prefix: str
) -> str:
    inner_app = getattr(mount, "_base_app", None) or mount.app
    inner = _resolve(inner_app, scope, remaining, fastapi)
    if fastapi:
        # FastAPI names the mount, and a FastAPI router in it names the route below it.
        if inner is None or inner[0] is None or not _is_fastapi_router(inner_app):
            return prefix + "/{path}"
        return prefix + inner[0]
    own: str = mount.path
    return own + (inner[0] if inner is not None and inner[0] else "/{path:path}")


def _generic(
    kind: int, route: Any, scope: Mapping[str, Any], path: str, fastapi: bool
) -> _Found | None:
    """Hosts and custom routes: ask ``route.matches`` (full matches only)."""
    from starlette.routing import Match

    if route is None:
        return None
    try:
        match, child = route.matches(scope)
    except Exception:  # a custom route that cannot match this scope
        return None
    if match is not Match.FULL:
        return None
    if kind == _HOST:
        # The route below the host names the request (FastAPI's telemetry only names it when a
        # FastAPI router is below).
        if fastapi and not _is_fastapi_router(route.app):
            return None, True
        inner = _resolve(route.app, {**scope, **child}, path, fastapi)
        return (inner[0] if inner is not None else None), True
    template = getattr(route, "path_format" if fastapi else "path", None)
    return (template if isinstance(template, str) else None), True


def _is_fastapi_router(app: Any) -> bool:
    router = getattr(app, "router", app)
    return hasattr(router, "_iter_low_priority_routes") or type(router).__module__.startswith(
        "fastapi"
    )


def _resolve(app: Any, scope: Mapping[str, Any], path: str, fastapi: bool) -> _Found | None:
    """Match ``path`` against the routes of ``app``: a Starlette or FastAPI app, a router, a
    bare route, or any of these behind middleware (``.app``)."""
    for _ in range(_MAX_MIDDLEWARE_DEPTH):
        router = getattr(app, "router", None)  # Starlette and FastAPI apps: checked first
        routes = getattr(router, "routes", None)
        if routes is None:
            if _is_route(app):
                return _match(_single(app), scope, path, fastapi)
            router = app
            routes = getattr(app, "routes", None)
        if type(routes) is list or isinstance(routes, Sequence):  # list first: skip ABCMeta
            found = _match(routes, scope, path, fastapi) if routes else None
            if found is None and hasattr(router, "_iter_low_priority_routes"):
                return _fastapi_fallbacks(router, routes, scope, path, fastapi)
            return found
        app = getattr(app, "app", None)  # a middleware: look at the app it wraps
        if app is None:
            return _NO_ROUTES
    return _NO_ROUTES


def _is_route(app: Any) -> bool:
    if not hasattr(app, "matches"):
        return False
    from starlette.routing import BaseRoute

    return isinstance(app, BaseRoute)


def _fastapi_fallbacks(
    router: Any, routes: Sequence[Any], scope: Mapping[str, Any], path: str, fastapi: bool
) -> _Found | None:
    """What a FastAPI router does when no route matched: a slash redirect, else its
    low-priority routes (``frontend()`` builds, most specific first)."""
    if scope["type"] != "http":
        return None
    if getattr(router, "redirect_slashes", False) and path != "/":
        toggled = path[:-1] if path.endswith("/") else path + "/"
        redirect = _match(routes, scope, toggled, fastapi) if routes else None
        if redirect is not None:
            # FastAPI's telemetry names a redirect after its target; Starlette does not name it.
            return (redirect[0] if fastapi else None), True
    best: tuple[str, int, bool] | None = None
    for candidate in router._iter_low_priority_routes():
        group, prefix = candidate, ""
        if hasattr(candidate, "original_route"):  # a frontend group in an included router
            group, prefix = candidate.original_route, getattr(candidate, "frontend_prefix", "")
        for frontend in getattr(group, "routes", None) or ():
            joined = _join_frontend(prefix, frontend.path)
            if not _frontend_matches(joined, path):
                continue
            full = scope.get("method") in frontend.methods
            specificity = 0 if joined == "/" else len(joined)
            if best is None or (full, specificity) > (best[2], best[1]):
                best = (joined.rstrip("/") + "/{path}", specificity, full)
    return (best[0], best[2]) if best is not None else None


def _join_frontend(prefix: str, path: str) -> str:
    if not prefix:
        return path
    return prefix if path == "/" else prefix + path


def _frontend_matches(frontend_path: str, path: str) -> bool:
    return frontend_path == "/" or path == frontend_path or path.startswith(frontend_path + "/")


def fastapi_telemetry_naming(scope: Mapping[str, Any], span: Any) -> tuple[str, str] | None:
    """``(method, prefix)`` FastAPI's telemetry names ``span`` with, if it opened that span.

    FastAPI (>= 0.1xx, with telemetry) renames its server span when its router selects a route,
    to ``"{method} {prefix}{path_format}"`` (``HTTP`` for unknown methods, ``WS`` for
    websockets, the root path as prefix); spanprof, running inside it, names the request the
    same way so the span and its profile label agree.
    """
    telemetry = scope.get("fastapi.telemetry")
    if telemetry is None or getattr(telemetry, "span", None) is not span:
        return None
    method = getattr(telemetry, "span_method", None)
    prefix = getattr(telemetry, "_mount_prefix", "")
    if not isinstance(method, str) or not isinstance(prefix, str):
        return None
    return method, prefix


def starlette_route_template(
    scope: Mapping[str, Any], app: Any = None, *, fastapi_prefix: str | None = None
) -> str | None:
    """The template of the Starlette/FastAPI route that will handle ``scope``, if any.

    Looks for routes on ``app`` (the app the middleware wraps, and the apps it wraps in turn),
    then on ``scope["app"]`` (set when the middleware runs inside a Starlette app). With
    ``fastapi_prefix``, the template is the one FastAPI's telemetry names the route with
    (``fastapi_telemetry_naming``), prefix included.
    """
    fastapi = fastapi_prefix is not None
    path = _route_path(scope)
    for candidate in (app, scope.get("app")):
        if candidate is None:
            continue
        found = _resolve(candidate, scope, path, fastapi)
        if found is _NO_ROUTES:
            continue
        if found is None or found[0] is None:
            return None
        return fastapi_prefix + found[0] if fastapi_prefix else found[0]
    return None
