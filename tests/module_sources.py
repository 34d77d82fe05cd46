"""The modules the import tests read: every file under flowalign/, samplers/, reward_models/ and kernels/, by the name
it is imported as (the mapped folders install as flowalign.samplers etc., pyproject's [tool.setuptools.package-dir]).

Shared by tests/test_layering.py (which layer may import which) and tests/test_import_graph.py (no cycles, no late
imports); both parse sources with ``ast`` and import nothing of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject's [tool.setuptools.package-dir])
FOLDERS = {"flowalign": "flowalign", "samplers": "flowalign.samplers", "reward_models": "flowalign.reward_models",
           "kernels": "flowalign.kernels"}


def module_name(path: Path, root: Path = REPO) -> str:
    """The import name of a file under one of FOLDERS (``samplers/sde.py`` -> ``flowalign.samplers.sde``)."""
    rel = path.relative_to(root)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path = REPO) -> Iterator[Path]:
    """Every ``.py`` file under FOLDERS in ``root`` (a checkout), in path order."""
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if ".venv" not in path.parts:
                yield path


def origin(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module ``node`` (``from X import ...``) imports from, relative imports resolved against ``module``
    (a package's own name when ``is_package``, else its parent's)."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The names one import statement imports: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` (``b`` may be
    a submodule or a name defined in ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = origin(node, module, is_package)
    return [f"{source}.{alias.name}" for alias in node.names]
