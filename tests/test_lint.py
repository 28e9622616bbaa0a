"""Static checks: ruff over the repository (``ruff.toml``: pyflakes' checks and import order), no import cycle
between reflow's packages, and none between its files (annotations and imports inside functions included)."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _package_imports() -> dict[str, set[str]]:
    """reflow's subpackages (and top-level modules) -> the others they import at run time (imports under
    ``if TYPE_CHECKING:`` are annotations only and do not count)."""
    edges: dict[str, set[str]] = {}
    package_root = os.path.join(ROOT, "reflow")
    for folder, _, files in os.walk(package_root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            source = os.path.relpath(path, package_root).split(os.sep)[0].removesuffix(".py")
            tree = ast.parse(open(path).read())
            annotation_only = {
                id(inner) for node in ast.walk(tree)
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)
            }
            for node in ast.walk(tree):
                from_reflow = isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reflow.")
                if from_reflow and id(node) not in annotation_only:
                    target = node.module.split(".")[1]
                    if target != source:
                        edges.setdefault(source, set()).add(target)
    return edges


def test_reflow_packages_import_each_other_without_cycles():
    edges = _package_imports()
    assert "modes" not in edges.get("config", set()) and "modes" not in edges.get("rollout", set())
    # a depth-first search for a back edge: any cycle fails, with its path
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for package in sorted(edges):
        if package not in state:
            visit(package, [package])


ANNOTATION_CYCLES_LEFT: set[frozenset[str]] = set()
"""File-level cycles still standing (none: the placement change works on explicit state, not on the mode). A
new cycle fails the test below, and so does one of these once gone."""


def _module_imports() -> dict[str, set[str]]:
    """Every reflow module -> the reflow modules it imports anywhere: at the top, inside functions, under
    ``if TYPE_CHECKING:`` (an import that only an annotation needs still ties the two files together)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "reflow")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = path
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reflow"):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    edges.setdefault(module, set()).add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.setdefault(module, set()).update(a.name for a in node.names if a.name in modules)
    return {module: {t for t in targets if t in modules and t != module} for module, targets in edges.items()}


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_reflow_files_import_each_other_without_cycles():
    assert set(_cycles(_module_imports())) == ANNOTATION_CYCLES_LEFT
