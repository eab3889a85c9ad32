"""kvdisagg bench's attainment.py: percentiles (vs numpy), SLO judgement at the boundaries,
attainment/goodput with failures, the window count, TPOT per event. No sockets."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvdisagg.bench.attainment import (
    judge,
    met_per_event,
    percentile,
    percentiles,
    summarize,
    window_goodput,
)
from kvdisagg.bench.records import RequestRecord, Slo

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


def test_met_per_event_times_tpot_like_the_proxy() -> None:
    # 5 tokens in 2 events: first at TTFT, then 4 packed in one event 0.12 s later.
    r = rec(ttft=0.1, tpot=0.03, tokens=5)
    r.itl_s, r.output_events = [0.12, 0.0, 0.0, 0.0], 2
    assert r.met_both  # per token: 0.12 / 4 = 0.03 <= 0.05
    assert not met_per_event(r, SLO)  # per event: 0.12 / 1 > 0.05
    r.output_events = 5
    assert met_per_event(r, SLO)
    assert not met_per_event(rec(ok=False), SLO)
