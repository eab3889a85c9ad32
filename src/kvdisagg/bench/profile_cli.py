"""``kvdisagg profile``: fit the planner's latency model from a live vLLM instance.

Runs the grid of ``bench.profiler`` against ``--url`` (an idle instance: other traffic would be
measured too), fits it with ``kvdisagg.planner.profile.fit_profile`` and writes the profile file
that ``kvdisagg plan --profile`` reads; ``--samples`` keeps the raw measurements to refit later.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of an idle vLLM instance")
    p.add_argument("--model", help="model name to send (default: the instance's first model)")
    p.add_argument("--out", default="profile.json", help="profile file to write")
    p.add_argument("--samples", metavar="FILE", help="also write the raw samples (JSON lines)")
    p.add_argument("--tp", type=int, default=1, help="the instance's tensor parallelism")
    p.add_argument("--pp", type=int, default=1, help="the instance's pipeline parallelism")
    p.add_argument("--hardware", default="unknown", help="label, e.g. A100-80GB or cpu-2core")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--kv-bytes-per-token", type=int,
                   help="KV bytes per token, all layers (default: from --model-dir, else 0)")
    p.add_argument("--model-dir", help="model directory whose config.json gives the KV size")
    p.add_argument("--prefill-batch", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prefill-len", type=int, nargs="+", default=[32, 128, 256, 512])
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--decode-ctx", type=int, nargs="+", default=[64, 512])
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens per decode stream")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="skip prefill points above the engine's per-step token budget")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec
    from rich.console import Console

    from kvdisagg.bench.client import ClientConfig
    from kvdisagg.bench.endpoint import model_card, vocabulary_end
    from kvdisagg.bench.profiler import Grid, MeasureError, Profiler, kv_bytes_per_token
    from kvdisagg.errors import ConfigError, EndpointError
    from kvdisagg.planner.profile import fit_profile, save_profile

    for flag, vals in (("--prefill-batch", args.prefill_batch), ("--prefill-len",
                       args.prefill_len), ("--decode-batch", args.decode_batch),
                       ("--decode-ctx", args.decode_ctx),
                       ("--decode-tokens", [args.decode_tokens]), ("--repeats", [args.repeats]),
                       ("--tp", [args.tp]), ("--pp", [args.pp])):
        if any(v < 1 for v in vals):
            raise SystemExit(f"kvdisagg profile: {flag} values must be >= 1")
    if args.decode_tokens < 3:
        raise SystemExit("kvdisagg profile: --decode-tokens must be >= 3 to see decode steps")
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"kvdisagg profile: --url {url!r} must start with http://")
    console = Console(stderr=True)
    try:
        model = args.model or model_card(url, None, 10.0).id
    except EndpointError as exc:
        raise SystemExit(f"kvdisagg profile: {exc}; pass --model") from None
    grid = Grid(args.prefill_batch, args.prefill_len, args.decode_batch, args.decode_ctx,
                args.decode_tokens, args.repeats, args.max_batch_tokens)
    if len(grid.prefill_points()) < 3 or len(grid.decode_points()) < 3:
        raise SystemExit("kvdisagg profile: the grid needs >= 3 prefill points (within "
                         "--max-batch-tokens) and >= 3 decode points to fit 3 coefficients")
    lo, hi = 10, 500  # prompts of random token ids, as bench's (kept inside the vocabulary)
    if (end := vocabulary_end(url, model, lo, hi, None, 10.0)) is not None:
        if end <= lo:
            raise SystemExit(f"kvdisagg profile: {model} knows no token id from {lo} on (its "
                             f"/detokenize: the vocabulary ends at {end})")
        console.print(f"token ids {lo}:{end}: the vocabulary of {model} ends at {end}")
        hi = end
    prof = Profiler(url, ClientConfig(model=model, total_s=args.timeout, idle_s=args.timeout),
                    tp=args.tp, pp=args.pp, seed=args.seed, token_ids=(lo, hi))
    kv = args.kv_bytes_per_token
    if kv is None:
        kv = kv_bytes_per_token(args.model_dir) if args.model_dir else 0
    try:
        samples = asyncio.run(prof.measure(grid, console.print))
        capacity = asyncio.run(prof.kv_capacity_tokens())
        profile = fit_profile(samples, model=model, hardware=args.hardware, engine=args.engine,
                              kv_bytes_per_token=kv, max_num_tokens=capacity,
                              source=f"kvdisagg profile --url {url}")
    except (MeasureError, ConfigError) as exc:
        raise SystemExit(f"kvdisagg profile: {exc}") from None
    if capacity is None:
        console.print(f"[yellow]warning:[/] {url}/metrics gave no vllm:cache_config_info: the "
                      "profile has no KV capacity (max_num_tokens), so the planner cannot check "
                      "that a placement's KV fits")
    save_profile(profile, args.out)
    if args.samples:
        enc = msgspec.json.Encoder()
        with open(args.samples, "wb") as f:
            for s in samples:
                f.write(enc.encode(s) + b"\n")
    cfg = profile.configs[0]
    console.print(f"prefill ms = {cfg.prefill[0]:.3f} + {cfg.prefill[1]:.3g}*sum(L) + "
                  f"{cfg.prefill[2]:.3g}*sum(L^2)")
    console.print(f"decode  ms = {cfg.decode_small[0]:.3f} + {cfg.decode_small[1]:.3g}*"
                  f"sum(ctx+1) + {cfg.decode_small[2]:.3g}*B")
    console.print(f"KV capacity {capacity} tokens, {kv} bytes/token; wrote {args.out}")
    sys.stdout.flush()
    return 0
