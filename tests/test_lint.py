"""Static checks: ruff over the repository (``ruff.toml``: pyflakes' checks and import order), and no import
cycle between reflow's packages."""

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
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reflow.") and id(node) not in annotation_only:
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
