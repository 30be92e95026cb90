"""The Pyroscope connection settings of both profiler backends, validated in one place.

``PyroscopeBackend`` and ``ExactBackend`` push to the same server with the same series labels,
configured by the same arguments and the same ``PYROSCOPE_*`` variables; and ``ExactBackend``
falls back to a ``PyroscopeBackend`` built from its own settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TypedDict, cast

from .._config import (
    parse_header_value,
    parse_int,
    parse_seconds,
    parse_server_address,
    redact_url,
    shown_value,
    split_credentials,
)
from .._env import env_value
from .._labels._labelset import parse_labels, sanitize_value

__all__ = ["PyroscopeSettings", "SettingsArguments", "WithPyroscopeSettings"]


class SettingsArguments(TypedDict):
    """The settings as keyword arguments of either backend's constructor."""

    server_address: str
    application_name: str
    upload_interval: int
    sample_rate: int
    tenant_id: str
    basic_auth_username: str
    basic_auth_password: str
    tags: Mapping[str, str]


@dataclass(frozen=True, repr=False)
class PyroscopeSettings:
    """Where and how a backend uploads; a bad value raises ``ValueError`` naming the argument.

    Credentials in the address (``http://user:pass@host``) become the basic-auth settings, as
    pyroscope-io would send them, unless ``basic_auth_username`` or ``basic_auth_password`` is
    set (explicit settings win); either way ``server_address`` keeps no credentials, so it can
    be logged. ``repr`` never shows the password.
    """

    server_address: str
    application_name: str
    upload_interval: int = 10
    sample_rate: int = 100
    tenant_id: str = ""
    basic_auth_username: str = ""
    basic_auth_password: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("server_address", "tenant_id", "basic_auth_username", "basic_auth_password"):
            _check_type(name, getattr(self, name), str)
        for name in ("upload_interval", "sample_rate"):
            _check_type(name, getattr(self, name), int)
        if not isinstance(self.tags, (Mapping, str)):
            raise TypeError(
                f"tags: expected a mapping of label names to values, got "
                f"{type(self.tags).__name__} {self.tags!r}"
            )
        address = parse_server_address("server_address", self.server_address)
        address, url_user, url_password = split_credentials(address)
        user, password = self.basic_auth_username, self.basic_auth_password
        if not (user or password):
            user, password = url_user, url_password
        _check_credential("basic_auth_username", user, colon=False)
        _check_credential("basic_auth_password", password, colon=True)
        name = _application_name("application_name", self.application_name)
        interval = parse_seconds("upload_interval", shown_value(self.upload_interval))
        rate = parse_int("sample_rate", shown_value(self.sample_rate), minimum=1, maximum=1000)
        parse_header_value("tenant_id", self.tenant_id)
        tags = parse_labels("tags", self.tags)
        # Frozen, so the normalized values (no trailing slash, sanitized tags) go in this way.
        object.__setattr__(self, "server_address", address)
        object.__setattr__(self, "application_name", name)
        object.__setattr__(self, "basic_auth_username", user)
        object.__setattr__(self, "basic_auth_password", password)
        object.__setattr__(self, "upload_interval", interval)
        object.__setattr__(self, "sample_rate", rate)
        object.__setattr__(self, "tags", tags)

    def __repr__(self) -> str:
        return f"PyroscopeSettings({self.describe()})"

    def describe(self) -> str:
        """The settings as ``name=value, ...``, with the password shown as ``'***'``, and the
        user name too when it comes without a password."""
        shown: dict[str, object] = {
            **asdict(self),
            "server_address": redact_url(self.server_address),
            "tags": dict(self.tags),
        }
        if self.basic_auth_password:
            shown["basic_auth_password"] = "***"
        elif self.basic_auth_username:
            # Alone it is most often a token (https://TOKEN@host), as redact_url assumes.
            shown["basic_auth_username"] = "***"
        return ", ".join(f"{name}={value!r}" for name, value in shown.items())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PyroscopeSettings | None:
        """The settings the ``PYROSCOPE_*`` variables give, or ``None`` without a server address.

        Reads ``PYROSCOPE_SERVER_ADDRESS``, ``PYROSCOPE_APPLICATION_NAME`` (default
        ``OTEL_SERVICE_NAME``), ``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``,
        ``PYROSCOPE_TENANT_ID``, ``PYROSCOPE_BASIC_AUTH_USER``, ``PYROSCOPE_BASIC_AUTH_PASSWORD``
        and ``PYROSCOPE_LABELS``. A bad value raises ``ValueError`` naming the variable.
        """
        env = os.environ if environ is None else environ
        address = env_value(env, "PYROSCOPE_SERVER_ADDRESS").strip()
        if not address:
            return None
        source = next(
            (v for v in ("PYROSCOPE_APPLICATION_NAME", "OTEL_SERVICE_NAME") if env_value(env, v)),
            None,
        )
        name = "python-app" if source is None else _application_name(source, env[source])
        # Parsed here with the variables' names, so that __post_init__ cannot fail on them.
        return cls(
            server_address=parse_server_address("PYROSCOPE_SERVER_ADDRESS", address),
            application_name=name,
            upload_interval=parse_seconds(
                "PYROSCOPE_UPLOAD_INTERVAL", env_value(env, "PYROSCOPE_UPLOAD_INTERVAL", "10")
            ),
            sample_rate=parse_int(
                "PYROSCOPE_SAMPLE_RATE",
                env_value(env, "PYROSCOPE_SAMPLE_RATE", "100"),
                minimum=1,
                maximum=1000,
            ),
            tenant_id=parse_header_value(
                "PYROSCOPE_TENANT_ID", env_value(env, "PYROSCOPE_TENANT_ID")
            ),
            basic_auth_username=_check_credential(
                "PYROSCOPE_BASIC_AUTH_USER",
                env_value(env, "PYROSCOPE_BASIC_AUTH_USER"),
                colon=False,
            ),
            basic_auth_password=_check_credential(
                "PYROSCOPE_BASIC_AUTH_PASSWORD",
                env_value(env, "PYROSCOPE_BASIC_AUTH_PASSWORD"),
                colon=True,
            ),
            tags=parse_labels("PYROSCOPE_LABELS", env_value(env, "PYROSCOPE_LABELS")),
        )

    def arguments(self) -> SettingsArguments:
        """The settings as keyword arguments for ``PyroscopeBackend`` or ``ExactBackend``."""
        return cast(SettingsArguments, asdict(self))


def _check_type(name: str, value: object, expected: type) -> None:
    # bool is an int to Python, never a count of seconds or samples to a user.
    if not isinstance(value, expected) or isinstance(value, bool):
        raise TypeError(
            f"{name}: expected {expected.__name__}, got {type(value).__name__} {value!r}"
        )


# Where pyroscope-io sends the name, in its ingest URL's `name=app.cpu{tags}`, braces would
# start the tags; every other unsafe character is what a label value cannot carry either.
_NAME_BRACES = str.maketrans("{}", "__")


def _application_name(setting: str, value: object) -> str:
    """The ``service_name`` label: a non-blank str, trimmed, sanitized like a label value.

    Surrounding whitespace (a file's trailing newline) is dropped, as from the environment; a
    control character inside is refused rather than replaced, since ``sh_op`` would be a
    service nobody looks for.
    """
    if not isinstance(value, str):
        raise TypeError(f"{setting}: expected str, got {type(value).__name__} {value!r}")
    text = value.strip()
    if not text:
        raise ValueError(f"{setting}: must not be empty or blank")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise ValueError(
            f"{setting}={value!r}: contains a control character; a service name cannot carry it"
        )
    return sanitize_value(text).translate(_NAME_BRACES)


def _check_credential(name: str, value: str, *, colon: bool) -> str:
    """A basic-auth user (no ``:``, RFC 7617) or password without control characters.

    The message never shows the value: it may be a secret.
    """
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(
            f"{name}: contains a control character (a trailing newline from a file?); "
            "basic auth would fail with it"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # An undecodable byte in the variable (surrogateescape): the Basic token is UTF-8.
        raise ValueError(
            f"{name}: is not valid UTF-8 (an undecodable byte?); basic auth would fail with it"
        ) from None
    if not colon and ":" in value:
        raise ValueError(f"{name}: a basic-auth user name cannot contain ':'")
    return value


class WithPyroscopeSettings:
    """A backend's settings as read-only attributes (``backend.server_address``, ...)."""

    _settings: PyroscopeSettings

    def __repr__(self) -> str:
        # The settings without the password; extra options (headers...) are not shown at all.
        return f"{type(self).__name__}({self._settings.describe()})"

    @property
    def settings(self) -> PyroscopeSettings:
        """All of them, as one frozen value."""
        return self._settings

    @property
    def server_address(self) -> str:
        return self._settings.server_address

    @property
    def application_name(self) -> str:
        return self._settings.application_name

    @property
    def upload_interval(self) -> int:
        return self._settings.upload_interval

    @property
    def sample_rate(self) -> int:
        return self._settings.sample_rate

    @property
    def tenant_id(self) -> str:
        return self._settings.tenant_id

    @property
    def basic_auth_username(self) -> str:
        return self._settings.basic_auth_username

    @property
    def basic_auth_password(self) -> str:
        return self._settings.basic_auth_password

    @property
    def tags(self) -> Mapping[str, str]:
        return self._settings.tags
