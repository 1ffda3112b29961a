"""The package layers hold: imports point only down, no module imports itself back through others,
every import sits at the top of its file unless it defers a heavy optional dependency and says
why, and no module edits ``sys.path``.

Layers, bottom to top: common ← modeling ← loader, planner ← worker, router, telemetry, quality ←
fleet ← cli ← bench. Packages on one layer may import each other (the worker ships telemetry, the router
federates it); tests sit above everything.

An import is an ``import`` statement, one under ``if TYPE_CHECKING:`` included, or a call of
``importlib.import_module`` or ``__import__`` by a literal name or an f-string: a placeholder
stands for any dotted name, so ``f"services.{name}.server"`` imports every ``services.*.server``
module of the tree (and, where it matches none, the f-string's leading text names the module).
``python -m tests.test_layers`` prints every violation in the tree.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"common": 0, "modeling": 1, "loader": 2, "planner": 2, "worker": 3, "router": 3, "telemetry": 3,
          "quality": 3, "fleet": 4, "cli": 5, "bench": 6, "tests": 7}
GENERATED = Path("services") / "common" / "proto" / "shardline"
DYNAMIC = ("importlib.import_module", "import_module", "__import__")


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return parts[1]
    return parts[0] if parts[0] in ("bench", "tests") else None


def sources(root: Path) -> list[Path]:
    files = [*sorted((root / "services").rglob("*.py")), *sorted((root / "bench").rglob("*.py"))]
    return [f for f in files if root / GENERATED not in f.parents]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _dynamic_name(node: ast.expr, module: str) -> tuple[str, str]:
    """The module a dynamic import names: (a regular expression of the names it can be, the
    leading text up to the last dot before the first placeholder). ``__name__``, the importing
    module's own name, counts as text; any other placeholder stands for a dotted name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value), node.value
    if not isinstance(node, ast.JoinedStr):
        return "", ""
    pattern, text, prefix = "", "", None
    for part in node.values:
        if isinstance(part, ast.Constant):
            pattern, text = pattern + re.escape(str(part.value)), text + str(part.value)
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id == "__name__":
            pattern, text = pattern + re.escape(module), text + module
        else:
            pattern += r"[A-Za-z0-9_.]+"
            prefix = text.rpartition(".")[0] if prefix is None else prefix
    return pattern, text if prefix is None else prefix


def imports(tree: ast.Module, module: str, package: str,
            modules: frozenset[str] = frozenset()) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, at module level) for every import of ``tree``, the module named
    ``module`` in ``package`` (for relative imports): statements, and dynamic imports (never at
    module level: a call defers its import), each of the tree's ``modules`` its name can be, or its
    leading text where it can be none of them."""
    top = {id(node) for node in tree.body}
    for node in tree.body:  # a module-level ``if TYPE_CHECKING:`` or ``try:`` block is still the top
        if isinstance(node, ast.If | ast.Try):
            top |= {id(child) for child in ast.walk(node)}
    found: list[tuple[ast.AST, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            found += [(node, f"{base}.{alias.name}", id(node) in top) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node, alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.Call) and _dotted(node.func) in DYNAMIC and node.args:
            pattern, prefix = _dynamic_name(node.args[0], module)
            matched = sorted(m for m in modules if re.fullmatch(pattern, m)) if pattern else []
            found += [(node, name, False) for name in matched or ([prefix] if prefix else [])]
    return found


def path_edits(tree: ast.Module) -> list[ast.AST]:
    """Calls that change ``sys.path`` (insert, append, extend, remove, ...) and assignments to it."""
    edits: list[ast.AST] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and _dotted(node.func.value) == "sys.path"):
            edits.append(node)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_dotted(t) == "sys.path" or (isinstance(t, ast.Subscript) and _dotted(t.value) == "sys.path")
                   for t in targets):
                edits.append(node)
    return edits


def module_names(root: Path) -> frozenset[str]:
    return frozenset(module_name(root, path) for path in sources(root))


def file_violations(root: Path, path: Path, modules: frozenset[str] = frozenset()) -> list[str]:
    rel = path.relative_to(root)
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    mine = _package(module)
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    found = []
    for node, target, at_top in imports(tree, module, package, modules or module_names(root)):
        theirs = _package(target)
        if mine is not None and theirs is not None and LAYERS[theirs] > LAYERS[mine]:
            found.append(f"{rel}:{node.lineno} imports {target} from a layer above")
        if not at_top:
            said = " ".join(lines[max(0, node.lineno - 5):node.end_lineno])  # the comment may head a block
            if "deferred:" not in said:
                found.append(f"{rel}:{node.lineno} imports {target} inside a function without a "
                             f"'# deferred: reason' comment")
    found += [f"{rel}:{node.lineno} edits sys.path" for node in path_edits(tree)]
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (``if TYPE_CHECKING:`` blocks included)."""
    files = {module_name(root, path): path for path in sources(root)}

    def resolve(target: str) -> str | None:  # the longest prefix that is a module of the tree
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in files:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = (resolve(t) for _, t, at_top in imports(ast.parse(path.read_text()), module, package) if at_top)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def violations(root: Path) -> list[str]:
    modules = module_names(root)
    found = [v for path in sources(root) for v in file_violations(root, path, modules)]
    found += [f"import cycle: {' <-> '.join(c)}" for c in cycles(import_graph(root))]
    return found


MODULES = module_names(REPO)


@pytest.mark.parametrize("path", sources(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down_sit_at_the_top_and_leave_sys_path_alone(path: Path) -> None:
    assert file_violations(REPO, path, MODULES) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(import_graph(REPO)) == []


def test_the_checks_catch_a_dynamic_upward_import_a_type_checking_cycle_and_a_path_edit(tmp_path: Path) -> None:
    router = tmp_path / "services" / "router"
    common = tmp_path / "services" / "common"
    for package in (router, common):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    (common / "sneaky.py").write_text(
        "import importlib\n\n\ndef load(kind, name):\n    # deferred: planted\n"
        "    importlib.import_module(f\"services.{kind}.picks\")\n"  # only services.router.picks can be it
        "    importlib.import_module(f\"services.router.{name}.gone\")\n")  # no module: its leading text counts
    (router / "picks.py").write_text("from services.router.views import View\n")
    (router / "views.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                     "    from services.router.picks import Pick\n")
    (router / "path.py").write_text("import sys\n\nsys.path.insert(0, '.')\n")
    found = violations(tmp_path)
    assert "services/common/sneaky.py:6 imports services.router.picks from a layer above" in found
    assert "services/common/sneaky.py:7 imports services.router from a layer above" in found
    assert "import cycle: services.router.picks <-> services.router.views" in found
    assert "services/router/path.py:3 edits sys.path" in found
    assert len(found) == 4, found
    named = ast.parse('f"{__name__}.{name}"', mode="eval").body  # a package's own submodules, by name
    assert _dynamic_name(named, "services.cli") == (r"services\.cli\.[A-Za-z0-9_.]+", "services.cli")


def test_a_dynamic_import_by_a_pattern_names_every_module_it_can_be() -> None:
    serve = REPO / "services" / "cli" / "serve.py"
    tree = ast.parse(serve.read_text())
    named = {target for _, target, _ in imports(tree, "services.cli.serve", "services.cli", MODULES)}
    assert {"services.router.server", "services.worker.server", "services.fleet.server"} <= named


if __name__ == "__main__":
    problems = violations(REPO)
    print("\n".join(problems) or "the layers hold: no upward import, no cycle, no sys.path edit")
    sys.exit(1 if problems else 0)
