"""The proxy's request forms (proxy/handoff/fanout.py), against fake vLLM upstreams: ``n > 1`` and
several prompts (issue 16)."""

from __future__ import annotations

from tests.support.proxy_harness import events, metric, proxy, run

PROMPTS = ["#first prompt", "#second one", "#third"]


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


def test_several_prompts_streamed_ask_decode_for_no_token_ids() -> None:
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS, "max_tokens": 2, "stream": True})
            data = await r.read()
            assert b'"token_ids":[' not in data
            assert all("return_token_ids" not in s["body"] for s in env.decode[0].seen)
    run(t())
