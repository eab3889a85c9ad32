"""The proxy's request forms and its per-request decision, against fake vLLM upstreams:
``n > 1`` and several prompts (issue 16), disaggregate or decode alone (issue 15)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from kvdisagg.proxy.app import SERVING
from kvdisagg.proxy.config import DecisionConfig, RetryConfig, SloConfig
from tests.unit.proxy.test_serving import metric, proxy, run

PROMPTS = ["#first prompt", "#second one", "#third"]


def events(data: bytes) -> list[Any]:
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_n_samples_one_handoff_prefill_asked_for_one() -> None:
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 5, "n": 3, "seed": 7,
                "best_of": 3})
            assert r.status == 200, await r.text()
            body = await r.json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2]
            (p,) = env.prefill[0].seen
            assert p["body"]["n"] == 1 and "best_of" not in p["body"]
            assert p["body"]["seed"] == 7  # the rest as the client sent it
            (d,) = env.decode[0].seen
            assert d["body"]["n"] == 3 and d["body"]["kv_transfer_params"]["do_remote_prefill"]
    run(t())


def test_several_prompts_one_handoff_each_merged_as_vllm_answers() -> None:
    async def t(n: int) -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 2, "n": n})
            assert r.status == 200, await r.text()
            assert r.headers["X-Kvdisagg-Handoff"] == "pd,pd,pd"
            body = await r.json()
            # choices prompt by prompt, index = prompt * n + sample
            assert [(c["index"], c["prompt_echo"]) for c in body["choices"]] == [
                (i * n + j, p) for i, p in enumerate(PROMPTS) for j in range(n)]
            prompt_tokens = sum(len(p) for p in PROMPTS)
            assert body["usage"] == {"prompt_tokens": prompt_tokens,
                                     "completion_tokens": 2 * n * len(PROMPTS),
                                     "total_tokens": prompt_tokens + 2 * n * len(PROMPTS)}
            # each prompt its own prefill leg and its own decode leg with that handoff
            assert sorted(s["body"]["prompt"] for s in env.prefill[0].seen) == sorted(PROMPTS)
            assert sorted(s["body"]["prompt"] for s in env.decode[0].seen) == sorted(PROMPTS)
            assert all(s["body"]["kv_transfer_params"]["do_remote_prefill"]
                       for s in env.decode[0].seen)
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_routed_total", route="pd") == 3
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t(1))
    run(t(2))


def test_several_prompts_streamed_interleaved_one_id_one_usage_one_done() -> None:
    async def t(n: int) -> None:
        async with proxy() as env:
            env.decode[0].tokens = 3
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 3, "n": n, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.status == 200
            evs = events(await r.read())
            assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
            usage = evs[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * n * 3
            assert usage["usage"]["prompt_tokens"] == sum(len(p) for p in PROMPTS)
            tokens = [e for e in evs[:-2]]
            assert all("usage" not in e for e in tokens)
            assert len({e["id"] for e in evs[:-1]}) == 1
            by_index: dict[int, list[str]] = {}
            for e in tokens:
                (c,) = e["choices"]
                by_index.setdefault(c["index"], []).append(c["text"])
                assert c["prompt_echo"] == PROMPTS[c["index"] // n]
            assert by_index == {i: ["t0 ", "t1 ", "t2 "] for i in range(3 * n)}
    run(t(1))
    run(t(2))


def test_several_prompts_one_bad_gives_its_error_and_abandons_the_rest() -> None:
    async def t() -> None:
        async with proxy() as env:
            env.prefill[0].status = 400
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 2})
            assert r.status == 400
            assert "says no" in (await r.json())["error"]["message"]
            assert env.decode[0].seen == []
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t())


def test_several_prompts_one_decode_dying_mid_stream_ends_the_stream_with_an_error() -> None:
    async def t() -> None:
        async with proxy() as env:
            env.decode[0].tokens = 5
            env.decode[0].die_after = 2
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 5, "stream": True})
            evs = events(await r.read())
            assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
            assert "error" in evs[-2] and "mid-stream" in evs[-2]["error"]["message"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="error") == 1
    run(t())


# ---- the per-request decision ------------------------------------------------------------


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


def test_passthrough_routes_reach_decode_control_routes_do_not() -> None:
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/tokenize?x=1", data=b'{"prompt":"hi"}',
                                      headers={"Content-Type": "application/json",
                                               "X-Request-Id": "tok-1"})
            assert r.status == 200 and r.headers["X-Request-Id"] == "tok-1"
            assert await r.json() == {"route": "/tokenize?x=1", "method": "POST",
                                      "got": '{"prompt":"hi"}'}
            r = await env.client.post("/detokenize", json={"tokens": [1]})
            assert (await r.json())["route"] == "/detokenize"
            r = await env.client.post("/v1/responses", json={"input": "hi"})
            assert (await r.json())["route"] == "/v1/responses"
            for path in ("/pause", "/sleep", "/reset_prefix_cache", "/collective_rpc"):
                r = await env.client.post(path, json={})
                assert r.status == 404, path
            assert [s["path"] for s in env.decode[0].seen] == [
                "/tokenize?x=1", "/detokenize", "/v1/responses"]
            assert env.prefill[0].seen == []
    run(t())


# ---- migration: a stream whose decode fails mid-way goes on elsewhere (issue 18) ----------


def token_texts(evs: list[Any], chat: bool = False) -> list[str]:
    out = []
    for e in evs:
        if e == "[DONE]" or "error" in e:
            continue
        for c in e.get("choices") or []:
            text = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if text:
                out.append(text)
    return out


def test_stream_migrates_to_another_decode_without_gap_or_duplicate() -> None:
    async def t(chat: bool) -> None:
        async with proxy(n_decode=2) as env:
            for d in env.decode:
                d.use_max_tokens = True
            env.decode[0].die_after = 3  # the decision's round robin starts with d0
            body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "stream": True,
                                    "stream_options": {"include_usage": True}}
            body |= ({"messages": [{"role": "user", "content": "hello"}]} if chat
                     else {"prompt": "hello"})
            r = await env.client.post("/v1/chat/completions" if chat else "/v1/completions",
                                      json=body)
            data = await r.read()
            evs = events(data)
            assert token_texts(evs, chat) == [f"t{k} " for k in range(8)]
            assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
            assert not any("error" in e for e in evs if e != "[DONE]")
            assert b'"token_ids":[' not in data  # the client did not ask for them
            assert len({e["id"] for e in evs if e != "[DONE]"}) == 1
            if chat:
                assert sum(1 for e in evs[:-1] for c in e["choices"]
                           if (c.get("delta") or {}).get("role")) == 1
            usage = evs[-2]["usage"]  # the whole answer, as one uninterrupted stream
            assert usage == {"prompt_tokens": 5 if not chat else 5, "completion_tokens": 8,
                             "total_tokens": 13}
            # the continuation: prompt + the 3 delivered tokens, 5 left to generate
            (cont,) = env.decode[1].seen
            cb = cont["body"]
            assert cb["max_tokens"] == 5 and cb["return_token_ids"] is True
            ids = (cb["kv_transfer_params"]["prompt_token_ids"] if chat else cb["prompt"])
            assert ids[-3:] == [100, 101, 102] and len(ids) == 8
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="ok") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
    run(t(False))
    run(t(True))


def test_only_decode_failing_twice_still_finishes_the_stream_then_gives_up() -> None:
    async def t(fault: str, tokens: int, migrations: int, finished: bool) -> None:
        async with proxy(retry=RetryConfig(migrations=migrations)) as env:
            d = env.decode[0]
            d.use_max_tokens = True
            setattr(d, fault, 2)
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": tokens, "stream": True,
                "return_token_ids": True})
            evs = events(await r.read())
            texts = token_texts(evs)
            if finished:
                assert texts == [f"t{k} " for k in range(tokens)]
                # the client asked for token ids: it gets them, one per token, in order
                ids = [i for e in evs[:-1] for c in e["choices"] for i in c["token_ids"]]
                assert ids == [100 + k for k in range(tokens)]
            else:
                assert texts == [f"t{k} " for k in range(2 * (migrations + 1))]
                assert "error" in evs[-2] and f"after {migrations} migrations" in \
                    evs[-2]["error"]["message"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_migrations_total", outcome="ok") == \
                migrations
    run(t("die_after", 5, 2, True))  # 2 + 2 + 1 tokens over three legs
    run(t("hang_after", 5, 2, True))  # silent past decode_idle_s: moved as well
    run(t("die_after", 9, 2, False))


def test_n_streams_are_not_migrated() -> None:
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            env.decode[0].tokens, env.decode[0].die_after = 5, 2
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 5, "n": 2, "stream": True})
            evs = events(await r.read())
            assert "error" in evs[-2] and evs[-1] == "[DONE]"
            assert "return_token_ids" not in env.decode[0].seen[0]["body"]
            assert env.decode[1].seen == []
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


def test_the_registry_tells_its_listeners_of_members() -> None:
    from kvdisagg.proxy.app import REGISTRY
    from kvdisagg.proxy.config import InstanceSpec
    from kvdisagg.proxy.registry import MemberEvent
    from kvdisagg.proxy.types import Role

    async def t() -> None:
        async with proxy() as env:
            reg = env.client.server.app[REGISTRY]
            heard: list[tuple[MemberEvent, str]] = []
            reg.listeners.append(lambda e, i: heard.append((e, i.url)))
            inst = reg.add(InstanceSpec(url="http://127.0.0.1:9", role=Role.DECODE))
            await reg.probe(inst)  # refused: unhealthy
            inst.probe_result(True, None, reg.cfg)
            inst.probe_result(True, None, reg.cfg)
            reg.remove(inst.url)
            assert heard == [(MemberEvent.ADDED, inst.url), (MemberEvent.RECOVERED, inst.url),
                             (MemberEvent.REMOVED, inst.url)]
    run(t())


def test_several_prompts_streamed_ask_decode_for_no_token_ids() -> None:
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 2, "stream": True})
            data = await r.read()
            assert b'"token_ids":[' not in data
            assert all("return_token_ids" not in s["body"] for s in env.decode[0].seen)
    run(t())


def test_echo_streams_ask_decode_for_no_token_ids() -> None:
    """vLLM echoes no prompt text when return_token_ids is set: an echo stream is not tapped."""
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True, "echo": True})
            assert r.status == 200
            assert "return_token_ids" not in env.decode[0].seen[0]["body"]
    run(t())
