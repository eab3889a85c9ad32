"""``kvdisagg simulate``: one placement on the simulator: goodput per GPU, or at a rate the
attainment and the tightest SLO scale it meets."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvdisagg.planner.cli_common import add_common

    add_common(p)
    p.add_argument("--colocated", action="store_true", help="simulate colocated instances (--tp, --instances)")
    p.add_argument("--tp", type=int, default=1, help="colocated: tensor parallel size")
    p.add_argument("--instances", type=int, default=1, help="colocated: number of instances")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--prefill-pp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--decode-pp", type=int, default=1)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--rate", type=float, help="total req/s: report attainment and the tightest SLO scale")


def run(args: argparse.Namespace) -> int:
    import msgspec
    import numpy as np

    from kvdisagg.errors import ConfigError
    from kvdisagg.planner.cli_common import load_common
    from kvdisagg.planner.goodput import (
        attainment,
        goodput,
        latencies,
        simulate,
        tightest_slo_scale,
    )
    from kvdisagg.planner.placement import Colocated, Disaggregated

    try:
        profile, seed, env, slo = load_common(args)
        try:
            placement: Colocated | Disaggregated = (
                msgspec.convert({"tp": args.tp, "num_instances": args.instances}, Colocated) if args.colocated
                else msgspec.convert({"prefill_tp": args.prefill_tp, "prefill_pp": args.prefill_pp,
                                      "decode_tp": args.decode_tp, "decode_pp": args.decode_pp,
                                      "num_prefill": args.num_prefill, "num_decode": args.num_decode},
                                     Disaggregated))
        except msgspec.ValidationError as exc:
            raise ConfigError(f"placement: {exc}") from exc
        out: dict[str, object] = {"placement": msgspec.to_builtins(placement),
                                  "describe": placement.describe(), "model": profile.model,
                                  "slo": msgspec.to_builtins(slo), "requests": args.requests}
        if args.rate is None:
            r = goodput(placement, seed, env, slo)
            out.update(goodput=r.rate, per_gpu=r.rate / placement.num_gpus, attainment=r.attainment,
                       simulations=r.simulations)
        else:
            if args.rate <= 0:
                raise ConfigError(f"--rate must be > 0, got {args.rate}")
            req = seed.at_rate(args.rate)
            tl = simulate(placement, req, env)
            colo = isinstance(placement, Colocated)
            ttft, tpot = latencies(tl, env.definition, colo)
            out.update(rate=args.rate, per_gpu_rate=args.rate / placement.num_gpus,
                       attainment=attainment(tl, slo, env.definition, colocated=colo),
                       ttft_p50=float(np.median(ttft)), ttft_p90=float(np.quantile(ttft, 0.9)),
                       tpot_p50=float(np.median(tpot)), tpot_p90=float(np.quantile(tpot, 0.9)),
                       slo_scale=tightest_slo_scale(placement, req, env, slo))
    except ConfigError as exc:
        print(f"kvdisagg simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{out['describe']}  model {profile.model}  {args.requests} requests of {args.workload}")
    if args.rate is None:
        print(f"goodput {out['goodput']:.3f} req/s = {out['per_gpu']:.3f} req/s/GPU at "
              f"{slo.attainment:.0%} attainment (TTFT<={slo.ttft_s:g}s, TPOT<={slo.tpot_s:g}s)")
    else:
        print(f"rate {args.rate:g} req/s: attainment {out['attainment']:.1%}; TTFT p50/p90 "
              f"{out['ttft_p50']:.3f}/{out['ttft_p90']:.3f}s, TPOT p50/p90 {out['tpot_p50']:.4f}/"
              f"{out['tpot_p90']:.4f}s; tightest SLO scale meeting {slo.attainment:.0%}: {out['slo_scale']:.3f}")
    return 0
