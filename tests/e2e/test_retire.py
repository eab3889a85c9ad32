"""Graceful retirement on real vLLM (connector/retire.py, docs/operations.md "Retirement"): a
prefill sent SIGTERM while it holds handoffs serves them all, then exits; a decode sent SIGTERM
with streams running lets them run for its --shutdown-timeout, then the proxy migrates those left
to the other decode. The proxy stops sending either new work; no request is lost. 2P2D."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    plain_tokens,
    prompt_ids,
    wait_handoffs_freed,
)

pytestmark = pytest.mark.e2e

LEASE_S = 6.0
TRANSFER_TIMEOUT_S = 5.0
HOLD_S = LEASE_S + TRANSFER_TIMEOUT_S  # how long a retiring prefill waits for its handoffs
SHUTDOWN_TIMEOUT_S = 30  # prefill's --shutdown-timeout: longer than HOLD_S
DECODE_SHUTDOWN_S = 3  # decode's: streams still running after it are migrated
BURST = 8


@pytest.fixture(scope="module")
def fleet(model):
    fleet = Fleet(model, LOG_DIR / "retire", prefills=2, decodes=2,
                  prefill_extra={"lease_seconds": LEASE_S,
                                 "transfer_timeout_seconds": TRANSFER_TIMEOUT_S},
                  decode_extra={"transfer_timeout_seconds": TRANSFER_TIMEOUT_S},
                  prefill_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
                  decode_args=["--shutdown-timeout", str(DECODE_SHUTDOWN_S)])
    with fleet:
        yield fleet


def bodies(seed: int, n: int, max_tokens: int = 24, stream: bool | None = None
           ) -> list[dict[str, Any]]:
    return [{"model": "tiny", "prompt": prompt_ids(600 + 100 * (i % 4), seed=seed + i),
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True, "stream": i % 2 == 1 if stream is None else stream}
            for i in range(n)]


def pulls(fleet) -> float:
    return sum(metric(d.base_url, "vllm:kvdisagg_pulls_total") for d in fleet.decodes)


def proxy_metric(fleet, name: str, **labels: str) -> float:
    return metric(fleet.proxy_url, name, **labels)


@pytest.mark.timeout(900)
def test_prefill_sigterm_serves_its_handoffs_then_exits(fleet, plain):
    """Decode is paused while a burst is prefilled, so the prefills hold every handoff; prefill
    0 gets SIGTERM (its API server only, as Kubernetes sends it), then decode resumes. Every
    request succeeds, token-identical to a plain instance, every handoff is pulled (decode's
    pull count), prefill 0 exits within HOLD_S of the signal plus the pulls, and later requests
    go to prefill 1 only."""
    retiring, other = fleet.prefills
    items, later = bodies(0, BURST), bodies(100, 4)
    expected = plain_tokens(plain, items + later)
    pulls0 = pulls(fleet)
    offered0 = [metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total")
                for p in fleet.prefills]

    for d in fleet.decodes:
        d.pause()
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
            for d in fleet.decodes:
                d.resume()
            results = [f.result() for f in futures]
    finally:
        for d in fleet.decodes:
            d.resume()
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
    assert pulls(fleet) - pulls0 == BURST + len(later), "every KV pulled, none recomputed"
    assert sum(metric(d.base_url, "vllm:kvdisagg_pull_failures_total")
               for d in fleet.decodes) == 0
    offered, freed = wait_handoffs_freed(other.base_url)
    assert offered == freed
    proxy_log = (fleet.log_dir / "proxy.log").read_text(errors="replace")
    assert "is retiring" in proxy_log or "unhealthy" in proxy_log


@pytest.mark.timeout(900)
def test_decode_sigterm_finishes_or_migrates_its_streams(fleet, plain):
    """Long greedy streams run on both decodes; decode 0 gets SIGTERM (its API server). Its
    streams run on for DECODE_SHUTDOWN_S, then vLLM kills its engine and the proxy migrates
    each stream left to decode 1. Every stream completes token-identical to a plain run; decode
    0 exits within DECODE_SHUTDOWN_S plus teardown; later requests all go to decode 1."""
    retiring, other = fleet.decodes
    items, later = bodies(200, BURST, max_tokens=500, stream=True), bodies(300, 4)
    expected = plain_tokens(plain, items + later)
    migrated0 = proxy_metric(fleet, "kvdisagg_proxy_migrations_total", outcome="ok")
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(completion_tokens, fleet.proxy_url, b, 300) for b in items]
        deadline = time.monotonic() + 120  # bounds a broken fleet, not the burst
        while (time.monotonic() < deadline
               and metric(retiring.base_url, "vllm:num_requests_running") < 2):
            time.sleep(0.1)
        assert retiring.proc is not None
        signalled = time.monotonic()
        os.kill(retiring.proc.pid, signal.SIGTERM)
        retiring.proc.wait(timeout=DECODE_SHUTDOWN_S + 30)  # then killed, torn down
        exited = time.monotonic() - signalled
        results = [f.result() for f in futures]
    assert results == [("ok", e) for e in expected[:BURST]]
    assert exited < DECODE_SHUTDOWN_S + 30
    log = retiring.log_path.read_text(errors="replace")
    assert "kvdisagg: retiring" in log, log[-3000:]
    migrated = proxy_metric(fleet, "kvdisagg_proxy_migrations_total", outcome="ok") - migrated0
    assert migrated >= 1, "no stream outlived the shutdown timeout: the test proves nothing"
    before = metric(other.base_url, "vllm:kvdisagg_pulls_total")
    results = [completion_tokens(fleet.proxy_url, b, 300) for b in later]
    assert results == [("ok", e) for e in expected[BURST:]]
    assert metric(other.base_url, "vllm:kvdisagg_pulls_total") - before == len(later)
