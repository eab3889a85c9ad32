"""Overload: P/D answers every request a plain vLLM instance answers, token for token.

A burst far past decode's batch (40 requests against ``--max-num-seqs 16``), streamed and not,
prompts of 1-1900 tokens, outputs of 1-2040 tokens, first against a plain instance with the same
model and flags (the session's: no instance of this module's own), then through the proxy to a
1P1D pair. Twice: each instance on its own core, and with vLLM's default CPU settings (no
``VLLM_CPU_OMP_THREADS_BIND``: vLLM binds every instance's worker to the same core), as users
start it. The plain answers of a workload are computed once and are the baseline of both pairs:
the same bodies (greedy, or seeded) on the same plain instance give the same answers, and the
plain instance is idle while a pair serves the burst, whichever its binding. Requests wait in
decode's queue far longer than a lease: decode keeps their handoffs alive, so none is freed
unread, no pull fails, and prefill's KV is back to zero afterwards. The next burst right after
is served too (no breaker left open).

The proxy runs as users run it: it decides per request (short prompts to decode alone, long ones
disaggregated) and follows the instances' KV events. The burst also holds request forms that
fan out: ``n = 2`` with seeded sampling (two samples share one handoff) and several prompts in
one request (one handoff each); none of them may read a handoff another already released.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    post,
    prompt_ids,
    wait_handoffs_freed,
    wait_kv_usage_zero,
)

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
        body = {"model": "tiny", "prompt": prompt_ids(prompt_len, seed=seed + i),
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": i % 2 == 1}
        if i % 10 == 4:  # two seeded samples: one handoff, pulled once, shared
            body |= {"n": 2, "temperature": 1.0, "seed": seed + i, "stream": False,
                     "max_tokens": min(max_tokens, 300)}
        elif i % 10 == 8:  # two prompts in one request: one handoff each
            body |= {"prompt": [body["prompt"], prompt_ids(prompt_len + 200, seed=-seed - i)],
                     "stream": False, "max_tokens": min(max_tokens, 300)}
        out.append(body)
    return out


def answer(base_url: str, body: dict[str, Any]) -> tuple[str, Any]:
    """("ok", token ids of every choice by index) for the fan-out forms, else
    completion_tokens' answer."""
    if body.get("n", 1) == 1 and not isinstance(body["prompt"][0], list):
        return completion_tokens(base_url, body, CLIENT_TIMEOUT_S)
    status, doc = post(base_url + "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
    if status != 200:
        return "error", doc
    return "ok", [c["token_ids"] for c in sorted(doc["choices"], key=lambda c: c["index"])]


def burst(base_url: str, bodies: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: answer(base_url, b), bodies))


@pytest.fixture(scope="module")
def reference_burst(plain: str) -> Callable[[list[dict[str, Any]]], list[tuple[str, Any]]]:
    """The plain instance's answers to a workload: the baseline, one burst per workload for
    both pairs (kept only if every request was answered: a failed baseline is asked again).
    The plain instance's engine died under this burst twice in CI (a seeded prompt computed in
    chunks, "CPU Generator does not use offset"), as prefill's and decode's did; kvdisagg's
    plugin now rewinds those generators (docs/operations.md)."""
    answers: dict[str, list[tuple[str, Any]]] = {}

    def baseline(bodies: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        key = json.dumps(bodies, sort_keys=True)
        if key in answers:
            return answers[key]
        got = burst(plain, bodies)
        if all(kind == "ok" for kind, _ in got):
            answers[key] = got
        return got

    return baseline


@pytest.fixture(scope="module", params=["own-cores", "vllm-defaults"])
def fleet(request, model):
    binds = {} if request.param == "own-cores" else {"prefill": None, "decode": None}
    fleet = Fleet(model, LOG_DIR / f"overload-{request.param}", binds=binds,
                  prefill_extra={"lease_seconds": LEASE_S}, always_disaggregate=False,
                  kv_events=True, worker_in_engine=request.param == "own-cores")
    with fleet:
        yield fleet


@pytest.mark.timeout(2400)
def test_burst_past_decode_capacity_is_served_like_a_plain_instance(fleet, reference_burst,
                                                                    plain):
    p, d = fleet.prefill.base_url, fleet.decode.base_url
    bodies = workload(BURST, seed=4000)
    expected = reference_burst(bodies)
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
    # vllm-cpu's float32 kernels are not batch-invariant: under a burst the plain instance
    # itself may answer a long greedy request otherwise than alone (its prompt and steps
    # computed in other batches; a near-tie flips after hundreds of tokens: request 30, 1200
    # tokens, in both pairs of one run). Such an answer must be the plain instance's answer to
    # that request alone, and rare.
    alone = {i: answer(plain, bodies[i]) for i in differ}
    unexplained = [i for i in differ if got[i][1] != alone[i][1]]
    assert not unexplained, \
        f"requests {unexplained} differ from the plain instance, in its burst and alone"
    assert len(differ) <= BURST // 20, \
        f"requests {differ} differ from the plain instance's burst (each equal to it alone)"
    # Requests waited in decode's queue past their lease (the burst took elapsed s): decode
    # renewed the handoffs it held, so none was freed unread and no pull failed.
    assert elapsed > LEASE_S
    assert metric(d, "vllm:kvdisagg_lease_renewals_total") > \
        before["vllm:kvdisagg_lease_renewals_total"]
    assert wait_kv_usage_zero(p, timeout=30) == 0
    offered, freed = wait_handoffs_freed(p)
    assert offered == freed
    assert metric(p, "vllm:kvdisagg_handoffs_expired_total") == \
        before["vllm:kvdisagg_handoffs_expired_total"]
    assert metric(d, "vllm:kvdisagg_pull_failures_total") == \
        before["vllm:kvdisagg_pull_failures_total"]
    # Every prompt the proxy disaggregated was pulled once (n samples share one pull; the
    # prompts of one request each have theirs), and the decision did split the burst.
    pd = metric(fleet.proxy_url, "kvdisagg_proxy_routed_total", route="pd")
    local = metric(fleet.proxy_url, "kvdisagg_proxy_routed_total", route="decode_only")
    assert pd >= BURST // 4 and local >= BURST // 4, (pd, local)
    assert metric(d, "vllm:kvdisagg_pulls_total") - before["vllm:kvdisagg_pulls_total"] == pd
    assert offered >= pd
    logs = "".join(f.read_text(errors="replace") for f in fleet.log_dir.glob("*.log"))
    assert "already released" not in logs


@pytest.mark.timeout(900)
def test_the_next_burst_is_served_at_once(fleet, reference_burst):
    """Right after the overload: no breaker was opened by load, the fleet serves."""
    bodies = workload(16, seed=5000)
    for body in bodies:
        body["max_tokens"] = min(body["max_tokens"], 32)
    expected = reference_burst(bodies)
    got = burst(fleet.proxy_url, bodies)
    assert got == expected
