"""SLO attainment of a simulated placement, its goodput (highest rate meeting a target), and the
tightest SLO scale met at a given rate.

Two latency definitions:

- ``distserve`` (its simulator and the paper's reproduction): TTFT = arrival to end of prefill;
  a request then runs ``output_len`` decode steps and TPOT = (finish - prefill end) / output_len.
- ``client`` (what ``kvdisagg bench`` measures through our proxy): disaggregated TTFT = arrival to
  the end of the first decode step on the decode instance (the prefill's token is discarded by
  the handoff); colocated TTFT = end of prefill and ``output_len - 1`` decode steps follow;
  TPOT = (last - first token) / (output_len - 1).

Attainment counts requests meeting both SLOs. Must not import ``vllm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import msgspec
import numpy as np

from kvdisagg.errors import ConfigError
from kvdisagg.planner.latency import LatencyModel
from kvdisagg.planner.placement import Colocated, Placement
from kvdisagg.planner.profile import Profile
from kvdisagg.planner.simulator import (
    SimInstance,
    Timeline,
    simulate_colocated,
    simulate_disaggregated,
)
from kvdisagg.planner.trace import Requests, TraceSeed

Definition = Literal["distserve", "client"]


class SloTarget(msgspec.Struct, frozen=True, kw_only=True):
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    """Target fraction of requests meeting both SLOs."""


class SimEnv(msgspec.Struct, frozen=True, kw_only=True):
    """What a simulation needs beyond the placement and the trace."""

    profile: Profile
    definition: Definition = "distserve"
    link_gbps: float = 0.0
    """Prefill -> decode KV bandwidth in Gbit/s per decode instance; 0: free transfers
    (DistServe)."""
    prefill_budget: int | None = None
    """Prompt tokens per prefill batch; None: the instance's KV capacity (DistServe). The
    SloScheduler's ``max_batched_tokens``."""
    decode_batch_cap: int | None = None
    """Most requests decoding at once per instance; None: KV capacity only. The SloScheduler's
    TPOT cap (``SchedulerSettings.decode_batch_cap()``)."""

    def spec(self, tp: int, pp: int) -> SimInstance:
        cfg = self.profile.get(tp, pp)
        return SimInstance(LatencyModel(cfg), cfg.max_num_tokens, self.prefill_budget,
                            self.decode_batch_cap)


def simulate(placement: Placement, req: Requests, env: SimEnv) -> Timeline:
    """Run one trace through ``placement``."""
    if isinstance(placement, Colocated):
        if placement.pp != 1:
            raise ConfigError(
                "colocated instances are simulated with pp=1 only (use TP, or a disaggregated plan)"
            )
        steps = req.output - 1 if env.definition == "client" else req.output
        return simulate_colocated(
            req, [env.spec(placement.tp, 1)] * placement.num_instances, steps=steps
        )
    pre = env.spec(placement.prefill_tp, placement.prefill_pp * placement.pp_cross)
    dec = env.spec(placement.decode_tp, placement.decode_pp * placement.pp_cross)
    bw = env.link_gbps * 1e9 / 8 if env.link_gbps > 0 else math.inf
    return simulate_disaggregated(
        req,
        [pre] * placement.num_prefill,
        [dec] * placement.num_decode,
        kv_bytes_per_token=env.profile.kv_bytes_per_token,
        link_bytes_per_s=bw,
    )


def latencies(
    tl: Timeline, definition: Definition, colocated: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per-request (TTFT, TPOT) in seconds under ``definition``."""
    if definition == "distserve" or colocated:
        first = tl.prefill_end
        denom = tl.steps
    else:
        first = np.where(np.isnan(tl.first), tl.finish, tl.first)
        denom = tl.steps - 1
    ttft = first - tl.arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(denom > 0, (tl.finish - first) / np.maximum(denom, 1), 0.0)
    return ttft, tpot


def attainment(
    tl: Timeline,
    slo: SloTarget,
    definition: Definition = "distserve",
    *,
    colocated: bool = False,
    phase: Literal["both", "ttft", "tpot"] = "both",
) -> float:
    """Fraction of requests meeting the SLOs (both, or one phase for single-phase runs)."""
    ttft, tpot = latencies(tl, definition, colocated)
    ok_t = ttft <= slo.ttft_s
    ok_p = tpot <= slo.tpot_s
    ok = ok_t if phase == "ttft" else ok_p if phase == "tpot" else ok_t & ok_p
    return float(np.mean(ok))


class RateResult(NamedTuple):
    rate: float
    """Highest total rate (req/s) found meeting the target; 0 if even a trickle fails."""
    attainment: float
    """Attainment measured at ``rate``."""
    simulations: int


def max_rate(attain_at: Callable[[float], float], target: float, *, start: float = 1.0,
             rel_tol: float = 0.01, max_sims: int = 40) -> RateResult:
    """Highest rate with ``attain_at(rate) >= target``: grow by doubling, then bisect.

    Assumes attainment falls with rate (common random numbers make it nearly monotone).
    """
    sims = 0
    lo, lo_att, hi = 0.0, 1.0, start
    while sims < max_sims:
        a = attain_at(hi)
        sims += 1
        if a < target:
            break
        lo, lo_att, hi = hi, a, hi * 2
    else:
        return RateResult(lo, lo_att, sims)
    floor = start * 1e-4
    while sims < max_sims and hi - lo > rel_tol * max(lo, floor):
        mid = (lo + hi) / 2
        a = attain_at(mid)
        sims += 1
        if a >= target:
            lo, lo_att = mid, a
        else:
            hi = mid
        if lo == 0.0 and hi < floor:
            break
    return RateResult(lo, lo_att, sims)


def goodput(placement: Placement, seed: TraceSeed, env: SimEnv, slo: SloTarget, *,
            start: float | None = None, rel_tol: float = 0.01) -> RateResult:
    """Highest total rate of ``placement`` meeting ``slo`` (divide by ``num_gpus`` for per GPU)."""
    colocated = isinstance(placement, Colocated)

    def attain_at(rate: float) -> float:
        return attainment(
            simulate(placement, seed.at_rate(rate), env), slo, env.definition, colocated=colocated
        )

    return max_rate(
        attain_at, slo.attainment, start=start or 0.5 * placement.num_gpus, rel_tol=rel_tol
    )


def phase_goodput(
    phase: Literal["prefill", "decode"],
    tp: int,
    pp: int,
    seed: TraceSeed,
    env: SimEnv,
    slo: SloTarget,
    *,
    start: float = 1.0,
    rel_tol: float = 0.01,
) -> RateResult:
    """Highest rate one prefill-only (TTFT) or decode-only (TPOT) instance sustains at the target.

    DistServe's high-affinity search optimises each phase on its own like this.
    """
    spec = env.spec(tp, pp)

    def attain_at(rate: float) -> float:
        req = seed.at_rate(rate)
        if phase == "prefill":
            tl = simulate_disaggregated(req, [spec], [])
            return attainment(tl, slo, "distserve", phase="ttft")
        tl = simulate_disaggregated(req, [], [spec])
        return attainment(tl, slo, "distserve", phase="tpot")

    return max_rate(attain_at, slo.attainment, start=start, rel_tol=rel_tol)


def tightest_slo_scale(placement: Placement, req: Requests, env: SimEnv, slo: SloTarget, *,
                       rel_tol: float = 0.005) -> float:
    """Smallest k such that ``slo`` scaled by k is met at the trace's rate (DistServe Fig. 8
    bottom)."""
    tl = simulate(placement, req, env)
    ttft, tpot = latencies(tl, env.definition, isinstance(placement, Colocated))
    # Attainment at scale k is monotone in k: bisect on k over the one simulation.
    lo, hi = 0.0, 1.0
    while np.mean((ttft <= slo.ttft_s * hi) & (tpot <= slo.tpot_s * hi)) < slo.attainment:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return math.inf
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if np.mean((ttft <= slo.ttft_s * mid) & (tpot <= slo.tpot_s * mid)) >= slo.attainment:
            hi = mid
        else:
            lo = mid
    return hi
