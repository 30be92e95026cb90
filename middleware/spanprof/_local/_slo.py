"""SLO verdicts for the local mode: which requests breached, against which threshold.

The middlewares mark a breaching server span with ``spanprof.slo.breached`` and
``spanprof.slo.threshold_s``, and one within its SLO with ``spanprof.slo.breached=false`` once
it took more than half its threshold. Local mode trusts those attributes when a span has them
and otherwise compares the span's duration with the same ``SloPolicy`` (built from the same
``SPANPROF_SLO_SECONDS`` / ``SPANPROF_ROUTE_SLO`` settings), so the page also works with apps
whose middleware does not mark spans. An unmarked span of spanprof's middleware took less than
half its threshold up to its last body message: both verdicts agree unless sending that message
took the other half.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._signals._duration import BREACH_ATTRIBUTE, THRESHOLD_ATTRIBUTE
from .._signals._slo import SloPolicy

__all__ = ["SloPolicy", "describe", "judge", "policy_env", "policy_from"]

_SLO_ENV = "SPANPROF_SLO_SECONDS"
_ROUTE_ENV = "SPANPROF_ROUTE_SLO"


def policy_from(
    environ: Mapping[str, str], *, slo: str | None = None, route_slo: str | None = None
) -> SloPolicy:
    """The policy of the environment, with the command line's ``--slo``/``--route-slo`` on top.

    Raises ``ValueError`` naming the setting when a value is not a valid threshold.
    """
    merged = dict(environ)
    if slo is not None:
        merged[_SLO_ENV] = slo
    if route_slo is not None:
        merged[_ROUTE_ENV] = route_slo
    return SloPolicy.build(slo_seconds=None, route_slos=None, environ=merged)


def policy_env(policy: SloPolicy) -> dict[str, str]:
    """The environment that gives the app's middleware the same policy."""
    return {
        _SLO_ENV: repr(policy.default),
        _ROUTE_ENV: ",".join(f"{route}={seconds!r}" for route, seconds in policy.routes.items()),
    }


def judge(
    policy: SloPolicy, route: str | None, duration_s: float, attributes: Mapping[str, object]
) -> tuple[bool, float, str]:
    """``(breached, threshold_s, source)`` of one server span.

    ``source`` is ``"span"`` when the middleware marked the span, ``"local"`` when the local
    mode compared the span's duration with ``policy``.
    """
    marked = attributes.get(BREACH_ATTRIBUTE)
    if isinstance(marked, bool):
        recorded = attributes.get(THRESHOLD_ATTRIBUTE)
        if isinstance(recorded, int | float) and not isinstance(recorded, bool):
            return marked, float(recorded), "span"
        return marked, policy.threshold(route), "span"
    threshold = policy.threshold(route)
    return duration_s > threshold, threshold, "local"


def describe(policy: SloPolicy) -> dict[str, object]:
    """The policy as JSON for the page."""
    return {"default_s": policy.default, "routes": dict(policy.routes)}
