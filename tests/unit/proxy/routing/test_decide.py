"""The per-request decision (proxy/routing/decide.py, issue 15) against fake vLLM upstreams on
loopback: disaggregate, or let decode serve the prompt alone, and which instance gets it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvdisagg.proxy.app import SERVING
from kvdisagg.proxy.config import DecisionConfig, HealthConfig, RetryConfig, SloConfig
from kvdisagg.proxy.routing.prefix_index import Lookup, Pending
from kvdisagg.proxy.types import Side
from tests.support.proxy_harness import metric, proxy, run, until


class FakeCache:
    """What a KV-event index would say: instance url -> tokens of any prompt it holds."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits
        self.asked: list[Sequence[int]] = []
        self.pending: list[str] = []  # instances noted as computing a prompt now

    def lookup(self, token_ids: Sequence[int], extra: Any = None) -> Lookup:
        self.asked.append(token_ids)
        return Lookup({u: min(h, len(token_ids)) for u, h in self.hits.items()}, {})

    def answering(self) -> list[str]:
        return list(self.hits)

    def note_pending(self, url: str, found: Lookup) -> Pending:
        self.pending.append(url)
        return Pending(url, ())

    def drop_pending(self, pending: Pending) -> None:
        self.pending.remove(pending.instance)


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


def test_an_idle_decode_takes_cold_prompts_while_prefill_is_backlogged() -> None:
    """A burst of long prompts: the first goes through prefill; while prefill computes it, an
    idle decode computes the next itself (as much as prefill's queue holds, within
    ``idle_decode_tokens``), and none once decode streams an answer."""
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=100,
                                                 idle_decode_tokens=1500)) as env:
            env.prefill[0].delay_s = 1.0  # a prefill busy computing
            env.decode[0].delay_s = 0.6  # decode computing its prompt
            serving = env.client.server.app[SERVING]
            (d,) = [i for i in serving.registry.instances.values() if i.url == env.urls["d0"]]

            async def send(n: int, stream: bool = True) -> str:
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * n, "max_tokens": 2, "stream": stream})
                assert r.status == 200
                await r.read()
                return r.headers["X-Kvdisagg-Handoff"]

            async def later(s: float, n: int) -> str:
                await asyncio.sleep(s)
                return await send(n)

            # 1: prefill idle -> pd; 2: decode's queue 0 <= prefill's 1000 -> decode; 3: past
            # idle_decode_tokens (900 + 900 > 1500) -> pd; 4: 900 <= 1900, 900 + 500 <= 1500
            # -> decode; 5: 1400 + 400 > 1500 -> pd
            got = await asyncio.gather(send(1000), later(0.1, 900), later(0.2, 900),
                                       later(0.3, 500), later(0.4, 400))
            assert got == ["pd", "decode_only:prefill_busy", "pd", "decode_only:prefill_busy",
                           "pd"]
            assert d.local_prefills == 0 and d.local_prefill_tokens == 0  # nothing leaks
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_routed_total", route="decode_only",
                          reason="prefill_busy") == 2
            # Decode streaming an answer (a handoff's leg) has a stream to protect: a long
            # prompt waits for prefill even with prefill backlogged.
            env.decode[0].delay_s, env.decode[0].token_delay_s = 0.0, 0.2
            env.decode[0].tokens = 5
            got = await asyncio.gather(send(1000), later(1.3, 900))
            assert got == ["pd", "pd"]
            # A whole (non-streamed) answer computed on decode counts as a stream throughout.
            env.decode[0].token_delay_s = 0.0
            env.decode[0].delay_s = 1.0
            d.tpot_s = None  # the slow stream above used up the TPOT headroom
            got = await asyncio.gather(send(100, stream=False), later(0.1, 1000),
                                       later(0.2, 900))
            assert got == ["decode_only:short_prompt", "pd", "pd"]
    run(t())


def test_idle_decode_tokens_zero_keeps_every_long_prompt_on_prefill() -> None:
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=100,
                                                 idle_decode_tokens=0)) as env:
            env.prefill[0].delay_s = 0.3

            async def send(delay: float) -> str:
                await asyncio.sleep(delay)
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 1000, "max_tokens": 2})
                return r.headers["X-Kvdisagg-Handoff"]

            assert await asyncio.gather(send(0), send(0.05)) == ["pd", "pd"]
    run(t())


def test_only_other_clients_requests_on_decode_keep_long_prompts_on_prefill() -> None:
    """vLLM's queue gauges count this proxy's own legs too, scraped a moment ago: a leg of
    ours that has since finished is not another client's stream; a request of another client
    (``others``) is."""
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=100)) as env:
            env.prefill[0].delay_s = 1.0
            serving = env.client.server.app[SERVING]
            (d,) = [i for i in serving.registry.instances.values() if i.url == env.urls["d0"]]

            async def send(n: int, after_s: float = 0.0) -> str:
                await asyncio.sleep(after_s)
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * n, "max_tokens": 2, "stream": True})
                await r.read()
                return r.headers["X-Kvdisagg-Handoff"]

            # Our own decode-only leg, seen running by a scrape, then finished.
            env.decode[0].delay_s = 1.0
            short = asyncio.ensure_future(send(50))
            await until(lambda: d.vllm_running >= 1, "a scrape seeing our leg")
            assert await short == "decode_only:short_prompt"
            assert d.vllm_others == 0  # counted as ours
            env.decode[0].delay_s = 0.2
            assert await asyncio.gather(send(1000), send(900, 0.1)) == [
                "pd", "decode_only:prefill_busy"]
            # Another client's request waiting on decode.
            env.decode[0].others = 1
            await until(lambda: d.vllm_others >= 1, "a scrape seeing the other client")
            assert await asyncio.gather(send(1000), send(900, 0.1)) == ["pd", "pd"]
    run(t())


class CharTokenizer:
    """Three token ids per character: far more than the body's estimate (characters / 4), as
    the tiny model's tokenizer gives for prose."""

    async def token_ids(self, fields: dict[str, Any], chat: bool, pool: Any = None
                        ) -> list[list[int]]:
        return [[7] * (3 * len(fields["prompt"]))]


def test_prefill_legs_queue_the_exact_prompt_length_once_the_proxy_tokenizes() -> None:
    """The backlog ``prefill_busy`` weighs is prefill's queued prompt tokens: the exact count
    when the proxy tokenized the prompt, not the characters / 4 estimate (which undercounts
    prose 12x here and would keep a second cold prompt on prefill)."""
    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=100)) as env:
            serving = env.client.server.app[SERVING]
            serving.cache = FakeCache({env.urls["d0"]: 0, env.urls["p0"]: 0})
            serving.tokenizer = CharTokenizer()
            env.prefill[0].delay_s = 1.0
            (p,) = serving.registry.candidates(Side.PREFILL)

            async def send(chars: int, after_s: float = 0.0) -> str:
                await asyncio.sleep(after_s)
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "x" * chars, "max_tokens": 2, "stream": True})
                await r.read()
                return r.headers["X-Kvdisagg-Handoff"]

            env.decode[0].delay_s = 0.5  # decode computing a prompt
            (d,) = serving.registry.candidates(Side.DECODE)
            first = asyncio.ensure_future(send(300))  # 900 tokens (estimate 75)
            await until(lambda: p.in_flight(Side.PREFILL) == 1, "the prefill leg in flight")
            assert p.in_flight_tokens(Side.PREFILL) == 900
            second = asyncio.ensure_future(send(290))  # decode's queue 0 <= prefill's 900
            await until(lambda: d.local_prefills == 1, "decode computing the second")
            assert d.local_prefill_tokens == 870
            # 300 tokens: decode's queue (870) is still no longer than prefill's (900, where
            # the estimate would say 75): it starts on decode no later than on prefill.
            assert await send(100) == "decode_only:prefill_busy"
            assert await second == "decode_only:prefill_busy"
            assert await first == "pd"
            assert p.in_flight_tokens(Side.PREFILL) == 0 and d.local_prefill_tokens == 0
    run(t())


def test_a_prompt_is_noted_where_it_is_computed_until_shortly_after(monkeypatch) -> None:
    """Decode alone: on decode; disaggregated: on the prefill. Dropped PENDING_GRACE_S after
    its leg answered (the KV events have it by then)."""
    from kvdisagg.proxy.handoff import pipeline

    monkeypatch.setattr(pipeline, "PENDING_GRACE_S", 0.2)

    async def t() -> None:
        async with proxy(decision=DecisionConfig(local_prefill_tokens=100)) as env:
            cache = FakeCache({env.urls["d0"]: 0, env.urls["p0"]: 0})
            env.client.server.app[SERVING].cache = cache
            env.decode[0].delay_s = env.prefill[0].delay_s = 0.3
            for n, where in ((50, "d0"), (1000, "p0")):
                sent = asyncio.ensure_future(env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * n, "max_tokens": 2}))
                url = env.urls[where]
                await until(lambda u=url: cache.pending == [u], f"noted on {where}")
                assert (await sent).status == 200
                assert cache.pending == [url]  # still, for the events to come
                await until(lambda: cache.pending == [], "dropped")
    run(t())


# ---- protocol versions: a fleet in the middle of a rolling upgrade ---------------------------


async def versions_known(env: Any, **want: tuple[int, int] | None) -> None:
    """Until the proxy's probes found each named fake's versions (``env.urls`` names)."""
    from kvdisagg.proxy.app import REGISTRY

    reg = env.client.server.app[REGISTRY]
    for name, versions in want.items():
        await until(lambda url=env.urls[name], v=versions: reg.get(url).protocol == v,
                    f"{name}'s protocol versions {versions}")


def test_a_prefill_speaking_no_version_of_decode_is_never_paired_and_every_request_served(
        ) -> None:
    """p1 runs the next release (6 only), p0 and d0 this one (4..5): every request goes to p0,
    whatever the prefill policy's turn; none reaches p1, none fails on decode."""
    async def t() -> None:
        async with proxy(n_prefill=2) as env:  # round robin on each side
            (p0, p1), d0 = env.prefill, env.decode[0]
            for fake, versions in ((p0, (4, 5)), (p1, (6, 6)), (d0, (4, 5))):
                fake.protocol, fake.full_kv = versions, True
            await versions_known(env, p0=(4, 5), p1=(6, 6), d0=(4, 5))
            for i in range(6):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 100, "max_tokens": 2, "stream": i % 2 == 1})
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
                await r.read()
            assert len(p0.seen) == 6 and p1.seen == [] and d0.incompatible == 0
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_routed_total", route="pd") == 6
            assert metric(text, "kvdisagg_proxy_instance_protocol_version",
                          instance=env.urls["p1"], role="prefill", bound="min") == 6
            assert metric(text, "kvdisagg_proxy_instance_protocol_version",
                          instance=env.urls["d0"], role="decode", bound="max") == 5
            r = await env.admin.get("/admin/list")
            listed = {i["url"]: i["protocol"] for i in (await r.json())["instances"]}
            assert listed[env.urls["p1"]] == "6" and listed[env.urls["d0"]] == "4..5"
    run(t())


def test_the_decode_chosen_is_one_some_prefill_speaks_with() -> None:
    """d0 was upgraded first to a release that dropped 5 (6 only), the prefill still speaks
    4..5: the handoff goes to d1, whichever decode the policy would pick; d0 still serves what
    decode serves alone."""
    async def t() -> None:
        async with proxy(n_decode=2, decision=DecisionConfig(local_prefill_tokens=64)) as env:
            p0, (d0, d1) = env.prefill[0], env.decode
            for fake, versions in ((p0, (4, 5)), (d0, (6, 6)), (d1, (4, 5))):
                fake.protocol, fake.full_kv = versions, True
            await versions_known(env, p0=(4, 5), d0=(6, 6), d1=(4, 5))
            for _ in range(4):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 100, "max_tokens": 2})
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert d0.seen == [] and len(d1.seen) == 4 and d1.incompatible == 0
            for _ in range(2):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 8, "max_tokens": 2})
                assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:short_prompt"
            assert len(d0.seen) == 1
    run(t())


def test_with_no_pair_in_common_decode_serves_alone_counted_or_503_without_the_fallback() -> None:
    async def t(fallback: bool) -> None:
        async with proxy(retry=RetryConfig(decode_only_fallback=fallback)) as env:
            p0, d0 = env.prefill[0], env.decode[0]
            p0.protocol, d0.protocol = (6, 6), (4, 5)
            await versions_known(env, p0=(6, 6), d0=(4, 5))
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 100, "max_tokens": 2})
            text = await env.metrics()
            if fallback:
                assert r.status == 200
                assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:no_compatible_prefill"
                assert metric(text, "kvdisagg_proxy_routed_total", route="decode_only",
                              reason="no_compatible_prefill") == 1
                assert "kv_transfer_params" not in d0.seen[0]["body"]
            else:
                assert r.status == 503
                assert "no prefill instance speaks a protocol version" in await r.text()
                assert metric(text, "kvdisagg_proxy_rejected_total",
                              reason="no_compatible_prefill") == 1
            assert p0.seen == []
    run(t(True))
    run(t(False))


def test_a_handoff_from_a_prefill_whose_versions_were_stale_goes_to_a_decode_that_speaks_them(
        ) -> None:
    """Without metrics (``health.scrape_metrics`` off) the proxy learns a prefill's versions
    from its handoff params only: the first handoff of p0, upgraded to 6, goes to d1 (6) rather
    than the chosen d0 (4..5), and so does every later one; with no decode left that speaks 6,
    decode computes the prompt itself (``no_compatible_decode``)."""
    from kvdisagg.connector.protocol.versions import Versions
    from kvdisagg.proxy.app import REGISTRY

    async def t() -> None:
        async with proxy(n_decode=2, health=HealthConfig(interval_s=0.2, timeout_s=0.5,
                                             startup_timeout_s=2.0, scrape_metrics=False)) as env:
            reg = env.client.server.app[REGISTRY]
            p0, (d0, d1) = env.prefill[0], env.decode
            p0.protocol, p0.full_kv = (6, 6), True
            d0.protocol, d1.protocol = (4, 5), (6, 6)
            reg.get(env.urls["d0"]).protocol = Versions(4, 5)  # as a scrape had said
            reg.get(env.urls["d1"]).protocol = Versions(6, 6)
            for _ in range(3):
                r = await env.client.post("/v1/completions", json={
                    "model": "tiny", "prompt": [5] * 100, "max_tokens": 2})
                assert r.status == 200 and r.headers["X-Kvdisagg-Handoff"] == "pd"
            assert d0.seen == [] and len(d1.seen) == 3 and d1.incompatible == 0
            assert reg.get(env.urls["p0"]).protocol == Versions(6, 6)
            reg.get(env.urls["d1"]).protocol = Versions(4, 5)  # downgraded, say
            reg.get(env.urls["p0"]).protocol = Versions(4, 5)  # stale again
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [5] * 100, "max_tokens": 2})
            assert r.status == 200
            assert r.headers["X-Kvdisagg-Handoff"] == "decode_only:no_compatible_decode"
            assert metric(await env.metrics(), "kvdisagg_proxy_routed_total",
                          route="decode_only", reason="no_compatible_decode") == 1
            assert d0.incompatible == d1.incompatible == 0
    run(t())
