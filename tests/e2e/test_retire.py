"""Graceful retirement on real vLLM: a prefill sent SIGTERM while it holds handoffs serves them
all, then exits; the proxy stops sending it prompts; no request is lost (connector/retire.py,
docs/operations.md "Retirement")."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.testing.fleet import Fleet

from .conftest import LOG_DIR, completion_tokens, metric, post, prompt_ids, wait_handoffs_freed

pytestmark = pytest.mark.e2e

LEASE_S = 6.0
TRANSFER_TIMEOUT_S = 5.0
HOLD_S = LEASE_S + TRANSFER_TIMEOUT_S  # how long a retiring prefill waits for its handoffs
SHUTDOWN_TIMEOUT_S = 30  # vLLM's --shutdown-timeout: longer than HOLD_S
BURST = 8


@pytest.fixture(scope="module")
def fleet(model):
    fleet = Fleet(model, LOG_DIR / "retire", prefills=2,
                  prefill_extra={"lease_seconds": LEASE_S},
                  decode_extra={"transfer_timeout_seconds": TRANSFER_TIMEOUT_S},
                  prefill_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    with fleet:
        yield fleet


def bodies(seed: int, n: int) -> list[dict[str, Any]]:
    return [{"model": "tiny", "prompt": prompt_ids(600 + 100 * (i % 4), seed=seed + i),
             "max_tokens": 24, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True, "stream": i % 2 == 1} for i in range(n)]


def expected_tokens(url: str, items: list[dict[str, Any]]) -> list[list[int]]:
    """What a plain instance answers (decode computing the prompt itself)."""
    out = []
    for body in items:
        status, reply = post(url + "/v1/completions", {**body, "stream": False}, timeout=300)
        assert status == 200, reply
        out.append(reply["choices"][0]["token_ids"])
    return out


@pytest.mark.timeout(900)
def test_prefill_sigterm_serves_its_handoffs_then_exits(fleet):
    """Decode is paused while a burst is prefilled, so the prefills hold every handoff; prefill
    0 gets SIGTERM (its API server only, as Kubernetes sends it), then decode resumes. Every
    request succeeds, token-identical to a plain instance, every handoff is pulled (decode's
    pull count), prefill 0 exits within HOLD_S of the signal plus the pulls, and later requests
    go to prefill 1 only."""
    retiring, other, decode = fleet.prefills[0], fleet.prefills[1], fleet.decode
    items, later = bodies(0, BURST), bodies(100, 4)
    expected = expected_tokens(decode.base_url, items + later)
    pulls0 = metric(decode.base_url, "vllm:kvdisagg_pulls_total")
    offered0 = [metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total")
                for p in fleet.prefills]

    decode.pause()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            futures = [pool.submit(completion_tokens, fleet.proxy_url, b, 300) for b in items]
            # Every prompt prefilled and offered (decode cannot pull: it is stopped). Bounded:
            # the proxy's health probe of the stopped decode times out after 5 s (not dead).
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline and sum(
                    metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total") - o
                    for p, o in zip(fleet.prefills, offered0)) < BURST:
                time.sleep(0.2)
            held = metric(retiring.base_url, "vllm:kvdisagg_handoffs_offered_total") - offered0[0]
            assert retiring.proc is not None
            signalled = time.monotonic()
            os.kill(retiring.proc.pid, signal.SIGTERM)
            time.sleep(1.0)
            decode.resume()
            results = [f.result() for f in futures]
    finally:
        decode.resume()
    assert held > 0, "prefill 0 held no handoff when it was signalled: the test proves nothing"
    assert results == [("ok", e) for e in expected[:BURST]]

    # Prefill 0 exits once its handoffs are pulled: within HOLD_S of the signal at most.
    retiring.proc.wait(timeout=HOLD_S + 15)
    exited = time.monotonic() - signalled
    log = retiring.log_path.read_text(errors="replace")
    assert "kvdisagg: retiring" in log and "giving up" not in log, log[-3000:]
    assert exited < HOLD_S + 15

    # The proxy saw it retiring (or gone) and routes only to prefill 1 now.
    results = [completion_tokens(fleet.proxy_url, b, 300) for b in later]
    assert results == [("ok", e) for e in expected[BURST:]]
    pulls = metric(decode.base_url, "vllm:kvdisagg_pulls_total") - pulls0
    assert pulls == BURST + len(later), "every request's KV was pulled, none recomputed"
    assert metric(decode.base_url, "vllm:kvdisagg_pull_failures_total") == 0
    offered, freed = wait_handoffs_freed(other.base_url)
    assert offered == freed
    proxy_log = (fleet.log_dir / "proxy.log").read_text(errors="replace")
    assert "is retiring" in proxy_log or "unhealthy" in proxy_log
