"""Arguments and loading shared by ``kvdisagg plan`` and ``kvdisagg simulate``.

Must not import ``vllm``; heavy work happens in the command's ``run``.
"""

from __future__ import annotations

import argparse
from importlib import resources

from kvdisagg.errors import ConfigError

SHIPPED = {
    "distserve-a100": "data/distserve/profiler-a100-80g.distserve.json",
    "vllm-a100": "data/distserve/profiler-a100-80g.vllm.json",
}


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="profile file (kvdisagg profile), a DistServe profiler-*.json, or a shipped one: "
        + ", ".join(SHIPPED),
    )
    p.add_argument("--model", help="model inside a DistServe profile file (e.g. facebook/opt-13b)")
    p.add_argument(
        "--workload",
        default="sharegpt",
        help="sharegpt (default), fixed:PROMPT:OUTPUT, or a .csv/.jsonl of prompt_len,output_len",
    )
    p.add_argument(
        "--ttft-slo", type=float, required=True, metavar="S", help="TTFT objective, seconds"
    )
    p.add_argument(
        "--tpot-slo", type=float, required=True, metavar="S", help="TPOT objective, seconds"
    )
    p.add_argument("--attainment", type=float, default=0.9,
                   help="target fraction of requests meeting both objectives (default 0.9)")
    p.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="simulated requests per run (default 2000; DistServe used 300, which is noisy)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--definition",
        choices=["distserve", "client"],
        default="distserve",
        help="latency definitions: DistServe's simulator, or what a client of our proxy sees",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        help="prefill->decode KV bandwidth per decode instance, Gbit/s (default 0: free)",
    )
    p.add_argument("--prefill-budget", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill batch (SloScheduler's max_batched_tokens; "
                        "default: the KV capacity, as DistServe)")
    p.add_argument("--decode-batch-cap", type=int, metavar="N",
                   help="most requests decoding at once per instance (SloScheduler's TPOT cap; "
                        "default: none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def resolve_profile(spec: str, model: str | None):  # -> Profile
    from kvdisagg.planner.profile import load_profile

    if spec in SHIPPED:
        path = resources.files("kvdisagg.planner").joinpath(SHIPPED[spec])
        engine = "distserve" if spec.startswith("distserve") else "vllm"
        return load_profile(str(path), model=model or "facebook/opt-13b", engine=engine)
    return load_profile(spec, model=model)


def load_common(args: argparse.Namespace):  # -> (Profile, TraceSeed, SimEnv, SloTarget)
    from kvdisagg.planner.goodput import SimEnv, SloTarget
    from kvdisagg.planner.trace import draw, load_lengths

    if args.ttft_slo <= 0 or args.tpot_slo <= 0:
        raise ConfigError("--ttft-slo and --tpot-slo must be > 0 seconds")
    if not 0 < args.attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.requests < 10:
        raise ConfigError(f"--requests must be >= 10, got {args.requests}")
    for flag, value in (("--prefill-budget", args.prefill_budget),
                        ("--decode-batch-cap", args.decode_batch_cap)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    profile = resolve_profile(args.profile, args.model)
    seed = draw(load_lengths(args.workload), args.requests, seed=args.seed)
    env = SimEnv(profile=profile, definition=args.definition, link_gbps=args.link_gbps,
                 prefill_budget=args.prefill_budget, decode_batch_cap=args.decode_batch_cap)
    slo = SloTarget(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, attainment=args.attainment)
    return profile, seed, env, slo
