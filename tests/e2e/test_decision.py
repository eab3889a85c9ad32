"""The per-request decision on real vLLM instances (issue 15): a proxy that decides, over the
session fleet's prefill and decode (which publish their KV cache events), next to the fleet's
plain instance as the baseline.

- a long fresh prompt is disaggregated: KV moves (decode's pull counter), tokens identical;
- its follow-up (the prompt, the answer, a little more) is served by decode alone from its
  prefix cache: no pull, the index's predicted hit is what vLLM reports, tokens identical;
- a short prompt is served by decode alone;
- with the prefill idle, a disaggregated request's decode leg goes out with its prefill leg
  (early dispatch): the KV is pulled once, by position, tokens identical, handoffs freed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.local.servers import free_port, stop_process

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    post,
    prompt_ids,
    wait_handoffs_freed,
)

pytestmark = pytest.mark.e2e
GEN = {"model": "tiny", "temperature": 0, "max_tokens": 16, "ignore_eos": True,
       "return_token_ids": True}


@pytest.fixture(scope="module")
def deciding(fleet, model: Path):
    """``kvdisagg proxy`` as users run it (it decides), over the fleet's pair."""
    port = free_port()
    log = open(LOG_DIR / "deciding-proxy.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvdisagg.cli", "proxy", "--prefill",
                             fleet.prefill.base_url, "--decode", fleet.decode.base_url,
                             "--host", "127.0.0.1", "--port", str(port), "--tokenizer",
                             str(model), "--local-prefill-tokens", "256", "--early-decode"],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # ready, and its index follows both instances
            try:
                text = urllib.request.urlopen(url + "/metrics", timeout=2).read().decode()
                if text.count('kvdisagg_proxy_cache_index_live{') >= 2 and all(
                        line.endswith(" 1") for line in text.splitlines()
                        if line.startswith("kvdisagg_proxy_cache_index_live{")):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"the deciding proxy's index never went live: "
                                 f"{(LOG_DIR / 'deciding-proxy.log').read_text()[-2000:]}")
        yield url
    finally:
        stop_process(proc, 15)


def complete(base: str, prompt: list[int]) -> tuple[list[int], str]:
    req = urllib.request.Request(base + "/v1/completions",
                                 json.dumps({**GEN, "prompt": prompt}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"], r.headers.get(
            "X-Kvdisagg-Handoff", "")


def settled(base: str, name: str, **labels: str) -> float:
    """A counter once vLLM's stats interval has passed (engine stats are published on one)."""
    time.sleep(1.5)
    return metric(base, name, **labels)


def test_long_fresh_prompt_is_disaggregated_and_its_follow_up_served_by_decode(fleet, deciding):
    d = fleet.decode.base_url
    prompt = prompt_ids(1200, seed=777)
    pulls = metric(d, "vllm:kvdisagg_pulls_total")
    tokens, route = complete(deciding, prompt)
    assert route == "pd"
    assert tokens == complete(fleet.reference.base_url, prompt)[0]
    assert settled(d, "vllm:kvdisagg_pulls_total") - pulls == 1  # the KV really moved

    follow_up = [*prompt, *tokens, *prompt_ids(60, seed=778)]
    hits = metric(d, "vllm:prefix_cache_hits_total")
    predicted = metric(deciding, "kvdisagg_proxy_predicted_cached_tokens_total",
                       instance=d)
    pulls = metric(d, "vllm:kvdisagg_pulls_total")
    tokens, route = complete(deciding, follow_up)
    assert route == "decode_only:cached_prefix"
    assert tokens == complete(fleet.reference.base_url, follow_up)[0]
    assert settled(d, "vllm:kvdisagg_pulls_total") == pulls  # nothing pulled
    got = metric(d, "vllm:prefix_cache_hits_total") - hits
    said = metric(deciding, "kvdisagg_proxy_predicted_cached_tokens_total",
                  instance=d) - predicted
    assert said >= 1152 and got == said  # the index predicted exactly what vLLM reused


def test_short_prompt_is_served_by_decode_alone(fleet, deciding):
    prompt = prompt_ids(100, seed=779)
    pulls = metric(fleet.decode.base_url, "vllm:kvdisagg_pulls_total")
    prefills = metric(deciding, "kvdisagg_proxy_instance_requests_total", side="prefill")
    tokens, route = complete(deciding, prompt)
    assert route == "decode_only:short_prompt"
    assert tokens == complete(fleet.reference.base_url, prompt)[0]
    assert metric(deciding, "kvdisagg_proxy_instance_requests_total", side="prefill") == prefills
    assert settled(fleet.decode.base_url, "vllm:kvdisagg_pulls_total") == pulls


def test_chat_follow_up_turn_stays_on_decode(fleet, deciding):
    """Text chat: the proxy's own tokenizer and chat template give the ids the index needs."""
    system = "You answer questions about the sea and its songs. " * 40
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": "What does it sing?"}]
    body = {"model": "tiny", "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    status, first = post(deciding + "/v1/chat/completions", {**body, "messages": messages})
    assert status == 200, first
    answer = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And at night?"}]
    req = urllib.request.Request(deciding + "/v1/chat/completions",
                                 json.dumps({**body, "messages": messages}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        route = r.headers["X-Kvdisagg-Handoff"]
        got = json.loads(r.read())["choices"][0]["message"]["content"]
    assert route == "decode_only:cached_prefix"
    status, ref = post(fleet.reference.base_url + "/v1/chat/completions",
                       {**body, "messages": messages})
    assert got == ref["choices"][0]["message"]["content"]


def test_early_handoffs_pull_once_by_position_and_match_the_plain_instance(fleet, deciding):
    """Sequential long fresh prompts find the prefill idle: the deciding proxy sends each
    decode leg with its prefill leg; decode's Read waits at prefill for the handoff."""
    d = fleet.decode.base_url
    complete(deciding, prompt_ids(700, seed=780))  # a handoff: the prefill's side channel known
    opened = metric(deciding, "kvdisagg_proxy_early_handoffs_total", outcome="opened")
    fell_back = metric(deciding, "kvdisagg_proxy_early_handoffs_total", outcome="fell_back")
    pulls = metric(d, "vllm:kvdisagg_pulls_total")
    for i, stream in enumerate((False, True, False)):
        prompt = prompt_ids(900 + 50 * i, seed=781 + i)
        got = completion_tokens(deciding, {**GEN, "prompt": prompt, "stream": stream})
        assert got == ("ok", complete(fleet.reference.base_url, prompt)[0])
    assert metric(deciding, "kvdisagg_proxy_early_handoffs_total", outcome="opened") \
        - opened == 3
    assert metric(deciding, "kvdisagg_proxy_early_handoffs_total",
                  outcome="fell_back") == fell_back
    assert settled(d, "vllm:kvdisagg_pulls_total") - pulls == 3  # the KV really moved, once
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url)
    assert offered == freed  # nothing held at prefill


def stream_events(base: str, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    req = urllib.request.Request(base + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=300) as r:
        route = r.headers.get("X-Kvdisagg-Handoff", "")
        lines = [line.strip() for line in r]
    assert lines[-2:] == [b"data: [DONE]", b""], lines[-3:]
    for line in lines:
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
    return events, route


def side_by_side(proxy: str, ref: str, path: str, body: dict[str, Any], sent: float
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same stream through the proxy (disaggregated, its first token from prefill
    ``sent`` times so far) and from the plain instance."""
    got, route = stream_events(proxy, path, body)
    want, _ = stream_events(ref, path, body)
    assert route == "pd"
    assert metric(proxy, "kvdisagg_proxy_first_tokens_from_prefill_total",
                  outcome="sent") == sent
    return got, want


def streamed(events: list[dict[str, Any]], chat: bool) -> tuple[list[int], str, list[Any]]:
    """Token ids, text and finish reasons of one answer's events; every event one id."""
    ids, text, finish = [], "", []
    assert len({e["id"] for e in events}) == 1, "one id for the whole stream"
    for e in events:
        for c in e["choices"]:
            ids += c.get("token_ids") or []
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish.append(c["finish_reason"])
    return ids, text, [f for f in finish if f is not None]


def test_a_disaggregated_stream_starts_with_prefills_first_token(fleet):
    """The first token is prefill's; decode continues after it (its prompt one token longer,
    the prompt's KV pulled, not recomputed): events, ids, text and usage as the plain
    instance streams them. Not eligible (a seed): the ordinary handoff, same answer."""
    d, ref, proxy = fleet.decode.base_url, fleet.reference.base_url, fleet.proxy_url
    # Text, not random ids: the tiny model's first token for a random prompt is often bytes
    # of a character, which vLLM holds back (no text): the ordinary handoff then.
    text = "The keeper counted the waves and wrote each one in his book. " * 40
    body = {**GEN, "prompt": text, "stream_options": {"include_usage": True}}
    sent = metric(proxy, "kvdisagg_proxy_first_tokens_from_prefill_total", outcome="sent")
    pulls = metric(d, "vllm:kvdisagg_pulls_total")
    prompt_tokens = metric(d, "vllm:prompt_tokens_total")
    got, want = side_by_side(proxy, ref, "/v1/completions", body, sent + 1)
    assert streamed(got, False) == streamed(want, False)
    prompt = want[0]["choices"][0]["prompt_token_ids"]
    assert got[0]["choices"][0]["prompt_token_ids"] == prompt and len(prompt) > 512
    assert got[-1]["usage"] == want[-1]["usage"] == {
        "prompt_tokens": len(prompt), "completion_tokens": 16,
        "total_tokens": len(prompt) + 16}
    assert settled(d, "vllm:kvdisagg_pulls_total") - pulls == 1  # the KV moved
    # decode's prompt was the prompt plus prefill's token
    assert metric(d, "vllm:prompt_tokens_total") - prompt_tokens == len(prompt) + 1

    # chat, the client not asking for token ids: none in the events, text as plain's
    system = "Tides keep their own counsel and the moon keeps theirs. " * 50
    chat = {"model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "What do tides say?"}]}
    got, want = side_by_side(proxy, ref, "/v1/chat/completions", chat, sent + 2)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("role") for e in got].count("assistant") == 1
    assert streamed(got, True) == streamed(want, True)
    # the same events a plain instance streams, but for their id, time and instance
    same = {"id": "", "created": 0, "system_fingerprint": ""}
    assert [{**e, **same} for e in got] == [{**e, **same} for e in want]

    # a seed: decode samples every token, as the plain instance does
    seeded = {**body, "prompt": "Gulls " + text, "seed": 5, "temperature": 1.0}
    got, want = side_by_side(proxy, ref, "/v1/completions", seeded, sent + 2)
    assert streamed(got, False) == streamed(want, False)
    wait_handoffs_freed(fleet.prefill.base_url)
