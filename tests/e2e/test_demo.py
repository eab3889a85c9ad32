"""The README's main job, as a user runs it: ``kvdisagg demo`` starts its own fleet (prefill,
decode, a plain reference and the proxy), serves a short load and prints its report."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvdisagg.cli.demo import explain

from .conftest import LOG_DIR

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(1500)
def test_demo_serves_its_load_and_reports_it():
    log_dir = LOG_DIR / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "kvdisagg.cli", "demo", "--requests", "6", "--log-dir",
         str(log_dir)], capture_output=True, text=True, timeout=1400, env=dict(os.environ))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # Every answer equal to the plain instance's, by token ids.
    assert "outputs identical to the single-instance reference (token ids): 6/6" in out, out
    # The proxy decided per request: the long prompts handed off, the short ones decode's.
    pd = int(re.search(r"(\d+) of 6 requests disaggregated \(pd\)", out)[1])  # type: ignore[index]
    assert 2 <= pd <= 5, out
    assert re.search(r"decode_only:short_prompt", out), out
    # Each request explained by the reason the proxy gave for it: the reason in its header
    # (a handoff's, the one the proxy counted for handoffs), and the proxy's own count agrees.
    rows = {int(m[1]): (int(m[2]), m[3]) for m in re.finditer(
        r"^\s*(\d+)\s+(\d+)\s+(pd|decode_only:\w+)\s+[\d.]+\s+[\d.]+\s+(?:yes|NO)$", out,
        re.M)}
    assert sorted(rows) == list(range(6)), out
    told: dict[int, tuple[str, ...]] = {}
    for m in re.finditer(r"^  requests? ([\d, ]+) \((\w+): (\w+)\): (.*)$", out, re.M):
        why = (m[2], m[3])
        assert m[4].startswith(explain(why, 512)), out  # the reason's own sentence
        told |= {int(i): why for i in m[1].split(", ")}
    assert told == {i: ("pd", "uncached_prompt") if served == "pd"
                    else tuple(served.split(":")) for i, (_, served) in rows.items()}, out
    assert "routed_total counted the same reasons" in out, out
    # Prompt lengths counted exactly (the model's tokenizer in the proxy, not chars / 4): a
    # prompt decode computed as short is one of at most decision.local_prefill_tokens.
    assert all(n <= 512 for n, served in rows.values() if served.endswith("short_prompt")), out
    # The KV really moved (decode's pull counter), and prefill holds nothing afterwards.
    pulls = int(re.search(r"MiB in (\d+) pulls", out)[1])  # type: ignore[index]
    assert pulls == pd, out
    usage = float(re.search(r"prefill KV usage after the load: ([\d.]+)", out)[1])  # type: ignore[index]
    assert usage == 0.0, out
