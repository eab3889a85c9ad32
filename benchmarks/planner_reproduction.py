"""Reproduce DistServe's published per-GPU goodput (OSDI'24 Fig. 8, ShareGPT chatbot, A100-80GB)
on kvdisagg's simulator with DistServe's shipped profiles, and time the simulator.

    .venv/bin/python benchmarks/planner_reproduction.py [--seeds 10] [--long 4000] [--plan]

Rows: DistServe's chosen placement (distserve profile) and the vLLM baseline (vllm profile), each
simulated (a) with the paper's run length (per-GPU prompts x GPUs: 13B 300/100, 66B 200/100
requests), mean and spread over seeds, and (b) with long runs (stable answer). ``--plan`` also
runs ``kvdisagg plan``'s search on the same GPU count. Published numbers are from
../shared/distserve/published_targets.json (plot.ipynb @cc3096f), copied below.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources
from pathlib import Path

from kvdisagg.planner.goodput import SimEnv, SloTarget, goodput, simulate
from kvdisagg.planner.placement import Colocated, Disaggregated
from kvdisagg.planner.profile import load_profile
from kvdisagg.planner.search import search_plan
from kvdisagg.planner.trace import draw, load_lengths

ROWS = [
    # model, SLO, DistServe placement, its N, vLLM placement, its N, published DistServe, vLLM
    ("facebook/opt-13b", SloTarget(ttft_s=0.25, tpot_s=0.1), Disaggregated(prefill_tp=2, decode_tp=1), 300,
     Colocated(tp=1), 100, 2.3, 0.5),
    ("facebook/opt-66b", SloTarget(ttft_s=2.5, tpot_s=0.15), Disaggregated(prefill_tp=4, decode_tp=2, decode_pp=2), 200,
     Colocated(tp=4), 100, 0.9553, 0.3473),
]
HISTORY = Path(__file__).resolve().parents[2] / "shared/distserve/profile_data_history/5331c99/profiler-a100-80g.vllm.json"


def per_gpu(placement, n, seeds, env, slo):
    lengths = load_lengths("sharegpt")
    vals = [goodput(placement, draw(lengths, n, seed=s), env, slo).rate / placement.num_gpus for s in seeds]
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--plan", action="store_true")
    args = ap.parse_args()
    data = resources.files("kvdisagg.planner").joinpath("data/distserve")
    seeds = range(args.seeds)
    print("| model | system (placement) | paper req/s/GPU | ours, paper-length runs (mean ± sd over "
          f"{args.seeds} seeds) | within ±20% | ours, {args.long}-request run |")
    print("|---|---|---|---|---|---|")
    for model, slo, ds, n_ds, vl, n_vl, pub_ds, pub_vl in ROWS:
        env_ds = SimEnv(profile=load_profile(str(data / "profiler-a100-80g.distserve.json"), model=model))
        env_vl = SimEnv(profile=load_profile(str(data / "profiler-a100-80g.vllm.json"), model=model))
        variants = [("DistServe", ds, n_ds, env_ds, pub_ds), ("vLLM", vl, n_vl, env_vl, pub_vl)]
        if HISTORY.exists():
            env_raw = SimEnv(profile=load_profile(str(HISTORY), model=model))
            variants.append(("vLLM, pre-realignment profile", vl, n_vl, env_raw, pub_vl))
        for name, pl, n, env, pub in variants:
            m, sd = per_gpu(pl, n, seeds, env, slo)
            long_v = goodput(pl, draw(load_lengths("sharegpt"), args.long, seed=0), env, slo).rate / pl.num_gpus
            ok = "yes" if abs(m - pub) <= 0.2 * pub else "no"
            print(f"| {model.split('/')[1].upper()} | {name} ({pl.describe()}) | {pub:.3f} | {m:.3f} ± {sd:.3f} "
                  f"({(m / pub - 1) * 100:+.0f}%) | {ok} | {long_v:.3f} |", flush=True)
        if args.plan:
            gpus = ds.num_gpus
            for n in (n_ds, args.long):
                seed = draw(load_lengths("sharegpt"), n, seed=0)
                t0 = time.perf_counter()
                p = search_plan(seed, env_ds, slo, gpus=gpus, colocated_env=env_vl)
                pub_sim = goodput(ds, seed, env_ds, slo).rate / ds.num_gpus
                print(f"plan {model} on {gpus} GPUs, {n} requests: {p.unit.placement.describe()} "
                      f"{p.unit.per_gpu:.3f} req/s/GPU vs published placement {pub_sim:.3f} on the same trace; "
                      f"best colocated {p.colocated.placement.describe() if p.colocated else '-'} "
                      f"{p.colocated.per_gpu if p.colocated else 0:.3f}; {p.simulations} sims, "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
    # Simulator speed: one run of N requests at the DistServe 13B placement's goodput rate.
    env = SimEnv(profile=load_profile(str(data / "profiler-a100-80g.distserve.json"), model="facebook/opt-13b"))
    for n in (1000, 4000):
        seed = draw(load_lengths("sharegpt"), n, seed=0)
        for pl, rate in ((Disaggregated(prefill_tp=2, decode_tp=1), 4.5), (Colocated(tp=1), 1.0)):
            req = seed.at_rate(rate)
            t0 = time.perf_counter()
            reps = 5
            for _ in range(reps):
                simulate(pl, req, env)
            dt = (time.perf_counter() - t0) / reps
            print(f"speed: {pl.describe()}, {n} requests at {rate} req/s: {dt * 1e3:.0f} ms per simulation "
                  f"({n / dt:,.0f} requests/s)")


if __name__ == "__main__":
    main()
