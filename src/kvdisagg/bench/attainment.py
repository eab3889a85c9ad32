"""Percentiles, SLO judgement, attainment and goodput: pure functions over ``RequestRecord``s.

The judgement is the proxy's (docs/proxy.md): TTFT against ``ttft_s``; TPOT, the mean gap after
the first token, against ``tpot_s`` (a request with fewer than two tokens meets TPOT); a failed
request meets nothing. Attainment divides by every request *sent*, so errors and timeouts lower
it instead of disappearing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvdisagg.bench.records import Percentiles, RequestRecord, RunSummary, Slo


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Iterable[float]) -> Percentiles:
    xs = sorted(values)
    if not xs:
        return Percentiles()
    return Percentiles(mean=sum(xs) / len(xs), p50=percentile(xs, 50), p90=percentile(xs, 90),
                       p99=percentile(xs, 99), max=xs[-1])


def judge(rec: RequestRecord, slo: Slo) -> RequestRecord:
    """Set ``met_*`` on ``rec`` (in place, and returned) from its latencies."""
    ok_ttft = rec.ok and rec.ttft_s is not None and rec.ttft_s <= slo.ttft_s
    ok_tpot = rec.ok and (rec.tpot_s is None or rec.tpot_s <= slo.tpot_s)
    rec.met_ttft, rec.met_tpot, rec.met_both = ok_ttft, ok_tpot, ok_ttft and ok_tpot
    return rec


def met_per_event(rec: RequestRecord, slo: Slo) -> bool:
    """Both SLOs met with TPOT taken per stream event, the way ``kvdisagg proxy`` times it."""
    if not rec.ok or rec.ttft_s is None or rec.ttft_s > slo.ttft_s:
        return False
    if rec.output_events < 2:
        return True
    return sum(rec.itl_s) / (rec.output_events - 1) <= slo.tpot_s


def duration(records: Sequence[RequestRecord]) -> float:
    """First arrival (0) to the last completion, or to the last send when nothing completed."""
    ends = [r.done_at_s for r in records if r.done_at_s is not None]
    ends += [r.sent_at_s for r in records]
    return max(ends, default=0.0)


def window_goodput(records: Sequence[RequestRecord], end_s: float, window_s: float,
                   good: Callable[[RequestRecord], bool] | None = None) -> float:
    """Good requests completed in ``(end_s - window_s, end_s]`` per second of window: what a
    sliding-window gauge such as ``kvdisagg_proxy_goodput_rps`` shows at ``end_s``. ``good``
    defaults to ``met_both``."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    n = sum(1 for r in records if (good(r) if good else r.met_both)
            and r.done_at_s is not None and end_s - window_s < r.done_at_s <= end_s)
    return n / window_s


def summarize(records: Sequence[RequestRecord], *, endpoint: str, url: str, run: str, gpus: int,
              rate: float | None) -> RunSummary:
    """One run's numbers; ``records`` must already be judged (``judge``)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    n = len(records)
    ok = [r for r in records if r.ok]
    dur = duration(records)
    good = sum(r.met_both for r in records)
    goodput = good / dur if dur > 0 else 0.0
    return RunSummary(
        endpoint=endpoint, url=url, run=run, gpus=gpus, rate=rate, requests=n, ok=len(ok),
        duration_s=dur,
        ttft_s=percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot_s=percentiles(r.tpot_s for r in ok if r.tpot_s is not None),
        itl_s=percentiles(g for r in ok for g in r.itl_s),
        e2e_s=percentiles(r.e2e_s for r in ok if r.e2e_s is not None),
        attainment_ttft=sum(r.met_ttft for r in records) / n if n else 0.0,
        attainment_tpot=sum(r.met_tpot for r in records) / n if n else 0.0,
        attainment=good / n if n else 0.0,
        goodput_rps=goodput, goodput_rps_per_gpu=goodput / gpus,
        throughput_rps=len(ok) / dur if dur > 0 else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / dur if dur > 0 else 0.0)
