"""kvdisagg bench's sweep.py: the first crossing of the target, interpolated, and the bisection
(edges included). No sockets."""

from __future__ import annotations

import pytest

from kvdisagg.bench.records import SweepPoint
from kvdisagg.bench.sweep import bisect_max_rate, max_rate_from_points


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
