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

from .._config import parse_int, parse_seconds, parse_server_address
from .._labels._labelset import parse_labels

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


@dataclass(frozen=True)
class PyroscopeSettings:
    """Where and how a backend uploads; a bad value raises ``ValueError`` naming the argument."""

    server_address: str
    application_name: str
    upload_interval: int = 10
    sample_rate: int = 100
    tenant_id: str = ""
    basic_auth_username: str = ""
    basic_auth_password: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        address = parse_server_address("server_address", self.server_address)
        if not self.application_name:
            raise ValueError("application_name: must not be empty")
        interval = parse_seconds("upload_interval", str(self.upload_interval))
        rate = parse_int("sample_rate", str(self.sample_rate), minimum=1, maximum=1000)
        tags = parse_labels("tags", self.tags)
        # Frozen, so the normalized values (no trailing slash, sanitized tags) go in this way.
        object.__setattr__(self, "server_address", address)
        object.__setattr__(self, "upload_interval", interval)
        object.__setattr__(self, "sample_rate", rate)
        object.__setattr__(self, "tags", tags)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PyroscopeSettings | None:
        """The settings the ``PYROSCOPE_*`` variables give, or ``None`` without a server address.

        Reads ``PYROSCOPE_SERVER_ADDRESS``, ``PYROSCOPE_APPLICATION_NAME`` (default
        ``OTEL_SERVICE_NAME``), ``PYROSCOPE_UPLOAD_INTERVAL``, ``PYROSCOPE_SAMPLE_RATE``,
        ``PYROSCOPE_TENANT_ID``, ``PYROSCOPE_BASIC_AUTH_USER``, ``PYROSCOPE_BASIC_AUTH_PASSWORD``
        and ``PYROSCOPE_LABELS``. A bad value raises ``ValueError`` naming the variable.
        """
        env = os.environ if environ is None else environ
        address = env.get("PYROSCOPE_SERVER_ADDRESS", "").strip()
        if not address:
            return None
        name = (
            env.get("PYROSCOPE_APPLICATION_NAME", "").strip()
            or env.get("OTEL_SERVICE_NAME", "").strip()
            or "python-app"
        )
        # Parsed here with the variables' names, so that __post_init__ cannot fail on them.
        return cls(
            server_address=parse_server_address("PYROSCOPE_SERVER_ADDRESS", address),
            application_name=name,
            upload_interval=parse_seconds(
                "PYROSCOPE_UPLOAD_INTERVAL", env.get("PYROSCOPE_UPLOAD_INTERVAL", "10")
            ),
            sample_rate=parse_int(
                "PYROSCOPE_SAMPLE_RATE",
                env.get("PYROSCOPE_SAMPLE_RATE", "100"),
                minimum=1,
                maximum=1000,
            ),
            tenant_id=env.get("PYROSCOPE_TENANT_ID", ""),
            basic_auth_username=env.get("PYROSCOPE_BASIC_AUTH_USER", ""),
            basic_auth_password=env.get("PYROSCOPE_BASIC_AUTH_PASSWORD", ""),
            tags=parse_labels("PYROSCOPE_LABELS", env.get("PYROSCOPE_LABELS", "")),
        )

    def arguments(self) -> SettingsArguments:
        """The settings as keyword arguments for ``PyroscopeBackend`` or ``ExactBackend``."""
        return cast(SettingsArguments, asdict(self))


class WithPyroscopeSettings:
    """A backend's settings as read-only attributes (``backend.server_address``, ...)."""

    _settings: PyroscopeSettings

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
