"""Which top-level folder may import which (DESIGN.md: the coordinator and the stage
servers share only the proto contract and common/), read from the source with `ast`, so
an import inside a function counts as much as one at the top of a file.

  coordinator/        never interleaf.stageserver
  common/, protos/    never interleaf.coordinator, interleaf.stageserver, interleaf.clients
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "coordinator": ("stageserver",),
    "common": ("coordinator", "stageserver", "clients"),
    "protos": ("coordinator", "stageserver", "clients"),
}


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `tree`; `from interleaf import x` counts
    as `interleaf.x`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            if node.module == "interleaf":
                found += [(node.lineno, f"interleaf.{alias.name}") for alias in node.names]
    return found


def violations(folder: str) -> list[str]:
    banned = tuple(f"interleaf.{name}" for name in FORBIDDEN[folder])
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for line, module in imported(ast.parse(path.read_text(), str(path)))
            if any(module == b or module.startswith(b + ".") for b in banned)]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_only_what_it_may(folder):
    assert violations(folder) == []


def test_the_check_sees_every_form_of_import():
    """A bare import, a from-import, one inside a function and `from interleaf import`."""
    source = ("import interleaf.stageserver.job\n"
              "from interleaf.stageserver.model import chunk\n"
              "def f():\n    from interleaf import stageserver\n"
              "from interleaf.common.model.config import ModelShape\n")
    modules = sorted(module for _, module in imported(ast.parse(source)))
    assert modules == ["interleaf", "interleaf.common.model.config", "interleaf.stageserver",
                       "interleaf.stageserver.job", "interleaf.stageserver.model"]
