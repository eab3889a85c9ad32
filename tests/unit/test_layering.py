"""The package's import graph: no circle anywhere in src/, and the one-way rules of STYLE.md.

Imports are read from the source (``ast``), module-level, inside functions and under
``TYPE_CHECKING`` alike: a function-level or annotation-only import hides a circle, it does not
remove it (the modules still know each other). ``from pkg import sub`` where ``sub`` is a module
counts as an import of ``pkg.sub``; a package's own ``__init__`` is not an edge of its
submodules. (What a module loads at run time, for the vLLM rule below, leaves annotations out.)
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Mapping
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


def imports_of(name: str, path: Path, known: dict[str, Path],
               type_checking: bool = True) -> set[str]:
    """The kvdisagg modules ``name`` imports: at run time, and for annotations too unless
    ``type_checking`` is False."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return {m for m in imported_names(path, package, known, type_checking)
            if m in known and m != name}


def imported_names(path: Path, package: str = "", known: Mapping[str, Path] | None = None,
                   type_checking: bool = False) -> set[str]:
    """The modules ``path`` imports at run time (and under ``TYPE_CHECKING`` with
    ``type_checking``), kvdisagg's and others' (``package``: its own, for relative imports;
    ``known``: kvdisagg's modules, to tell ``from pkg import sub``)."""
    known = known or {}
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not type_checking and _type_checking(node.test):
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
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """kvdisagg's modules and what each imports (parsed once per run: do not mutate it)."""
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


def test_annotation_only_imports_count(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from kvdisagg.b import B\n")
    known = {"kvdisagg.a": mod, "kvdisagg.b": mod}
    assert imports_of("kvdisagg.a", mod, known) == {"kvdisagg.b"}
    assert imports_of("kvdisagg.a", mod, known, type_checking=False) == set()


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


CONNECTOR_SIDES = tuple(f"kvdisagg.connector.{m}" for m in (
    "connector", "scheduler", "worker", "metadata", "leases", "retire", "stats"))
"""The connector's modules that run a side of it in vLLM (and import vLLM): the facade, its
scheduler and worker sides and what they hand each other."""
CONNECTOR_BASE = tuple(f"kvdisagg.connector.{m}" for m in (
    "protocol", "config", "layout", "sharding", "integrity", "threads"))
"""The connector's lower layer (connector/__init__.py): shared with kvdisagg.transport."""
HTTP_CONTRACT = ("kvdisagg.connector.protocol.params", "kvdisagg.connector.protocol.versions")
"""What the proxy may import of the connector: kv_transfer_params and the protocol's versions."""


@pytest.mark.parametrize("module,forbidden", [
    # the connector's scheduler side runs in EngineCore: no torch, no byte movement
    ("kvdisagg.connector.scheduler", ("kvdisagg.transport",)),
    ("kvdisagg.connector.worker", ("kvdisagg.connector.scheduler",)),
    # the transports move bytes below the connector's sides, never above them
    *[(m, CONNECTOR_SIDES) for m in ("kvdisagg.transport.base", "kvdisagg.transport.pull",
                                     "kvdisagg.transport.tcp", "kvdisagg.transport.nccl",
                                     "kvdisagg.transport.mooncake", "kvdisagg.transport.lmcache")],
    # the scheduler plugin reads vLLM's scheduler state and the request's SLO key, not handoffs
    ("kvdisagg.slo_scheduler", ("kvdisagg.transport", "kvdisagg.proxy",
                                "kvdisagg.connector.connector", "kvdisagg.connector.scheduler",
                                "kvdisagg.connector.worker", "kvdisagg.connector.protocol.frames",
                                "kvdisagg.connector.protocol.sockets")),
    # the dataset format (bench's), which the planner's traces read too: never the planner back
    ("kvdisagg.bench.workload", ("kvdisagg.planner",)),
    # doctor runs before vLLM is started: the connector's config and protocol, not its sides
    ("kvdisagg.cli.doctor", ("kvdisagg.proxy", *CONNECTOR_SIDES)),
    # the proxy's vocabulary and config sit below everything else in the proxy
    ("kvdisagg.proxy.types", ("kvdisagg.proxy.",)),
    ("kvdisagg.proxy.config", ("kvdisagg.proxy.fleet", "kvdisagg.proxy.routing",
                               "kvdisagg.proxy.handoff", "kvdisagg.proxy.metrics",
                               "kvdisagg.proxy.app")),
    # policies only select: they see instances through InstanceView, never the registry
    ("kvdisagg.proxy.routing.policies", ("kvdisagg.proxy.fleet", "kvdisagg.proxy.handoff")),
])
def test_imports_run_one_way(module: str, forbidden: tuple[str, ...]) -> None:
    assert module in graph(), f"{module} is gone: update this rule"
    reached = reaches(graph(), module)
    assert not [m for m in reached if m.startswith(forbidden)], sorted(reached)


def test_the_connectors_lower_layer_imports_nothing_above_it() -> None:
    g = graph()
    for module in sorted(m for m in g if m.startswith(CONNECTOR_BASE)):
        reached = reaches(g, module)
        assert not [m for m in reached if m.startswith(
            ("kvdisagg.transport", "kvdisagg.proxy", *CONNECTOR_SIDES))], (module, sorted(reached))


def test_the_http_contract_stands_alone() -> None:
    """kv_transfer_params and the versions import nothing of kvdisagg but each other: the proxy,
    the scheduler plugin and vLLM's detokenizer patch import them."""
    g = graph()
    for module in HTTP_CONTRACT:
        assert module in g
        assert reaches(g, module) <= set(HTTP_CONTRACT), module


def test_the_proxy_imports_of_the_connector_only_its_http_contract() -> None:
    g = graph()
    for module in sorted(m for m in g if m.startswith("kvdisagg.proxy")):
        reached = {m for m in reaches(g, module)
                   if m.startswith(("kvdisagg.connector", "kvdisagg.transport"))}
        assert reached <= set(HTTP_CONTRACT), (module, sorted(reached))


def test_the_command_dispatcher_imports_no_command() -> None:
    """``kvdisagg --help`` imports no command module (kvdisagg/cli/__init__.py)."""
    assert "kvdisagg.cli" in graph()
    assert reaches(graph(), "kvdisagg.cli") <= {"kvdisagg.errors"}


def imports_vllm(path: Path) -> bool:
    """Whether ``path`` imports vllm at run time (at module level or in a function)."""
    return any(m == "vllm" or m.startswith("vllm.") for m in imported_names(path))


@pytest.mark.parametrize("package", ["kvdisagg.planner", "kvdisagg.bench", "kvdisagg.proxy",
                                     "kvdisagg.cli", "kvdisagg.connector.protocol"])
def test_runs_without_vllm(package: str) -> None:
    """The planner and bench run on client machines, the proxy in its own image, the commands
    of kvdisagg/cli/ before vLLM starts: none of them, nor anything they import, imports vllm."""
    g, known = graph(), modules()
    assert package in g
    for module in sorted(m for m in g if m == package or m.startswith(package + ".")):
        importers = [m for m in {module} | reaches(g, module) if imports_vllm(known[m])]
        assert not importers, (module, sorted(importers))


def test_the_vllm_check_can_fail(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from vllm.config import VllmConfig\n")
    assert imports_vllm(f)
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n")
    assert not imports_vllm(f)


# The proxy's config is its bottom layer (proxy/config.py's docstring): loading a config file,
# or `kvdisagg proxy --help`, needs none of the proxy's runtime.
CONFIG_MAY_REACH = {"kvdisagg.errors", "kvdisagg.keys", "kvdisagg.tracing", "kvdisagg.proxy.types",
                    "kvdisagg.proxy.targets"}
CONFIG_THIRD_PARTY = {"msgspec", "yaml"}


def module_level_imports(path: Path) -> set[str]:
    """Top-level names of what ``path`` imports when it is loaded (its module-level statements,
    TYPE_CHECKING blocks included: they must not name the runtime either)."""
    found: set[str] = set()
    for node in ast.walk(ast.Module(body=[n for n in ast.parse(path.read_text()).body
                                          if not isinstance(n, ast.FunctionDef | ast.ClassDef)],
                                    type_ignores=[])):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_proxy_config_imports_no_runtime_module() -> None:
    known = modules()
    reached = reaches(graph(), "kvdisagg.proxy.config")
    assert reached <= CONFIG_MAY_REACH, f"config reaches {sorted(reached - CONFIG_MAY_REACH)}"
    for name in {"kvdisagg.proxy.config", *reached}:
        third = {m for m in module_level_imports(known[name]) - {"kvdisagg", "__future__"}
                 if m not in sys.stdlib_module_names}
        assert third <= CONFIG_THIRD_PARTY, f"{name} imports {sorted(third)}"


def test_importing_proxy_config_loads_no_runtime_module() -> None:
    """The same, as Python sees it: what ``import kvdisagg.proxy.config`` loads."""
    code = ("import sys, kvdisagg.proxy.config\n"
            "print(' '.join(m for m in sys.modules if m.startswith('kvdisagg.') or '.' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(SRC)}).stdout.split()
    ours = {m for m in out if m.startswith("kvdisagg.")} - {"kvdisagg.proxy",
                                                            "kvdisagg.proxy.config"}
    assert ours <= CONFIG_MAY_REACH, sorted(ours - CONFIG_MAY_REACH)
    runtime = {"zmq", "aiohttp", "httptools", "uvloop", "dns", "multidict", "yarl"} & set(out)
    assert not runtime, sorted(runtime)


def test_the_config_layer_check_can_fail() -> None:
    assert "zmq" in module_level_imports(modules()["kvdisagg.proxy.routing.cache_index"])
    assert "kvdisagg.proxy.routing.kv_events" in reaches(graph(),
                                                         "kvdisagg.proxy.routing.cache_index")


PROXY_LAYERS = (
    ("kvdisagg.proxy.types", "kvdisagg.proxy.targets", "kvdisagg.proxy.config",
     "kvdisagg.proxy.responses"),
    ("kvdisagg.proxy.fleet",),
    ("kvdisagg.proxy.routing",),
    ("kvdisagg.proxy.metrics",),
    ("kvdisagg.proxy.handoff",),
    ("kvdisagg.proxy", "kvdisagg.proxy.app", "kvdisagg.proxy.cli", "kvdisagg.proxy.admin_cli"),
)
"""The proxy's parts, bottom up (docs/architecture.md's module map): its vocabulary and config;
the fleet (membership, health, the upstream client); routing (the request, the contract,
policies, the decision, the cache index); the metrics; the handoff (the request pipeline, legs,
relay, migration, fan-out); the application and its command lines. A module reaches nothing of
a part above its own."""


def proxy_layer(module: str) -> int | None:
    for i, layer in enumerate(PROXY_LAYERS):
        if any(module == p or (p != "kvdisagg.proxy" and module.startswith(p + "."))
               for p in layer):
            return i
    return None


def upward(g: dict[str, set[str]], module: str) -> list[str]:
    """The proxy modules of a part above ``module``'s that it reaches."""
    level = proxy_layer(module)
    assert level is not None, module
    return sorted(m for m in reaches(g, module)
                  if (other := proxy_layer(m)) is not None and other > level)


def test_every_proxy_module_has_a_layer() -> None:
    assert not [m for m in graph() if m.startswith("kvdisagg.proxy") and proxy_layer(m) is None]


def test_the_proxy_imports_run_one_way() -> None:
    g = graph()
    for module in sorted(m for m in g if m.startswith("kvdisagg.proxy")):
        assert not upward(g, module), f"{module} reaches {upward(g, module)}"


def test_the_proxy_layer_check_can_fail() -> None:
    assert proxy_layer("kvdisagg.proxy") == proxy_layer("kvdisagg.proxy.app") == 5
    g = {"kvdisagg.proxy.fleet.registry": {"kvdisagg.proxy.config"},
         "kvdisagg.proxy.config": {"kvdisagg.proxy.handoff.relay"},
         "kvdisagg.proxy.handoff.relay": set()}
    assert upward(g, "kvdisagg.proxy.fleet.registry") == ["kvdisagg.proxy.handoff.relay"]
    assert upward(g, "kvdisagg.proxy.handoff.relay") == []
