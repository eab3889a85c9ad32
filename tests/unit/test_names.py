"""One name, one concept: no two modules of src/ define a class (of any name) or a public
function of the same name, so a reader who meets ``Instance`` or ``plan()`` knows which it is;
and no two modules (or packages) of src/ bear one name, so ``stats.py`` or ``workload.py`` does
not name two things either.

Read from the source (``ast``): the definitions at a module's top level, and inside its
top-level ``if``/``try`` blocks. Names that must be shared are allowed below, each with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from kvdisagg.cli import COMMANDS

SRC = Path(__file__).resolve().parents[2] / "src"

# name -> the modules that may define it
ALLOWED: dict[str, set[str]] = {
    # The command interface: kvdisagg.cli imports each command's module and calls these two
    # by name (``add_arguments(parser)``, ``run(args)``).
    "add_arguments": {c.module for c in COMMANDS.values()},
    "run": {c.module for c in COMMANDS.values()},
}


def definitions(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not node.name.startswith("_"):
                yield node.name
        elif isinstance(node, ast.If):
            yield from definitions(node.body)
            yield from definitions(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody,
                         *(h.body for h in node.handlers)):
                yield from definitions(part)


def defined(sources: dict[str, str]) -> dict[str, list[str]]:
    """name -> the modules (of ``module -> source``) defining it, each once."""
    out: dict[str, list[str]] = {}
    for module, source in sorted(sources.items()):
        for name in sorted(set(definitions(ast.parse(source).body))):
            out.setdefault(name, []).append(module)
    return out


def clashes(sources: dict[str, str]) -> dict[str, list[str]]:
    return {name: mods for name, mods in defined(sources).items()
            if len(mods) > 1 and not set(mods) <= ALLOWED.get(name, set())}


SHARED_BASENAMES: dict[str, str | set[str]] = {
    # One concept in every package that has one: any package may hold its own.
    "cli": "a package's command line (kvdisagg.cli dispatches; proxy/cli.py and bench/cli.py are "
           "the flags of `kvdisagg proxy` and `kvdisagg bench`)",
    "config": "a package's config struct, parsed and validated once (STYLE.md 7)",
}
"""Module basenames any package may use, and why. A name shared by exactly named modules goes
in ``SHARED_BY`` instead."""

SHARED_BY: dict[str, set[str]] = {
    # The fleet of vLLM instances: local/fleet.py starts one on this machine (demo, tests,
    # benchmarks); proxy/fleet/ is the proxy's view of one (membership, health, upstream).
    "fleet": {"kvdisagg.local.fleet", "kvdisagg.proxy.fleet"},
}


def basename_clashes(modules: set[str]) -> dict[str, list[str]]:
    """basename -> the modules (dotted names; a package by its own name) bearing it, for the
    names more than one module bears and neither table allows."""
    by_name: dict[str, list[str]] = {}
    for module in sorted(modules):
        package, _, name = module.rpartition(".")
        if package.rpartition(".")[2] == name:
            continue  # a package's own module (connector/connector.py): the package's concept
        by_name.setdefault(name, []).append(module)
    return {name: mods for name, mods in by_name.items()
            if len(mods) > 1 and name not in SHARED_BASENAMES
            and not set(mods) <= SHARED_BY.get(name, set())}


def src_modules() -> dict[str, str]:
    out = {}
    for f in (SRC / "kvdisagg").rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f.read_text()
    return out


def test_no_two_modules_define_one_name() -> None:
    found = clashes(src_modules())
    assert found == {}, f"rename one of each (or allow it in ALLOWED, saying why): {found}"


def test_no_two_modules_bear_one_name() -> None:
    found = basename_clashes(set(src_modules()))
    assert found == {}, ("name each module for its own concept (or allow the name in "
                         f"SHARED_BASENAMES or SHARED_BY, saying why): {found}")
    for name, mods in SHARED_BY.items():
        assert mods <= set(src_modules()), f"{name}: {sorted(mods)} changed: update SHARED_BY"


def test_the_basename_check_can_fail() -> None:
    modules = {"kvdisagg.bench.stats", "kvdisagg.connector.stats", "kvdisagg.bench.workload",
               "kvdisagg.planner.workload", "kvdisagg.planner.trace", "kvdisagg.proxy.config",
               "kvdisagg.connector.config", "kvdisagg.cli", "kvdisagg.bench.cli",
               "kvdisagg.local.fleet", "kvdisagg.proxy.fleet", "kvdisagg.bench.fleet",
               "kvdisagg.connector", "kvdisagg.connector.connector"}
    assert basename_clashes(modules) == {
        "fleet": ["kvdisagg.bench.fleet", "kvdisagg.local.fleet", "kvdisagg.proxy.fleet"],
        "stats": ["kvdisagg.bench.stats", "kvdisagg.connector.stats"],
        "workload": ["kvdisagg.bench.workload", "kvdisagg.planner.workload"]}
    assert basename_clashes(modules - {"kvdisagg.bench.stats", "kvdisagg.planner.workload",
                                       "kvdisagg.bench.fleet"}) == {}


def test_the_name_check_can_fail() -> None:
    sources = {"a": "class Instance: ...\ndef plan(): ...\ndef _own(): ...\n",
               "b": "if True:\n    class Instance: ...\ntry:\n    def plan(): ...\nexcept E: ...\n",
               "c": "def _own(): ...\ndef run(): ...\n", "d": "def run(): ...\n"}
    assert clashes(sources) == {"Instance": ["a", "b"], "plan": ["a", "b"], "run": ["c", "d"]}
    assert clashes({**sources, "a": "", "b": ""}) == {"run": ["c", "d"]}
    doctor, demo = COMMANDS["doctor"].module, COMMANDS["demo"].module  # commands: allowed
    assert clashes({doctor: "def run(): ...\n", demo: "def run(): ...\n"}) == {}
