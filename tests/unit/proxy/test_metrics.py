"""The proxy's /metrics (proxy/metrics.py): the text as Prometheus parses it (one TYPE per family,
every family documented, labels escaped, cumulative histogram buckets), the SLO judgement at its
boundaries, attainment and goodput over the sliding window (a hand-driven clock), and the same
gauges from requests served by fake vLLM upstreams on loopback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvdisagg import prom_text
from kvdisagg.proxy.config import InstanceSpec, ProxyConfig, SloConfig
from kvdisagg.proxy.fleet.registry import Registry
from kvdisagg.proxy.metrics import LATENCY_BUCKETS, TPOT_BUCKETS, Histogram, Metrics
from kvdisagg.proxy.routing.cache_index import IndexState, InstanceStatus
from kvdisagg.proxy.routing.kv_events import IndexCounters
from kvdisagg.proxy.types import Role, Side
from tests.support.proxy_harness import GEN, metric, proxy, run

DOCS = Path(__file__).resolve().parents[3] / "docs"
SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family -> TYPE, samples) of an exposition text; fails on anything Prometheus would not
    take: a malformed line, a sample before its family's TYPE, a family typed twice, a sample
    repeated (a check of the format stricter than prometheus_client's lax parser, which must
    read the same samples)."""
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"{name} typed twice"
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"malformed sample line: {line!r}"
        name, raw, value = m.groups()
        labels = dict(LABEL.findall(raw or ""))
        if raw:
            assert ",".join(f'{k}="{v}"' for k, v in labels.items()) == raw, line
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        family = family if types.get(family) == "histogram" else name
        assert family in types, f"{name} before its # TYPE"
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen, f"sample repeated: {line}"
        seen.add(key)
        samples.append((name, labels, float(value)))
    # the reading every other reader of /metrics uses (prometheus_client's parser) agrees,
    # label values unescaped there (escaped again to compare)
    def escaped(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    assert [(s.name, {k: escaped(v) for k, v in s.labels.items()}, s.value)
            for s in prom_text.samples(text)] == samples
    return types, samples


def fleet() -> Registry:
    reg = Registry(ProxyConfig())
    for url, role in (("http://p0:8000", Role.PREFILL), ("http://d0:8000", Role.DECODE),
                      ("http://b0:8000", Role.BOTH)):
        reg.add(InstanceSpec(url=url, role=role))
    return reg


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_histogram_buckets_are_cumulative_and_le_is_inclusive() -> None:
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    types, samples = parse("".join(_rendered(h)))
    assert types == {"x_seconds": "histogram"}
    assert [(n, lb, v) for n, lb, v in samples] == [
        ("x_seconds_bucket", {"le": "0.1"}, 2),  # 0.05 and exactly 0.1
        ("x_seconds_bucket", {"le": "1.0"}, 4),
        ("x_seconds_bucket", {"le": "+Inf"}, 5),
        ("x_seconds_sum", {}, pytest.approx(8.65)),
        ("x_seconds_count", {}, 5),
    ]


def _rendered(h: Histogram) -> list[str]:
    out: list[str] = []
    h.render(out)
    return out


def test_metrics_text_parses_and_every_family_is_documented() -> None:
    reg = fleet()
    m = Metrics(SloConfig())
    m.request_done("completions", "ok")
    m.request_done("chat", "error")
    m.leg_error("http://p0:8000", Side.PREFILL, "timeout")
    m.missing_kv_params("http://p0:8000")
    m.routed("decode_only", "short_prompt")
    m.migration("ok")
    m.predicted_hit("http://d0:8000", 48)
    m.rejected("max_in_flight")
    m.discovery_error("decode", 'k8s:app="vllm"\\x')  # a quote and a backslash, escaped
    m.ttft.observe(0.2)
    m.judge("http://d0:8000", 1.0, 0.2, 0.01, 10)

    class Index:
        def status(self) -> list[InstanceStatus]:
            return [InstanceStatus(url="http://d0:8000", role="decode", state=IndexState.LIVE,
                                   blocks=7, counters=IndexCounters(events=3, gaps=1)),
                    InstanceStatus(url="http://b0:8000", role="kv_both",
                                   state=IndexState.DISABLED)]

    m.cache = Index()
    types, samples = parse(m.render(reg))
    documented = " ".join(p.read_text() for p in DOCS.glob("*.md"))
    undocumented = [f for f in types if f"`{f}" not in documented]
    assert not undocumented, f"add them to docs/proxy.md's metrics table: {undocumented}"

    def values(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(lb.items())): v for n, lb, v in samples if n == name}

    P = "kvdisagg_proxy_"
    assert values(P + "requests_total") == {
        (("endpoint", "chat"), ("outcome", "error")): 1,
        (("endpoint", "completions"), ("outcome", "ok")): 1}
    # per instance and side, every instance, both sides
    assert set(values(P + "instance_in_flight")) == {
        (("instance", u), ("side", s)) for u in reg.instances for s in ("prefill", "decode")}
    assert values(P + "instance_healthy") == {  # not probed yet: 0
        (("instance", "http://p0:8000"), ("role", "prefill")): 0,
        (("instance", "http://d0:8000"), ("role", "decode")): 0,
        (("instance", "http://b0:8000"), ("role", "kv_both")): 0}
    # goodput per instance only for those that serve decode
    assert set(values(P + "instance_goodput_rps")) == {
        (("instance", "http://d0:8000"),), (("instance", "http://b0:8000"),)}
    assert values(P + "instance_errors_total") == {
        (("instance", "http://p0:8000"), ("kind", "timeout"), ("side", "prefill")): 1}
    assert values(P + "discovery_errors_total") == {
        (("side", "decode"), ("source", 'k8s:app=\\"vllm\\"\\\\x')): 1}
    assert values(P + "cache_index_live") == {
        (("instance", "http://d0:8000"), ("state", "live")): 1,
        (("instance", "http://b0:8000"), ("state", "disabled")): 0}
    assert values(P + "cache_index_gaps_total")[(("instance", "http://d0:8000"),)] == 1
    # every latency histogram with the buckets it promises
    for name, bounds in (("ttft_seconds", LATENCY_BUCKETS), ("tpot_seconds", TPOT_BUCKETS),
                         ("e2e_seconds", LATENCY_BUCKETS), ("handoff_seconds", LATENCY_BUCKETS),
                         ("decode_first_token_seconds", LATENCY_BUCKETS)):
        assert types[P + name] == "histogram"
        les = [lb["le"] for n, lb, _ in samples if n == P + name + "_bucket"]
        assert les == [str(b) for b in bounds] + ["+Inf"]
    assert values(P + "ttft_seconds_bucket")[(("le", "0.25"),)] == 1
    assert values(P + "ttft_seconds_bucket")[(("le", "0.1"),)] == 0
    assert values(P + "slo_met_total") == {(("slo", "ttft"),): 1, (("slo", "tpot"),): 1,
                                           (("slo", "both"),): 1}


@pytest.mark.parametrize("ttft, tpot, e2e, tokens, met", [
    (0.5, 0.1, 9.0, 10, ("ttft", "tpot", "both")),  # streamed: both bounds inclusive
    (0.51, 0.1, 1.0, 10, ("tpot",)),
    (0.2, 0.11, 1.0, 10, ("ttft",)),
    (0.2, None, 1.0, 1, ("ttft", "tpot", "both")),  # one token: no TPOT to miss
    (None, None, 1.5, 11, ("ttft", "tpot", "both")),  # non-streamed: 0.5 + 0.1 * 10
    (None, None, 1.51, 11, ()),
    (None, None, 0.5, None, ("ttft", "tpot", "both")),  # no usage: one token
    (None, None, 0.51, 0, ()),
])
def test_judge_at_the_slo_boundaries(ttft, tpot, e2e, tokens, met) -> None:
    m = Metrics(SloConfig(ttft_s=0.5, tpot_s=0.1))
    assert m.judge("http://d0:8000", e2e, ttft, tpot, tokens) is ("both" in met)
    assert m.slo_requests == 1
    assert {k for k, n in m.slo_met.items() if n} == set(met)


def test_attainment_and_goodput_over_the_sliding_window() -> None:
    clock = Clock()
    m = Metrics(SloConfig(ttft_s=0.5, tpot_s=0.1, window_s=10.0), clock=clock)
    assert m.goodput() == (0.0, 0.0, {})  # nothing judged: 0, not a division by zero
    clock.now += 0.5
    for url, ttft in (("http://d0:8000", 0.1), ("http://d0:8000", 0.1),
                      ("http://b0:8000", 0.1), ("http://d0:8000", 0.9)):
        m.judge(url, 1.0, ttft, 0.01, 10)
    # younger than a second: goodput per at least one second, not per half a second
    assert m.goodput() == (0.75, 3.0, {"http://d0:8000": 2.0, "http://b0:8000": 1.0})
    clock.now += 3.5  # 4 s since start: the window is what there is so far
    assert m.goodput() == (0.75, 0.75, {"http://d0:8000": 0.5, "http://b0:8000": 0.25})
    clock.now += 6.0
    m.judge("http://d0:8000", 1.0, 0.1, 0.01, 10)  # 10 s since start: a full window
    assert m.goodput() == (0.8, 0.4, {"http://d0:8000": 0.3, "http://b0:8000": 0.1})
    clock.now += 9.6  # the first four fell out of the window
    attainment, goodput, per = m.goodput()
    assert (attainment, goodput, per) == (1.0, 0.1, {"http://d0:8000": 0.1})
    text = m.render(fleet())
    assert metric(text, "kvdisagg_proxy_slo_attainment") == 1.0
    assert metric(text, "kvdisagg_proxy_goodput_rps") == 0.1
    assert metric(text, "kvdisagg_proxy_instance_goodput_rps", instance="http://d0:8000") == 0.1
    assert metric(text, "kvdisagg_proxy_instance_goodput_rps", instance="http://b0:8000") == 0.0
    assert metric(text, "kvdisagg_proxy_slo_requests_total") == 5  # counters keep everything
    clock.now += 20
    assert m.goodput() == (0.0, 0.0, {})


def test_goodput_and_slo_metrics() -> None:
    async def t() -> None:
        async with proxy(slo=SloConfig(ttft_s=0.5, tpot_s=0.1)) as env:
            for stream in (True, True, False):
                r = await env.client.post("/v1/completions", json={**GEN, "stream": stream})
                await r.read()
            env.prefill[0].delay_s = 0.6  # misses TTFT
            r = await env.client.post("/v1/completions", json={**GEN, "stream": True})
            await r.read()
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_slo_requests_total") == 4
            assert metric(text, "kvdisagg_proxy_slo_met_total", slo="both") == 3
            assert metric(text, "kvdisagg_proxy_slo_attainment") == pytest.approx(0.75)
            assert metric(text, "kvdisagg_proxy_goodput_rps") > 0
            assert metric(text, "kvdisagg_proxy_instance_goodput_rps",
                          instance=env.urls["d0"]) == metric(text, "kvdisagg_proxy_goodput_rps")
            assert metric(text, "kvdisagg_proxy_handoff_seconds_count") == 4
            assert metric(text, "kvdisagg_proxy_e2e_seconds_count") == 4
    run(t())
