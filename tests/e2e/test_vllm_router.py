"""Interop: vllm-router (PyPI, Rust; the router users already run) in vLLM P/D mode in front of a
DisaggConnector pair: our kv_transfer_params are NixlConnector's, so it hands off as it does for
NIXL, and the answers are the prefill instance's own, token for token, streamed or not, with
the KV really moved: decode pulled once per request (a decode that silently computed the prompt
itself would give the same tokens)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvdisagg.local.servers import free_port, stop_process

from .conftest import LOG_DIR, completion_tokens, metric, prompt_ids, wait_metric_change

pytestmark = pytest.mark.e2e

# scripts/setup.sh installs vllm-router in its own venv (its pins are not vLLM's).
ROUTER = Path(os.environ.get("KVDISAGG_VLLM_ROUTER",
                             Path(__file__).resolve().parents[2] / ".venv-router/bin/vllm-router"))
GEN = {"model": "tiny", "temperature": 0, "max_tokens": 16, "ignore_eos": True,
       "return_token_ids": True}


@pytest.fixture(scope="module")
def router(fleet):
    if not ROUTER.exists():
        pytest.skip(f"vllm-router not installed at {ROUTER} (bash scripts/setup.sh installs it)")
    port, prom = free_port(), free_port()
    log = open(LOG_DIR / "vllm-router.log", "wb")
    proc = subprocess.Popen(
        [str(ROUTER), "--vllm-pd-disaggregation", "--policy", "round_robin",
         "--prefill", fleet.prefill.base_url, "--decode", fleet.decode.base_url,
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(prom), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"vllm-router exited; see {LOG_DIR / 'vllm-router.log'}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm-router never became healthy"
            time.sleep(0.5)
        yield url
    finally:
        stop_process(proc)
        log.close()


def tokens(base_url: str, prompt: list[int], stream: bool) -> list[int]:
    kind, out = completion_tokens(base_url, {**GEN, "prompt": prompt, "stream": stream})
    assert kind == "ok", out
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("n_tokens", [1, 127, 129, 700, 1500])
def test_vllm_router_in_front_is_token_identical(fleet, router, plain, n_tokens, stream):
    prompt = prompt_ids(n_tokens, seed=7000 + n_tokens)
    expected = tokens(plain, prompt, stream=False)
    d = fleet.decode.base_url
    pulls = metric(d, "vllm:kvdisagg_pulls_total")
    recomputed = metric(d, "vllm:kvdisagg_recomputed_prompts_total")
    assert tokens(router, prompt, stream) == expected
    assert wait_metric_change(d, "vllm:kvdisagg_pulls_total", pulls) == pulls + 1
    assert metric(d, "vllm:kvdisagg_recomputed_prompts_total") == recomputed
