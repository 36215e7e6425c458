"""Imports flow one way (design.md): experiments may use distributed, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

import shrinkgrad

SRC = Path(shrinkgrad.__file__).parent


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every module ``path`` (in ``package``) imports, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = package.split(".")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _modules_of(sub: str) -> dict[str, set[str]]:
    """Every module under ``shrinkgrad.<sub>`` and what it imports."""
    found = {}
    for path in sorted((SRC / sub).rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if path.name == "__init__.py":
            module = package = ".".join(parts[:-1])
        else:
            module, package = ".".join(parts), ".".join(parts[:-1])
        found[module] = _imported_modules(path, package)
    return found


def test_distributed_does_not_import_experiments() -> None:
    offenders = {
        module: sorted(m for m in imports if m.startswith("shrinkgrad.experiments"))
        for module, imports in _modules_of("distributed").items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_resolver_sees_relative_imports() -> None:
    """The check above would pass vacuously if relative imports were not resolved."""
    sweep = _modules_of("experiments")["shrinkgrad.experiments.distributed_sweep"]
    assert "shrinkgrad.distributed.runner" in sweep
    assert "shrinkgrad.experiments.config" in sweep
    runner = _modules_of("distributed")["shrinkgrad.distributed.runner"]
    assert "shrinkgrad.sim" in runner and "shrinkgrad.methods.base" in runner
