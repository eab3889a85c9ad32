"""``kvdisagg demo``'s story of each request (kvdisagg/cli/demo.py): the reason it prints is the one
the proxy gave, read from a real proxy's header and counter (fake vLLM upstreams), and every
reason the proxy documents has its own sentence."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from kvdisagg.cli.demo import WHY, explain, reasons, routed
from kvdisagg.proxy.config import DecisionConfig
from tests.support.proxy_harness import proxy, run

DOCS = Path(__file__).resolve().parents[3] / "docs" / "proxy.md"


def test_every_documented_reason_has_its_sentence() -> None:
    (row,) = [line for line in DOCS.read_text().splitlines()
              if line.startswith("| `kvdisagg_proxy_routed_total`")]
    documented = {(route, reason)
                  for route, said in re.findall(r'`route="(\w+)"` \(([^)]*)\)', row)
                  for reason in re.findall(r"`(\w+)`", said) if reason != "reason"}
    assert documented == set(WHY)
    assert all("{" not in explain(why, 512) for why in WHY)


def test_the_reasons_printed_are_the_proxys() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=64)) as env:
            long = [5] * 100  # over the 64 tokens decode computes itself
            sent = [({"prompt": [5] * 10}, ("decode_only", "short_prompt")),
                    ({"prompt": long}, ("pd", "uncached_prompt")),
                    ({"prompt": long, "prompt_logprobs": 1}, ("decode_only", "prompt_logprobs")),
                    ({"prompt": long, "use_beam_search": True, "n": 2},
                     ("decode_only", "beam_search")),
                    ({"prompt": long}, ("decode_only", "prefill_failed"))]
            handoffs = []
            for i, (fields, _) in enumerate(sent):
                env.prefill[0].status = 500 if i == len(sent) - 1 else 200  # the last: fails
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "max_tokens": 2, **fields})
                assert r.status == 200, await r.text()
                handoffs.append(r.headers["X-Kvdisagg-Handoff"])
            counted = routed(await env.metrics())
        whys = reasons(handoffs, counted)
        assert whys == [why for _, why in sent]
        assert Counter(whys) == counted  # what the demo checks and prints
        assert explain(whys[0], 64).startswith("decode alone: at most "
                                               "decision.local_prefill_tokens (64)")
        assert explain(whys[1], 64).startswith("disaggregated: ")
        assert "fallback" in explain(whys[-1], 64)
    run(t())


def test_a_handoffs_reason_is_unknown_when_the_proxy_counted_several() -> None:
    counted = Counter({("pd", "uncached_prompt"): 1, ("pd", "always"): 1,
                       ("decode_only", "prefill_busy"): 1})
    whys = reasons(["pd", "decode_only:prefill_busy", "pd"], counted)
    assert whys == [("pd", "?"), ("decode_only", "prefill_busy"), ("pd", "?")]
    assert Counter(whys) != counted  # the demo prints the proxy's count then, not its story
    assert explain(("decode_only", "new_reason"), 512).startswith(
        "decode_only, reason new_reason")
