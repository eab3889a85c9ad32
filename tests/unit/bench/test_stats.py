"""Pure parts of kvdisagg bench: percentiles, SLO judgement, attainment/goodput, rate search,
length distributions, arrivals and datasets. No sockets."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvdisagg.bench import workload
from kvdisagg.bench.records import RequestRecord, Slo, SweepPoint
from kvdisagg.bench.stats import judge, percentile, percentiles, summarize, window_goodput
from kvdisagg.bench.sweep import bisect_max_rate, max_rate_from_points

SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def rec(i: int = 0, *, ok: bool = True, ttft: float | None = 0.1, tpot: float | None = 0.01,
        done: float | None = 1.0, sent: float = 0.0, tokens: int = 10) -> RequestRecord:
    r = RequestRecord(endpoint="e", run="e@1", index=i, rate=1.0, scheduled_at_s=sent,
                      sent_at_s=sent, prompt_len=8, output_len=tokens, ok=ok,
                      ttft_s=ttft if ok else None, tpot_s=tpot if ok else None,
                      done_at_s=done if ok else None, e2e_s=(done - sent) if ok and done else None,
                      output_tokens=tokens if ok else 0)
    return judge(r, SLO)


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    xs = [random.Random(7).expovariate(1.0) for _ in range(101)] + [0.3, 0.3]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], q) is None


def test_percentile_rejects_bad_q() -> None:
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0], 101)


def test_percentiles_summary() -> None:
    p = percentiles([3.0, 1.0, 2.0])
    assert (p.mean, p.p50, p.max) == (2.0, 2.0, 3.0)
    assert percentiles([]).p90 is None


def test_judge_boundaries_and_failures() -> None:
    assert rec(ttft=0.5, tpot=0.05).met_both  # the objective itself is met (<=)
    r = rec(ttft=0.5001, tpot=0.01)
    assert (r.met_ttft, r.met_tpot, r.met_both) == (False, True, False)
    r = rec(ttft=0.1, tpot=0.0501)
    assert (r.met_ttft, r.met_tpot, r.met_both) == (True, False, False)
    assert rec(ttft=0.1, tpot=None, tokens=1).met_both  # one token: TPOT does not apply
    r = rec(ok=False)
    assert (r.met_ttft, r.met_tpot, r.met_both) == (False, False, False)


def test_summary_counts_failures_as_misses_and_divides_goodput_by_gpus() -> None:
    records = [rec(0, done=1.0), rec(1, done=2.0), rec(2, ttft=0.9, done=3.0),
               rec(3, ok=False, sent=3.5)]
    s = summarize(records, endpoint="e", url="http://x", run="e@1", gpus=2, rate=1.0)
    assert (s.requests, s.ok) == (4, 3)
    assert s.duration_s == 3.5  # the failed request's send is the last event
    assert s.attainment == 0.5 and s.attainment_ttft == 0.5 and s.attainment_tpot == 0.75
    assert s.goodput_rps == pytest.approx(2 / 3.5)
    assert s.goodput_rps_per_gpu == pytest.approx(1 / 3.5)
    assert s.throughput_rps == pytest.approx(3 / 3.5)
    assert s.ttft_s.max == 0.9
    with pytest.raises(ValueError, match="gpus"):
        summarize(records, endpoint="e", url="u", run="r", gpus=0, rate=1.0)


def test_window_goodput_counts_good_completions_in_the_window() -> None:
    records = [rec(0, done=1.0), rec(1, done=5.0), rec(2, done=9.5), rec(3, done=10.0),
               rec(4, ttft=2.0, done=9.0), rec(5, ok=False)]
    assert window_goodput(records, 10.0, 5.0) == pytest.approx(2 / 5)  # 5.0 is outside (5, 10]
    assert window_goodput(records, 10.0, 10.0) == pytest.approx(4 / 10)
    with pytest.raises(ValueError):
        window_goodput(records, 10.0, 0)


def pts(*pairs: tuple[float, float]) -> list[SweepPoint]:
    return [SweepPoint(r, a) for r, a in pairs]


def test_max_rate_interpolates_first_crossing() -> None:
    got = max_rate_from_points(pts((4, 0.7), (1, 1.0), (2, 0.95), (3, 0.85)), 0.9)
    assert got.rate == pytest.approx(2.5) and not got.censored
    # Noise: attainment recovers at 4 after missing at 3; the first crossing is the answer.
    got = max_rate_from_points(pts((1, 1.0), (2, 0.95), (3, 0.85), (4, 0.92)), 0.9)
    assert got.rate == pytest.approx(2.5)


def test_max_rate_none_and_censored() -> None:
    assert max_rate_from_points(pts((1, 0.5), (2, 0.4)), 0.9).rate is None
    got = max_rate_from_points(pts((1, 1.0), (2, 0.95)), 0.9)
    assert got.rate == 2 and got.censored
    with pytest.raises(ValueError):
        max_rate_from_points([], 0.9)


def test_bisect_finds_threshold_within_bracket() -> None:
    calls: list[float] = []

    def measure(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= 3.3 else 0.5

    best, probes = bisect_max_rate(measure, 1.0, 8.0, 0.9, steps=6)
    assert len(calls) == len(probes) == 8
    assert best.rate is not None and 3.3 - 7 / 2**6 <= best.rate <= 3.3 and not best.censored
    assert [p.rate for p in probes] == calls


def test_bisect_edges() -> None:
    best, probes = bisect_max_rate(lambda r: 0.0, 1.0, 8.0, 0.9, steps=5)
    assert best.rate is None and len(probes) == 1
    best, probes = bisect_max_rate(lambda r: 1.0, 1.0, 8.0, 0.9, steps=5)
    assert best.rate == 8.0 and best.censored and len(probes) == 2
    with pytest.raises(ValueError):
        bisect_max_rate(lambda r: 1.0, 2.0, 1.0, 0.9, steps=1)


@pytest.mark.parametrize("spec,err", [("uniform:5", "takes 2"), ("gamma:3", "unknown kind"),
                                      ("uniform:9:3", "HI must be"), ("x", "numbers"),
                                      ("fixed:0", "positive")])
def test_length_spec_errors(spec: str, err: str) -> None:
    with pytest.raises(ValueError, match=err):
        workload.LengthDist(spec)


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert {workload.LengthDist("17").sample(rng) for _ in range(5)} == {17}
    u = [workload.LengthDist("uniform:3:6").sample(rng) for _ in range(400)]
    assert set(u) == {3, 4, 5, 6}
    ln = [workload.LengthDist("lognormal:100:0.5").sample(rng) for _ in range(4000)]
    assert 90 < float(np.median(ln)) < 110
    ex = [workload.LengthDist("exponential:50", max_len=80).sample(rng) for _ in range(4000)]
    assert max(ex) == 80 and min(ex) >= 1


def test_poisson_arrivals_rate_and_common_random_numbers() -> None:
    t1 = workload.arrival_times(4000, 1.0, "poisson", seed=3)
    t4 = workload.arrival_times(4000, 4.0, "poisson", seed=3)
    assert t1[0] == 0.0
    assert (len(t1) - 1) / t1[-1] == pytest.approx(1.0, rel=0.05)
    assert t4 == pytest.approx([t / 4 for t in t1])
    gaps = np.diff(t1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.06)  # exponential: CV 1
    assert workload.arrival_times(3, 2.0, "constant", 0) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        workload.arrival_times(3, 0.0, "poisson", 0)


def test_trace_rescaled_to_rate() -> None:
    rows = [workload.RequestLengths(4, 2, timestamp=t) for t in (10.0, 12.0, 11.0, 14.0)]
    assert workload.trace_times(rows, None) == [0.0, 1.0, 2.0, 4.0]
    assert workload.trace_times(rows, 1.5) == pytest.approx([0.0, 0.5, 1.0, 2.0])
    specs = workload.build(4, None, seed=0, salt=0, dataset=rows, trace=True)
    assert [s.at_s for s in specs] == [0.0, 1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="timestamp"):
        workload.trace_times([workload.RequestLengths(1, 1)], None)


def test_datasets(tmp_path) -> None:
    c = tmp_path / "d.csv"
    c.write_text("prompt_len,output_len\n12,3\n40,7\n")
    assert [r[:2] for r in workload.load_dataset(c)] == [(12, 3), (40, 7)]
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"prompt": [5, 6, 7], "output_len": 2}) + "\n\n"
                 + json.dumps({"prompt": "a b c d", "output_len": 1, "timestamp": 1.5}) + "\n")
    rows = workload.load_dataset(j)
    assert rows[0] == workload.RequestLengths(3, 2, [5, 6, 7], None)
    assert rows[1].prompt_len == 4 and rows[1].timestamp == 1.5
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len,output_len\n12,x\n")
    with pytest.raises(ValueError, match=r"bad.csv:2"):
        workload.load_dataset(bad)
    (tmp_path / "d.txt").write_text("12 3\n")
    with pytest.raises(ValueError, match="use a .csv or .jsonl"):
        workload.load_dataset(tmp_path / "d.txt")
    specs = workload.build(5, 2.0, seed=1, salt=0, dataset=rows)
    assert all(s.prompt in ([5, 6, 7], "a b c d") for s in specs)


def test_build_same_lengths_new_prompts_per_run() -> None:
    kw = dict(seed=4, prompt_len=workload.LengthDist("uniform:5:50"),
              output_len=workload.LengthDist("uniform:2:9"))
    a = workload.build(30, 1.0, salt=1, **kw)
    b = workload.build(30, 3.0, salt=2, **kw)
    assert [(s.prompt_len, s.output_len) for s in a] == [(s.prompt_len, s.output_len) for s in b]
    assert all(len(s.prompt) == s.prompt_len for s in a)
    assert all(10 <= t < 500 for s in a for t in s.prompt)  # type: ignore[union-attr]
    assert [s.prompt for s in a] != [s.prompt for s in b]  # no prefix-cache hits across runs
    assert [s.at_s for s in b] == pytest.approx([s.at_s / 3 for s in a])
    text = workload.build(2, 1.0, salt=1, token_ids=None, **kw)
    assert isinstance(text[0].prompt, str) and len(text[0].prompt.split()) == text[0].prompt_len


def test_met_per_event_times_tpot_like_the_proxy() -> None:
    from kvdisagg.bench.stats import met_per_event

    # 5 tokens in 2 events: first at TTFT, then 4 packed in one event 0.12 s later.
    r = rec(ttft=0.1, tpot=0.03, tokens=5)
    r.itl_s, r.output_events = [0.12, 0.0, 0.0, 0.0], 2
    assert r.met_both  # per token: 0.12 / 4 = 0.03 <= 0.05
    assert not met_per_event(r, SLO)  # per event: 0.12 / 1 > 0.05
    r.output_events = 5
    assert met_per_event(r, SLO)
    assert not met_per_event(rec(ok=False), SLO)


def test_phase_breakdown_from_histogram_deltas():
    from kvdisagg.bench.scrape import phase_means, phase_totals
    from kvdisagg.prom_text import samples

    def text(transfer: tuple[int, float], leg: tuple[int, float]) -> str:
        return (f'vllm:kvdisagg_phase_seconds_count{{engine="0",phase="transfer"}} {transfer[0]}\n'
                f'vllm:kvdisagg_phase_seconds_sum{{engine="0",phase="transfer"}} {transfer[1]}\n'
                f'vllm:kvdisagg_phase_seconds_bucket{{engine="0",phase="transfer",le="1"}} 9\n'
                f"kvdisagg_proxy_handoff_seconds_count {leg[0]}\n"
                f"kvdisagg_proxy_handoff_seconds_sum {leg[1]}\n"
                f"kvdisagg_proxy_ttft_seconds_count 99\n")

    before = phase_totals(samples(text((2, 0.004), (5, 1.0))))
    assert before == {"transfer": (2, 0.004), "prefill leg": (5, 1.0)}
    after = phase_totals(samples(text((6, 0.012), (5, 1.0))))
    (m,) = phase_means("http://d", before, after)  # the prefill leg saw nothing new
    assert (m.where, m.phase, m.count) == ("http://d", "transfer", 4)
    assert abs(m.mean_s - 0.002) < 1e-12
