"""Immutable label sets and the one ContextVar that carries them.

The label set a piece of code runs with is the value of ``LABELS`` in its context. Everything
else in spanprof (the middleware, ``profile_labels``, the label engine) reads or sets that one
variable, so asyncio tasks, ``contextvars.copy_context`` and thread-pool hand-offs inherit labels
exactly as they inherit any other context.
"""

from __future__ import annotations

import re
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from contextvars import ContextVar
from typing import Any

from .._logging import log_once

__all__ = [
    "EMPTY",
    "LABELS",
    "RESERVED_KEYS",
    "LabelSet",
    "parse_labels",
    "sanitize_value",
    "validate_key",
]

# Pyroscope (like Prometheus) accepts label names matching this; anything else is rejected at
# ingest, which would silently drop every sample of the upload.
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Keys spanprof owns, or that Pyroscope itself uses for series identity.
RESERVED_KEYS = frozenset({"span_id", "trace_id", "span_name", "slo", "service_name", "__name__"})

MAX_KEY_LENGTH = 128
MAX_VALUE_LENGTH = 256

# Characters that survive every Pyroscope ingest path (push API and the legacy `name{k=v}`
# query syntax): printable ASCII minus quotes, backslash, `=` and `,`. Braces stay allowed because
# route templates (`/items/{item_id}`) are the documented `span_name` format and the push API
# carries values as opaque protobuf strings.
_UNSAFE_VALUE_RE = re.compile(r"[^\x21-\x7e ]|[\"'\\=,]")


def validate_key(key: str, *, setting: str = "label key", allow_reserved: bool = False) -> str:
    """Return ``key`` if Pyroscope accepts it as a label name, else raise ``ValueError``."""
    if not isinstance(key, str) or not _KEY_RE.match(key) or len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"{setting}: {key!r} is not a valid profile label name; use letters, digits and "
            f"underscores, not starting with a digit, at most {MAX_KEY_LENGTH} characters"
        )
    if key.startswith("__") or (not allow_reserved and key in RESERVED_KEYS):
        raise ValueError(
            f"{setting}: {key!r} is reserved (spanprof sets span_id, trace_id, span_name and slo "
            "itself; service_name and keys starting with '__' belong to Pyroscope)"
        )
    return key


def sanitize_value(value: object) -> str:
    """Turn any value into a label value Pyroscope accepts: safe ASCII, bounded length.

    A value whose ``str()`` raises becomes ``<TypeName>``: ``profile_labels`` runs inside
    requests (a lazy user object whose name needs the database), and must not fail them.
    """
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:
        log_once(
            "label-value-str",
            "spanprof: str() failed on a profile label value; it is labelled with its type name "
            "instead (logged once)",
        )
        text = f"<{type(value).__name__}>"
    if len(text) > MAX_VALUE_LENGTH:
        text = text[:MAX_VALUE_LENGTH]
    if _UNSAFE_VALUE_RE.search(text):
        text = _UNSAFE_VALUE_RE.sub("_", text)
    return text


class LabelSet(Mapping[str, str]):
    """An immutable, hashable set of profile labels (``key -> value``).

    Label sets are compared by content, but the label engine first compares them by identity:
    a request keeps one ``LabelSet`` object for its whole life, so the common "labels did not
    change between two task steps" check is a single pointer comparison. The sorted form and
    the hash are computed only when asked for: the request path never needs them.
    """

    __slots__ = ("_hash", "_items", "_map")

    _map: dict[str, str]
    _items: tuple[tuple[str, str], ...] | None
    _hash: int | None

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        self._map = dict(items.items() if isinstance(items, Mapping) else items)
        self._items = None
        self._hash = None

    @classmethod
    def _adopt(cls, mapping: dict[str, str]) -> LabelSet:
        # For callers that built a fresh dict they will never touch again.
        self = cls.__new__(cls)
        self._map = mapping
        self._items = None
        self._hash = None
        return self

    def merged(self, other: Mapping[str, str]) -> LabelSet:
        """Return a new set with ``other``'s labels laid over this one's."""
        if not other:
            return self
        combined = dict(self._map)
        combined.update(other)
        return LabelSet._adopt(combined)

    def __getitem__(self, key: str) -> str:
        return self._map[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        return self._map.get(key, default)

    def items(self) -> ItemsView[str, str]:
        """The ``(key, value)`` pairs."""
        return self._map.items()

    def keys(self) -> KeysView[str]:
        """The label names."""
        return self._map.keys()

    def values(self) -> ValuesView[str]:
        """The label values."""
        return self._map.values()

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __bool__(self) -> bool:
        return bool(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._map.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        # type() first: isinstance() against an ABC subclass goes through ABCMeta, and the
        # label engine compares label sets on every switch.
        if type(other) is LabelSet or isinstance(other, LabelSet):
            return self._map == other._map
        if isinstance(other, Mapping):
            return self._map == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.items_tuple)
        return f"LabelSet({inner})"

    @property
    def items_tuple(self) -> tuple[tuple[str, str], ...]:
        """The labels as a sorted tuple of pairs, ready for a profile encoder."""
        if self._items is None:
            self._items = tuple(sorted(self._map.items()))
        return self._items


EMPTY = LabelSet()

LABELS: ContextVar[LabelSet] = ContextVar("spanprof.labels", default=EMPTY)


def parse_labels(name: str, value: str | Mapping[str, str]) -> dict[str, str]:
    """Static labels from ``k=v,k2=v2`` (or a mapping), with keys validated.

    A key given twice, or a value holding another ``=`` (pairs joined by ``;`` or a space), is
    refused rather than merged or glued into one sanitized value.
    """
    pairs: list[tuple[str, str]]
    if isinstance(value, str):
        pairs = []
        seen: set[str] = set()
        for part in value.split(","):
            if not part.strip():
                continue
            key, sep, val = part.partition("=")
            if not sep:
                raise ValueError(f"{name}={value!r}: expected comma-separated key=value pairs")
            key, val = key.strip(), val.strip()
            if "=" in val:
                raise ValueError(
                    f"{name}: the value of {key!r} contains '=' ({val!r}); separate key=value "
                    "pairs with ',', like 'env=prod,region=eu'"
                )
            if key in seen:
                raise ValueError(f"{name}={value!r}: the label {key!r} is given twice")
            seen.add(key)
            pairs.append((key, val))
    else:
        pairs = []
        for key, raw in value.items():
            try:
                pairs.append((key, raw if isinstance(raw, str) else str(raw)))
            except Exception as exc:
                # Configuration, not a request: say so now (sanitize_value would hide it).
                raise ValueError(
                    f"{name}: the value of {key!r} cannot be turned into text: str() raised "
                    f"{type(exc).__name__}"
                ) from exc
    return {validate_key(k, setting=name): sanitize_value(v) for k, v in pairs}
