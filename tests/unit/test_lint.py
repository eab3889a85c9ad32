"""The code stays lint- and type-clean: ``ruff check src tests`` and ``mypy`` (both configured in
pyproject.toml) report nothing. Runs the venv's own executables, the versions the ``test`` extra
pins, so a newer ruff or mypy elsewhere on PATH does not change the verdict."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    """The tool next to this interpreter (the venv's), else on PATH; skip when neither."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' installs it)")
    return found


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    # A cold mypy run takes ~30 s on one core; later runs reuse .mypy_cache.
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    out = _run([_tool("ruff"), "check", "--no-cache", "src", "tests"])
    assert out.returncode == 0, f"ruff check src tests:\n{out.stdout}{out.stderr}"


def test_mypy_clean() -> None:
    # No arguments: pyproject's [tool.mypy] names the files and the per-module strictness.
    out = _run([_tool("mypy")])
    assert out.returncode == 0, f"mypy:\n{out.stdout}{out.stderr}"
    assert "Success" in out.stdout, out.stdout
