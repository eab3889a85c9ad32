"""``kvdisagg plan``'s launch lines, pasted into a shell as printed, start the placement: a
2-core plan (a core per rank) of the tiny model, whose proxy then answers like the prefill
instance alone, with decode pulling the KV."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvdisagg.planner.profile import ParallelProfile, Profile, save_profile
from kvdisagg.local.servers import free_port

from .conftest import LOG_DIR, metric, post, prompt_ids

pytestmark = pytest.mark.e2e

SERVE_ARGS = ("--dtype float32 --max-model-len 2048 --enforce-eager --block-size 128 "
              "--served-model-name tiny")


def plan_lines(model: Path, tmp_path: Path, base_port: int, proxy_port: int) -> list[str]:
    """What ``kvdisagg plan`` prints under "launch" for 2 cores of a CPU profile."""
    config = ParallelProfile(tp=1, prefill=(5.0, 0.05, 0.0), decode_small=(5.0, 0.001, 0.1),
                             decode_large=(5.0, 0.001, 0.1), max_num_tokens=100_000)
    profile = tmp_path / "tiny-cpu.json"
    save_profile(Profile(model=str(model), hardware="2 CPU cores", configs=(config,)), profile)
    out = subprocess.run(
        [sys.executable, "-m", "kvdisagg.cli", "plan", "--profile", str(profile), "--gpus", "2",
         "--device", "cpu", "--ttft-slo", "5", "--tpot-slo", "1", "--requests", "100",
         "--base-port", str(base_port), "--proxy-port", str(proxy_port),
         "--serve-args", SERVE_ARGS],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert "1 prefill TP1PP1 + 1 decode TP1PP1" in out, out
    return [line.strip() for line in out.split("\nlaunch")[1].splitlines()[1:] if line.strip()]


@pytest.mark.timeout(1200)
def test_the_printed_launch_lines_start_a_serving_placement(model, tmp_path):
    base_port, proxy_port = free_port(), free_port()
    lines = plan_lines(model, tmp_path, base_port, proxy_port)
    commands = [line for line in lines if not line.startswith("#")]
    assert [c.split()[0] for c in commands] == [
        "VLLM_CPU_OMP_THREADS_BIND=0", "VLLM_CPU_OMP_THREADS_BIND=1", "kvdisagg"], lines
    assert "kv_producer" in commands[0] and "kv_consumer" in commands[1], lines
    log_dir = LOG_DIR / "plan"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "launch.sh"
    script.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    with open(log_dir / "launch.log", "wb") as log:
        shell = subprocess.Popen(["bash", str(script)], env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    proxy, prefill = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{base_port}"
    decode = f"http://127.0.0.1:{base_port + 1}"
    try:
        wait_ready(proxy, shell, timeout_s=900)
        # The proxy decides per request: the 5-token prompt is decode's alone (no pull), the
        # two past decision.local_prefill_tokens (512) are handed off.
        for n in (5, 700, 1000):
            body = {"model": "tiny", "prompt": prompt_ids(n, seed=n), "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            status, alone = post(prefill + "/v1/completions", body, timeout=300)
            assert status == 200, alone
            status, split = post(proxy + "/v1/completions", body, timeout=300)
            assert status == 200, split
            assert split["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert metric(decode, "vllm:kvdisagg_pulls_total") == 2
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        try:
            shell.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(5)  # the instances' own shutdown; then whatever is left of the group
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_ready(proxy: str, shell: subprocess.Popen, timeout_s: float) -> None:
    """Until the proxy's probes found both instances healthy; the shell must stay up."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        assert shell.poll() is None, f"the launch lines exited ({shell.returncode})"
        try:
            with urllib.request.urlopen(proxy + "/readiness", timeout=2) as r:
                state = json.loads(r.read())
            if all(state[s]["healthy"] == state[s]["total"] == 1 for s in ("prefill", "decode")):
                return
            last = str(state)
        except (OSError, ValueError, KeyError) as exc:
            last = str(exc)
        time.sleep(1)
    raise AssertionError(f"not ready after {timeout_s:.0f}s: {last}")
