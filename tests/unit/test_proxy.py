"""Proxy handoff tests against fake prefill/decode upstreams on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvdisagg.proxy import make_app

PREFILL_KV = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "eng-1",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}
FORGED = {"do_remote_prefill": True, "remote_block_ids": [666]}


def _prefill_app(seen: list[dict[str, Any]], name: str = "p0", status: int = 200,
                 with_kv: bool = True) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"name": name, "body": body, "headers": request.headers.copy()})
        if status != 200:
            return web.json_response({"error": "boom"}, status=status)
        resp: dict[str, Any] = {"id": "cmpl-p", "choices": [{"text": "x"}]}
        if with_kv:
            resp["kv_transfer_params"] = PREFILL_KV
        return web.json_response(resp)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    return app


CHUNKS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
          b"data: [DONE]\n\n"]


def _decode_app(seen: list[dict[str, Any]]) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "headers": request.headers.copy()})
        if body.get("stream"):
            resp = web.StreamResponse()
            resp.content_type = "text/event-stream"
            await resp.prepare(request)
            for c in CHUNKS:
                await resp.write(c)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        return web.json_response({"id": "cmpl-d", "choices": [{"text": "hello"}]})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/v1/models", models)
    return app


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def _with_proxy(prefill_apps: list[web.Application], decode_apps: list[web.Application],
                      fn: Callable[[TestClient], Awaitable[None]],
                      extra_decode_urls: list[str] | None = None) -> None:
    servers = [TestServer(a, host="127.0.0.1") for a in prefill_apps + decode_apps]
    for s in servers:
        await s.start_server()
    try:
        urls = [str(s.make_url("")).rstrip("/") for s in servers]
        purls, durls = urls[: len(prefill_apps)], urls[len(prefill_apps):]
        durls += extra_decode_urls or []
        client = TestClient(TestServer(make_app(purls, durls, timeout_s=5.0), host="127.0.0.1"))
        await client.start_server()
        try:
            await fn(client)
        finally:
            await client.close()
    finally:
        for s in servers:
            await s.close()


def test_non_streaming_handoff() -> None:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []

    async def fn(client: TestClient) -> None:
        body = {"model": "m", "prompt": "hi", "max_tokens": 17, "ignore_eos": True,
                "stream": False, "min_tokens": 3, "kv_transfer_params": FORGED}
        r = await client.post("/v1/completions", json=body,
                              headers={"Authorization": "Bearer k"})
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == "hello"

    asyncio.run(_with_proxy([_prefill_app(pseen)], [_decode_app(dseen)], fn))
    p = pseen[0]["body"]
    assert p["max_tokens"] == 1 and p["stream"] is False and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["kv_transfer_params"]["do_remote_prefill"] is False
    assert p["kv_transfer_params"] != FORGED
    d = dseen[0]["body"]
    assert d["kv_transfer_params"] == PREFILL_KV
    assert d["max_tokens"] == 17 and d["ignore_eos"] is True and d["min_tokens"] == 3
    rid = pseen[0]["headers"]["X-Request-Id"]
    assert rid and rid == dseen[0]["headers"]["X-Request-Id"]
    assert pseen[0]["headers"]["Authorization"] == "Bearer k"
    assert dseen[0]["headers"]["Authorization"] == "Bearer k"


def test_chat_prefill_limits_completion_tokens() -> None:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []

    async def fn(client: TestClient) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 9, "stream": True,
                "stream_options": {"include_usage": True}}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200
        await r.read()

    asyncio.run(_with_proxy([_prefill_app(pseen)], [_decode_app(dseen)], fn))
    p = pseen[0]["body"]
    assert p["max_completion_tokens"] == 1 and "stream_options" not in p and p["stream"] is False
    d = dseen[0]["body"]
    assert d["max_completion_tokens"] == 9 and d["stream_options"] == {"include_usage": True}


def test_streaming_relay() -> None:
    async def fn(client: TestClient) -> None:
        r = await client.post("/v1/completions",
                              json={"model": "m", "prompt": "hi", "stream": True})
        assert r.status == 200
        assert r.content_type == "text/event-stream"
        assert await r.read() == b"".join(CHUNKS)

    asyncio.run(_with_proxy([_prefill_app([])], [_decode_app([])], fn))


def test_prefill_error_relayed() -> None:
    async def fn(client: TestClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status == 500
        err = (await r.json())["error"]
        assert err["code"] == 500 and "prefill http://127.0.0.1" in err["message"]

    asyncio.run(_with_proxy([_prefill_app([], status=500)], [_decode_app([])], fn))


def test_prefill_missing_kv_params() -> None:
    dseen: list[dict[str, Any]] = []

    async def fn(client: TestClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status == 502
        assert "returned no kv_transfer_params" in (await r.json())["error"]["message"]

    asyncio.run(_with_proxy([_prefill_app([], with_kv=False)], [_decode_app(dseen)], fn))
    assert dseen == []


def test_decode_unreachable() -> None:
    port = _closed_port()

    async def fn(client: TestClient) -> None:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            assert r.status == 502
            err = (await r.json())["error"]
            assert f"127.0.0.1:{port}" in err["message"]

    asyncio.run(_with_proxy([_prefill_app([])], [], fn,
                            extra_decode_urls=[f"http://127.0.0.1:{port}"]))


def test_round_robin_prefill() -> None:
    seen: list[dict[str, Any]] = []

    async def fn(client: TestClient) -> None:
        for _ in range(4):
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status == 200

    asyncio.run(_with_proxy([_prefill_app(seen, "p0"), _prefill_app(seen, "p1")],
                            [_decode_app([])], fn))
    assert [s["name"] for s in seen] == ["p0", "p1", "p0", "p1"]


def test_bad_json_health_models() -> None:
    async def fn(client: TestClient) -> None:
        r = await client.post("/v1/completions", data=b"{not json",
                              headers={"Content-Type": "application/json"})
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"
        r = await client.post("/v1/completions", json=[1, 2])
        assert r.status == 400
        r = await client.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok"}
        r = await client.get("/v1/models")
        assert (await r.json())["data"][0]["id"] == "m"

    asyncio.run(_with_proxy([_prefill_app([])], [_decode_app([])], fn))




def test_decode_fails_mid_stream() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Length": "1000"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(CHUNKS[0])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    dapp = web.Application()
    dapp.router.add_post("/v1/completions", broken)

    async def fn(client: TestClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status == 200
        data = await r.read()
        assert data.startswith(CHUNKS[0])
        assert b'data: {"error"' in data and data.endswith(b"data: [DONE]\n\n")

    asyncio.run(_with_proxy([_prefill_app([])], [dapp], fn))
