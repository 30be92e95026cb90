"""Route templates for WSGI apps, resolved from the environ before the app runs.

Labels are set when the request enters the middleware, before the framework has routed it, so
the middleware matches the request itself, the way the framework is about to, and names it
``GET /items/<int:item_id>`` from its first sample on:

- Flask: the app's ``url_map``, bound as ``Flask.create_url_adapter`` binds it; the template is
  the matching rule's ``rule``. The app's own URL converters never run here (they are app
  code, often a database lookup that needs Flask's app context): the framework runs them,
  once;
- Django: the ``ROOT_URLCONF`` resolver's patterns; the template is the route Django's
  ``ResolverMatch.route`` would be (Django writes routes relative to the root: spanprof adds
  the leading ``/``). Converters never run here: Django runs them, once;
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
    rule; redirects (strict slashes, defaults, ``redirect_to``) and 404s have no template.

    The match runs no app code: it runs against a shadow of the app's map (see
    ``_shadow_map``) whose app-defined converters only match their regex. werkzeug picks the
    rule by regex and converts the picked rule's values afterwards, so the template is the
    one Flask picks, except where an app-defined converter's ``to_python`` decides:

    - it rejects a value (raises ``ValidationError``): Flask answers 404, spanprof names the
      request after the rule;
    - another rule of the endpoint has ``defaults`` (``redirect_defaults``): werkzeug
      redirects when the converted value equals the default; spanprof compares the string
      as captured, so it names a redirect, or misses one, where converting changes the value.

    Arguments:
        app: the ``flask.Flask`` application.
    """
    from werkzeug.exceptions import HTTPException, MethodNotAllowed

    # (the map, its rule signal, its shadow): replaced whole, so a thread never pairs one
    # map's signal with another's shadow. Two threads may both rebuild after a change; each
    # shadow is complete, the last one stays. Built on the first request, when set-up code
    # has added its rules and settings.
    built: tuple[Any, int, Any] | None = None

    def resolve(environ: WSGIEnvironment) -> str | None:
        nonlocal built
        url_map = app.url_map
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
        current = built
        try:  # inline, not a helper: every request pays for this check
            count, remapped = len(url_map._rules_by_endpoint), url_map._remap
        except (AttributeError, TypeError):  # werkzeug changed its internals
            count, remapped = _rule_count(url_map), False
        # Rules added since the shadow was built (see _rule_count): ``Map.add`` sets ``_remap``
        # until the map is next sorted (Flask's own match, right after this, or the
        # rebuild's ``iter_rules``), and a new endpoint changes the count.
        if current is None or current[0] is not url_map or current[1] != count or remapped:
            current = built = (url_map, count, _shadow_map(url_map))
        adapter = current[2].bind_to_environ(environ, server_name=server_name, subdomain=subdomain)
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


def _rule_count(url_map: Any) -> int:
    """The resolver's change signal where werkzeug keeps no ``_rules_by_endpoint``: O(n).

    The resolver checks on every request that the shadow map is current, in O(1): werkzeug
    maps only grow (``Map.add``; there is no removal) and keep their rules by endpoint, so a
    new endpoint changes the count of endpoints, and a rule for an existing endpoint sets
    ``_remap`` until the map is next sorted. Only a rule added for a known endpoint and
    sorted in by app code (``url_for``, ``iter_rules``) before the next request goes unseen,
    until the next new endpoint: Flask refuses ``add_url_rule`` once it served a request.
    """
    return sum(1 for _ in url_map.iter_rules())


def _shadow_map(url_map: Any) -> Any:
    """A werkzeug ``Map`` that matches as ``url_map`` does, without running app code.

    Each rule is copied from its public attributes (as bound: strict and merge slashes,
    subdomain already settled) into a ``Rule`` whose converters are the original rule's:
    werkzeug's own converter objects as they are (pure werkzeug code, so ``<int(min=1)>``
    and default redirects behave exactly), app-defined ones replaced by a plain converter
    with the same regex, weight and ``part_isolating``, whose ``to_python`` returns the
    string. Converter classes are not instantiated again (their ``__init__`` is app code
    too). ``redirect_to`` becomes a constant: the request still redirects (no template)
    without calling the app's redirect callable.
    """
    from werkzeug.routing import BaseConverter, Map, Rule
    from werkzeug.routing.converters import DEFAULT_CONVERTERS

    werkzeug_converters = {*DEFAULT_CONVERTERS.values(), BaseConverter}

    class _RegexOnly(BaseConverter):
        def __init__(self, map: Map, source: BaseConverter) -> None:
            super().__init__(map)
            self.regex = source.regex
            self.weight = source.weight
            self.part_isolating = source.part_isolating

    class _ShadowRule(Rule):
        source: Rule

        def get_converter(
            self,
            variable_name: str,
            converter_name: str,
            args: tuple[Any, ...],
            kwargs: Any,
        ) -> BaseConverter:
            original: BaseConverter = self.source._converters[variable_name]
            if type(original) in werkzeug_converters:
                return original
            assert self.map is not None  # get_converter runs while the rule is bound
            return _RegexOnly(self.map, original)

    shadow = Map(
        default_subdomain=url_map.default_subdomain,
        strict_slashes=url_map.strict_slashes,
        merge_slashes=url_map.merge_slashes,
        redirect_defaults=url_map.redirect_defaults,
        sort_parameters=url_map.sort_parameters,
        sort_key=url_map.sort_key,
        host_matching=url_map.host_matching,
    )
    for rule in list(url_map.iter_rules()):
        copy = _ShadowRule(
            rule.rule,
            defaults=dict(rule.defaults) if rule.defaults else None,
            subdomain=rule.subdomain,
            methods=rule.methods,
            build_only=rule.build_only,
            endpoint=rule.endpoint,
            strict_slashes=rule.strict_slashes,
            merge_slashes=rule.merge_slashes,
            redirect_to=None if rule.redirect_to is None else "/",
            alias=rule.alias,
            host=rule.host,
            websocket=rule.websocket,
        )
        copy.source = rule
        shadow.add(copy)
    return shadow


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

    The match runs no converter (``register_converter`` converters are app code, often a
    database lookup): ``path()`` patterns are matched by their regex, as Django matches them
    before converting. Django's own converters never reject a value their regex matched, so
    the route is the one Django resolves, except for an app converter whose ``to_python``
    rejects a value (raises ``ValueError``): Django goes on to the next pattern (often none:
    a 404), spanprof names the request after the pattern whose regex matched.

    ``i18n_patterns`` routes are matched, and named, in the language ``LocaleMiddleware`` is
    about to activate for the request: the language of the path's prefix, else
    ``LANGUAGE_CODE``. As Django names them, the route has the prefix: ``/fr/items/<int:id>/``,
    and none for the default language when ``prefix_default_language=False``.

    Arguments:
        urlconf: the URLconf module to resolve against.
    """
    from django.conf import settings
    from django.core.handlers.wsgi import get_path_info
    from django.urls import Resolver404, URLPattern, URLResolver, get_resolver
    from django.urls.resolvers import LocalePrefixPattern, RoutePattern
    from django.utils.translation import get_language, get_language_from_path, override

    def route_in(resolver: Any, path: str, whole: str) -> str | None:
        """``URLResolver.resolve``'s route for ``path`` (of the request's ``whole`` path),
        without converting."""
        rest = match(resolver.pattern, path)
        if rest is None:
            return None
        for pattern in resolver.url_patterns:
            kind = type(pattern)
            if kind is URLPattern:
                # URLPattern.resolve: its route is its pattern's text.
                if match(pattern.pattern, rest) is not None:
                    return str(pattern.pattern)
            elif kind is URLResolver:
                if type(pattern.pattern) is LocalePrefixPattern:
                    sub = localized_route(pattern, rest, whole)
                    if sub is not None:
                        return sub
                    continue
                sub = route_in(pattern, rest, whole)
                if sub is not None:
                    return join(str(pattern.pattern), sub)
            else:
                # A subclass may resolve its own way: ask it (it converts, as before).
                sub = foreign_route(pattern, rest)
                if sub is not None:
                    own = "" if isinstance(pattern, URLPattern) else str(pattern.pattern)
                    return join(own, sub)
        return None

    def localized_route(resolver: Any, path: str, whole: str) -> str | None:
        """The route of an ``i18n_patterns`` resolver, in the request's language."""
        # LocalePrefixPattern matches, and reads as, the active language's prefix (translated
        # routes: their active translation), but LocaleMiddleware activates the request's
        # language only after this naming ran: until then the thread has its previous
        # request's. LocaleMiddleware's choice: the path's language, else LANGUAGE_CODE with
        # prefix_default_language=False. With True, it picks from cookie or headers, but a
        # path with no language of LANGUAGES as its prefix matches none of their prefixes:
        # LANGUAGE_CODE's fails it alike, without parsing the request.
        language = get_language_from_path(whole) or settings.LANGUAGE_CODE
        if get_language() == language:  # the common case: the thread served this language
            return in_language(resolver, path, whole)
        with override(language):
            return in_language(resolver, path, whole)

    def in_language(resolver: Any, path: str, whole: str) -> str | None:
        sub = route_in(resolver, path, whole)
        return None if sub is None else join(str(resolver.pattern), sub)

    def join(route: str, sub: str) -> str:
        # URLResolver._join_route.
        return route + sub.removeprefix("^") if route else sub

    def match(pattern: Any, path: str) -> str | None:
        """The rest of ``path`` after ``pattern``, or ``None``."""
        if type(pattern) is RoutePattern and pattern.converters:
            # RoutePattern.match converts every captured value; the regex alone decides.
            found = pattern.regex.search(path)
            return None if found is None else path[found.end() :]
        # Regex and locale-prefix patterns capture strings only: their own match converts
        # nothing (and a route without converters matches by string comparison). A pattern
        # class of the app's own matches its own way, as before.
        result = pattern.match(path)
        return None if result is None else str(result[0])

    def foreign_route(pattern: Any, path: str) -> str | None:
        try:
            found = pattern.resolve(path)
        except Resolver404:
            return None
        route = getattr(found, "route", None) if found else None
        return route if isinstance(route, str) else None

    def resolve(environ: WSGIEnvironment) -> str | None:
        # WSGIRequest's path_info: a request for the SCRIPT_NAME prefix itself ("/app", with an
        # empty PATH_INFO) is routed as "/".
        path = get_path_info(environ) or "/"
        route = route_in(get_resolver(urlconf), path, path)
        return None if route is None else "/" + route.removeprefix("^")

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
