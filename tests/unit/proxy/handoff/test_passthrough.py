"""Routes a decode instance serves as is (proxy/handoff/passthrough.py), against fake vLLM
upstreams: the allowlist reaches decode, vLLM's control routes do not."""

from __future__ import annotations

from tests.support.proxy_harness import proxy, run


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
