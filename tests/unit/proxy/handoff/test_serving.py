"""One client request through the proxy's stages (proxy/handoff/serving.py, prefill.py, decode.py,
legs.py) against fake vLLM upstreams on loopback: handoff, failover, faults, relay. Each fault of
issue 4 has a test that asserts what the client and the upstreams saw."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvdisagg.proxy import make_app
from kvdisagg.proxy.app import REGISTRY
from kvdisagg.proxy.config import (
    BreakerConfig,
    DecisionConfig,
    HealthConfig,
    InstanceSpec,
    PolicyConfig,
    ProxyConfig,
    RetryConfig,
    SloConfig,
    TimeoutConfig,
)
from kvdisagg.proxy.types import Role
from kvdisagg.tracing import TRACE_PARAMS_KEY, Tracer
from tests.support.fake_vllm import FakeVllm
from tests.support.proxy_harness import GEN, Env, metric, proxy, run

FORGED = {"do_remote_prefill": True, "remote_block_ids": [666]}


def test_handoff_passes_body_bytes_through_and_forwards_auth() -> None:
    async def t() -> None:
        async with proxy() as env:
            raw = (b'{"model":"tiny","prompt":"hi","max_tokens":17,"temperature":0.7,'
                   b'"top_p":1e-1,"repetition_penalty":1.1,"min_tokens":3,"stream":false}')
            r = await env.client.post("/v1/completions", data=raw, headers={
                "Authorization": "Bearer k", "X-Request-Id": "abc-1",
                "Content-Type": "application/json"})
            assert r.status == 200, await r.text()
            assert r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert (await r.json())["choices"][0]["text"].startswith("t0")
            p, d = env.prefill[0].seen[0], env.decode[0].seen[0]
            assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
            # its one token is the answer's first: an end of sequence masked there too
            assert p["body"]["min_tokens"] == 1
            assert p["body"]["kv_transfer_params"]["do_remote_decode"] is True
            assert p["body"]["temperature"] == 0.7 and p["body"]["repetition_penalty"] == 1.1
            # decode gets the client's exact bytes plus the prefill's params, untouched
            kv = msgspec.json.encode(env.prefill[0].kv_params())
            assert d["raw"] == b'{"kv_transfer_params":' + kv + b"," + raw[1:]
            for leg in (p, d):
                assert leg["headers"]["Authorization"] == "Bearer k"
                assert leg["headers"].get("X-Request-Id") == "abc-1", leg["headers"]
    run(t())


def test_request_spans_nest_and_carry_their_context_to_both_legs() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    traceparent = f"00-{client_trace}-b7ad6b7169203331-01"

    async def t() -> None:
        tracer = Tracer.with_processor(SimpleSpanProcessor(exporter), "test-proxy")
        async with proxy(tracer=tracer) as env:
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True},
                                      headers={"traceparent": traceparent})
            assert r.status == 200
            await r.read()
            # a forged trace key from the client is dropped with the rest of its params
            r = await env.client.post("/v1/completions", json={
                **GEN, "kv_transfer_params": {TRACE_PARAMS_KEY: "00-" + "1" * 32 + "-"
                                              + "2" * 16 + "-01"}})
            assert r.status == 200
            p, d = env.prefill[0].seen[0], env.decode[0].seen[0]
            p_trace = p["body"]["kv_transfer_params"][TRACE_PARAMS_KEY]
            d_trace = d["body"]["kv_transfer_params"][TRACE_PARAMS_KEY]
            # decode still gets prefill's params untouched, after the trace key
            assert d["body"]["kv_transfer_params"] == {**env.prefill[0].kv_params(),
                                                       TRACE_PARAMS_KEY: d_trace}
            assert "1" * 32 not in env.prefill[0].seen[1]["raw"].decode()
            # and as HTTP headers, for vLLM's own tracing
            assert p["headers"]["traceparent"] == p_trace
            assert d["headers"]["traceparent"] == d_trace
        spans = {s.name: s for s in exporter.get_finished_spans()
                 if s.context.trace_id == int(client_trace, 16)}
        assert set(spans) == {"kvdisagg.request", "prefill_leg", "decode_leg"}
        root, pre, dec = spans["kvdisagg.request"], spans["prefill_leg"], spans["decode_leg"]
        assert root.parent.span_id == 0xb7ad6b7169203331  # joined the client's trace
        assert pre.parent.span_id == root.context.span_id == dec.parent.span_id
        assert p_trace == f"00-{client_trace}-{pre.context.span_id:016x}-01"
        assert d_trace == f"00-{client_trace}-{dec.context.span_id:016x}-01"
        assert root.start_time <= pre.start_time < pre.end_time <= dec.start_time
        assert dec.end_time <= root.end_time
        assert [e.name for e in dec.events] == ["first_token", "first_byte"]
        assert root.attributes["outcome"] == "ok" and pre.attributes["outcome"] == "ok"
        assert len(exporter.get_finished_spans()) == 6  # the second request: its own trace

    run(t())


def test_forged_kv_params_are_stripped_and_api_key_replaces_auth() -> None:
    async def t() -> None:
        async with proxy(api_key="secret") as env:
            r = await env.client.post("/v1/completions", json={**GEN, "kv_transfer_params": FORGED},
                                      headers={"Authorization": "Bearer client"})
            assert r.status == 200
            d = env.decode[0].seen[0]
            assert d["body"]["kv_transfer_params"] == env.prefill[0].kv_params()
            assert d["body"]["temperature"] == 0.7
            assert d["headers"]["Authorization"] == "Bearer secret"
            assert env.prefill[0].seen[0]["headers"]["Authorization"] == "Bearer secret"
    run(t())


def test_chat_streaming_relay_is_byte_identical() -> None:
    async def t() -> None:
        async with proxy() as env:
            env.decode[0].tokens = 4
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 9, "stream": True,
                    "stream_options": {"include_usage": True}}
            r = await env.client.post("/v1/chat/completions", json=body)
            assert r.status == 200 and r.content_type == "text/event-stream"
            data = await r.read()
            # a role chunk, 4 tokens, the usage chunk, [DONE]
            assert data.count(b"data: ") == 7 and data.endswith(b"data: [DONE]\n\n")
            # asked of decode for migration, taken out again: null, as a plain vLLM has them
            assert b'"token_ids":[' not in data and data.count(b'"token_ids":null') == 4
            assert b'"content":"t3 "' in data
            p = env.prefill[0].seen[0]["body"]
            assert p["max_completion_tokens"] == 1 and "stream_options" not in p
            d = env.decode[0].seen[0]["body"]
            assert d["max_completion_tokens"] == 9 and d["stream_options"] == {
                "include_usage": True
            }
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_ttft_seconds_count") == 1
            assert metric(text, "kvdisagg_proxy_tpot_seconds_count") == 1
            assert metric(text, "kvdisagg_proxy_requests_total", endpoint="chat", outcome="ok") == 1
    run(t())


def test_prefill_500_retries_on_other_prefill() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, breaker=None or ProxyConfig().breaker) as env:
            env.prefill[0].status = 500
            for _ in range(4):
                r = await env.client.post("/v1/completions", json=GEN)
                assert r.status == 200
                assert r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(env.decode[0].seen) == 4
            assert all(s["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p1"
                       for s in env.decode[0].seen)
            text = await env.metrics()
            p0 = env.urls["p0"]
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=p0,
                          side="prefill", kind="status") >= 1
            assert metric(text, "kvdisagg_proxy_instance_retries_total", instance=p0,
                          side="prefill") >= 1
    run(t())


def test_all_prefill_down_falls_back_to_decode_only_or_errors() -> None:
    async def t(fallback: bool) -> None:
        async with proxy(n_prefill=2, retry=RetryConfig(decode_only_fallback=fallback)) as env:
            for p in env.prefill:
                p.status = 500
            r = await env.client.post("/v1/completions", json=GEN)
            if fallback:
                assert r.status == 200
                assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:prefill_failed"
                assert "kv_transfer_params" not in env.decode[0].seen[0]["body"]
                text = await env.metrics()
                assert metric(text, "kvdisagg_proxy_routed_total", route="decode_only",
                              reason="prefill_failed") == 1
            else:
                assert r.status == 502
                err = (await r.json())["error"]
                assert err["type"] == "upstream_error"
                assert env.urls["p0"] in err["message"] and env.urls["p1"] in err["message"]
                assert env.decode[0].seen == []
    run(t(True))
    run(t(False))


def test_prefill_timeout_is_bounded_and_retried() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, timeouts=TimeoutConfig(prefill_s=0.3, decode_connect_s=2,
                                                             decode_idle_s=1)) as env:
            env.prefill[0].delay_s = 5
            t0 = time.monotonic()
            for _ in range(2):
                r = await env.client.post("/v1/completions", json=GEN)
                assert r.status == 200
            assert time.monotonic() - t0 < 2.0
            assert env.prefill[0].aborted >= 1  # the timed-out leg was aborted upstream
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["p0"],
                          kind="timeout") >= 1
    run(t())


def test_prefill_without_kv_params_is_counted_not_silent() -> None:
    async def t() -> None:
        async with proxy(n_prefill=1) as env:
            env.prefill[0].with_kv = False
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 502
            assert "returned no kv_transfer_params" in (await r.json())["error"]["message"]
            assert env.decode[0].seen == []
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_missing_kv_transfer_params_total",
                          instance=env.urls["p0"]) == 1
        async with proxy(n_prefill=2) as env:  # with another prefill it is retried there
            env.prefill[0].with_kv = False
            for _ in range(2):
                r = await env.client.post("/v1/completions", json=GEN)
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert all(s["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p1"
                       for s in env.decode[0].seen)
    run(t())


def test_prefill_aborting_requests_is_retried_elsewhere_not_missing_kv() -> None:
    """A prefill that aborts new requests unanswered (vLLM shutting down, before the probe sees
    it retiring): retried on another prefill, or decode-only with none; never counted as a
    misconfigured prefill (missing kv_transfer_params)."""
    async def t() -> None:
        async with proxy(n_prefill=2) as env:
            env.prefill[0].aborting = True
            for _ in range(2):
                r = await env.client.post("/v1/completions", json=GEN)
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert all(s["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p1"
                       for s in env.decode[0].seen)
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_missing_kv_transfer_params_total") == 0
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["p0"],
                          kind="aborted") >= 1
        async with proxy(n_prefill=1) as env:
            env.prefill[0].aborting = True
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 200
            assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:prefill_failed"
    run(t())


def test_decode_aborting_requests_is_retried_on_another_decode() -> None:
    """A decode that aborts new requests unanswered (vLLM shutting down, before the probe sees
    it retiring): the request is retried whole on another decode, never relayed as an empty
    answer; streamed or not."""
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            d0, d1 = env.decode
            d0.aborting = True
            for stream in (False, True, False, True):
                r = await env.client.post("/v1/completions", json={**GEN, "stream": stream})
                text = await r.text()
                assert r.status == 200 and '"abort"' not in text and "t0" in text, text
            assert d0.seen and len(d1.seen) == 4
            assert metric(await env.metrics(), "kvdisagg_proxy_instance_errors_total",
                          instance=env.urls["d0"], kind="aborted") == len(d0.seen)
    run(t())


def test_decode_refusing_connection_retries_other_decode_with_same_handoff() -> None:
    async def t() -> None:
        async with proxy(dead_decode=1, health=HealthConfig(interval_s=60, startup_timeout_s=0.1,
                                                            timeout_s=0.3)) as env:
            # the dead decode failed its start-up probe; make it routable to exercise failover
            reg = env.client.server.app[__import__("kvdisagg.proxy.app").proxy.app.REGISTRY]
            for inst in reg.instances.values():
                inst.healthy = True
            for stream in (False, True):
                r = await env.client.post("/v1/completions", json={**GEN, "stream": stream})
                assert r.status == 200
                await r.read()
            # one prefill per request: a refused connection means decode never saw the KV
            assert len(env.prefill[0].seen) == 2 and len(env.decode[0].seen) == 2
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", kind="connect") >= 1
    run(t())


def test_decode_500_before_first_byte_reprefills_on_retry() -> None:
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            env.decode[0].status = 503
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            assert r.status == 200
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
            assert len(env.prefill[0].seen) == 2  # KV may be gone: a fresh handoff
            assert len(env.decode[0].seen) == 1 and len(env.decode[1].seen) == 1
        async with proxy(n_decode=1) as env:
            env.decode[0].status = 500
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 502
            assert "decode failed" in (await r.json())["error"]["message"]
            # the only decode answered, so it got the retry, with a fresh handoff
            assert len(env.prefill[0].seen) == 2 and len(env.decode[0].seen) == 2
    run(t())


def test_failed_kv_load_on_only_decode_reprefills_on_other_prefill_and_retries() -> None:
    """A prefill dies after handing off: decode's KV load fails (500, or an error event as the
    stream's first event). Nothing reached the client yet, so the proxy re-prefills (on the
    other prefill) and retries the only decode; its breaker stays closed."""
    async def t(stream: bool) -> None:
        async with proxy(n_prefill=2, n_decode=1) as env:
            d = env.decode[0]
            for _ in range(4):  # more than breaker.failure_threshold
                d.kv_load_failures = 1
                r = await env.client.post("/v1/completions", json={**GEN, "stream": stream})
                assert r.status == 200, await r.text()
                data = await r.read()
                assert b'"error"' not in data
                assert (data.endswith(b"data: [DONE]\n\n") if stream
                        else b"t0 t1" in data)
            assert len(d.seen) == 8
            assert len(env.prefill[0].seen) + len(env.prefill[1].seen) == 8
            text = await env.metrics()
            kind = "error_event" if stream else "status"
            assert metric(text, "kvdisagg_proxy_instance_errors_total", side="decode",
                          kind=kind) == 4
            assert metric(text, "kvdisagg_proxy_instance_healthy", role="decode") == 1
            r = await env.admin.get("/admin/list")
            info = [i for i in (await r.json())["instances"] if i["role"] == "decode"][0]
            assert info["breaker"] == "closed" and info["errors"]["decode"] == 4
    run(t(False))
    run(t(True))


def test_decode_dying_or_hanging_mid_stream_ends_with_error_event() -> None:
    """Without migration (retry.migrations 0): an error event, then [DONE]."""
    async def t(fault: str) -> None:
        async with proxy(retry=RetryConfig(migrations=0)) as env:
            env.decode[0].tokens = 5
            setattr(env.decode[0], fault, 2)
            t0 = time.monotonic()
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            assert r.status == 200
            data = await r.read()
            assert time.monotonic() - t0 < 5
            assert data.startswith(b'data: {"id"') and data.count(b'"text"') == 2
            assert b'data: {"error"' in data and data.endswith(b"data: [DONE]\n\n")
            assert b"mid-stream" in data
            text = await env.metrics()
            kind = "stream" if fault == "die_after" else "timeout"
            assert metric(text, "kvdisagg_proxy_instance_errors_total", side="decode",
                          kind=kind) == 1
    run(t("die_after"))
    run(t("hang_after"))


def test_client_disconnect_aborts_upstream() -> None:
    async def t() -> None:
        async with proxy() as env:
            env.decode[0].tokens = 5
            env.decode[0].hang_after = 1
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            assert r.status == 200
            await r.content.readline()
            r.close()  # the client goes away mid-stream
            for _ in range(50):
                if env.decode[0].aborted:
                    break
                await asyncio.sleep(0.05)
            assert env.decode[0].aborted == 1
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_in_flight") == 0
            assert metric(text, "kvdisagg_proxy_requests_total",
                          outcome="client_disconnect") == 1
            assert metric(text, "kvdisagg_proxy_instance_in_flight") == 0
            # a disconnect says nothing about the instance: its breaker stays closed
            r = await env.admin.get("/admin/list")
            d = [i for i in (await r.json())["instances"] if i["url"] == env.urls["d0"]][0]
            assert d["breaker"] == "closed" and d["errors"]["decode"] == 0
        async with proxy() as env:  # disconnect during the prefill leg aborts prefill
            env.prefill[0].delay_s = 5
            task = asyncio.create_task(env.client.post("/v1/completions", json=GEN))
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(50):
                if env.prefill[0].aborted:
                    break
                await asyncio.sleep(0.05)
            assert env.prefill[0].aborted == 1 and env.decode[0].seen == []
    run(t())


def test_decode_recomputed_prompts_exported_per_instance() -> None:
    """A decode that computed prompts itself although they came with a handoff (its
    vllm:kvdisagg_recomputed_prompts_total) shows it on the proxy's /metrics, per instance
    and reason, as of the last probe; a decode that recomputed nothing exports no sample."""
    async def t() -> None:
        async with proxy(n_decode=2) as env:
            d0, d1 = env.decode
            d0.recomputed = {"load_failed": 3, "not_read": 1}
            await asyncio.sleep(0.5)  # a few probe rounds (interval 0.2 s)
            text = await env.metrics()
            name = "kvdisagg_proxy_instance_recomputed_prompts_total"
            assert metric(text, name, instance=env.urls["d0"], reason="load_failed") == 3
            assert metric(text, name, instance=env.urls["d0"], reason="not_read") == 1
            assert metric(text, name, instance=env.urls["d1"]) == 0
            assert f"# TYPE {name} counter" in text
            d0.recomputed["load_failed"] = 5
            await asyncio.sleep(0.5)
            text = await env.metrics()
            assert metric(text, name, instance=env.urls["d0"], reason="load_failed") == 5
            r = await env.admin.get("/admin/list")
            rows = {i["url"]: i for i in (await r.json())["instances"]}
            assert rows[env.urls["d0"]]["recomputed_prompts"] == {"load_failed": 5,
                                                                  "not_read": 1}
    run(t())


def test_health_probes_mark_unhealthy_and_recover() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, health=HealthConfig(interval_s=0.1, timeout_s=0.5,
                                                          failure_threshold=2,
                                                          success_threshold=2)) as env:
            env.prefill[1].health_status = 503
            await asyncio.sleep(0.6)
            r = await env.admin.get("/admin/list")
            rows = {i["url"]: i for i in (await r.json())["instances"]}
            assert rows[env.urls["p1"]]["healthy"] is False
            assert "503" in rows[env.urls["p1"]]["last_probe_error"]
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.prefill[1].seen) == 0 and len(env.prefill[0].seen) == 4
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_healthy", instance=env.urls["p1"]) == 0
            env.prefill[1].health_status = 200
            await asyncio.sleep(0.6)
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_healthy", instance=env.urls["p1"]) == 1
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.prefill[1].seen) == 2
    run(t())


def test_retiring_instance_drains_itself_then_returns_as_a_new_process() -> None:
    """An instance whose /metrics says vllm:kvdisagg_retiring 1 (SIGTERM) turns DRAINING at the
    next probe: its leg in flight finishes, new prompts go elsewhere; once it answers without
    the gauge (a new process at its URL) it is ACTIVE again. An operator's drain stands."""
    async def t() -> None:
        async with proxy(n_prefill=2) as env:
            p0, p1 = env.prefill

            async def state(name: str) -> str:
                r = await env.admin.get("/admin/list")
                return next(i["state"] for i in (await r.json())["instances"]
                            if i["url"] == env.urls[name])

            async def until(name: str, want: str) -> None:
                for _ in range(50):  # probes every 0.2 s
                    if await state(name) == want:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{name} is {await state(name)}, not {want}")

            p0.delay_s = 0.6  # a prefill leg in flight on p0 when it retires
            first = [asyncio.create_task(env.client.post("/v1/completions", json=GEN))
                     for _ in range(2)]
            await asyncio.sleep(0.1)
            assert len(p0.seen) == 1
            p0.retiring = True
            await until("p0", "draining")
            assert [(await q).status for q in first] == [200, 200]
            n0 = len(p0.seen)
            for _ in range(4):
                r = await env.client.post("/v1/completions", json=GEN)
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(p0.seen) == n0
            p0.retiring = False  # restarted: a new process, no longer retiring
            await until("p0", "active")
            # An operator's drain is not undone by a probe that sees no retirement.
            r = await env.admin.post("/admin/drain", json={"url": env.urls["p1"]})
            assert r.status == 200
            await asyncio.sleep(0.5)
            assert await state("p1") == "draining"
    run(t())


def test_retiring_decode_gone_dead_migrates_its_streams_at_once() -> None:
    """A retiring decode whose probes then fail (vLLM killed its engine at --shutdown-timeout
    and its streams stall for good): its relayed streams fail at once and migrate, well before
    timeouts.decode_idle_s."""
    async def t() -> None:
        async with proxy(n_decode=2, timeouts=TimeoutConfig(
                prefill_s=2.0, decode_connect_s=2.0, decode_total_s=30.0,
                decode_idle_s=20.0)) as env:
            d0, d1 = env.decode
            d0.tokens, d0.hang_after = 6, 2  # two events, then silence (its engine is gone)
            body = {**GEN, "prompt": [5, 6, 7], "max_tokens": 6, "stream": True,
                    "temperature": 0}
            t0 = time.monotonic()
            task = asyncio.create_task(env.client.post("/v1/completions", json=body))
            for _ in range(50):
                if d0.seen:
                    break
                await asyncio.sleep(0.02)
            assert d0.seen, "the stream went to d1: route it to d0 for this test"
            d0.retiring = True
            for _ in range(50):
                r = await env.admin.get("/admin/list")
                if any(i["url"] == env.urls["d0"] and i["state"] == "draining"
                       for i in (await r.json())["instances"]):
                    break
                await asyncio.sleep(0.05)
            d0.health_status = 503  # its listener is gone
            r = await task
            text = await r.text()
            assert r.status == 200 and "[DONE]" in text, text
            assert time.monotonic() - t0 < 10.0, "waited out decode_idle_s"
            assert d1.seen  # the continuation
            assert metric(await env.metrics(), "kvdisagg_proxy_migrations_total",
                          outcome="ok") == 1
    run(t())


def test_a_decode_found_slow_then_gone_fails_its_waiting_legs_at_once() -> None:
    """A decode whose probes first time out (slow: its legs are left alone) and then fail as
    gone: a leg still waiting for its answer fails at that probe and the request is served
    by the other decode, well before timeouts.decode_idle_s (it waited all of it before)."""
    async def t() -> None:
        async with proxy(n_decode=2, health=HealthConfig(interval_s=0.1, timeout_s=0.2),
                         decision=DecisionConfig(enabled=False), timeouts=TimeoutConfig(
                             prefill_s=2.0, decode_connect_s=2.0, decode_total_s=60.0,
                             decode_idle_s=30.0)) as env:
            d0, d1 = env.decode
            d0.delay_s = 60.0  # takes the leg and never answers
            body = {**GEN, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                    "temperature": 0}
            t0 = time.monotonic()
            task = asyncio.create_task(env.client.post("/v1/completions", json=body))
            for _ in range(100):
                if d0.seen or d1.seen:
                    break
                await asyncio.sleep(0.02)
            assert d0.seen and not d1.seen, "the leg went to d1: route it to d0 for this test"
            d0.health_delay_s = 1.0  # slow: unhealthy, its waiting leg kept
            for _ in range(100):
                listed = (await (await env.admin.get("/admin/list")).json())["instances"]
                if not next(i["healthy"] for i in listed if i["url"] == env.urls["d0"]):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("d0 never turned unhealthy")
            await asyncio.sleep(0.5)  # several slow probes
            assert not task.done()
            d0.health_delay_s, d0.health_status = 0.0, 503  # now gone
            r = await task
            text = await r.text()
            assert r.status == 200 and "[DONE]" in text, text
            assert time.monotonic() - t0 < 10.0, "waited out decode_idle_s"
            assert d1.seen
    run(t())


def test_slo_aware_sheds_with_429_when_no_instance_meets_ttft() -> None:
    async def t() -> None:
        async with proxy(policy=PolicyConfig(prefill="slo_aware", decode="slo_aware"),
                         slo=SloConfig(ttft_s=0.05, tpot_s=1.0, admission="shed")) as env:
            env.prefill[0].delay_s = 0.1
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 200  # no measurement yet: explored
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 429
            err = (await r.json())["error"]
            assert err["type"] == "rate_limit_exceeded" and "TTFT SLO" in err["message"]
            assert r.headers["Retry-After"] == "1"
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="shed") == 1
            assert metric(text, "kvdisagg_proxy_rejected_total", reason="slo_ttft") == 1
    run(t())


def test_bad_json_health_readiness_models() -> None:
    async def t() -> None:
        async with proxy() as env:
            r = await env.client.post("/v1/completions", data=b"{not json",
                                      headers={"Content-Type": "application/json"})
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
            assert (await env.client.post("/v1/completions", json=[1, 2])).status == 400
            assert (await env.client.get("/health")).status == 200
            r = await env.client.get("/readiness")
            body = await r.json()
            assert r.status == 200 and body["decode"] == {"healthy": 1, "total": 1}
            r = await env.client.get("/v1/models")
            assert (await r.json())["data"][0]["id"] == "tiny"
        async with proxy(n_decode=0, dead_decode=1,
                         health=HealthConfig(startup_timeout_s=0.3, timeout_s=0.2)) as env:
            assert (await env.client.get("/readiness")).status == 503
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 503 and "no healthy decode" in (await r.json())["error"]["message"]
            assert r.headers["Retry-After"] == "2"  # health.interval_s: when it may be back
            assert metric(await env.metrics(), "kvdisagg_proxy_rejected_total",
                          reason="no_healthy_decode") == 1
    run(t())


def test_startup_does_not_wait_forever_for_dead_url() -> None:
    async def t() -> None:
        t0 = time.monotonic()
        async with proxy(dead_decode=1, health=HealthConfig(startup_timeout_s=5, timeout_s=0.2)):
            pass  # the healthy decode is enough: no wait for the dead one
        assert time.monotonic() - t0 < 2
    run(t())


def test_kv_both_serves_either_side() -> None:
    async def t() -> None:
        both = FakeVllm("b")
        srv = TestServer(both.app(), host="127.0.0.1")
        await srv.start_server()
        url = str(srv.make_url("")).rstrip("/")
        cfg = ProxyConfig(instances=[InstanceSpec(url=url, role=Role.BOTH)],
                          decision=DecisionConfig(enabled=False))
        client = TestClient(TestServer(make_app(config=cfg), host="127.0.0.1"))
        await client.start_server()
        try:
            r = await client.post("/v1/completions", json=GEN)
            assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert len(both.seen) == 2
        finally:
            await client.close()
            await srv.close()
    run(t())


def test_stream_relay_backpressure_and_http10(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback relay: a client that reports itself backed up on every write (pause the
    decode stream, drain, resume) still gets every event, in order; an HTTP/1.0 client gets the
    stream unframed (no chunked encoding) until the connection closes."""
    from kvdisagg.proxy.handoff import relay

    def expected(rid: bytes) -> bytes:
        return b"".join(b'data: {"id":"%s","choices":[{"index":0,"text":"t%d ",'
                        b'"prompt_token_ids":null,"token_ids":null,"finish_reason":%s}]}\n\n'
                        % (rid, i, b'"length"' if i == 299 else b"null")
                        for i in range(300)) + b"data: [DONE]\n\n"

    async def t() -> None:
        async with proxy() as env:
            env.decode[0].tokens = 300
            monkeypatch.setattr(relay, "_CLIENT_HIGH_WATER", -1)
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            assert r.status == 200 and await r.read() == expected(b"cmpl-d0-0")
            monkeypatch.undo()
            host, port = env.client.server.host, env.client.server.port
            reader, writer = await asyncio.open_connection(host, port)
            body = msgspec.json.encode({**GEN, "stream": True})
            writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            head, _, rest = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
            assert rest == expected(b"cmpl-d0-1")
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="ok") == 2
    run(t())


# Issue 9: under load, P/D never loses a request that a single vLLM instance would serve.

FAST = TimeoutConfig(prefill_s=2.0, decode_connect_s=0.2, decode_total_s=5.0, decode_idle_s=0.2)


async def instance_rows(env: Env) -> dict[str, dict[str, Any]]:
    r = await env.admin.get("/admin/list")
    return {i["url"]: i for i in (await r.json())["instances"]}


def test_decode_answering_later_than_connect_timeout_is_served() -> None:
    """vLLM sends a non-streamed answer's headers only when generation is done, so waiting for
    them (or for a stream's first event) is bounded by decode_total_s, not decode_connect_s
    or decode_idle_s; a leg that takes its time is not held against the breaker."""
    async def t() -> None:
        async with proxy(timeouts=FAST, breaker=BreakerConfig(failure_threshold=1)) as env:
            env.decode[0].delay_s = 0.6  # > decode_connect_s and decode_idle_s
            rs = await asyncio.gather(*(env.client.post("/v1/completions",
                                                        json={**GEN, "stream": i % 2 == 1})
                                        for i in range(6)))
            assert [r.status for r in rs] == [200] * 6
            assert all([b"t1" in await r.read() for r in rs])
            assert len(env.prefill[0].seen) == 6  # no retry, no re-prefill
            row = (await instance_rows(env))[env.urls["d0"]]
            assert row["breaker"] == "closed" and row["errors"]["decode"] == 0
    run(t())


def test_timeouts_count_but_do_not_open_breakers() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, n_decode=2, breaker=BreakerConfig(failure_threshold=1),
                         timeouts=TimeoutConfig(prefill_s=0.3, decode_total_s=0.4)) as env:
            env.prefill[0].delay_s = 1.0  # each of its legs times out; p1 takes the retry
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.prefill[0].seen) == 2  # still in the rotation after timing out
            env.prefill[0].delay_s = 0
            env.decode[0].delay_s = 1.0  # over decode_total_s: 504, nothing left to retry in
            statuses = [(await env.client.post("/v1/completions", json=GEN)).status
                        for _ in range(2)]
            assert sorted(statuses) == [200, 504]
            rows = await instance_rows(env)
            for url in (env.urls["p0"], env.urls["d0"]):
                assert rows[url]["breaker"] == "closed" and rows[url]["healthy"] is True
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["p0"],
                          kind="timeout") == 2
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["d0"],
                          kind="timeout") == 1
    run(t())


def test_breaker_of_the_last_decode_does_not_take_the_side_out() -> None:
    async def t() -> None:
        async with proxy(breaker=BreakerConfig(failure_threshold=1, open_s=60)) as env:
            env.decode[0].status = 503
            assert (await env.client.post("/v1/completions", json=GEN)).status == 502
            assert (await instance_rows(env))[env.urls["d0"]]["breaker"] == "open"
            assert (await env.client.get("/readiness")).status == 200
            env.decode[0].status = 200  # recovered: served at once, not 503 for open_s
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 200, await r.text()
            assert (await instance_rows(env))[env.urls["d0"]]["breaker"] == "closed"
    run(t())


def test_broken_decode_opens_its_breaker_when_another_exists() -> None:
    async def t() -> None:
        async with proxy(n_decode=2, breaker=BreakerConfig(failure_threshold=1, open_s=60)) as env:
            env.decode[0].status = 503
            for _ in range(5):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.decode[0].seen) == 1 and len(env.decode[1].seen) == 5
            assert (await instance_rows(env))[env.urls["d0"]]["breaker"] == "open"
        async with proxy(dead_decode=1, breaker=BreakerConfig(failure_threshold=1, open_s=60),
                         health=HealthConfig(interval_s=60, startup_timeout_s=0.1,
                                             timeout_s=0.3)) as env:
            reg = env.client.server.app[REGISTRY]
            for inst in reg.instances.values():
                inst.healthy = True  # the refused one too: only its breaker may stop it
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", kind="connect") == 1
            assert len(env.prefill[0].seen) == 4  # a refused connection reuses the handoff
    run(t())


def test_leg_waiting_on_instance_that_turns_unhealthy_fails_over() -> None:
    async def t() -> None:
        async with proxy(n_decode=2, timeouts=TimeoutConfig(decode_total_s=30),
                         health=HealthConfig(interval_s=0.1, timeout_s=0.5,
                                             failure_threshold=1)) as env:
            env.decode[0].delay_s = 30
            t0 = time.monotonic()
            task = asyncio.create_task(env.client.post("/v1/completions", json=GEN))
            await asyncio.sleep(0.3)
            env.decode[0].health_status = 503
            r = await task
            assert r.status == 200 and time.monotonic() - t0 < 3, await r.text()
            assert len(env.decode[1].seen) == 1 and len(env.prefill[0].seen) == 2
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["d0"],
                          kind="unhealthy") == 1
    run(t())


def test_leg_on_an_instance_whose_probes_only_time_out_is_not_failed() -> None:
    """A /health slower than the probe bound (a starved host) takes the instance out of routing
    but does not fail the legs it is already serving: they are progress."""
    async def t() -> None:
        async with proxy(n_decode=2, timeouts=TimeoutConfig(decode_total_s=30),
                         health=HealthConfig(interval_s=0.1, timeout_s=0.2,
                                             failure_threshold=1)) as env:
            env.decode[0].delay_s = 1.0
            task = asyncio.create_task(env.client.post("/v1/completions", json=GEN))
            await asyncio.sleep(0.3)
            env.decode[0].health_delay_s = 5
            r = await task
            assert r.status == 200, await r.text()
            assert len(env.decode[1].seen) == 0 and len(env.prefill[0].seen) == 1
            reg = env.client.server.app[REGISTRY]
            assert not reg.instances[env.urls["d0"]].healthy
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_errors_total", instance=env.urls["d0"],
                          kind="unhealthy") == 0
    run(t())


def test_saturated_proxy_answers_503_with_retry_after_and_counts_it() -> None:
    async def t() -> None:
        async with proxy(max_in_flight=2) as env:
            env.decode[0].delay_s = 0.5
            rs = await asyncio.gather(*(env.client.post("/v1/completions", json=GEN)
                                        for _ in range(3)))
            assert sorted(r.status for r in rs) == [200, 200, 503]
            shed = next(r for r in rs if r.status == 503)
            assert shed.headers["Retry-After"] == "1"
            assert (await shed.json())["error"]["type"] == "service_unavailable"
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_rejected_total", reason="max_in_flight") == 1
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="shed") == 1
            assert (await env.client.post("/v1/completions", json=GEN)).status == 200
    run(t())


def test_non_streamed_body_over_1mib_is_read_whole() -> None:
    """upstream.Response.read() pauses the socket at 1 MiB buffered; it must resume it."""
    async def t() -> None:
        async with proxy(timeouts=TimeoutConfig(decode_total_s=3)) as env:
            env.decode[0].tokens = 300_000  # a ~2.2 MB JSON body
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 200, await r.text()
            text = (await r.json())["choices"][0]["text"]
            assert len(text) > 2 << 20 and text.endswith("t299999 ")
    run(t())
