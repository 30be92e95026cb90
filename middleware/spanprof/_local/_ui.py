"""The local web page and its JSON APIs, served by the standard library on loopback.

Any web page the developer visits can make their browser send requests to loopback, so the page
answers only requests addressed to a name it serves (no DNS-rebinding names) and, when they
carry an ``Origin``, only from its own origin.

Routes (all ``GET``):

- ``/``: the page; ``/static/...``: its scripts, styles and vendored libraries;
- ``/api/status``: counters (spans, requests, breaches, profile uploads, SLO settings);
- ``/api/breaches``: recent SLO breaches, newest first;
- ``/api/latency?since=UNIX``: server-span latencies over time, breaches flagged;
- ``/api/flamegraph?span_id=ID&kind=KIND``: a d3-flame-graph tree of the samples labelled
  ``ID``: ``kind`` is ``cpu`` (the default, nanoseconds), ``alloc_space`` (bytes allocated),
  ``alloc_objects`` (objects allocated), ``inuse_space`` or ``inuse_objects`` (in use at the
  latest upload); anything else is answered 400;
- ``/api/trace?trace_id=ID``: the spans of a trace, by start time;
- ``/api/pprof?span_id=ID&kind=KIND``: the same samples as a gzip-compressed pprof download:
  ``cpu`` (the default), or for a memory kind the span's memory profile with all four memory
  types, that kind first;
- ``/api/compare?kind=KIND``: the routes with ``slo``-labelled samples of that kind (``cpu``
  by default), each side's requests and samples;
- ``/api/compare?route=NAME&kind=KIND``: that route's breaching requests against its good
  ones, per request: functions ranked by extra self CPU (or bytes, objects), and a
  differential flame graph. In-use memory is sided by the span store's verdicts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .._logging import log_once
from ._compare import SloComparison, compare_sides
from ._loopback import LoopbackServer, url_host
from ._memory import MEMORY_KINDS, MEMORY_UNITS
from ._samples import SampleStore
from ._slo import describe
from ._spans import SpanRecord, SpanStore
from ._stacks import flame_tree

__all__ = ["UiServer"]

_SPAN_ID = re.compile(r"[0-9a-f]{16}\Z")
_TRACE_ID = re.compile(r"[0-9a-f]{32}\Z")
# The ``kind`` values of the flame-graph APIs (the first is the default) and their units.
_KINDS = ("cpu", *MEMORY_KINDS)
_UNITS = {"cpu": "nanoseconds", **MEMORY_UNITS}
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything the page loads is served from here; d3-flame-graph injects its own <style>.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"
)
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _load_static() -> dict[str, tuple[bytes, str]]:
    """The page's files by URL path, read once (package data of ``spanprof._local``)."""
    root = resources.files("spanprof._local") / "static"
    files: dict[str, tuple[bytes, str]] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
                continue
            suffix = "." + child.name.rpartition(".")[2]
            content_type = _CONTENT_TYPES.get(suffix)
            if content_type is not None:
                files[f"/static/{prefix}{child.name}"] = (child.read_bytes(), content_type)

    walk(root, "")
    index = files.get("/static/index.html")
    if index is None:
        raise RuntimeError("spanprof local mode: static/index.html is missing from the package")
    files["/"] = index
    return files


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_name(host: str) -> str:
    """The name part of a ``Host`` header value (``[::1]:80`` -> ``::1``), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _Server(LoopbackServer):
    ui: UiServer

    def __init__(self, address: tuple[str, int], ui: UiServer) -> None:
        self.ui = ui
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # http.server answers unparsable requests with an HTML page quoting the request line.
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s\n"
    protocol_version = "HTTP/1.1"
    server_version = "spanprof-local"
    sys_version = ""
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        return  # the page polls every few seconds: no access log

    def do_GET(self) -> None:
        ui = self.server.ui
        if not self._allowed():
            return
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        static = ui.static.get(parts.path)
        if static is not None:
            self._send(200, static[0], static[1], cache="no-cache")
            return
        api = ui.api.get(parts.path)
        if api is None:
            self._json(404, {"error": f"no such page: {parts.path}"})
            return
        try:
            status, body, content_type, extra = api(query)
        except Exception as exc:  # a bug in an API must not take the page down
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(status, body, content_type, extra_headers=extra)

    def _refuse_method(self) -> None:
        # Everything here is GET; other methods (a page's form POST, a preflight) get 405.
        if self._allowed():
            self.close_connection = True
            self._send(
                405,
                b"method not allowed\n",
                "text/plain; charset=utf-8",
                extra_headers={"Allow": "GET"},
            )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def _allowed(self) -> bool:
        """Answer 403 unless the request is addressed to this page, from it; ``True`` if so."""
        ui = self.server.ui
        host = self.headers.get("Host", "")
        origin = self.headers.get("Origin")
        if not ui.serves(_host_name(host)):
            # A page must not answer a rebinding DNS name pointing at its address.
            kind, reason = "host", f"refused a request for Host {host[:100]!r}"
        elif origin is not None and origin.lower() != f"http://{host.strip().lower()}":
            # Another origin's script (fetch, form) made the browser send this.
            kind, reason = "origin", f"refused a request from Origin {origin[:100]!r}"
        else:
            return True
        log_once(f"ui:{kind}", f"spanprof local page: {reason}", exc_info=False)
        self.close_connection = True
        self._send(403, b"forbidden\n", "text/plain; charset=utf-8")
        return False

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str,
        *,
        cache: str = "no-store",
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        for key, value in (extra_headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


_ApiResult = tuple[int, bytes, str, dict[str, str]]
# More than the span store keeps: every kept request's verdict, for the in-use comparison.
_MAX_VERDICTS = 1_000_000
_NUMBERS = ("delta", "ok_value")


def _ok(payload: Any, status: int = 200) -> _ApiResult:
    return status, json.dumps(payload).encode(), "application/json", {}


def _tree_json(root: dict[str, Any]) -> str:
    """A flame-graph tree as JSON, written without recursion.

    ``json.dumps`` recurses per nesting level (two per frame), so it fails on stacks
    that a program can legitimately reach (a 700-frame recursion).
    """
    out: list[str] = []
    # Nodes still to write, and the literal text between them, in reverse order.
    todo: list[dict[str, Any] | str] = [root]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        # A differential tree's frames also carry their delta and the other side's value.
        extra = "".join(f'"{key}": {int(item[key])}, ' for key in _NUMBERS if key in item)
        out.append(
            f'{{"name": {json.dumps(item["name"])}, "file": {json.dumps(item["file"])}, '
            f'"value": {int(item["value"])}, {extra}"children": ['
        )
        todo.append("]}")
        children = item["children"]
        for index in range(len(children) - 1, -1, -1):
            todo.append(children[index])
            if index:
                todo.append(", ")
    return "".join(out)


class UiServer:
    """Serves the local page and its APIs from ``spans`` and ``samples`` in a thread.

    Arguments:
        spans: the span store (server spans, breaches, traces).
        samples: the sample store (flame graphs, pprof).
        comparison: the breach-vs-ok comparison per route (none: ``/api/compare`` is empty).
        status: extra counters for ``/api/status`` (receiver errors, app URL...).
        host, port: where to listen; loopback by default, port 0 picks a free one.
    """

    def __init__(
        self,
        spans: SpanStore,
        samples: SampleStore,
        *,
        status: Callable[[], dict[str, Any]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        comparison: SloComparison | None = None,
    ) -> None:
        self.spans = spans
        self.samples = samples
        self.comparison = comparison
        self._extra_status = status
        self.host = host
        self._port = port
        self.loopback_only = _is_loopback(host)
        self.wildcard = host in _WILDCARDS
        # The names a request may address the page by: loopback's, the bind address, and on a
        # wildcard bind this machine's names. An IP literal cannot be rebound to another
        # address, so on a wildcard bind any address this machine answers on is fine.
        names = {*_LOOPBACK_NAMES, _host_name(host)}
        if self.wildcard:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.host_names = frozenset(names)
        self.static = _load_static()
        self.api: dict[str, Callable[[dict[str, str]], _ApiResult]] = {
            "/api/status": self._status,
            "/api/breaches": self._breaches,
            "/api/latency": self._latency,
            "/api/flamegraph": self._flamegraph,
            "/api/trace": self._trace,
            "/api/pprof": self._pprof,
            "/api/compare": self._compare,
        }
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> UiServer:
        """Bind and serve in a daemon thread; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("UiServer already started")
        server = _Server((self.host, self._port), self)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="spanprof-local-ui",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    @property
    def port(self) -> int:
        """The bound port (while started)."""
        if self._server is None:
            raise RuntimeError("UiServer is not started")
        return int(self._server.server_address[1])

    def serves(self, name: str) -> bool:
        """Whether ``name`` (a ``Host`` header's name part) addresses this page."""
        return name in self.host_names or (self.wildcard and _is_ip(name))

    @property
    def url(self) -> str:
        """The page's URL (on a wildcard bind, its loopback one)."""
        host = url_host(self.host)
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/"

    # -- APIs --------------------------------------------------------------------------------

    def _breach_json(self, record: SpanRecord) -> dict[str, Any]:
        item = record.to_json()
        item["profile_ns"] = self.samples.sample_total(record.span_id)
        item["alloc_bytes"] = self.samples.allocated_bytes(record.span_id)
        return item

    def _status(self, query: dict[str, str]) -> _ApiResult:
        payload: dict[str, Any] = {
            "time": time.time(),
            "spans": self.spans.spans_seen,
            "requests": self.spans.request_count(),
            "breaches": self.spans.breach_count(),
            "kept": self.spans.counters(),
            "slo": describe(self.spans.policy),
            "profiles": self.samples.status(),
            "memory": self.samples.memory.status(),
        }
        if self._extra_status is not None:
            payload.update(self._extra_status())
        return _ok(payload)

    def _breaches(self, query: dict[str, str]) -> _ApiResult:
        limit = _int(query.get("limit"), 200, 1, 500)
        return _ok({"breaches": [self._breach_json(r) for r in self.spans.breaches(limit=limit)]})

    def _latency(self, query: dict[str, str]) -> _ApiResult:
        try:
            since = float(query.get("since", "0"))
        except ValueError:
            return _ok({"error": "since: expected Unix seconds"}, 400)
        limit = _int(query.get("limit"), 5000, 1, 20000)
        points = [
            {
                "start": r.start_ns / 1e9,
                "duration_s": r.duration_s,
                "route": r.route or r.name,
                "name": r.name,
                "service": r.service,
                "breached": r.breached,
                "threshold_s": r.threshold_s,
                "span_id": r.span_id,
                "trace_id": r.trace_id,
                "status_code": r.status_code(),
            }
            for r in self.spans.requests(since=since, limit=limit)
        ]
        return _ok({"points": points, "slo": describe(self.spans.policy)})

    def _flamegraph(self, query: dict[str, str]) -> _ApiResult:
        span_id = query.get("span_id", "")
        if not _SPAN_ID.match(span_id):
            return _ok({"error": "span_id: expected 16 lowercase hex digits"}, 400)
        kind = query.get("kind", _KINDS[0])
        if kind not in _KINDS:
            return _bad_kind(kind)
        record = self.spans.span(span_id)
        memory = self.samples.memory
        if kind == "cpu":
            root = self.samples.flamegraph(span_id)
            profile = self.samples.span(span_id)
            stacks = len(profile.stacks) if profile is not None else 0
        else:
            rows = memory.stacks(span_id, kind)
            name = record.name if record is not None else f"span {span_id}"
            root, stacks = flame_tree(name, rows.items()), len(rows)
        head = json.dumps(
            {
                "span_id": span_id,
                "kind": kind,
                "unit": _UNITS[kind],
                "now": time.time(),
                "total": root["value"],
                # CPU nanoseconds whatever the kind: the page tells "no samples yet" by them.
                "total_ns": self.samples.sample_total(span_id),
                "stacks": stacks,
                "period_ns": self.samples.status()["period_ns"],
                "span": record.to_json() if record is not None else None,
                "alloc_bytes": self.samples.allocated_bytes(span_id),
                "inuse_at": memory.inuse_at() if kind.startswith("inuse_") else None,
            }
        )
        # The tree is as deep as the deepest stack: it goes in through _tree_json.
        body = f'{head[:-1]}, "root": {_tree_json(root)}}}'
        return 200, body.encode(), "application/json", {}

    def _verdicts(self) -> Callable[[str], bool | None]:
        """Whether a kept request (by span id) breached its SLO; ``None`` when not kept."""
        verdicts = {r.span_id: r.breached for r in self.spans.requests(limit=_MAX_VERDICTS)}
        return verdicts.get

    def _trace(self, query: dict[str, str]) -> _ApiResult:
        trace_id = query.get("trace_id", "")
        if not _TRACE_ID.match(trace_id):
            return _ok({"error": "trace_id: expected 32 lowercase hex digits"}, 400)
        spans = []
        for record in self.spans.trace(trace_id):
            item = record.to_json()
            item["profile_ns"] = self.samples.sample_total(record.span_id)
            spans.append(item)
        return _ok({"trace_id": trace_id, "spans": spans})

    def _pprof(self, query: dict[str, str]) -> _ApiResult:
        span_id = query.get("span_id", "")
        if not _SPAN_ID.match(span_id):
            return _ok({"error": "span_id: expected 16 lowercase hex digits"}, 400)
        kind = query.get("kind", _KINDS[0])
        if kind not in _KINDS:
            return _bad_kind(kind)
        data = self.samples.pprof(span_id, kind)
        if data is None:
            what = "profile" if kind == "cpu" else "memory"
            return _ok({"error": f"no {what} samples for span {span_id} (yet)"}, 404)
        name = f"spanprof-{span_id}" if kind == "cpu" else f"spanprof-{span_id}-memory"
        headers = {"Content-Disposition": f'attachment; filename="{name}.pb.gz"'}
        return 200, data, "application/octet-stream", headers

    def _compare(self, query: dict[str, str]) -> _ApiResult:
        kind = query.get("kind", _KINDS[0])
        if kind not in _KINDS:
            return _bad_kind(kind)
        route = query.get("route")
        if route is None:
            return _ok({"kind": kind, "unit": _UNITS[kind], "routes": self._routes(kind)})
        result = self._compared(route, kind, _int(query.get("limit"), 50, 1, 500))
        if result is None:
            return _ok(
                {"error": f"no slo-labelled {kind} samples for route {route[:200]!r} (yet)"}, 404
            )
        result["kind"] = kind
        tree = result.pop("flamegraph")
        head = json.dumps(result)
        # The tree is as deep as the deepest stack: it goes in through _tree_json.
        return (
            200,
            f'{head[:-1]}, "flamegraph": {_tree_json(tree)}}}'.encode(),
            "application/json",
            {},
        )

    def _comparison(self, kind: str) -> SloComparison | None:
        """The comparison that sums ``kind`` per route side (in-use memory has none)."""
        if kind == "cpu":
            return self.comparison
        if kind.startswith("alloc_"):
            return self.samples.memory.comparison(kind)
        return None

    def _routes(self, kind: str) -> list[dict[str, Any]]:
        """The routes with ``kind`` samples on a side: each side's requests and samples."""
        memory = self.samples.memory
        out = []
        if kind.startswith("inuse_"):
            verdict = self._verdicts()
            for name in memory.inuse_routes():
                sides = memory.inuse_sides(name, kind, verdict) or {}
                sampled = {side: sum(stacks.values()) for side, stacks in sides.items()}
                out.append(
                    {"route": name, "requests": self.spans.verdicts(name), "sampled": sampled}
                )
            return out
        comparison = self._comparison(kind)
        if comparison is None:
            return out
        for name in comparison.routes():
            sampled = comparison.sampled_ns(name)
            item = {"route": name, "requests": self.spans.verdicts(name), "sampled": sampled}
            if kind == "cpu":
                item["sampled_ns"] = sampled  # its name before memory came
            out.append(item)
        return out

    def _compared(self, route: str, kind: str, limit: int) -> dict[str, Any] | None:
        """``route``'s breach-vs-ok comparison of ``kind``; ``None`` without samples."""
        requests = self.spans.verdicts(route)
        if kind.startswith("inuse_"):
            sides = self.samples.memory.inuse_sides(route, kind, self._verdicts())
            if sides is None:
                return None
            return compare_sides(route, sides, requests, unit=_UNITS[kind], limit=limit)
        comparison = self._comparison(kind)
        return None if comparison is None else comparison.compare(route, requests, limit=limit)


def _bad_kind(kind: str) -> _ApiResult:
    expected = ", ".join(_KINDS)
    return _ok({"error": f"kind: expected one of {expected}, got {kind[:100]!r}"}, 400)


def _int(raw: str | None, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    with contextlib.suppress(ValueError):
        return min(max(int(raw), low), high)
    return default
