"""Packages import only downward: pallas_kernels <- qspec_jax <- convert <- bench. Every import in
the source counts, function-level ones included (a lazy import still makes a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("pallas_kernels", "qspec_jax", "convert", "bench")  # each may import those before it


def _imported_packages(path: Path) -> set[tuple[str, int]]:
    """``(top-level package, line)`` of every absolute import in ``path``, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", ORDER[:3])
def test_no_module_imports_a_higher_package(package):
    higher = set(ORDER[ORDER.index(package) + 1:]) | {"tests"}
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(ROOT)}:{line} imports {top}" for f in files
           for top, line in sorted(_imported_packages(f)) if top in higher]
    assert not bad, "\n".join(bad)
