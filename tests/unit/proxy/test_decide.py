"""The per-request decision (proxy/decide.py, issue 15) against fake vLLM upstreams on loopback:
disaggregate, or let decode serve the prompt alone, and which instance gets it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvdisagg.proxy.app import SERVING
from kvdisagg.proxy.config import DecisionConfig, SloConfig
from tests.support.proxy_harness import metric, proxy, run


class FakeCache:
    """What a KV-event index would say: instance url -> tokens of any prompt it holds."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits
        self.asked: list[Sequence[int]] = []

    def cached_tokens(self, token_ids: Sequence[int], extra: Any = None) -> dict[str, int]:
        self.asked.append(token_ids)
        return {u: min(h, len(token_ids)) for u, h in self.hits.items()}

    def answering(self) -> list[str]:
        return list(self.hits)


def test_short_prompt_goes_to_decode_alone_long_one_is_disaggregated() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=64)) as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 64, "max_tokens": 2})
            assert r.status == 200
            assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:short_prompt"
            assert env.prefill[0].seen == []
            assert "kv_transfer_params" not in env.decode[0].seen[0]["body"]
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 65, "max_tokens": 2})
            assert r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(env.prefill[0].seen) == 1
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_routed_total", route="decode_only",
                          reason="short_prompt") == 1
            assert metric(text, "kvdisagg_proxy_routed_total", route="pd",
                          reason="uncached_prompt") == 1
    run(t())


def test_prompt_logprobs_and_beam_search_go_to_decode_alone() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=0)) as env:
            long = [5] * 500
            for extra, reason in (({"prompt_logprobs": 1}, "prompt_logprobs"),
                                  ({"echo": True, "logprobs": 1}, "prompt_logprobs"),
                                  ({"use_beam_search": True, "n": 2}, "beam_search")):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": long, "max_tokens": 2, **extra})
                assert r.headers["X-Kvdisagg-Handoff"] == f"decode_only:{reason}", extra
            assert env.prefill[0].seen == []
    run(t())


def test_decode_holding_the_prefix_serves_the_follow_up_and_is_sticky() -> None:
    async def t() -> None:
        async with proxy(n_decode=2, decision=DecisionConfig(local_prefill_tokens=100)) as env:
            d1 = env.urls["d1"]
            env.client.server.app[SERVING].cache = FakeCache({d1: 900})
            for _ in range(3):  # a 1000-token prompt of which d1 holds 900: d1 computes 100
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 1000, "max_tokens": 2})
                assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:cached_prefix"
            assert len(env.decode[1].seen) == 3 and env.decode[0].seen == []
            assert env.prefill[0].seen == []
            # more uncached than the threshold: disaggregated, still to the decode that holds
            # the prefix (its pull then skips the blocks it has)
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 1200, "max_tokens": 2})
            assert r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(env.decode[1].seen) == 4
    run(t())


def test_tpot_pressure_shrinks_what_decode_computes_itself() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=200),
                         slo=SloConfig(tpot_s=0.1)) as env:
            decider = env.client.server.app[SERVING].decider
            (d,) = [i for i in env.client.server.app[SERVING].registry.instances.values()
                    if i.url == env.urls["d0"]]
            assert decider.threshold(d) == 200  # nothing measured yet: the whole budget
            d.tpot_s, d.tpot_load = 0.05, 0.0  # half the SLO used by one stream
            assert decider.threshold(d) == 100
            d.tpot_s = 0.2  # over the SLO: every prompt is disaggregated
            assert decider.threshold(d) == 0
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 50, "max_tokens": 2})
            assert r.headers["X-Kvdisagg-Handoff"] == "pd"
    run(t())


def test_prefill_holding_the_prefix_gets_the_disaggregated_request() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, decision=DecisionConfig(local_prefill_tokens=10)) as env:
            p1 = env.urls["p1"]
            cache = FakeCache({p1: 600})
            env.client.server.app[SERVING].cache = cache
            for _ in range(3):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 1000, "max_tokens": 2})
                assert r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(env.prefill[1].seen) == 3 and env.prefill[0].seen == []
            assert [len(ids) for ids in cache.asked] == [1000] * 3  # the client's own ids
    run(t())
