"""spanprof's version, defined once: read by the package face, pyproject.toml and exporters."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
