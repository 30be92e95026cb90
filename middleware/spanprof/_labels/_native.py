"""The optional C extension, loaded once, where it may be used.

``_cproxy`` holds the label engine's hot paths and the sampler's frame snapshot. It relies on
the GIL: on a free-threaded build, importing it would re-enable the GIL for the whole process
(with a RuntimeWarning), so there it is not imported at all and the Python versions run.
"""

from __future__ import annotations

import sysconfig
from types import ModuleType

__all__ = ["FREE_THREADED", "cproxy"]

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _load() -> ModuleType | None:
    if FREE_THREADED:
        return None
    try:
        from . import _cproxy
    except ImportError:  # installed without a C compiler
        return None
    return _cproxy


cproxy: ModuleType | None = _load()
