"""The package's import graph: no circle anywhere in src/, and the one-way rules of STYLE.md.

Imports are read from the source (``ast``), module-level and inside functions alike (a
function-level import hides a circle, it does not remove it), but not under ``TYPE_CHECKING``
(annotations only). ``from pkg import sub`` where ``sub`` is a module counts as an import of
``pkg.sub``; a package's own ``__init__`` is not an edge of its submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "kvdisagg").rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvdisagg modules ``name`` imports, at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _type_checking(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs)
            if len(subs) < len(node.names):  # names from the module itself
                found.add(base)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_src() -> None:
    assert cycles(graph()) == []


def test_the_circle_check_can_fail() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def reaches(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in g.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("module,forbidden", [
    # the connector's scheduler side runs in EngineCore: no torch, no byte movement
    ("kvdisagg.connector.scheduler", ("kvdisagg.transport",)),
    ("kvdisagg.connector.worker", ("kvdisagg.connector.scheduler",)),
    # the proxy's vocabulary and config sit below everything else in the proxy
    ("kvdisagg.proxy.types", ("kvdisagg.proxy.",)),
    ("kvdisagg.proxy.config", ("kvdisagg.proxy.policies", "kvdisagg.proxy.registry",
                               "kvdisagg.proxy.discovery", "kvdisagg.proxy.app")),
    ("kvdisagg.proxy.policies", ("kvdisagg.proxy.registry", "kvdisagg.proxy.serving")),
])
def test_imports_run_one_way(module: str, forbidden: tuple[str, ...]) -> None:
    reached = reaches(graph(), module)
    assert not [m for m in reached if m.startswith(forbidden)], sorted(reached)
