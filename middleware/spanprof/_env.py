"""The one rule for reading an environment variable: set but blank means unset.

A compose file's ``VAR: ""`` or a Helm value left empty sets the variable to ``""``; people
mean "the default" by it. So every variable spanprof reads goes through ``env_value``, and an
empty or whitespace-only value is the same as no value at all, for every setting alike.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["env_value"]


def env_value(env: Mapping[str, str], name: str, default: str = "") -> str:
    """``env[name]``, or ``default`` when it is unset, empty or only whitespace.

    A value with content is returned as it is (its parser decides about surrounding spaces).
    A value that is not a str (``environ={"SPANPROF_SLO_SECONDS": 0.3}``) raises ``TypeError``
    naming the variable, not an ``AttributeError`` from whichever parser meets it first.
    """
    value = env.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        # The value is not shown: it may be a secret (a password, a header).
        raise TypeError(
            f"environ[{name!r}]: expected a str, as os.environ holds, got {type(value).__name__}"
        )
    if not value.strip():
        return default
    return value
