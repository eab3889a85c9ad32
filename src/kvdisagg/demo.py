"""``kvdisagg demo``: P/D serving end to end on this machine, with a printed report.

Generates the tiny model, starts a prefill, a decode and a plain reference vLLM instance plus the
proxy (deciding per request, as users run it), streams a short load of prompts from a few
tokens to about a thousand through the proxy and compares every answer with the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model


def _stream(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    # Token ids, not text: the tiny model's greedy answers are often tokens with no text, and
    # two empty texts would "match" whatever the tokens were.
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        route = r.headers.get("X-Kvdisagg-Handoff", "?")
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                event = json.loads(line[6:])
                ids = [i for c in event.get("choices") or () for i in c.get("token_ids") or ()]
                if ids:
                    stamps.append(time.perf_counter() - start)
                    tokens += ids
    ttft = stamps[0] if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"tokens": tokens, "ttft": ttft, "tpot": tpot, "route": route}


def _reference(url: str, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
    return list(answer["choices"][0]["token_ids"])


def _tokens(url: str, prompt: str) -> int:
    req = urllib.request.Request(url + "/tokenize", json.dumps(
        {"model": "tiny", "prompt": prompt}).encode(), {"Content-Type": "application/json"})
    return int(json.loads(urllib.request.urlopen(req, timeout=60).read())["count"])


PULL = {"pulls": "vllm:kvdisagg_pulls_total", "bytes": "vllm:kvdisagg_pulled_bytes_total"}
PHASES = ("connect", "read", "transfer", "done")


def _pull_state(decode: str) -> dict[str, float]:
    """Decode's pull counters and the time in each pull phase (its phase histograms)."""
    out = {k: metric_value(decode, name) for k, name in PULL.items()}
    for phase in PHASES:
        out[phase] = metric_value(decode, "vllm:kvdisagg_phase_seconds_sum", phase=phase)
    return out


def run_demo(num_requests: int = 8, log_dir: str = "out/demo") -> int:
    print("kvdisagg demo: generating the tiny model ...", flush=True)
    model = ensure_tiny_model()
    print("starting prefill, decode and reference vLLM instances and the proxy "
          "(a few minutes on 2 cores) ...", flush=True)
    words = "the quick brown fox jumps over the lazy dog while the sea keeps singing".split()
    # From a few words to about a thousand: the short ones are decode's alone, the long ones
    # handed off (decision.local_prefill_tokens, 512 by default).
    sizes = [8 + 1000 * i // max(1, num_requests - 1) for i in range(num_requests)]
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(n))
               for i, n in enumerate(sizes)]
    max_tokens = 16
    # The proxy as users run it: it decides per request whether splitting pays.
    with Fleet(model, Path(log_dir), reference=True, always_disaggregate=False) as fleet:
        assert fleet.reference is not None
        print(f"ready: proxy {fleet.proxy_url}, prefill {fleet.prefill.base_url}, "
              f"decode {fleet.decode.base_url}", flush=True)
        d = fleet.decode.base_url
        before = _pull_state(d)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: _stream(fleet.proxy_url, p, max_tokens), prompts))
        refs = [_reference(fleet.reference.base_url, p, max_tokens) for p in prompts]
        lengths = [_tokens(fleet.reference.base_url, p) for p in prompts]
        time.sleep(1.5)  # engine stats are published on an interval
        after = _pull_state(d)
        usage = metric_value(fleet.prefill.base_url, "vllm:kv_cache_usage_perc")

    print(f"\n{'req':>3} {'prompt tokens':>13} {'served':>26} {'TTFT ms':>9} {'TPOT ms':>9}"
          "  match")
    for i, (n, r, ref) in enumerate(zip(lengths, results, refs)):
        print(f"{i:>3} {n:>13} {r['route']:>26} {r['ttft'] * 1e3:>9.1f} "
              f"{r['tpot'] * 1e3:>9.1f}  {'yes' if r['tokens'] == ref else 'NO'}")
    matched = sum(r["tokens"] == ref for r, ref in zip(results, refs))
    moved = {k: after[k] - before[k] for k in after}
    pd = sum(r["route"] == "pd" for r in results)
    print(f"\n{pd} of {len(results)} requests disaggregated (pd); the others were served by "
          f"decode alone: their prompt was short enough that computing it on decode costs "
          f"less than a handoff (decision.local_prefill_tokens)")
    if moved["pulls"]:
        rate = moved["bytes"] / moved["transfer"] / 2**30 if moved["transfer"] else 0.0
        print(f"KV moved prefill -> decode: {moved['bytes'] / 2**20:.2f} MiB in "
              f"{moved['pulls']:.0f} pulls; the bytes themselves took {moved['transfer'] * 1e3:.1f}"
              f" ms ({rate:.2f} GiB/s while moving); asking prefill for them (read) "
              f"{moved['read'] * 1e3:.1f} ms, releasing them (done) {moved['done'] * 1e3:.1f} ms")
        print(f"opening side-channel connections: {moved['connect'] * 1e3:.1f} ms in all, paid "
              "by the first pulls only (connections are pooled): why early requests are slower")
    print(f"outputs identical to the single-instance reference (token ids): "
          f"{matched}/{len(prompts)}")
    print(f"prefill KV usage after the load: {usage:.3f}")
    print(f"logs: {log_dir}/")
    return 0 if matched == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(run_demo())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--log-dir", default="out/demo")


def run(args: argparse.Namespace) -> int:
    return run_demo(args.requests, args.log_dir)
