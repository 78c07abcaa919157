"""Interleaf: GPT training with data, tensor and interleaved pipeline parallelism over gRPC stage servers.

Everything lives under this one namespace: `interleaf.coordinator`, `interleaf.stageserver`,
`interleaf.clients` and `interleaf.protos`.
"""

from __future__ import annotations

import pathlib

# An installed wheel holds the subpackages inside this folder. A source checkout keeps them as
# the repository's top-level folders (the layout DESIGN.md describes), one level up: there the
# namespace reaches them through that folder too, so the checkout runs without being installed.
_checkout = pathlib.Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "coordinator" / "__init__.py").is_file():
    __path__.append(str(_checkout))
