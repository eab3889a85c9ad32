"""``kvdisagg demo``: P/D serving end to end on this machine, with a printed report.

Generates the tiny model, starts a prefill, a decode and a plain reference vLLM instance plus the
proxy, streams a short load through the proxy and compares every answer with the reference.
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

from kvdisagg.testing.fleet import Fleet
from kvdisagg.testing.servers import metric_value
from kvdisagg.testing.tiny_model import ensure_tiny_model


def _stream(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    stamps, text = [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                event = json.loads(line[6:])
                if event.get("choices"):
                    stamps.append(time.perf_counter() - start)
                    text.append(event["choices"][0]["text"])
    ttft = stamps[0] if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"text": "".join(text), "ttft": ttft, "tpot": tpot}


def _reference(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]["text"]


def run_demo(num_requests: int = 8, log_dir: str = "out/demo") -> int:
    print("kvdisagg demo: generating the tiny model ...", flush=True)
    model = ensure_tiny_model()
    print("starting prefill, decode and reference vLLM instances and the proxy "
          "(a few minutes on 2 cores) ...", flush=True)
    words = "the quick brown fox jumps over the lazy dog while the sea keeps singing".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(40 + 60 * i))
               for i in range(num_requests)]
    max_tokens = 16
    with Fleet(model, Path(log_dir), reference=True) as fleet:
        assert fleet.reference is not None
        print(f"ready: proxy {fleet.proxy_url}, prefill {fleet.prefill.base_url}, "
              f"decode {fleet.decode.base_url}", flush=True)
        d = fleet.decode.base_url
        bytes0, secs0 = (metric_value(d, "vllm:kvdisagg_pulled_bytes_total"),
                         metric_value(d, "vllm:kvdisagg_pull_seconds_total"))
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: _stream(fleet.proxy_url, p, max_tokens), prompts))
        refs = [_reference(fleet.reference.base_url, p, max_tokens) for p in prompts]
        time.sleep(1.5)  # engine stats are published on an interval
        moved = metric_value(d, "vllm:kvdisagg_pulled_bytes_total") - bytes0
        xfer = metric_value(d, "vllm:kvdisagg_pull_seconds_total") - secs0
        usage = metric_value(fleet.prefill.base_url, "vllm:kv_cache_usage_perc")

    print(f"\n{'req':>3} {'prompt words':>12} {'TTFT ms':>9} {'TPOT ms':>9}  match")
    for i, (p, r, ref) in enumerate(zip(prompts, results, refs)):
        print(f"{i:>3} {len(p.split()):>12} {r['ttft'] * 1e3:>9.1f} {r['tpot'] * 1e3:>9.1f}  "
              f"{'yes' if r['text'] == ref else 'NO'}")
    matched = sum(r["text"] == ref for r, ref in zip(results, refs))
    print(f"\nKV moved prefill -> decode: {moved / 2**20:.2f} MiB in {xfer * 1e3:.1f} ms of "
          f"transfer time ({moved / xfer / 2**30 if xfer else 0:.2f} GiB/s)")
    print(f"outputs identical to the single-instance reference: {matched}/{len(prompts)}")
    print(f"prefill KV usage after the load: {usage:.3f}")
    print(f"logs: {log_dir}/")
    return 0 if matched == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(run_demo())


HELP = "P/D serving on a generated tiny model, with a report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--log-dir", default="out/demo")


def run(args: argparse.Namespace) -> int:
    return run_demo(args.requests, args.log_dir)
