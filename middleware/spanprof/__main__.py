"""``python -m spanprof dev module:app``: the same as the ``spanprof`` console script."""

from __future__ import annotations

import sys

from ._local._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
