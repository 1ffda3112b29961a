"""The package layers hold: imports point only down, and every import sits at the top of its file
unless it defers a heavy optional dependency and says why.

Layers, bottom to top: common ← modeling ← loader, planner ← worker, router, telemetry ← fleet ←
cli ← bench. Packages on one layer may import each other (the worker ships telemetry, the router
federates it); tests sit above everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"common": 0, "modeling": 1, "loader": 2, "planner": 2, "worker": 3, "router": 3, "telemetry": 3,
          "fleet": 4, "cli": 5, "bench": 6, "tests": 7}
GENERATED = REPO / "services" / "common" / "proto" / "shardline"


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return parts[1]
    return parts[0] if parts[0] in ("bench", "tests") else None


def _sources() -> list[Path]:
    files = [*sorted((REPO / "services").rglob("*.py")), *sorted((REPO / "bench").rglob("*.py"))]
    return [f for f in files if GENERATED not in f.parents]


def _imports(tree: ast.Module) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported module, at module level) for every absolute import."""
    top = {id(node) for node in tree.body}
    for node in tree.body:  # a module-level ``if TYPE_CHECKING:`` or ``try:`` block is still the top
        if isinstance(node, ast.If | ast.Try):
            top |= {id(child) for child in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node, node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(node, alias.name, id(node) in top) for alias in node.names]
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down_and_sit_at_the_top(path: Path) -> None:
    rel = path.relative_to(REPO)
    module = ".".join(rel.with_suffix("").parts)
    mine = _package(module)
    lines = path.read_text().splitlines()
    tree = ast.parse(path.read_text())
    for node, target, at_top in _imports(tree):
        theirs = _package(target)
        if mine is not None and theirs is not None:
            assert LAYERS[theirs] <= LAYERS[mine], f"{rel}:{node.lineno} imports {target} from a layer above"
        if not at_top:
            said = " ".join(lines[max(0, node.lineno - 5):node.end_lineno])  # the comment may head a block
            assert "deferred:" in said, (f"{rel}:{node.lineno} imports {target} inside a function without a "
                                         f"'# deferred: reason' comment")
