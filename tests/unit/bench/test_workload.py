"""kvdisagg bench's workload.py: length specs, Poisson arrivals (rate, CV 1, common random
numbers), traces, the dataset format, the requests of a run. No sockets."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvdisagg.bench import workload


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
    j.write_text(json.dumps({"output_len": 2}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: need output_len and prompt_len or prompt"):
        workload.load_dataset(j)
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


def test_one_dataset_format_for_bench_and_planner(tmp_path) -> None:
    """``prompt_tokens``/``output_tokens`` name the lengths too, and a records file of an earlier
    run reads as a dataset (its other keys ignored); the planner reads through the same parser
    (tests/unit/planner/test_trace.py)."""
    rows = workload.parse_dataset("prompt_tokens,output_tokens,timestamp\n7,2,\n9,3,4.5\n",
                                  ".csv", "t.csv")
    assert rows == [workload.RequestLengths(7, 2), workload.RequestLengths(9, 3, None, 4.5)]
    j = tmp_path / "records.jsonl"
    j.write_text(json.dumps({"endpoint": "e", "index": 0, "prompt_len": 12, "output_len": 4,
                             "ok": True, "itl_s": [0.1]}) + "\n"
                 + json.dumps({"prompt_tokens": 5, "output_tokens": 1}) + "\n")
    assert [r[:2] for r in workload.load_dataset(j)] == [(12, 4), (5, 1)]
    with pytest.raises(ValueError, match="t.csv: lengths must be >= 1"):
        workload.parse_dataset("prompt_len,output_len\n0,2\n", ".csv", "t.csv")
    with pytest.raises(ValueError, match="t.jsonl:1"):
        workload.parse_dataset("[1, 2]\n", ".jsonl", "t.jsonl")
