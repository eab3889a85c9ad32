"""examples/cpu-1p1d/run.sh as a user runs it: a prefill, a decode and the proxy on this host,
a long prompt handed off through the proxy and a short one
served by decode alone, every process gone afterwards."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvdisagg.local.servers import free_port

from .conftest import LOG_DIR

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_cpu_1p1d_example_runs():
    logs = LOG_DIR / "example-cpu-1p1d"
    logs.mkdir(parents=True, exist_ok=True)
    ports = {name: str(free_port()) for name in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT")}
    done = subprocess.run(["bash", str(ROOT / "examples/cpu-1p1d/run.sh")], cwd=ROOT,
                          env={**os.environ, **ports, "LOG_DIR": str(logs)},
                          capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "handoff: pd\n" in done.stdout, done.stdout[-3000:]
    assert "handoff: decode_only:short_prompt\n" in done.stdout, done.stdout[-3000:]
    # Nothing it started still listens.
    for port in ports.values():
        probe = subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
                               capture_output=True)
        assert probe.returncode != 0, f"port {port} still open after the example"
