"""DistServe's placement search (OSDI'24, Algorithms 1 and 2) over the simulator.

High node-affinity (fast links between nodes): each phase is optimised on its own, as DistServe
does. For every ``(tp, pp)`` of the profile, a prefill-only instance's TTFT goodput and a
decode-only instance's TPOT goodput are found by simulation. Every pair that fits, with small
prefill:decode ratios near the balance of their rates, gets the estimate
``min(n_p*r_p, n_d*r_d) / gpus``; the best ``max_verify`` units are verified jointly on the
simulator (the phase-alone estimate ignores their interaction). The unit
with the highest per-GPU goodput is replicated to use the GPUs or to meet ``rate``.

Low node-affinity (slow links between nodes, KV must stay in a node): a unit is a set of node
segments. Each segment holds prefill and decode pipeline stages side by side:
``n_p*tp_p*pp_p + n_d*tp_d*pp_d <= gpus_per_node``. DistServe also chains ``pp_cross`` nodes'
segments into instances of ``pp*pp_cross`` stages; DisaggConnector does not serve an instance
spanning nodes (commands.unserved), so the search keeps ``pp_cross = 1``, and in high affinity
only instances that fit in a node. Candidates are again ranked by the phase-alone estimate and
the best few are verified jointly with the intra-node link.

The best colocated plan (the vLLM baseline: one TP, replicated) is found the same way, for
comparison. Must not import ``vllm``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Literal

import msgspec

from kvdisagg.errors import ConfigError
from kvdisagg.planner.goodput import SimEnv, SloTarget, goodput, phase_goodput
from kvdisagg.planner.placement import Colocated, Disaggregated, Placement
from kvdisagg.planner.trace import TraceSeed


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated unit: its total goodput (req/s) and per GPU."""

    placement: Disaggregated | Colocated
    goodput: float
    per_gpu: float
    attainment: float


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kvdisagg plan`` prints: the deployment, its unit, and the colocated comparison."""

    affinity: Literal["high", "low"]
    unit: Candidate
    """The best unit found; the deployment is ``replicas`` copies of it."""
    replicas: int
    deployment: Disaggregated | Colocated
    predicted_goodput: float
    """replicas x unit goodput, req/s."""
    predicted_per_gpu: float
    gpus_used: int
    meets_rate: bool | None = None
    """With --rate: whether ``predicted_goodput >= rate`` within the GPU budget."""
    colocated: Candidate | None = None
    colocated_replicas: int = 0
    candidates: tuple[Candidate, ...] = ()
    """Every unit verified jointly, best first."""
    simulations: int = 0
    elapsed_s: float = 0.0


def _rank_key(c: Candidate) -> tuple[float, int]:
    # Highest per-GPU goodput first, then fewer GPUs (DistServe's tie-break).
    return (-round(c.per_gpu, 9), c.placement.num_gpus)


class Searcher:
    """Caches phase-alone and joint goodputs for one (trace seed, env, SLO)."""

    def __init__(self, seed: TraceSeed, env: SimEnv, slo: SloTarget, *, rel_tol: float = 0.01,
                 max_verify: int = 12, phase_requests: int = 1000) -> None:
        self.seed, self.env, self.slo = seed, env, slo
        # Phase-alone runs only rank candidates, so they use a prefix of the trace; the joint
        # verification that decides uses all of it.
        k = min(len(seed.gaps), phase_requests)
        self.phase_seed = TraceSeed(seed.gaps[:k], seed.prompt[:k], seed.output[:k])
        self.rel_tol, self.max_verify = rel_tol, max_verify
        self.simulations = 0
        self._phase: dict[tuple[str, int, int], float] = {}
        self._joint: dict[Placement, Candidate] = {}

    def phase_rate(self, phase: Literal["prefill", "decode"], tp: int, pp: int) -> float:
        key = (phase, tp, pp)
        if key not in self._phase:
            r = phase_goodput(
                phase, tp, pp, self.phase_seed, self.env, self.slo, rel_tol=max(self.rel_tol, 0.02)
            )
            self.simulations += r.simulations
            self._phase[key] = r.rate
        return self._phase[key]

    def joint(self, placement: Disaggregated | Colocated, start: float | None = None) -> Candidate:
        if placement not in self._joint:
            r = goodput(placement, self.seed, self.env, self.slo, start=start, rel_tol=self.rel_tol)
            self.simulations += r.simulations
            self._joint[placement] = Candidate(
                placement=placement,
                goodput=r.rate,
                per_gpu=r.rate / placement.num_gpus,
                attainment=r.attainment,
            )
        return self._joint[placement]

    def verify(self, estimates: Iterable[tuple[float, Disaggregated]]) -> list[Candidate]:
        """Joint-simulate the best ``max_verify`` estimated units (estimate = per-GPU req/s)."""
        ranked = sorted(estimates, key=lambda e: (-e[0], e[1].num_gpus))
        out = []
        for est, placement in ranked[: self.max_verify]:
            if est <= 0:
                continue
            out.append(self.joint(placement, start=max(est * placement.num_gpus, 1e-3)))
        return sorted(out, key=_rank_key)


def _configs(env: SimEnv, max_gpus: int) -> list[tuple[int, int]]:
    return [(tp, pp) for tp, pp in env.profile.parallel_configs() if tp * pp <= max_gpus]


def _ratios(
    r_p: float, r_d: float, g_p: int, g_d: int, max_gpus: int, max_n: int = 4
) -> list[tuple[int, int]]:
    """Small (n_p, n_d) near the rate balance ``n_p*r_p ~ n_d*r_d`` that fit in ``max_gpus``."""
    out = []
    for n_p in range(1, max_n + 1):
        for n_d in range(1, max_n + 1):
            if math.gcd(n_p, n_d) != 1 or n_p * g_p + n_d * g_d > max_gpus:
                continue
            out.append((n_p, n_d))
    # Keep the three best by estimated per-GPU goodput.
    out.sort(key=lambda nn: -min(nn[0] * r_p, nn[1] * r_d) / (nn[0] * g_p + nn[1] * g_d))
    return out[:3]


def high_affinity_units(
    s: Searcher, gpus: int, gpus_per_node: int | None = None
) -> list[Candidate]:
    """Algorithm 1: best prefill and decode configs alone, paired with a ratio, verified jointly.
    Instances stay within a node (what DisaggConnector serves)."""
    per_instance = min(gpus, gpus_per_node or gpus)
    cfgs = _configs(s.env, per_instance)
    if not cfgs:
        raise ConfigError(f"no profiled (tp, pp) fits in {per_instance} GPUs")
    estimates = []
    for tp_p, pp_p in cfgs:
        for tp_d, pp_d in cfgs:
            r_p, r_d = s.phase_rate("prefill", tp_p, pp_p), s.phase_rate("decode", tp_d, pp_d)
            for n_p, n_d in _ratios(r_p, r_d, tp_p * pp_p, tp_d * pp_d, gpus):
                pl = Disaggregated(prefill_tp=tp_p, prefill_pp=pp_p, decode_tp=tp_d, decode_pp=pp_d,
                                   num_prefill=n_p, num_decode=n_d)
                estimates.append((min(n_p * r_p, n_d * r_d) / pl.num_gpus, pl))
    return s.verify(estimates)


def low_affinity_units(s: Searcher, gpus: int, gpus_per_node: int) -> list[Candidate]:
    """Algorithm 2: prefill and decode segments share a node; ``pp_cross`` nodes per instance."""
    nodes = gpus // gpus_per_node
    if nodes < 1:
        raise ConfigError(f"low affinity needs whole nodes: {gpus} GPUs < {gpus_per_node} per node")
    have = set(s.env.profile.parallel_configs())
    estimates = []
    for pp_cross in range(1, 2):  # instances across nodes are not served (commands.unserved)
        segs = sorted({(tp, pp // pp_cross) for tp, pp in have
                       if pp % pp_cross == 0 and tp * (pp // pp_cross) <= gpus_per_node})
        rated_p = {c: s.phase_rate("prefill", c[0], c[1] * pp_cross) for c in segs}
        rated_d = {c: s.phase_rate("decode", c[0], c[1] * pp_cross) for c in segs}
        for tp_p, pp_p in segs:
            for tp_d, pp_d in segs:
                g_p, g_d = tp_p * pp_p, tp_d * pp_d
                for n_p, n_d in _ratios(
                    rated_p[(tp_p, pp_p)], rated_d[(tp_d, pp_d)], g_p, g_d, gpus_per_node
                ):
                    pl = Disaggregated(
                        prefill_tp=tp_p,
                        prefill_pp=pp_p,
                        decode_tp=tp_d,
                        decode_pp=pp_d,
                        num_prefill=n_p,
                        num_decode=n_d,
                        pp_cross=pp_cross,
                    )
                    est = (
                        min(n_p * rated_p[(tp_p, pp_p)], n_d * rated_d[(tp_d, pp_d)]) / pl.num_gpus
                    )
                    estimates.append((est, pl))
    return s.verify(estimates)


def colocated_units(s: Searcher, gpus: int) -> list[Candidate]:
    """Every profiled TP (pp=1) as one colocated instance."""
    out = [s.joint(Colocated(tp=tp)) for tp, pp in _configs(s.env, gpus) if pp == 1]
    return sorted(out, key=_rank_key)


def _replicate(unit: Candidate, gpus: int, rate: float | None) -> tuple[int, bool | None]:
    fit = gpus // unit.placement.num_gpus
    if rate is None:
        return max(fit, 1), None
    if unit.goodput <= 0:
        return max(fit, 1), False
    need = math.ceil(rate / unit.goodput - 1e-9)
    return (need, True) if need <= fit else (max(fit, 1), False)


def _scaled(p: Disaggregated | Colocated, k: int) -> Disaggregated | Colocated:
    if isinstance(p, Colocated):
        return msgspec.structs.replace(p, num_instances=p.num_instances * k)
    return msgspec.structs.replace(p, num_prefill=p.num_prefill * k, num_decode=p.num_decode * k)


def search_plan(
    seed: TraceSeed,
    env: SimEnv,
    slo: SloTarget,
    *,
    gpus: int,
    gpus_per_node: int | None = None,
    affinity: Literal["high", "low"] = "high",
    rate: float | None = None,
    colocated_env: SimEnv | None = None,
    rel_tol: float = 0.01,
) -> Plan:
    """Search placements for ``gpus`` GPUs; ``colocated_env`` may use another profile (DistServe
    compares against vLLM's own profile)."""
    if gpus < 2:
        raise ConfigError(
            f"a disaggregated plan needs at least 2 GPUs (one prefill, one decode), got {gpus}; "
            "use `kvdisagg simulate --colocated` for a single instance"
        )
    t0 = time.perf_counter()
    s = Searcher(seed, env, slo, rel_tol=rel_tol)
    if affinity == "high":
        units = high_affinity_units(s, gpus, gpus_per_node)
    else:
        units = low_affinity_units(s, gpus, gpus_per_node or gpus)
    if not units:
        raise ConfigError(
            "no placement meets the SLOs at any rate (try a looser SLO or more GPUs per instance)"
        )
    best = units[0]
    replicas, meets = _replicate(best, gpus, rate)
    sc = Searcher(seed, colocated_env or env, slo, rel_tol=rel_tol)
    col = colocated_units(sc, min(gpus, gpus_per_node or gpus))
    col_best = col[0] if col else None
    col_rep = _replicate(col_best, gpus, rate)[0] if col_best else 0
    deployment = _scaled(best.placement, replicas)
    return Plan(affinity=affinity, unit=best, replicas=replicas, deployment=deployment,
                predicted_goodput=best.goodput * replicas, predicted_per_gpu=best.per_gpu,
                gpus_used=best.placement.num_gpus * replicas, meets_rate=meets,
                colocated=col_best, colocated_replicas=col_rep, candidates=tuple(units),
                simulations=s.simulations + sc.simulations, elapsed_s=time.perf_counter() - t0)
