"""Environment variables: read once, in one place, validated with errors naming the variable.

The variables, their defaults and meanings are listed in one table in README.md
("Configuration"); each parser below names the variable in its ``ValueError``.
"""

from __future__ import annotations

import ipaddress
import re
import string
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = [
    "check_url",
    "header_name_problem",
    "parse_bool",
    "parse_header_value",
    "parse_int",
    "parse_seconds",
    "parse_server_address",
    "redact_url",
    "shown_value",
    "split_credentials",
    "url_problem",
]

_SECONDS_RE = re.compile(r"\s*(\d+)\s*(s)?\s*\Z")


def shown_value(value: object) -> str:
    """``repr(value)`` for an error message, or the size of an int too long for ``repr``.

    ``repr()`` of an int past 4300 digits raises a ValueError that names no setting; such a
    value is out of every range a setting takes.
    """
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    return repr(value)


def parse_seconds(name: str, value: str, *, minimum: int = 1, maximum: int = 3600) -> int:
    """Whole seconds from ``"10"`` or ``"10s"``; the profiler uploads on whole seconds."""
    match = _SECONDS_RE.match(value)
    try:
        seconds = int(match.group(1)) if match else minimum - 1
    except ValueError:  # past int()'s 4300 digits: out of range all the same
        seconds = minimum - 1
    if not minimum <= seconds <= maximum:
        raise ValueError(
            f"{name}={value!r}: expected whole seconds between {minimum} and {maximum}, "
            "like '10' or '10s'"
        )
    return seconds


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


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """``(start, end)`` of what reads as user info: from after ``//`` to the last ``@``.

    Not urlsplit's netloc, which ends at the first ``/``, ``?`` or ``#``: a password holding one
    unencoded would otherwise be shown as the host, port or path it was cut into.
    """
    slashes = url.find("//")
    start = 0 if slashes < 0 else slashes + 2
    at = url.rfind("@", start)
    return None if at < 0 else (start, at)


def redact_url(url: str) -> str:
    """``url`` with its user info (``user:pass@``) shown as ``user:***@``, or ``***@``, and the
    values of its query shown as ``***`` (``?api_key=***``).

    Everything before the last ``@`` after ``//`` is taken as user info, however urlsplit would
    cut it. The user name is kept only beside a password: alone, it is often a token. A query
    (an OTLP profiles endpoint may keep one) is the other place a URL carries keys.
    """
    span = _userinfo_span(url)
    if span is not None:
        start, at = span
        user, colon, _ = url[start:at].partition(":")
        shown = f"{user}:***" if colon and not any(c in user for c in "/?#") else "***"
        url = url[:start] + shown + url[at:]
    base, question, rest = url.partition("?")
    if not question:
        return url
    query, hash_, fragment = rest.partition("#")
    hidden = "&".join(
        name + "=***" if eq else name
        for name, eq, _ in (item.partition("=") for item in query.split("&"))
    )
    return f"{base}?{hidden}{hash_}{fragment}"


_BRACKETED_HOST = re.compile(r"\[([^\[\]]*)\](:[^\[\]]*)?\Z")


def _bracket_problem(hostport: str) -> str | None:
    # Python 3.10's urlsplit takes any "[...]" as a host, and every version takes "[::1]]".
    if "[" not in hostport and "]" not in hostport:
        return None
    match = _BRACKETED_HOST.match(hostport)
    if match is not None:
        try:
            ipaddress.IPv6Address(match.group(1).partition("%")[0])
        except ValueError:
            pass
        else:
            return None
    return "a host in brackets must be an IPv6 address, like [::1]"


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an ``http(s)://`` URL the uploaders can use, or ``None``.

    The reason never quotes the URL: the caller shows it redacted, with the setting's name.
    """
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return "the URL must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed "[" (and, from 3.11, a bracketed non-IP host)
        return "a host in brackets must be an IPv6 address, like [::1]"
    if "@" in parts.path or "@" in parts.query or "@" in parts.fragment:
        return (
            "an '@' after the host part: if it ends user:password, percent-encode the "
            "password's '/', '?', '#' and '@' (as %2F, %3F, %23 and %40)"
        )
    userinfo, _, hostport = parts.netloc.rpartition("@")
    bracket = _bracket_problem(hostport)
    if bracket is not None:
        return bracket
    if not (parts.path + parts.query + parts.fragment).isascii():
        # http.client sends the request line as ASCII: it would fail every upload.
        return "non-ASCII characters after the host must be percent-encoded"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http:// or https:// URL with a host"
    if "%" in hostport.rpartition("]")[2].partition(":")[0]:
        # Outside an IPv6 literal's zone (`[fe80::1%25eth0]`), resolvers take `%` literally.
        return "a host name must not be percent-encoded"
    if not parts.hostname.isascii():
        try:
            # What http.client and the resolver do with a non-ASCII name (IDNA 2003); a name
            # it refuses (an empty or 64+ character label) would fail every upload instead.
            parts.hostname.encode("idna")
        except UnicodeError:
            return (
                "the host name is not a valid internationalized domain name (each label 1 to "
                "63 characters, no empty label)"
            )
    if url.endswith("#") or parts.fragment:
        # A fragment never reaches the server; what comes after it would not either.
        return "the URL must not have a #fragment"
    try:
        port = parts.port
    except ValueError:
        port = 0
    else:
        if port is None:
            port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        return "the port must be a number between 1 and 65535"
    user, _, password = (unquote(part) for part in userinfo.partition(":"))
    if ":" in user:
        return "the user name in the address contains ':' (%3A); basic auth cannot carry it"
    for what, value in (("user name", user), ("password", password)):
        if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
            return (
                f"the {what} in the address contains a control character (percent-encoded?); "
                "basic auth would fail with it"
            )
    return None


def check_url(name: str, value: str) -> str:
    """``value`` stripped, if ``url_problem`` finds nothing; else ``ValueError`` naming ``name``.

    The message shows the URL redacted (``redact_url``).
    """
    text = value.strip()
    problem = url_problem(text)
    if problem is not None:
        raise ValueError(f"{name}={redact_url(text)!r}: {problem}")
    return text


def parse_server_address(name: str, value: str) -> str:
    """An ``http://`` or ``https://`` URL with a host and a valid port, without a trailing slash.

    Checked here (``check_url``), at configuration time, so that the uploader never fails on it
    later; credentials in it are checked as basic auth would need them. Error messages show the
    URL with its user info redacted.
    """
    text = check_url(name, value)
    if "?" in text:
        # The uploaders append their own paths (`/ingest`, `/push.v1.PusherService/Push`) to it.
        raise ValueError(
            f"{name}={redact_url(text)!r}: the server address must not have a ?query; "
            "give the server's base URL"
        )
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


# RFC 9110's token: http.client refuses anything else in a header name, and pyroscope-io sends it
# as it is (the server then refuses every upload), both in threads that fail much later.
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~" + string.digits + string.ascii_letters)


def header_name_problem(key: str) -> str | None:
    """Why ``key`` cannot be an HTTP header name, or ``None`` (it never quotes a value)."""
    bad = next((ch for ch in key if ch not in _TOKEN_CHARS), None)
    if not key or bad is not None:
        found = f"contains {bad!r}" if bad is not None else "is empty"
        return (
            f"a header name {found}: it must be an HTTP token (letters, digits and !#$%&'*+-.^_`|~)"
        )
    return None


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
