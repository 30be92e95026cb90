"""Why the slow requests are slow: a route's breaching requests against its good ones.

The exact profiler labels every sample of a request ``slo=breached`` or ``slo=ok`` once the
request ends. ``SloComparison`` adds those samples up per route (``span_name``) and side, and
compares the sides per request: a differential flame graph (the breaching requests' average,
each frame coloured by how much more it costs them than a good request) and the functions
ranked by extra self CPU per request, in microseconds, with the number of requests behind each
side (from the span store, so requests too short to be sampled count too).

The same comparison serves memory (``unit="bytes"`` or ``"count"``: what each side's requests
allocated), and ``compare_sides`` compares sides built elsewhere (the in-use snapshot, whose
samples carry no ``slo`` label and are sided by the span store's verdicts).

Bounded like the rest of local mode: at most ``max_routes`` routes, and an estimate of the bytes
its stacks hold; past it a side's new stacks are folded into one ``[truncated]`` stack.
"""

from __future__ import annotations

import threading
from typing import Any

from .._profiling._window import Frame
from ._stacks import descend

__all__ = ["SIDES", "SloComparison", "compare_sides"]

#: The two values of the ``slo`` label, breaching side first.
SIDES = ("breached", "ok")

_TRUNCATED = (Frame("[truncated]", "", 0),)
_STACK_OVERHEAD = 160


class SloComparison:
    """Samples per ``(route, slo)``, merged by stack (leaf first); compared per request.

    Arguments:
        max_routes: routes (``span_name`` values) kept; later ones are not compared.
        max_bytes: estimated bytes of the stacks kept over all routes.
        unit: what the samples' values are (``nanoseconds`` of CPU, allocated ``bytes``...).
    """

    def __init__(
        self,
        *,
        max_routes: int = 64,
        max_bytes: int = 16 * 1024 * 1024,
        unit: str = "nanoseconds",
    ) -> None:
        self._lock = threading.Lock()
        self.unit = unit
        self._sides: dict[str, dict[str, dict[tuple[Frame, ...], int]]] = {}
        self.max_routes = max_routes
        self.max_bytes = max_bytes
        self._bytes = 0
        self.unlabelled_ns = 0

    def add(self, stack: tuple[Frame, ...], value: int, route: str, slo: str | None) -> None:
        """One request sample of ``route``; ``slo`` is its label (``None``: went out without)."""
        with self._lock:
            if slo not in SIDES:
                self.unlabelled_ns += value
                return
            sides = self._sides.get(route)
            if sides is None:
                if len(self._sides) >= self.max_routes:
                    return
                sides = self._sides[route] = {side: {} for side in SIDES}
            stacks = sides[slo]
            previous = stacks.get(stack)
            if previous is not None:
                stacks[stack] = previous + value
            elif self._bytes < self.max_bytes:
                stacks[stack] = value
                self._bytes += _STACK_OVERHEAD + 8 * len(stack)
            else:
                stacks[_TRUNCATED] = stacks.get(_TRUNCATED, 0) + value

    def routes(self) -> list[str]:
        """The routes with labelled samples, by name."""
        with self._lock:
            return sorted(self._sides)

    def sampled_ns(self, route: str) -> dict[str, int]:
        """The sum of ``route``'s samples per side (CPU nanoseconds, or ``unit``)."""
        with self._lock:
            sides = self._sides.get(route, {})
            return {side: sum(sides.get(side, {}).values()) for side in SIDES}

    def compare(
        self, route: str, requests: dict[str, int], *, limit: int = 50
    ) -> dict[str, Any] | None:
        """``route``'s breach-vs-ok comparison, per request of each side (``requests``).

        ``None`` when the route has no labelled samples. See ``compare_sides``.
        """
        with self._lock:
            sides = self._sides.get(route)
            if sides is None:
                return None
            copies = {side: dict(stacks) for side, stacks in sides.items()}
        return compare_sides(route, copies, requests, unit=self.unit, limit=limit)


def compare_sides(
    route: str,
    sides: dict[str, dict[tuple[Frame, ...], int]],
    requests: dict[str, int],
    *,
    unit: str = "nanoseconds",
    limit: int = 50,
) -> dict[str, Any]:
    """``route``'s breaching side against its ok side (``sides``), per request (``requests``).

    Functions are ranked by extra self value per breaching request (``breached``, ``ok`` and
    ``extra`` in ``unit``; CPU also in microseconds, ``breached_us``...); a side without
    requests counts as zero per request.
    """
    per = {side: (1.0 / requests[side] if requests.get(side) else 0.0) for side in SIDES}
    self_values: dict[tuple[str, str], list[float]] = {}
    for index, side in enumerate(SIDES):
        for stack, value in sides.get(side, {}).items():
            if not stack:
                continue
            leaf = stack[0]
            cell = self_values.setdefault((leaf.function, leaf.filename), [0.0, 0.0])
            cell[index] += value * per[side]
    ranked = sorted(self_values.items(), key=lambda item: (-(item[1][0] - item[1][1]), item[0][0]))
    cpu = unit == "nanoseconds"
    functions = []
    for (function, filename), (breached, ok) in ranked[:limit]:
        row: dict[str, Any] = {
            "function": function,
            "file": filename,
            "breached": breached,
            "ok": ok,
            "extra": breached - ok,
        }
        if cpu:  # what the page and its users read first, before memory came
            row.update(breached_us=breached / 1e3, ok_us=ok / 1e3, extra_us=(breached - ok) / 1e3)
        functions.append(row)
    copies = {side: sides.get(side, {}) for side in SIDES}
    sampled = {side: sum(copies[side].values()) for side in SIDES}
    result: dict[str, Any] = {
        "route": route,
        "unit": unit,
        "requests": {side: requests.get(side, 0) for side in SIDES},
        "sampled": sampled,
    }
    if cpu:
        result["sampled_ns"] = sampled
    result["functions"] = functions
    result["flamegraph"] = _differential(route, copies, per)
    return result


def _differential(
    route: str, sides: dict[str, dict[tuple[Frame, ...], int]], per: dict[str, float]
) -> dict[str, Any]:
    """A d3-flame-graph tree of the breaching side per request, ``delta`` against the ok side.

    ``value`` is a breaching request's average (CPU ns, bytes...) in the frame; ``delta`` that
    minus a good request's, which d3-flame-graph's differential mode colours (red: more when
    breaching).
    """
    root = _node(route, "")
    for index, side in enumerate(SIDES):
        weight = per[side]
        for stack, value in sides[side].items():
            scaled = value * weight
            root["sides"][index] += scaled
            for node in descend(root, stack, _node):
                node["sides"][index] += scaled
    todo = [root]
    while todo:  # iterative: stacks are deeper than this function could recurse
        node = todo.pop()
        breached, ok = node.pop("sides")
        node["value"] = round(breached)
        node["delta"] = round(breached - ok)
        node["ok_value"] = round(ok)
        children = sorted(node["children"].values(), key=lambda c: -c["sides"][0])
        node["children"] = children
        todo.extend(children)
    return root


def _node(name: str, filename: str) -> dict[str, Any]:
    return {"name": name, "file": filename, "sides": [0.0, 0.0], "children": {}}
