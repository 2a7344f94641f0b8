"""The layout of the project's own Python modules, read with `ast` (nothing is imported).

- The operator's code (scripts/cluster_lib) never imports the local rehearsal
  (scripts/rehearsal): the stand-ins depend on the operator's code, not the other way round.
- No import cycle among the modules under scripts/, stacks/ and workload/.

Both count every import statement of a module wherever it stands: at the top, inside a
function (a lazy import still ties two modules together), or under `if TYPE_CHECKING:`.
Importing `a.b.c` also loads the packages `a` and `a.b`, so those count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

PROJECT_FOLDERS = ("scripts", "stacks", "workload")
OPERATOR_PACKAGE = "scripts.cluster_lib"
REHEARSAL_PACKAGE = "scripts.rehearsal"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every Python module of the project by its dotted name."""
    return {
        module_name(path): path
        for folder in PROJECT_FOLDERS
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def imported_names(node: ast.stmt, name: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads (a `from` import: the module and, where
    they are modules, the names it takes from it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def project_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.stmt):
            continue
        for dotted in imported_names(node, name, path.name == "__init__.py"):
            parts = dotted.split(".")
            # The module and every package above it are loaded.
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(modules)
    found.discard(name)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: project_imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_operators_code_never_imports_the_rehearsal() -> None:
    modules = project_modules()
    assert any(name.startswith(REHEARSAL_PACKAGE) for name in modules)
    offenders = {
        name: sorted(m for m in imports if m.startswith(REHEARSAL_PACKAGE))
        for name, path in modules.items()
        if name.startswith(OPERATOR_PACKAGE)
        for imports in [project_imports(name, path, modules)]
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_projects_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph(project_modules())
    # The graph holds what the modules import (the rehearsal runs the operator's code).
    assert "scripts.cluster_lib.cluster" in graph["scripts.rehearsal.runner"]
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
