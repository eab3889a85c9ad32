"""planner/trace.py: length pools (ShareGPT, fixed, a bench dataset file) and the traces drawn
from them under a seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvdisagg.errors import ConfigError
from kvdisagg.planner.trace import LengthPool, draw, load_lengths


def test_shipped_and_fixed_pools() -> None:
    sharegpt = load_lengths("sharegpt")
    assert sharegpt.name == "sharegpt" and len(sharegpt.prompt) == len(sharegpt.output) > 1000
    assert load_lengths("fixed:100:11") == LengthPool("fixed:100:11", (100,), (11,))
    for bad in ("fixed:1", "fixed:0:3", "fixed:a:b", "nowhere.csv"):
        with pytest.raises(ConfigError, match="workload"):
            load_lengths(bad)


def test_a_file_is_read_as_bench_reads_a_dataset(tmp_path) -> None:
    c = tmp_path / "d.csv"
    c.write_text("prompt_len,output_len,timestamp\n12,3,0.5\n40,7,1.0\n")
    assert load_lengths(str(c)) == LengthPool("d.csv", (12, 40), (3, 7))
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"prompt": [5, 6, 7], "output_len": 2}) + "\n"
                 + json.dumps({"prompt_tokens": 9, "output_tokens": 4}) + "\n")
    assert load_lengths(str(j)) == LengthPool("d.jsonl", (3, 9), (2, 4))
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len,output_len\n12,x\n")
    with pytest.raises(ConfigError, match=r"workload: bad.csv:2: need integer"):
        load_lengths(str(bad))
    (tmp_path / "d.txt").write_text("12 3\n")
    with pytest.raises(ConfigError, match="use a .csv or .jsonl"):
        load_lengths(str(tmp_path / "d.txt"))


def test_draw_is_seeded_and_scales_with_rate() -> None:
    pool = LengthPool("p", (1, 2, 3), (4, 5, 6))
    a, b = draw(pool, 50, seed=3), draw(pool, 50, seed=3)
    assert np.array_equal(a.gaps, b.gaps) and np.array_equal(a.prompt, b.prompt)
    assert set(a.prompt.tolist()) <= {1, 2, 3} and a.output.tolist() == [p + 3 for p in
                                                                          a.prompt.tolist()]
    slow, fast = a.at_rate(1.0), a.at_rate(4.0)
    assert np.allclose(fast.arrival * 4, slow.arrival)
    even = draw(pool, 4, seed=0, poisson=False).at_rate(2.0)
    assert even.arrival.tolist() == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ConfigError):
        draw(pool, 0)
    with pytest.raises(ConfigError):
        a.at_rate(0.0)
