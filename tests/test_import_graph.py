"""The import graph of flowalign, samplers, reward_models and kernels has no cycle, and no module imports after code.

Every module (tests/module_sources.py: the mapped folders by their installed names) is parsed with ``ast``; nothing
is imported.

Which imports are edges. The imports executed when the module is imported: the statements of the module body and,
recursively, of its ``if``/``else``, ``try``/``except``/``else``/``finally``, ``with``, ``for``, ``while`` and class
bodies. Excluded:

* the body of ``if TYPE_CHECKING:`` (``typing.TYPE_CHECKING`` too): it never runs (its ``else`` does and counts);
* imports inside functions (and lambdas): they run when the function is called, after every module imported at
  start-up has finished initialising, so they cannot meet a half-initialised module, and they do not decide the
  order modules initialise in, which is what a cycle breaks. Their direction is still checked: tests/test_layering.py
  reads every import, lazy ones included, so a lazy import cannot reach upwards;
* the implicit import of a module's parent packages (``import a.b.c`` and ``from a.b.c import x`` run
  ``a/__init__`` and ``a/b/__init__`` first): Python initialises a package before any of its submodules, whatever
  they import, so that order is never a cycle.

The edges of one statement go to the modules it names: ``import a.b`` to ``a.b``; ``from X import n`` to ``X`` (the
module the statement imports from, always imported) and, where ``X.n`` is a module, to ``X.n``. So ``from
flowalign.credit import Credit`` is an edge to ``flowalign.credit`` (its ``__init__``), and ``from . import chroma``
inside ``flowalign/models/loading.py`` is an edge to ``flowalign.models`` and to ``flowalign.models.chroma``. A
package's ``__init__`` importing its own submodules is an edge like any other, so a submodule importing from its own
package closes a cycle; it imports from the package's protocol module (``base.py``) or a sibling instead.

Late imports are read as flake8's E402 reads them (pycodestyle's ``module_imports_on_top_of_file``): among the
module's top-level statements, code is anything but an import, a docstring (any string expression), a dunder
assignment (``__all__ = ...``, ``__version__ = ...``) and an ``if``, ``try`` or ``with`` block (whose own statements
are not code either); an import at top level, or inside such a block, that comes after code is late. ``from
__future__`` is an import. A failure names the cycle (the module chain, with each edge's file and line) or the late
import's file and line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from module_sources import REPO, imported_names, module_name, origin, sources


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at import time, at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements executed when the module is imported (module docstring), in source order."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.ClassDef)):
                visit(node.body)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return found


def _target(name: str, modules: set[str]) -> str | None:
    """The longest module of ``modules`` that ``name`` is or lies in (None: outside the graph)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def edges(files: dict[str, tuple[str, str, bool]]) -> list[Edge]:
    """The import-time edges among ``files`` (``module -> (path, source, is_package)``)."""
    modules = set(files)
    out = []
    for module, (path, source, is_package) in files.items():
        for node in import_time_imports(ast.parse(source)):
            names = imported_names(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # ``from X import ...`` imports X itself too
                names.append(origin(node, module, is_package))
            targets = {_target(name, modules) for name in names} - {None, module}
            out += [Edge(module, target, path, node.lineno) for target in sorted(targets)]
    return out


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative), members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def cycle_in(group: list[str], found: list[Edge]) -> list[Edge]:
    """One shortest cycle through the first member of a strongly connected ``group``, as its edges."""
    members = set(group)
    by_source: dict[str, list[Edge]] = {}
    for edge in found:
        if edge.source in members and edge.target in members:
            by_source.setdefault(edge.source, []).append(edge)
    start = group[0]
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in sorted(by_source.get(node, []), key=lambda e: (e.target, e.line)):
                if edge.target == start:
                    return paths[node] + [edge]
                if edge.target not in paths:
                    paths[edge.target] = paths[node] + [edge]
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"{group} is not strongly connected")


def describe(cycle: list[Edge]) -> str:
    """``a -> b (path:line) -> a (path:line)``: the chain, each edge with the import that makes it."""
    return " -> ".join([cycle[0].source] + [f"{edge.target} ({edge.path}:{edge.line})" for edge in cycle])


def cycles(files: dict[str, tuple[str, str, bool]]) -> list[str]:
    """One line per strongly connected group of ``files``: its size, members and one cycle through it."""
    found = edges(files)
    graph: dict[str, list[str]] = {module: [] for module in files}
    for edge in found:
        graph[edge.source].append(edge.target)
    return [f"{len(group)} modules {{{', '.join(group)}}}: {describe(cycle_in(group, found))}"
            for group in strongly_connected(graph)]


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_dunder_assignment(node: ast.stmt) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    return bool(targets) and all(isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__")
                                 for t in targets)


def late_imports(path: str, source: str) -> list[str]:
    """``path:line: ...`` for each import after code (module docstring: E402 as flake8 reads it)."""
    out = []
    seen_code = False

    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            late = [node] if seen_code else []
        elif isinstance(node, (ast.If, ast.Try, getattr(ast, "TryStar", ast.Try), ast.With, ast.AsyncWith)):
            late = _block_imports(node) if seen_code else []
        else:
            late = []
            if not (_is_docstring(node) or _is_dunder_assignment(node)):
                seen_code = True
        out += [f"{path}:{n.lineno}: an import after code (E402): {ast.unparse(n)}" for n in late]
    return out


def _block_imports(node: ast.stmt) -> list[ast.stmt]:
    """The imports of an ``if``/``try``/``with`` block outside the functions and classes it defines."""
    found = []

    def visit(statements: list[ast.stmt]) -> None:
        for child in statements:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(child, field, []))
                for handler in getattr(child, "handlers", []):
                    visit(handler.body)

    visit([node])
    return found


def read_tree(root: Path = REPO) -> dict[str, tuple[str, str, bool]]:
    """``module -> (path relative to root, source, is_package)`` of every module under the mapped folders."""
    return {module_name(path, root): (str(path.relative_to(root)), path.read_text(), path.name == "__init__.py")
            for path in sources(root)}


def test_the_import_graph_has_no_cycle():
    found = cycles(read_tree())
    assert not found, f"{len(found)} import cycles (each: its modules and one cycle through them):\n" + "\n".join(found)


def test_no_module_imports_after_code():
    found = [line for path, source, _ in read_tree().values() for line in late_imports(path, source)]
    assert not found, f"{len(found)} late imports (move them to the top; a cycle is broken with a protocol module, " \
                      "not a late import):\n" + "\n".join(found)


PACKAGE = '''"""A package."""
from flowalign.pkg import impl  # noqa: F401
'''


def test_a_cycle_is_named_by_its_modules_and_lines():
    files = {"flowalign.pkg": ("flowalign/pkg/__init__.py", PACKAGE + "Thing = 1\n", True),
             "flowalign.pkg.impl": ("flowalign/pkg/impl.py", "import torch\n\nfrom flowalign.pkg import Thing\n",
                                    False)}
    (message,) = cycles(files)
    assert message == ("2 modules {flowalign.pkg, flowalign.pkg.impl}: flowalign.pkg -> flowalign.pkg.impl "
                       "(flowalign/pkg/__init__.py:2) -> flowalign.pkg (flowalign/pkg/impl.py:3)")


def test_a_protocol_module_breaks_the_package_cycle():
    files = {"flowalign.pkg": ("flowalign/pkg/__init__.py", PACKAGE + "from flowalign.pkg.base import Thing\n", True),
             "flowalign.pkg.base": ("flowalign/pkg/base.py", "Thing = 1\n", False),
             "flowalign.pkg.impl": ("flowalign/pkg/impl.py", "from .base import Thing\n", False)}
    assert cycles(files) == []
    assert {(e.source, e.target) for e in edges(files)} == {
        ("flowalign.pkg", "flowalign.pkg.impl"), ("flowalign.pkg", "flowalign.pkg.base"),
        ("flowalign.pkg.impl", "flowalign.pkg.base")}


def test_only_imports_run_at_import_time_are_edges():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from flowalign.b import B\nelse:\n    from flowalign.c import C\n"
              "try:\n    import flowalign.d\nexcept ImportError:\n    from flowalign import e\n"
              "class K:\n    from flowalign.f import F\n"
              "def lazy():\n    from flowalign.b import B\n")
    files = {name: (name, "", False) for name in ("flowalign", "flowalign.b", "flowalign.c", "flowalign.d",
                                                  "flowalign.e", "flowalign.f")}
    files["flowalign.a"] = ("flowalign/a.py", source, False)
    assert sorted(e.target for e in edges(files) if e.source == "flowalign.a") == [
        "flowalign", "flowalign.c", "flowalign.d", "flowalign.e", "flowalign.f"]


def test_a_late_import_is_named_by_its_file_and_line():
    source = ('"""Doc."""\nfrom __future__ import annotations\n\n__all__ = ["x"]\nimport os\n'
              'try:\n    import yaml\nexcept ImportError:\n    yaml = None\nimport sys\n\n'
              'x = 1\n\nimport json  # noqa: E402\nif x:\n    import re\n\ndef f():\n    import math\n')
    assert late_imports("flowalign/m.py", source) == [
        "flowalign/m.py:14: an import after code (E402): import json",
        "flowalign/m.py:16: an import after code (E402): import re"]
