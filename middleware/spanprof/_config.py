"""Environment variables: read once, in one place, validated with errors naming the variable.

The variables, their defaults and meanings are listed in one table in README.md
("Configuration"); each parser below names the variable in its ``ValueError``.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = [
    "parse_bool",
    "parse_int",
    "parse_seconds",
    "parse_server_address",
]

_SECONDS_RE = re.compile(r"\s*(\d+)\s*(s)?\s*\Z")


def parse_seconds(name: str, value: str, *, minimum: int = 1, maximum: int = 3600) -> int:
    """Whole seconds from ``"10"`` or ``"10s"``; the profiler uploads on whole seconds."""
    match = _SECONDS_RE.match(value)
    if not match or not minimum <= int(match.group(1)) <= maximum:
        raise ValueError(
            f"{name}={value!r}: expected whole seconds between {minimum} and {maximum}, "
            "like '10' or '10s'"
        )
    return int(match.group(1))


def parse_int(name: str, value: str, *, minimum: int, maximum: int) -> int:
    """An integer within ``[minimum, maximum]``."""
    try:
        number = int(value.strip())
    except ValueError:
        number = minimum - 1
    if not minimum <= number <= maximum:
        raise ValueError(f"{name}={value!r}: expected an integer between {minimum} and {maximum}")
    return number


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, value: str) -> bool:
    """``true/false``, ``1/0``, ``yes/no``, ``on/off`` (any case)."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected true or false")


def parse_server_address(name: str, value: str) -> str:
    """An ``http://`` or ``https://`` URL with a host, without a trailing slash."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{name}={value!r}: expected an http:// or https:// URL with a host")
    return value.strip().rstrip("/")
