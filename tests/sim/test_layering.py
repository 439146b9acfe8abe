"""shim.sim may import shim.core and the standard library only; matplotlib only in plots, and only lazily."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import shim.sim

PACKAGE = Path(shim.sim.__file__).parent


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, id(node) in top))
    return found


def test_every_module_says_why_it_exists():
    for path in sorted(PACKAGE.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 8, f"{path.name} has no module docstring"


def test_sim_imports_only_core_and_the_standard_library():
    bad = []
    for path in sorted(PACKAGE.glob("*.py")):
        for module, top_level in imports(path):
            root = module.split(".")[0]
            if module.startswith(("shim.core", "shim.sim")) or root == "__future__":
                continue
            if root == "matplotlib" and path.name == "plots.py" and not top_level:
                continue
            if root in sys.stdlib_module_names:
                continue
            bad.append(f"{path.name}: {module}")
    assert not bad, f"shim.sim imports outside shim.core and the standard library: {bad}"


def test_the_package_imports_without_matplotlib_loaded():
    # A fresh interpreter, so that an earlier test's import does not hide a top-level one here.
    import subprocess

    code = "import sys, shim.sim.cli, shim.sim.study; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
