"""Early dispatch (proxy/handoff/early.py): the decode leg goes out with the prefill leg, both
naming the same handoff; whatever fails, the request is served the ordinary way. Against fake vLLM
upstreams on loopback (the real handoff is tests/e2e/test_decision.py's)."""

from __future__ import annotations

import asyncio

from kvdisagg.proxy.config import DecisionConfig
from tests.support.proxy_harness import metric, proxy, run, until

LONG = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 2, "stream": True}
EARLY_ON = DecisionConfig(local_prefill_tokens=10, early_decode=True)


async def _send(env) -> tuple[int, str]:
    r = await env.client.post("/v1/completions", json=LONG)
    await r.read()
    return r.status, r.headers.get("X-Kvdisagg-Handoff", "")


def test_the_decode_leg_goes_out_with_the_prefill_leg_naming_the_same_handoff() -> None:
    async def t() -> None:
        async with proxy(decision=EARLY_ON) as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.full_kv = True
            # No handoff from this prefill yet: its side channel is unknown, the ordinary way.
            assert await _send(env) == (200, "pd")
            assert "kvdisagg_early" not in prefill.seen[0]["body"]["kv_transfer_params"]
            prefill.delay_s = decode.delay_s = 0.5  # decode waits for the handoff
            sent = asyncio.ensure_future(_send(env))
            await until(lambda: len(decode.seen) == 2, "the early decode leg")
            assert prefill.active == 1  # sent before prefill answered
            named = prefill.seen[1]["body"]["kv_transfer_params"]["kvdisagg_early"]
            kv = decode.seen[1]["body"]["kv_transfer_params"]
            assert kv["remote_request_id"] == named["handoff_id"]
            assert kv["kvdisagg"]["token"] == named["token"] != "faketoken"
            assert kv["kvdisagg"]["early"] is True and kv["remote_block_ids"] == []
            assert (kv["remote_host"], kv["kvdisagg"]["ports"]) == ("127.0.0.1", [5600])
            # A second request while the prefill computes the first: not idle, the ordinary
            # way (decode would hold its blocks through prefill's queue).
            second = asyncio.ensure_future(_send(env))
            await until(lambda: len(prefill.seen) == 3, "the second prefill leg")
            assert len(decode.seen) == 2
            assert await sent == (200, "pd") and await second == (200, "pd")
            assert "kvdisagg_early" not in prefill.seen[2]["body"]["kv_transfer_params"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total", outcome="opened") == 1
            assert metric(text, "kvdisagg_proxy_routed_total", route="pd") == 3
            # Why the other two went the ordinary way: no template yet, then prefill busy.
            for reason in ("no_template", "prefill_busy"):
                assert metric(text, "kvdisagg_proxy_early_declined_total", reason=reason) == 1
    run(t())


def test_a_failed_prefill_cancels_the_early_decode_leg_and_serves_it_the_ordinary_way() -> None:
    async def t() -> None:
        async with proxy(decision=EARLY_ON) as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.full_kv = True
            assert await _send(env) == (200, "pd")
            # (prefill answers after decode got its leg, which waits for the handoff)
            prefill.status, prefill.delay_s, decode.delay_s = 500, 0.2, 1.0
            # early prefill fails -> decode leg aborted; it was the request's first prefill
            # try and no other prefill is left -> decode alone (retry.decode_only_fallback)
            assert await _send(env) == (200, "decode_only:prefill_failed")
            assert len(prefill.seen) == 2
            await until(lambda: decode.aborted == 1, "decode's early leg aborted")
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total", outcome="fell_back") == 1
            # A client error from prefill goes back as it came, decode's leg aborted.
            prefill.status = 400
            assert (await _send(env))[0] == 400
            await until(lambda: decode.aborted == 2, "decode's leg aborted")
    run(t())


def test_after_a_failed_early_prefill_the_retry_goes_to_another_prefill() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, decision=EARLY_ON) as env:
            for p in env.prefill:
                p.full_kv = True
            for _ in range(2):  # round_robin: each prefill hands off once (its params known)
                assert await _send(env) == (200, "pd")
            assert [len(p.seen) for p in env.prefill] == [1, 1]
            bad, good = env.prefill
            bad.status, bad.delay_s, env.decode[0].delay_s = 500, 0.2, 1.0
            assert await _send(env) == (200, "pd")  # early on `bad`, then the ordinary way
            assert "kvdisagg_early" in bad.seen[1]["body"]["kv_transfer_params"]
            assert [len(p.seen) for p in env.prefill] == [2, 2]  # `bad` not tried again
            assert "kvdisagg_early" not in good.seen[1]["body"]["kv_transfer_params"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total", outcome="fell_back") == 1
            assert metric(text, "kvdisagg_proxy_instance_retries_total",
                          instance=env.urls[bad.name], side="prefill") == 1
    run(t())


def test_a_failed_early_decode_leg_is_served_the_ordinary_way() -> None:
    async def t() -> None:
        async with proxy(decision=EARLY_ON) as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.full_kv = True
            assert await _send(env) == (200, "pd")
            decode.kv_load_failures = 1  # the early read fails as vLLM reports it
            assert await _send(env) == (200, "pd")
            assert len(prefill.seen) == 3 and len(decode.seen) == 3
            assert "kvdisagg_early" not in prefill.seen[2]["body"]["kv_transfer_params"]
            assert "early" not in decode.seen[2]["body"]["kv_transfer_params"]["kvdisagg"]
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total", outcome="fell_back") == 1
    run(t())


def test_always_disaggregate_keeps_the_ordinary_handoff() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(enabled=False, early_decode=True)) as env:
            env.prefill[0].full_kv = True
            for _ in range(2):
                assert await _send(env) == (200, "pd")
            assert all("kvdisagg_early" not in s["body"]["kv_transfer_params"]
                       for s in env.prefill[0].seen)
    run(t())


def test_a_request_not_sent_early_keeps_the_prefill_policys_turn() -> None:
    """The prefill is chosen once per request: an early try that is not taken (no handoff
    seen from it yet) must not advance round_robin a second time."""
    async def t() -> None:
        async with proxy(n_prefill=2, decision=EARLY_ON) as env:
            for _ in range(4):
                assert await _send(env) == (200, "pd")
            assert [len(p.seen) for p in env.prefill] == [2, 2]
    run(t())


def test_no_early_dispatch_for_a_pair_that_speaks_only_a_version_before_early_handoffs() -> None:
    """A prefill of the previous release (4 only) and a decode of this one: they pair, over
    4, which has no early handoffs: the ordinary handoff, every time."""
    from kvdisagg.proxy.app import REGISTRY

    async def t() -> None:
        async with proxy(decision=EARLY_ON) as env:
            prefill, decode = env.prefill[0], env.decode[0]
            prefill.full_kv, prefill.protocol, decode.protocol = True, (4, 4), (4, 5)
            reg = env.client.server.app[REGISTRY]
            await until(lambda: reg.get(env.urls["p0"]).protocol is not None
                        and reg.get(env.urls["d0"]).protocol is not None, "versions probed")
            for _ in range(3):
                assert await _send(env) == (200, "pd")
            assert all("kvdisagg_early" not in s["body"]["kv_transfer_params"]
                       for s in prefill.seen)
            assert decode.incompatible == 0
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total") == 0
            assert metric(text, "kvdisagg_proxy_early_declined_total", reason="protocol") >= 2
    run(t())


def test_a_probe_that_read_our_own_prefill_leg_does_not_decline_the_next() -> None:
    """A probe reads prefill's vLLM while our prefill leg runs there: that request is ours,
    not another client's, so once it has ended the next request still goes out early (the
    stale reading declined it, `prefill_queue`, until the next probe)."""
    from kvdisagg.proxy.app import REGISTRY
    from kvdisagg.proxy.config import HealthConfig
    from kvdisagg.proxy.types import Side

    async def t() -> None:
        async with proxy(decision=EARLY_ON, health=HealthConfig(interval_s=0.05)) as env:
            prefill = env.prefill[0]
            prefill.full_kv = True
            assert await _send(env) == (200, "pd")  # the handoff template
            inst = env.client.server.app[REGISTRY].get(env.urls["p0"])
            prefill.delay_s = 0.4
            sent = asyncio.ensure_future(_send(env))
            await until(lambda: inst.vllm_running >= 1, "a probe reading our prefill leg")
            assert inst.vllm_others == 0
            assert await sent == (200, "pd")
            await until(lambda: inst.in_flight(Side.PREFILL) == 0, "its prefill leg's end")
            prefill.delay_s = 0
            assert await _send(env) == (200, "pd")
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_early_handoffs_total", outcome="opened") == 2
            assert metric(text, "kvdisagg_proxy_early_declined_total", reason="prefill_queue") == 0
    run(t())
