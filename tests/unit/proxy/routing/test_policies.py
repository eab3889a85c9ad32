"""Routing policies, circuit breaker, health hysteresis, body handling and config: pure logic with
fake instances, no sockets."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec
import pytest

from kvdisagg.errors import BodyError, ConfigError
from kvdisagg.proxy.config import (
    InstanceSpec,
    PolicyConfig,
    ProxyConfig,
    SloConfig,
    load_config_file,
)
from kvdisagg.proxy.fleet.breaker import BreakerState, CircuitBreaker
from kvdisagg.proxy.fleet.registry import (
    Registry,
    probe_samples,
    recomputed_by_reason,
    vllm_queue,
)
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.policies import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    SloAware,
    Verdict,
)
from kvdisagg.proxy.types import Role, Side


@dataclass(eq=False)
class FakeInst:
    url: str
    flight: dict[Side, int] = field(default_factory=lambda: {Side.PREFILL: 0, Side.DECODE: 0})
    tokens: dict[Side, int] = field(default_factory=lambda: {Side.PREFILL: 0, Side.DECODE: 0})
    vllm_waiting: float = 0.0
    vllm_running: float = 0.0
    prefill_s_per_token: float | None = None
    tpot_s: float | None = None
    tpot_load: float = 0.0

    def in_flight(self, side: Side) -> int:
        return self.flight[side]

    def in_flight_tokens(self, side: Side) -> int:
        return self.tokens[side]


def req(key: str = "p", tokens: int = 100) -> RouteRequest:
    return RouteRequest(key.encode(), tokens, 16)


FLEET = [FakeInst(f"http://10.0.0.{i}:8000") for i in range(4)]


def test_round_robin_distribution_is_even() -> None:
    rr = RoundRobin()
    picks = Counter(rr.select(req(), FLEET, Side.PREFILL).instance.url for _ in range(400))
    assert set(picks.values()) == {100}
    assert rr.select(req(), [], Side.PREFILL).verdict is Verdict.NO_CANDIDATE


def test_least_loaded_follows_load() -> None:
    fleet = [FakeInst(f"u{i}") for i in range(3)]
    ll = LeastLoaded()
    fleet[0].flight[Side.DECODE] = 3
    fleet[1].flight[Side.DECODE] = 1
    fleet[2].flight[Side.DECODE] = 2
    assert ll.select(req(), fleet, Side.DECODE).instance is fleet[1]
    fleet[1].vllm_waiting = 5  # vLLM's own queue (other clients) counts too
    assert ll.select(req(), fleet, Side.DECODE).instance is fleet[2]
    fleet[2].tokens[Side.DECODE] = 4096  # many in-flight tokens weigh like requests
    assert ll.select(req(), fleet, Side.DECODE).instance is fleet[0]
    # simulate a stream of arrivals that each add load: picks spread to balance
    for f in fleet:
        f.flight[Side.PREFILL] = 0
        f.vllm_waiting = 0
    counts: Counter[str] = Counter()
    for _ in range(30):
        inst = ll.select(req(), fleet, Side.PREFILL).instance
        inst.flight[Side.PREFILL] += 1
        counts[inst.url] += 1
    assert set(counts.values()) == {10}


def test_prefix_aware_is_sticky_and_balanced() -> None:
    fleet = [FakeInst(f"http://p{i}") for i in range(4)]
    pa = PrefixAware(PolicyConfig(prefix_load_slack=2))
    # stickiness: the same prefix always lands on the same instance
    for k in range(20):
        homes = {pa.select(req(f"system prompt {k}"), fleet, Side.PREFILL).instance.url
                 for _ in range(10)}
        assert len(homes) == 1
    # spread: many distinct prefixes cover every instance roughly evenly
    spread = Counter(pa.select(req(f"doc {k}"), fleet, Side.PREFILL).instance.url
                     for k in range(400))
    assert len(spread) == 4 and min(spread.values()) > 60
    # removing one instance only moves the keys that lived on it
    before = {k: pa.select(req(f"doc {k}"), fleet, Side.PREFILL).instance.url for k in range(200)}
    gone = fleet[0].url
    after = {k: pa.select(req(f"doc {k}"), fleet[1:], Side.PREFILL).instance.url
             for k in range(200)}
    assert all(after[k] == before[k] for k in before if before[k] != gone)
    # balance: a hot prefix overflows once its home is loaded beyond the slack
    home = pa.select(req("hot"), fleet, Side.PREFILL).instance
    home.flight[Side.PREFILL] = 3
    other = pa.select(req("hot"), fleet, Side.PREFILL).instance
    assert other is not home and other.in_flight(Side.PREFILL) == 0
    home.flight[Side.PREFILL] = 2
    assert pa.select(req("hot"), fleet, Side.PREFILL).instance is home


def test_slo_aware_picks_lower_predicted_ttft_and_sheds_when_none_meets() -> None:
    slo = SloConfig(ttft_s=0.5, tpot_s=0.05)
    sa = SloAware(slo=slo)
    fast = FakeInst("fast", prefill_s_per_token=0.001)
    slow = FakeInst("slow", prefill_s_per_token=0.004)
    sel = sa.select(req(tokens=100), [slow, fast], Side.PREFILL)
    assert sel.instance is fast and sel.verdict is Verdict.OK
    assert sel.predicted_s == pytest.approx(0.1)
    fast.tokens[Side.PREFILL] = 1000  # queued work ahead makes the fast one slower
    sel = sa.select(req(tokens=100), [slow, fast], Side.PREFILL)
    assert sel.instance is slow and sel.predicted_s == pytest.approx(0.4)
    sel = sa.select(req(tokens=1000), [slow, fast], Side.PREFILL)
    assert sel.verdict is Verdict.SLO_MISS and sel.instance is fast  # best of the bad
    # decode side: predicted TPOT scales with load relative to when it was measured
    d1 = FakeInst("d1", tpot_s=0.02, tpot_load=1.0)
    d2 = FakeInst("d2", tpot_s=0.01, tpot_load=1.0)
    d2.flight[Side.DECODE] = 7
    sel = sa.select(req(), [d1, d2], Side.DECODE)
    assert sel.instance is d1 and sel.predicted_s == pytest.approx(0.01)
    d1.flight[Side.DECODE] = 9  # predicted 0.1 s
    d2.flight[Side.DECODE] = 11  # predicted 0.06 s: both over 0.05
    assert sa.select(req(), [d1, d2], Side.DECODE).verdict is Verdict.SLO_MISS
    # an unmeasured instance is explored
    assert sa.select(req(), [d1, FakeInst("new")], Side.DECODE).instance.url == "new"


def test_circuit_breaker_transitions() -> None:
    now = [0.0]
    b = CircuitBreaker("x", failure_threshold=2, open_s=5.0, clock=lambda: now[0])
    assert b.can_execute()
    b.on_failure()
    assert b.state is BreakerState.CLOSED
    b.on_failure()
    assert b.state is BreakerState.OPEN and not b.can_execute()
    now[0] = 5.0
    assert b.can_execute() and b.state is BreakerState.HALF_OPEN
    b.on_start()
    assert not b.can_execute()  # one trial at a time
    b.on_failure()
    assert b.state is BreakerState.OPEN
    now[0] = 10.0
    assert b.can_execute()
    b.on_start()
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.can_execute()


def test_health_hysteresis() -> None:
    cfg = ProxyConfig()  # failure_threshold 2, success_threshold 2
    reg = Registry(cfg)
    inst = reg.add(InstanceSpec(url="http://a:1", role=Role.PREFILL))
    inst.probe_result(True, None, cfg)
    assert inst.healthy  # the first answer counts at once
    inst.probe_result(False, "x", cfg)
    assert inst.healthy
    inst.probe_result(False, "x", cfg)
    assert not inst.healthy and reg.candidates(Side.PREFILL) == []
    inst.probe_result(True, None, cfg)
    assert not inst.healthy
    inst.probe_result(True, None, cfg)
    assert inst.healthy and reg.candidates(Side.PREFILL) == [inst]


def test_parse_vllm_queue() -> None:
    text = (
        b'# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{engine="0"} 3.0\n'
        b'vllm:num_requests_waiting{engine="1"} 2.0\nvllm:num_requests_running{engine="0"} 4.0\n'
        b"vllm:num_requests_running_total 99\n"
    )
    assert vllm_queue(probe_samples(text)) == (5.0, 4.0 + 99)


def test_parse_recomputed_sums_engines_by_reason() -> None:
    text = (b'# HELP vllm:kvdisagg_recomputed_prompts_total x\n'
            b'vllm:kvdisagg_recomputed_prompts_total{engine="0",model_name="m",'
            b'reason="load_failed"} 2.0\n'
            b'vllm:kvdisagg_recomputed_prompts_total{engine="1",model_name="m",'
            b'reason="load_failed"} 1.0\n'
            b'vllm:kvdisagg_recomputed_prompts_created{engine="0",model_name="m",'
            b'reason="load_failed"} 1.7e9\n'
            b'vllm:kvdisagg_recomputed_prompts_total{engine="0",model_name="m",'
            b'reason="not_read"} 0.0\n')
    assert recomputed_by_reason(probe_samples(text)) == {"load_failed": 3.0, "not_read": 0.0}
    assert recomputed_by_reason(probe_samples(b"vllm:num_requests_running 1\n")) == {}


def test_decode_body_splices_client_bytes() -> None:
    raw = b' {"prompt":"a","temperature":0.1000000000000000055511151231257827}'
    b = bodies.parse(raw, chat=False, prefix_chars=8)
    out = bodies.decode_body(b, b'{"x":1}')
    assert (
        out
        == b' {"kv_transfer_params":{"x":1},"prompt":"a",'
        b'"temperature":0.1000000000000000055511151231257827}'
    )
    empty = bodies.parse(b"{ }", chat=False, prefix_chars=8)
    assert msgspec.json.decode(bodies.decode_body(empty, b"{}")) == {"kv_transfer_params": {}}
    assert bodies.decode_body(b, None) == raw
    forged = bodies.parse(
        b'{"prompt":"a","top_p":0.7,"kv_transfer_params":{"remote_block_ids":[6]}}',
        chat=False,
        prefix_chars=8,
    )
    assert b"kv_transfer_params" not in forged.raw and b'"top_p":0.7' in forged.raw
    assert bodies.parse(b'{"prompt":[1,2,3,4,5]}', False, 8).route.prompt_tokens == 5
    assert bodies.parse(b'{"prompt":"x"}', False, 8).route.max_tokens == 16
    chat = bodies.parse(b'{"messages":[{"role":"user","content":"hello world"}],'
                        b'"max_completion_tokens":7}', True, 5)
    assert chat.route.prefix_key == b"hello" and chat.route.max_tokens == 7
    with pytest.raises(BodyError):
        bodies.parse(b"[1]", False, 8)


def test_client_slo_goes_on_to_prefill_and_nothing_else() -> None:
    b = bodies.parse(b'{"prompt":"a","kv_transfer_params":{"kvdisagg_slo":{"ttft_s":0.25},'
                     b'"remote_block_ids":[6]}}', chat=False, prefix_chars=8)
    assert b"kv_transfer_params" not in b.raw
    prefill = msgspec.json.decode(bodies.prefill_body(b))["kv_transfer_params"]
    assert prefill == {**bodies.PREFILL_KV_PARAMS, "kvdisagg_slo": {"ttft_s": 0.25}}
    plain = bodies.parse(b'{"prompt":"a"}', chat=False, prefix_chars=8)
    assert msgspec.json.decode(bodies.prefill_body(plain))["kv_transfer_params"] == \
        bodies.PREFILL_KV_PARAMS
    for bad in (b'{"ttft_s":-1}', b'{"ttft_s":"fast"}', b'[1]'):
        with pytest.raises(BodyError, match="kvdisagg_slo"):
            bodies.parse(b'{"prompt":"a","kv_transfer_params":{"kvdisagg_slo":' + bad + b"}}",
                         chat=False, prefix_chars=8)


def test_kv_params_extracted_raw() -> None:
    assert bodies.kv_params_of(b'{"id":"x","kv_transfer_params":{"a":1.10}}') == b'{"a":1.10}'
    assert bodies.kv_params_of(b'{"id":"x"}') is None
    assert bodies.kv_params_of(b'{"kv_transfer_params":null}') is None
    assert bodies.kv_params_of(b"not json") is None


def test_config_validation_and_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"policy.prefill: Invalid enum value 'fastest'; "
                       r"choose one of \['least_loaded', 'prefix_aware', 'round_robin'"):
        ProxyConfig(policy=PolicyConfig(prefill="fastest")).validate()
    with pytest.raises(ConfigError, match="listed twice"):
        ProxyConfig(instances=[InstanceSpec(url="http://a:1", role=Role.DECODE),
                               InstanceSpec(url="http://a:1/", role=Role.PREFILL)]).validate()
    y = tmp_path / "p.yaml"
    y.write_text("instances:\n  - {url: 'http://a:1', role: prefill}\n  - {url: 'http://b:2', "
                 "role: kv_both}\npolicy: {prefill: prefix_aware}\nslo: {ttft_s: 0.2, "
                 "admission: shed}\n")
    cfg = load_config_file(y).validate()
    assert [i.role for i in cfg.instances] == [Role.PREFILL, Role.BOTH]
    assert cfg.policy.prefill == "prefix_aware" and cfg.slo.admission == "shed"
    t = tmp_path / "p.toml"
    t.write_text(
        '[[instances]]\nurl = "http://a:1"\nrole = "decode"\n[retry]\nprefill_atempts = 3\n'
    )
    with pytest.raises(ConfigError, match="prefill_atempts"):
        load_config_file(t)
