"""``kvdisagg demo``: P/D serving end to end on this machine, with a printed report.

Generates the tiny model, starts a prefill, a decode and a plain reference vLLM instance plus the
proxy (deciding per request, as users run it: with the model's tokenizer and the instances' KV
events, so it counts each prompt's tokens exactly), streams a short load of prompts from a few
tokens to about a thousand through the proxy and compares every answer with the reference.
Each request is explained by the reason the proxy itself gives for serving it as it did.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model
from kvdisagg.prom_text import samples
from kvdisagg.proxy.config import DecisionConfig


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


ROUTED = "kvdisagg_proxy_routed_total"
Why = tuple[str, str]
"""How the proxy served a request and why: (route, reason), as ``kvdisagg_proxy_routed_total``
labels them (``pd`` or ``decode_only``, and the reason: docs/proxy.md)."""
UNKNOWN = "?"

# Every reason the proxy gives (decide.py, body.py, prefill.py), as a sentence;
# tests/unit/cli/test_demo.py keeps it in step with docs/proxy.md's list.
WHY: dict[Why, str] = {
    ("pd", "uncached_prompt"):
        "disaggregated: more prompt tokens to compute than decode computes itself "
        "(decision.local_prefill_tokens, {threshold}, lowered as decode's TPOT nears "
        "slo.tpot_s): prefill computed the prompt and decode pulled its KV",
    ("pd", "always"):
        "disaggregated: the per-request decision is off (--always-disaggregate)",
    ("decode_only", "short_prompt"):
        "decode alone: at most decision.local_prefill_tokens ({threshold}) prompt tokens, "
        "which cost decode less to compute than a handoff",
    ("decode_only", "cached_prefix"):
        "decode alone: decode's prefix cache held the start of the prompt (its KV events "
        "said so) and the rest was within decision.local_prefill_tokens ({threshold})",
    ("decode_only", "prefill_busy"):
        "decode alone although long: prefill had a queue while decode had no stream to "
        "protect, so the prompt started sooner on decode (decision.idle_decode_tokens)",
    ("decode_only", "prompt_logprobs"):
        "decode alone: prompt logprobs, which vLLM computes from the prompt whatever KV it "
        "is given",
    ("decode_only", "beam_search"):
        "decode alone: beam search, which vLLM runs step by step in its server",
    ("decode_only", "no_healthy_prefill"):
        "decode alone, a fallback: no prefill instance was healthy "
        "(retry.decode_only_fallback)",
    ("decode_only", "prefill_failed"):
        "decode alone, a fallback: every prefill try failed (retry.decode_only_fallback; "
        "proxy.log says why)",
    ("decode_only", "prompt_embeds"):
        "decode alone: prompt embeddings, which only the instance given them can compute",
    ("decode_only", "invalid_min_tokens"):
        "decode alone: a min_tokens vLLM refuses, answered with vLLM's own error without a "
        "prefill",
    ("decode_only", "no_compatible_prefill"):
        "decode alone, a fallback: no prefill speaks a protocol version this decode speaks "
        "(a rolling upgrade in progress)",
    ("decode_only", "no_compatible_decode"):
        "decode alone, a fallback: no decode could pull the handoff's protocol version",
    ("decode_only", "colocate"):
        "decode alone: no prefill was predicted to meet the TTFT SLO (slo.admission "
        "colocate)",
}


def routed(metrics_text: str) -> Counter[Why]:
    """The proxy's requests by (route, reason): its ``kvdisagg_proxy_routed_total``."""
    out: Counter[Why] = Counter()
    for sample in samples(metrics_text):
        if sample.name == ROUTED:
            out[sample.labels.get("route", ""), sample.labels.get("reason", "")] += int(
                sample.value)
    return out


def reasons(handoffs: Sequence[str], counted: Counter[Why]) -> list[Why]:
    """Each request's (route, reason) from the proxy's ``X-Kvdisagg-Handoff`` header:
    ``decode_only:<reason>`` names it; ``pd`` does not, so a handoff's reason is the one the
    proxy counted for handoffs (``counted``: this load's ``routed``) when it counted only one
    (with the decision on, ``uncached_prompt``), else ``?``."""
    pd = {reason for (route, reason), n in counted.items() if route == "pd" and n > 0}
    out = []
    for header in handoffs:
        route, _, reason = header.partition(":")
        if route == "pd" and not reason:
            reason = next(iter(pd)) if len(pd) == 1 else UNKNOWN
        out.append((route, reason or UNKNOWN))
    return out


def explain(why: Why, threshold: int) -> str:
    """``why`` as a sentence (``WHY``); a reason this demo does not know, named as is."""
    text = WHY.get(why)
    if text is None:
        return f"{why[0]}, reason {why[1]} (docs/proxy.md: kvdisagg_proxy_routed_total)"
    return text.format(threshold=threshold)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode("utf-8", "replace")


def run_demo(num_requests: int = 8, log_dir: str = "out/demo") -> int:
    print("kvdisagg demo: generating the tiny model ...", flush=True)
    model = ensure_tiny_model()
    print("starting prefill, decode and reference vLLM instances and the proxy "
          "(a few minutes on 2 cores) ...", flush=True)
    words = "the quick brown fox jumps over the lazy dog while the sea keeps singing".split()
    # From a few words to about a thousand, sent four at a time: the proxy decides each
    # (decision.local_prefill_tokens, 512 by default; why it decided so is printed).
    sizes = [8 + 1000 * i // max(1, num_requests - 1) for i in range(num_requests)]
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(n))
               for i, n in enumerate(sizes)]
    max_tokens = 16
    threshold = DecisionConfig().local_prefill_tokens  # the demo's proxy keeps the default
    # The proxy as users run it: it decides per request whether splitting pays, counting the
    # prompt's tokens with the model's tokenizer (which it does while its cache index follows
    # the instances' KV events: kv_events) rather than estimating them from the text.
    with Fleet(model, Path(log_dir), reference=True, always_disaggregate=False,
               kv_events=True) as fleet:
        assert fleet.reference is not None
        fleet.wait_index_live()
        print(f"ready: proxy {fleet.proxy_url}, prefill {fleet.prefill.base_url}, "
              f"decode {fleet.decode.base_url}", flush=True)
        d = fleet.decode.base_url
        before, counted_before = _pull_state(d), routed(_get(fleet.proxy_url + "/metrics"))
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: _stream(fleet.proxy_url, p, max_tokens), prompts))
        counted = routed(_get(fleet.proxy_url + "/metrics")) - counted_before
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
    whys = reasons([r["route"] for r in results], counted)
    print("\nwhy, as the proxy decided (its X-Kvdisagg-Handoff header; a handoff's reason from "
          f"its {ROUTED}):")
    for why in sorted(set(whys), key=whys.index):
        which = [i for i, w in enumerate(whys) if w == why]
        kv = (f"; KV moved prefill -> decode: {moved['bytes'] / 2**20:.2f} MiB in "
              f"{moved['pulls']:.0f} pulls" if why[0] == "pd" else "")
        print(f"  {'requests' if len(which) > 1 else 'request'} "
              f"{', '.join(map(str, which))} ({why[0]}: {why[1]}): "
              f"{explain(why, threshold)}{kv}")
    pd = sum(w[0] == "pd" for w in whys)
    agree = Counter(whys) == counted
    print(f"{pd} of {len(results)} requests disaggregated (pd), {len(results) - pd} served by "
          f"decode alone; the proxy's {ROUTED} "
          + ("counted the same reasons" if agree else
             f"counted other reasons: {dict(counted)}, not {dict(Counter(whys))}"))
    if moved["pulls"]:
        rate = moved["bytes"] / moved["transfer"] / 2**30 if moved["transfer"] else 0.0
        print(f"moving the KV: the bytes themselves took {moved['transfer'] * 1e3:.1f}"
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
