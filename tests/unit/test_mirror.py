"""tests/unit/ mirrors src/kvdisagg/: ``tests/unit/D/test_X.py`` tests ``kvdisagg/D/X.py`` (or the
package ``kvdisagg/D/X/``), so a module's tests are found where the module is. A file that tests
something else says what, here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"
SRC = ROOT / "src" / "kvdisagg"

NOT_ONE_MODULE = {
    "test_mirror.py": "this layout",
    "test_layering.py": "the package's import graph",
    "test_lint.py": "ruff and mypy over src/ and tests/",
    "test_names.py": "one name, one concept: class, function and module names unique across "
                     "src/",
    "test_examples.py": "examples/ (manifests, scripts, configs)",
    "test_monitoring.py": "examples/kubernetes/monitoring/ (alert rules, their promtool tests, "
                          "the dashboard)",
    "bench/test_layering.py": "bench/ and the profile command run without vLLM",
    "proxy/fleet/test_discovery_kubernetes.py": "discovery.py's Kubernetes source, apart for its "
                                                "size",
    "transport/test_conformance.py": "every transport against one contract (slow: processes)",
    "transport/test_data_paths.py": "the data-path helpers of every pull transport",
}


def test_each_unit_test_file_names_the_module_it_tests() -> None:
    strays = []
    for path in sorted(UNIT.rglob("test_*.py")):
        rel = path.relative_to(UNIT)
        if rel.as_posix() in NOT_ONE_MODULE:
            continue
        module = SRC / rel.parent / rel.name.removeprefix("test_").removesuffix(".py")
        if not (module.with_suffix(".py").is_file() or module.is_dir()):
            strays.append(rel.as_posix())
    assert not strays, (f"{strays}: name each after the module it tests (tests/unit/D/test_X.py "
                        "for kvdisagg/D/X.py), or say in NOT_ONE_MODULE what it tests")
    for name in NOT_ONE_MODULE:
        assert (UNIT / name).is_file(), f"{name} is gone: take it out of NOT_ONE_MODULE"


def test_each_unit_test_directory_is_a_package_of_src() -> None:
    for d in sorted(p for p in UNIT.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = d.relative_to(UNIT)
        assert (SRC / rel / "__init__.py").is_file(), f"tests/unit/{rel}: no kvdisagg/{rel}"
        assert (d / "__init__.py").is_file(), f"tests/unit/{rel} needs an __init__.py"
