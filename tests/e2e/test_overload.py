"""Overload: P/D answers every request a plain vLLM instance answers, token for token.

A burst far past decode's batch (40 requests against ``--max-num-seqs 16``), streamed and not,
prompts of 1-1900 tokens, outputs of 1-2040 tokens, first against a plain instance with the same
model and flags, then through the proxy to a 1P1D pair. Twice: each instance on its own core, and
with vLLM's default CPU settings (no ``VLLM_CPU_OMP_THREADS_BIND``: vLLM binds every instance's
worker to the same core), as users start it. Requests wait in decode's queue far longer than a
lease: decode keeps their handoffs alive, so none is freed unread, no pull fails, and prefill's KV
is back to zero afterwards. The next burst right after is served too (no breaker left open).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.testing.fleet import Fleet

from .conftest import (LOG_DIR, completion_tokens, metric, prompt_ids, wait_handoffs_freed,
                       wait_kv_usage_zero)

pytestmark = pytest.mark.e2e

LEASE_S = 8.0  # shorter than the time requests wait in decode's queue
# (prompt tokens, output tokens): long and short both ways, within the tiny model's 2048
SHAPES = [(1, 2040), (40, 16), (300, 600), (900, 1), (500, 1500), (1900, 100), (128, 1200),
          (700, 40)]
BURST = 40
CLIENT_TIMEOUT_S = 1200  # a bound on a dead server, not on generation: the burst takes minutes


def workload(n: int, seed: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        prompt_len, max_tokens = SHAPES[i % len(SHAPES)]
        out.append({"model": "tiny", "prompt": prompt_ids(prompt_len, seed=seed + i),
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": i % 2 == 1})
    return out


def burst(base_url: str, bodies: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: completion_tokens(base_url, b, CLIENT_TIMEOUT_S),
                             bodies))


@pytest.fixture(scope="module", params=["own-cores", "vllm-defaults"])
def fleet(request, model):
    binds = ({} if request.param == "own-cores"
             else {"prefill": None, "decode": None, "reference": None})
    fleet = Fleet(model, LOG_DIR / f"overload-{request.param}", reference=True, binds=binds,
                  prefill_extra={"lease_seconds": LEASE_S})
    with fleet:
        yield fleet


@pytest.mark.timeout(2400)
def test_burst_past_decode_capacity_is_served_like_a_plain_instance(fleet):
    p, d = fleet.prefill.base_url, fleet.decode.base_url
    bodies = workload(BURST, seed=4000)
    expected = burst(fleet.reference.base_url, bodies)
    assert [k for k, _ in expected] == ["ok"] * BURST, expected
    before = {name: metric(url, name) for url, name in
              [(p, "vllm:kvdisagg_handoffs_expired_total"),
               (d, "vllm:kvdisagg_pull_failures_total"), (d, "vllm:kvdisagg_pulls_total"),
               (d, "vllm:kvdisagg_lease_renewals_total")]}
    start = time.monotonic()
    got = burst(fleet.proxy_url, bodies)
    elapsed = time.monotonic() - start
    failed = [(i, k, str(t)[:200]) for i, (k, t) in enumerate(got) if k != "ok"]
    assert not failed, f"{len(failed)} of {BURST} failed through P/D: {failed[:5]}"
    differ = [i for i, (g, e) in enumerate(zip(got, expected)) if g[1] != e[1]]
    assert not differ, f"requests {differ} differ from the plain instance"
    # Requests waited in decode's queue past their lease (the burst took elapsed s): decode
    # renewed the handoffs it held, so none was freed unread and no pull failed.
    assert elapsed > LEASE_S
    assert metric(d, "vllm:kvdisagg_lease_renewals_total") > \
        before["vllm:kvdisagg_lease_renewals_total"]
    assert wait_kv_usage_zero(p, timeout=30) == 0
    offered, freed = wait_handoffs_freed(p)
    assert offered == freed >= BURST
    assert metric(p, "vllm:kvdisagg_handoffs_expired_total") == \
        before["vllm:kvdisagg_handoffs_expired_total"]
    assert metric(d, "vllm:kvdisagg_pull_failures_total") == \
        before["vllm:kvdisagg_pull_failures_total"]
    assert metric(d, "vllm:kvdisagg_pulls_total") - before["vllm:kvdisagg_pulls_total"] \
        >= BURST - BURST // len(SHAPES)  # 1-token prompts: nothing to pull but the recompute


@pytest.mark.timeout(900)
def test_the_next_burst_is_served_at_once(fleet):
    """Right after the overload: no breaker was opened by load, the fleet serves."""
    bodies = workload(16, seed=5000)
    for body in bodies:
        body["max_tokens"] = min(body["max_tokens"], 32)
    expected = burst(fleet.reference.base_url, bodies)
    got = burst(fleet.proxy_url, bodies)
    assert got == expected
