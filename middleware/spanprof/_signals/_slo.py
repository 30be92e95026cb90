"""Latency SLOs: a default threshold and per-route overrides keyed by route template."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .._config import shown_value
from .._env import env_value

__all__ = ["DEFAULT_SLO_SECONDS", "SloPolicy"]

DEFAULT_SLO_SECONDS = 0.5


def _threshold(setting: str, value: object, *, text: bool = False) -> float:
    # Only an environment variable's text is parsed: in code, "0.3" is a mistake somewhere,
    # and True would be a 1-second SLO.
    if isinstance(value, bool) or not isinstance(
        value, (int, float, str) if text else (int, float)
    ):
        raise ValueError(
            f"{setting}={value!r}: expected a positive number of seconds (int or float), "
            f"got {type(value).__name__}"
        )
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{setting}={shown_value(value)}: expected a positive number of seconds")
    return number


def _route(setting: str, template: object) -> str:
    if not isinstance(template, str) or not template.startswith("/"):
        raise ValueError(
            f"{setting}: route {template!r} must be a route template starting with '/', "
            "like '/items/{item_id}'"
        )
    return template


@dataclass(frozen=True)
class SloPolicy:
    """Which duration breaches a request's SLO: ``routes`` by template, else ``default``.

    ```python
    slo = spanprof.SloPolicy(default=0.5, routes={"/checkout": 0.25})
    app.add_middleware(spanprof.ProfilingMiddleware, slo=slo)
    ```

    Arguments:
        default: seconds; the SLO of every route without its own (default 0.5).
        routes: seconds by route template (``"/items/{item_id}"``).

    A threshold that is not a positive number, or a route that is not a template starting with
    ``/``, raises ``ValueError``.
    """

    default: float = DEFAULT_SLO_SECONDS
    routes: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A policy built by hand is checked like one built from options or the environment.
        object.__setattr__(self, "default", _threshold("SloPolicy.default", self.default))
        if not isinstance(self.routes, Mapping):
            raise ValueError(f"SloPolicy.routes: expected a mapping, got {self.routes!r}")
        routes = {
            _route("SloPolicy.routes", template): _threshold(
                f"SloPolicy.routes[{template!r}]", seconds
            )
            for template, seconds in self.routes.items()
        }
        object.__setattr__(self, "routes", routes)

    @classmethod
    def build(
        cls,
        *,
        slo_seconds: float | None,
        route_slos: Mapping[str, float] | None,
        environ: Mapping[str, str],
    ) -> SloPolicy:
        """Options first, then ``SPANPROF_SLO_SECONDS`` / ``SPANPROF_ROUTE_SLO``, then 0.5 s."""
        if slo_seconds is not None:
            default = _threshold("slo_seconds", slo_seconds)
        else:
            raw = env_value(environ, "SPANPROF_SLO_SECONDS")
            default = (
                _threshold("SPANPROF_SLO_SECONDS", raw, text=True) if raw else DEFAULT_SLO_SECONDS
            )
        routes: dict[str, float] = {}
        if route_slos is not None:
            if not isinstance(route_slos, Mapping):
                raise ValueError(
                    "route_slos: expected a mapping of route templates to seconds, got "
                    f"{type(route_slos).__name__} {route_slos!r}"
                )
            for template, seconds in route_slos.items():
                routes[_route("route_slos", template)] = _threshold(
                    f"route_slos[{template!r}]", seconds
                )
        elif raw_routes := env_value(environ, "SPANPROF_ROUTE_SLO"):
            routes = cls.parse_routes("SPANPROF_ROUTE_SLO", raw_routes)
        return cls(default=default, routes=routes)

    @staticmethod
    def parse_routes(setting: str, text: str) -> dict[str, float]:
        """``/checkout=0.25,/search=1`` to ``{"/checkout": 0.25, "/search": 1.0}``.

        A route given twice, or holding ``=`` or ``;`` (pairs joined by the wrong separator),
        raises ``ValueError``: route templates (``/items/{item_id}``, ``/items/<int:id>``) do
        not contain them in practice, and taking them would misread the text silently.
        """
        routes: dict[str, float] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            template, sep, seconds = part.rpartition("=")
            if not sep:
                raise ValueError(
                    f"{setting}={text!r}: expected comma-separated route=seconds pairs, "
                    "like '/checkout=0.25,/search=1'"
                )
            template = template.strip()
            if "=" in template or ";" in template:
                raise ValueError(
                    f"{setting}: route {template!r} contains '=' or ';'; separate route=seconds "
                    "pairs with ',', like '/checkout=0.25,/search=1'"
                )
            if template in routes:
                raise ValueError(f"{setting}={text!r}: the route {template!r} is given twice")
            routes[_route(setting, template)] = _threshold(
                f"{setting} ({template})", seconds.strip(), text=True
            )
        return routes

    def threshold(self, route: str | None) -> float:
        """The SLO of ``route`` (a template, or ``None`` when no route matched)."""
        if route is not None:
            override = self.routes.get(route)
            if override is not None:
                return override
        return self.default
