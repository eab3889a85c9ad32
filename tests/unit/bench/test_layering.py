"""bench/ (and the profile command) must run on client machines without vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_bench_imports_no_vllm() -> None:
    code = (
        "import sys, pkgutil, importlib, kvdisagg.bench as b\n"
        "for m in pkgutil.iter_modules(b.__path__):\n"
        "    importlib.import_module(f'{b.__name__}.{m.name}')\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'torch')))\n"
        "print(len(list(pkgutil.iter_modules(b.__path__))), bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split(None, 1)
    assert int(out[0]) >= 10 and out[1].strip() == "[]"
