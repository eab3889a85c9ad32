"""The highest arrival rate whose SLO attainment meets a target: DistServe's goodput.

Two ways to get it, both pure so they are unit-tested without a server:

* ``max_rate_from_points``: from runs at given rates, the first crossing of the target line
  (linear interpolation between the last rate meeting it and the first missing it), as
  DistServe's plots read it. Noise can make attainment non-monotone; the *first* crossing is
  the conservative answer.
* ``bisect_max_rate``: runs chosen adaptively: check ``lo`` and ``hi``, then bisect the bracket
  ``steps`` times. Each probe is one real run, so the caller's ``measure`` is expensive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from kvdisagg.bench.records import SweepPoint


class MaxRate(NamedTuple):
    rate: float | None  # None: the lowest rate tried already misses the target
    censored: bool  # True: the highest rate tried still meets it, so ``rate`` is a lower bound


def max_rate_from_points(points: Iterable[SweepPoint], target: float) -> MaxRate:
    pts = sorted(points, key=lambda p: p.rate)
    if not pts:
        raise ValueError("no sweep points")
    if pts[0].attainment < target:
        return MaxRate(None, False)
    for prev, cur in zip(pts, pts[1:]):
        if cur.attainment < target:
            # prev meets, cur misses: the target line is crossed between them.
            frac = (prev.attainment - target) / (prev.attainment - cur.attainment)
            return MaxRate(prev.rate + frac * (cur.rate - prev.rate), False)
    return MaxRate(pts[-1].rate, True)


def bisect_max_rate(measure: Callable[[float], float], lo: float, hi: float, target: float,
                    steps: int) -> tuple[MaxRate, list[SweepPoint]]:
    """Probe ``measure(rate) -> attainment`` at most ``steps + 2`` times.

    Returns the highest probed rate that met the target (``rate`` None if ``lo`` misses;
    ``censored`` if ``hi`` meets) and every probe, in the order made.
    """
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo} hi={hi}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    probes: list[SweepPoint] = []

    def probe(rate: float) -> bool:
        a = measure(rate)
        probes.append(SweepPoint(rate, a))
        return a >= target

    if not probe(lo):
        return MaxRate(None, False), probes
    if probe(hi):
        return MaxRate(hi, True), probes
    good, bad = lo, hi
    for _ in range(steps):
        mid = (good + bad) / 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return MaxRate(good, False), probes
