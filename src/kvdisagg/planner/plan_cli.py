"""``kvdisagg plan``: DistServe's placement search on the simulator, with launch commands (the
transport and the proxy's policy they use printed with the reason for each) and, with
``--kustomize DIR``, the replica counts as a kustomize overlay."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvdisagg.planner.cli_common import add_common

    add_common(p)
    p.add_argument("--gpus", type=int, required=True, help="GPUs available in all")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: all in one node)")
    p.add_argument("--affinity", choices=["high", "low"], default="high",
                   help="high: fast links between nodes (phases placed independently); "
                        "low: KV must stay in a node (prefill and decode segments share nodes)")
    p.add_argument(
        "--rate", type=float, help="required rate, req/s: replicate the best unit to meet it"
    )
    p.add_argument("--colocated-profile", metavar="FILE",
                   help="profile for the colocated baseline (default: --profile)")
    p.add_argument(
        "--base-port", type=int, default=8100, help="first instance port in the commands"
    )
    p.add_argument("--proxy-port", type=int, default=8000, help="the proxy's port in the commands")
    p.add_argument(
        "--device",
        choices=["gpu", "cpu"],
        default="gpu",
        help="what a 'GPU' of the plan is in the launch lines: a GPU "
        "(CUDA_VISIBLE_DEVICES, vllm serve) or a CPU core (VLLM_CPU_OMP_THREADS_BIND, "
        "one core per rank)",
    )
    p.add_argument("--hosts", metavar="ADDR[,ADDR...]",
                   help="each node's address, in order (default: 127.0.0.1 for a one-node plan, "
                        "<nodeK> placeholders otherwise)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more vLLM arguments for every instance line, e.g. '--dtype float32'")
    from kvdisagg.planner.commands import POLICIES, SIMULATED_POLICY, TRANSPORTS

    p.add_argument("--transport", choices=["auto", *TRANSPORTS], default="auto",
                   help="the KV transport in the launch lines (default auto: nccl on GPUs, tcp "
                        "with --device cpu)")
    p.add_argument("--lmcache-url", metavar="lm://HOST:PORT",
                   help="the LMCache server, for --transport lmcache")
    p.add_argument("--policy", choices=POLICIES, default=SIMULATED_POLICY,
                   help=f"the proxy's policy in the launch lines (default {SIMULATED_POLICY}: "
                        "what the simulator dispatches by, so what the goodput predicted is for)")
    p.add_argument("--kustomize", metavar="DIR",
                   help="also write DIR/kustomization.yaml: the plan's prefill and decode "
                        "replica counts as an overlay of --kustomize-base")
    p.add_argument("--kustomize-base", metavar="DIR", default="examples/kubernetes",
                   help="the kustomize base the overlay scales (default examples/kubernetes, "
                        "whose Deployments are named prefill and decode)")


def run(args: argparse.Namespace) -> int:
    import os
    import shlex

    import msgspec

    from kvdisagg.errors import ConfigError
    from kvdisagg.planner.cli_common import load_common, resolve_profile
    from kvdisagg.planner.commands import (
        SIMULATED_POLICY,
        Launch,
        choose_transport,
        kustomization,
        launch_commands,
        printed,
    )
    from kvdisagg.planner.placement import Disaggregated
    from kvdisagg.planner.search import search_plan

    try:
        profile, seed, env, slo = load_common(args)
        if args.gpus < 1 or (args.gpus_per_node is not None and args.gpus_per_node < 1):
            raise ConfigError("--gpus and --gpus-per-node must be >= 1")
        if args.rate is not None and args.rate <= 0:
            raise ConfigError(f"--rate must be > 0, got {args.rate}")
        col_env = None
        if args.colocated_profile:
            col_env = msgspec.structs.replace(
                env, profile=resolve_profile(args.colocated_profile, args.model)
            )
        result = search_plan(seed, env, slo, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                      affinity=args.affinity, rate=args.rate, colocated_env=col_env)
    except ConfigError as exc:
        print(f"kvdisagg plan: {exc}", file=sys.stderr)
        return 2
    gpn = args.gpus_per_node or args.gpus
    try:
        transport = choose_transport(args.transport, args.device)
        cmds = launch_commands(result.deployment, profile.model, gpus_per_node=gpn,
                               base_port=args.base_port, proxy_port=args.proxy_port,
                               ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                               device=args.device,
                               hosts=[h for h in (args.hosts or "").split(",") if h],
                               serve_args=shlex.split(args.serve_args),
                               transport=transport.name, policy=args.policy,
                               lmcache_url=args.lmcache_url)
        overlay = kustomization(result.deployment, args.kustomize_base, args.kustomize,
                                describe=result.deployment.describe()) if args.kustomize else None
    except ConfigError as exc:
        print(f"kvdisagg plan: {exc}", file=sys.stderr)
        return 2
    if overlay is not None:
        os.makedirs(args.kustomize, exist_ok=True)
        with open(os.path.join(args.kustomize, "kustomization.yaml"), "w") as f:
            f.write(overlay)
    policy_why = ("--policy" if args.policy != SIMULATED_POLICY else
                  "what the simulator dispatches by: the goodput predicted is for it")
    lines = [c.command if isinstance(c, Launch) else c for c in cmds]
    if args.json:
        out = msgspec.to_builtins(result)
        out["unit"]["placement"]["describe"] = result.unit.placement.describe()
        out["commands"] = lines
        out["model"] = profile.model
        out["slo"] = msgspec.to_builtins(slo)
        out["transport"] = {"name": transport.name, "why": transport.why}
        out["policy"] = {"name": args.policy, "why": policy_why}
        if args.kustomize:
            out["kustomization"] = os.path.join(args.kustomize, "kustomization.yaml")
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(
        f"model {profile.model} ({profile.engine}, {profile.hardware}); "
        f"{args.requests} requests of {args.workload}; "
        f"TTFT<={args.ttft_slo:g}s TPOT<={args.tpot_slo:g}s at {slo.attainment:.0%}; "
        f"{args.gpus} GPUs, {args.affinity} affinity"
    )
    print(
        f"best unit : {result.unit.placement.describe()}  goodput {result.unit.goodput:.3f} req/s "
        f"= {result.unit.per_gpu:.3f} req/s/GPU"
    )
    print(f"deployment: {result.replicas} x unit = {result.deployment.describe()}  "
          f"predicted {result.predicted_goodput:.3f} req/s")
    if result.meets_rate is not None:
        print(
            f"rate {args.rate:g} req/s: "
            f"{'met' if result.meets_rate else 'NOT met within the GPU budget'}"
        )
    if result.colocated is not None:
        c = result.colocated
        ratio = result.unit.per_gpu / c.per_gpu if c.per_gpu > 0 else float("inf")
        print(f"colocated : {c.placement.describe()}  {c.per_gpu:.3f} req/s/GPU  "
              f"(disaggregated is {ratio:.2f}x per GPU)")
    print(f"searched {len(result.candidates)} units jointly, {result.simulations} simulations, "
          f"{result.elapsed_s:.1f}s")
    print("\ncandidates (per GPU):")
    for cand in result.candidates[:8]:
        print(f"  {cand.per_gpu:8.3f}  {cand.placement.describe()}")
    print(f"\ntransport : {transport.name} ({transport.why})")
    print(f"policy    : {args.policy} ({policy_why})")
    print("\nlaunch (paste on each node; instances start in the background, the proxy last):")
    for line in printed(cmds):
        print("  " + line)
    if overlay is not None and isinstance(dep := result.deployment, Disaggregated):
        print(f"\nkustomize overlay: {os.path.join(args.kustomize, 'kustomization.yaml')} "
              f"(prefill {dep.num_prefill}, decode {dep.num_decode} replicas; "
              f"kubectl apply -k {args.kustomize})")
        for note in (line for line in (overlay or "").splitlines() if line.startswith("# NOTE")):
            print("  " + note.removeprefix("# "))
    return 0
