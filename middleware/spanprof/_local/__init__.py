"""Local mode: run an app with its profiles, spans and SLO breaches on a page, no servers needed.

``spanprof dev module:app`` (see ``_cli``) or ``LocalMode`` in code. Private: the command line
is the supported interface.
"""

from __future__ import annotations

from ._cli import main
from ._memory import MemoryStore
from ._mode import LocalMode, detect_interface, import_app
from ._samples import SampleStore, SpanProfile
from ._slo import SloPolicy
from ._spans import SpanRecord, SpanStore
from ._ui import UiServer

__all__ = [
    "LocalMode",
    "MemoryStore",
    "SampleStore",
    "SloPolicy",
    "SpanProfile",
    "SpanRecord",
    "SpanStore",
    "UiServer",
    "detect_interface",
    "import_app",
    "main",
]
