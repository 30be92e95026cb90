"""Environment variables: read once, in one place, validated with errors naming the variable.

The variables, their defaults and meanings are listed in one table in README.md
("Configuration"); each parser below names the variable in its ``ValueError``.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = [
    "parse_bool",
    "parse_header_value",
    "parse_int",
    "parse_seconds",
    "parse_server_address",
    "redact_url",
    "split_credentials",
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


def redact_url(url: str) -> str:
    """``url`` with the password of its user info (``user:pass@``) replaced by ``***``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


def parse_server_address(name: str, value: str) -> str:
    """An ``http://`` or ``https://`` URL with a host and a valid port, without a trailing slash.

    Checked here, at configuration time, so that the uploader never fails on it later. Error
    messages show the URL with its password (if any) redacted.
    """
    text = value.strip()
    parts = urlsplit(text)
    shown = redact_url(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name}={shown!r}: expected an http:// or https:// URL with a host")
    try:
        port = parts.port
    except ValueError:
        port = 0
    else:
        if port is None:
            port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={shown!r}: the port must be a number between 1 and 65535")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise ValueError(f"{name}={shown!r}: the URL must not contain spaces or control characters")
    return text.rstrip("/")


def split_credentials(url: str) -> tuple[str, str, str]:
    """``(url without user info, user, password)``; user and password are percent-decoded."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, "", ""
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=hostport)), unquote(user), unquote(password)


# What http.client refuses in a header value (a line break not followed by folding whitespace),
# and what no header should carry anyway: every other control character.
_BAD_HEADER_CHAR = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def parse_header_value(name: str, value: str) -> str:
    """A value that can be sent as an HTTP header: Latin-1, no control characters.

    ``PYROSCOPE_TENANT_ID="team-a\\n"`` (a secret written with a trailing newline) is refused
    here, naming the variable, instead of failing every upload later.
    """
    bad = _BAD_HEADER_CHAR.search(value)
    if bad is not None:
        raise ValueError(
            f"{name}: contains the control character {bad.group()!r} at position "
            f"{bad.start()}; HTTP headers cannot carry it (a trailing newline from a file?)"
        )
    try:
        value.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name}: contains {value[exc.start]!r}, which an HTTP header cannot carry "
            "(Latin-1 only)"
        ) from None
    return value
