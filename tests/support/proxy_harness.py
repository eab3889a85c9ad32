"""A proxy application in front of fake vLLM upstreams (tests.support.fake_vllm), all on loopback:
the serving and the admin test clients, and a reader of its /metrics text. Used by the proxy's
unit tests (tests/unit/proxy/)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from kvdisagg.local.servers import free_port
from kvdisagg.prom_text import samples, total
from kvdisagg.proxy import make_app
from kvdisagg.proxy.app import ADMIN
from kvdisagg.proxy.config import (
    DecisionConfig,
    HealthConfig,
    InstanceSpec,
    ProxyConfig,
    TimeoutConfig,
)
from kvdisagg.proxy.types import Role
from kvdisagg.tracing import Tracer
from tests.support.fake_vllm import FakeVllm


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for ``cond`` (polled every 10 ms), failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples in an exposition text whose labels include ``labels`` (0 if
    none)."""
    return total(samples(text), name, **labels) or 0.0


class Env:
    def __init__(self, client: TestClient, admin: TestClient, prefill: list[FakeVllm],
                 decode: list[FakeVllm], urls: dict[str, str]) -> None:
        self.client, self.admin, self.prefill, self.decode, self.urls = (client, admin, prefill,
                                                                          decode, urls)

    async def metrics(self) -> str:
        r = await self.client.get("/metrics")
        assert r.status == 200
        return await r.text()


@contextlib.asynccontextmanager
async def proxy(n_prefill: int = 1, n_decode: int = 1, dead_decode: int = 0,
                tracer: Tracer | None = None, **cfg_kw: Any) -> AsyncIterator[Env]:
    prefill = [FakeVllm(f"p{i}") for i in range(n_prefill)]
    decode = [FakeVllm(f"d{i}") for i in range(n_decode)]
    servers = [TestServer(f.app(), host="127.0.0.1") for f in prefill + decode]
    for s in servers:
        await s.start_server()
    urls = {f.name: str(s.make_url("")).rstrip("/") for f, s in zip(prefill + decode, servers)}
    instances = ([InstanceSpec(url=urls[f.name], role=Role.PREFILL) for f in prefill]
                 + [InstanceSpec(url=f"http://127.0.0.1:{free_port()}", role=Role.DECODE)
                    for _ in range(dead_decode)]
                 + [InstanceSpec(url=urls[f.name], role=Role.DECODE) for f in decode])
    cfg_kw.setdefault("timeouts", TimeoutConfig(prefill_s=2.0, decode_connect_s=2.0,
                                                decode_total_s=10.0, decode_idle_s=1.0))
    cfg_kw.setdefault("health", HealthConfig(interval_s=0.2, timeout_s=0.5, startup_timeout_s=2.0))
    # These tests are about the handoff: every request goes through prefill unless a test
    # is about the per-request decision (tests/unit/proxy/test_decide.py).
    cfg_kw.setdefault("decision", DecisionConfig(enabled=False))
    cfg = ProxyConfig(instances=instances, **cfg_kw)
    app = make_app(config=cfg, tracer=tracer)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    admin = TestClient(TestServer(app[ADMIN], host="127.0.0.1"))
    await client.start_server()
    await admin.start_server()
    try:
        yield Env(client, admin, prefill, decode, urls)
    finally:
        await admin.close()
        await client.close()
        for s in servers:
            await s.close()


def run(coro: Any) -> None:
    asyncio.run(coro)


GEN = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0.7,
       "top_p": 0.9}


async def post_stream(env: Env, chat: bool, max_tokens: int) -> bytes:
    """A streamed request of ``max_tokens`` with usage, chat or completions, saying "hello"."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    body |= ({"messages": [{"role": "user", "content": "hello"}]} if chat
             else {"prompt": "hello"})
    r = await env.client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status == 200, await r.text()
    return await r.read()


def events(data: bytes) -> list[Any]:
    """An event stream's ``data:`` payloads, decoded (``"[DONE]"`` as the string)."""
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
