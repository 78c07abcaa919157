"""The folders the `interleaf` distribution is made of: `interleaf/` itself and the
top-level folders its links point to (interleaf/coordinator -> ../coordinator, ...)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINKED = sorted(p.name for p in (ROOT / "interleaf").iterdir() if p.is_symlink())
PACKAGE_FOLDERS = ["interleaf", *LINKED]
