"""The handoff timeline from a real run: one trace per request across the proxy, prefill and
decode processes (exported over OTLP/HTTP to a loopback collector), its spans nested and in
order, and the same phases as Prometheus histograms on each instance and on the proxy."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.support.otlp_sink import SpanRecord, by_request

from .conftest import metric, poke, prompt_ids

pytestmark = pytest.mark.e2e
PULL_PHASES = ["queue", "connect", "read", "transfer", "done"]


def stream(url: str, prompt: list[int], rid: str) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": rid})
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def complete(trace: list[SpanRecord]) -> bool:
    names = {s.name for s in trace}
    return {"kvdisagg.request", "kvdisagg.load", "kvdisagg.serve", *PULL_PHASES} <= names


def test_each_request_is_one_trace_across_processes(fleet, otlp_sink):
    # seeds of its own: 700 (test_pd_serving's) would leave that prompt's blocks on decode
    rids = [f"timeline-{i}-{time.monotonic_ns()}" for i in range(3)]
    for i, rid in enumerate(rids):
        assert len(stream(fleet.proxy_url, prompt_ids(300 + i, seed=470 + i), rid)) == 4

    def all_in(spans: list[SpanRecord]) -> bool:
        traces = by_request(spans)
        return all(rid in traces and complete(traces[rid]) for rid in rids)

    traces = by_request(otlp_sink.wait_for(all_in, timeout_s=30))
    for rid in rids:
        assert rid in traces, f"no trace for {rid}"
        trace = {s.name: s for s in traces[rid]}
        assert complete(list(trace.values())), sorted(trace)
        root, pre, dec = trace["kvdisagg.request"], trace["prefill_leg"], trace["decode_leg"]
        load, pull, serve = trace["kvdisagg.load"], trace["kvdisagg.pull"], trace["kvdisagg.serve"]
        # who made each span, and its parent
        assert {root.service, pre.service, dec.service} == {"kvdisagg-proxy"}
        assert (load.service, pull.service) == ("kvdisagg-decode-scheduler", "kvdisagg-decode")
        assert serve.service == "kvdisagg-prefill"
        assert root.parent_id == "" and pre.parent_id == dec.parent_id == root.span_id
        assert serve.parent_id == pre.span_id and load.parent_id == dec.span_id
        assert pull.parent_id == load.span_id
        phases = [trace[p] for p in PULL_PHASES]
        assert all(p.parent_id == pull.span_id for p in phases)
        # in order: prefill answered before decode was asked; the pull's phases back to back
        assert root.start_ns <= pre.start_ns < pre.end_ns <= dec.start_ns <= load.start_ns
        assert load.start_ns <= pull.start_ns and pull.end_ns <= load.end_ns <= dec.end_ns
        assert phases[0].start_ns == pull.start_ns
        assert all(a.end_ns == b.start_ns for a, b in zip(phases, phases[1:]))
        assert pre.end_ns <= serve.start_ns < serve.end_ns  # decode read after prefill answered
        assert load.end_ns <= dec.events["first_token"] <= dec.events["first_byte"]
        assert pull.attributes["kvdisagg.bytes"] > 0

    # the same phases as histograms (vLLM publishes engine stats on an interval)
    d = fleet.decode.base_url
    deadline = time.monotonic() + 15
    while (metric(d, "vllm:kvdisagg_phase_seconds_count", phase="load") < len(rids)
           and time.monotonic() < deadline):
        time.sleep(0.25)
    for phase in [*PULL_PHASES, "load"]:
        assert metric(d, "vllm:kvdisagg_phase_seconds_count", phase=phase) >= len(rids), phase
    p = fleet.prefill.base_url
    poke(p)  # an idle prefill accounts its serving thread's work on its next step
    while (metric(p, "vllm:kvdisagg_phase_seconds_count", phase="serve") < len(rids)
           and time.monotonic() < deadline + 15):
        poke(p)
        time.sleep(0.25)
    assert metric(p, "vllm:kvdisagg_phase_seconds_count", phase="serve") >= len(rids)
    assert metric(fleet.proxy_url, "kvdisagg_proxy_decode_first_token_seconds_count") >= len(rids)
