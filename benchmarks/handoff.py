"""Where a P/D request's time to first token goes, per prompt length, in one run.

A 1P1D pair (each instance on its own core) behind ``kvdisagg proxy``, every process exporting
its spans to a loopback OTLP collector (tests/support/otlp_sink.py). For each prompt length, N
rounds, one request at a time, each with fresh prompts (no prefix-cache hits):

- prefill alone: the prompt straight to the prefill instance, ``max_tokens=1`` (its own TTFT);
- P/D: another prompt of that length through the proxy, streamed (TTFT at the client).

The overhead is P/D TTFT minus prefill alone; the trace of each P/D request says where it went
(p50 over the rounds, ms):

    in          the client sent the request .. the proxy's handler started
    accept      proxy: handler started .. prefill leg sent
    prefill     proxy's prefill leg (prefill's HTTP, queue, forward, request_finished)
    between     prefill answered .. decode leg sent (proxy)
    admit       decode leg sent .. decode's scheduler planned the load (HTTP, tokenize, schedule)
    to-worker   load planned .. the worker picked it up (the step's metadata)
    queue connect read transfer done    the pull (decode worker)
    noticed     pull done .. decode's scheduler saw it (next step's output)
    first-tok   load seen .. decode's first token event at the proxy (a decode step)
    relay       proxy's first token .. the client's
    read>serve  (within read) the Read sent .. prefill's serving thread received it
    pin-wait    (within read) prefill waiting for the handoff (offered in its next step)
    pull        queue + connect + read + transfer + done

Goal (issue 12): overhead p50 <= pull + 8 ms at 1000 and 2000 tokens.

    .venv/bin/python benchmarks/handoff.py [--lengths 100 1000 2000 8000] [--rounds 15]
        [--transport tcp] [--out out/handoff.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the collector
from kvdisagg.local.fleet import Fleet  # noqa: E402
from kvdisagg.local.tiny_model import ensure_tiny_model  # noqa: E402
from tests.support.otlp_sink import OtlpSink, SpanRecord, by_request  # noqa: E402

PHASES = ["in", "accept", "prefill", "between", "admit", "to-worker", "queue", "connect", "read",
          "transfer", "done", "noticed", "first-tok", "relay", "read>serve", "pin-wait"]
PULL = ["queue", "connect", "read", "transfer", "done"]
MAX_LEN = 8192


class Client:
    """One kept-alive connection per target, so both measurements pay the same client costs
    (no connect per request)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)

    def first_token_s(self, body: dict[str, Any], rid: str) -> float:
        """Seconds until the first token: a stream's first event, or a whole 1-token answer."""
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        self.conn.request("POST", "/v1/completions", payload,
                          {"Content-Type": "application/json", "X-Request-Id": rid})
        r = self.conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"{rid}: HTTP {r.status}: {r.read()[:300]!r}")
        if not body.get("stream"):
            r.read()
            return time.perf_counter() - start
        first = None
        while line := r.readline():
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
        assert first is not None, f"{rid}: no token event"
        return first


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def phases_of(trace: list[SpanRecord], sent_ns: int, client_first_ns: int) -> dict[str, float]:
    """Milliseconds per phase of one request's trace."""
    s = {span.name: span for span in trace}
    root, pre, dec = s["kvdisagg.request"], s["prefill_leg"], s["decode_leg"]
    load, pull = s["kvdisagg.load"], s["kvdisagg.pull"]
    marks = {
        "in": (sent_ns, root.start_ns),
        "accept": (root.start_ns, pre.start_ns), "prefill": (pre.start_ns, pre.end_ns),
        "between": (pre.end_ns, dec.start_ns), "admit": (dec.start_ns, load.start_ns),
        "to-worker": (load.start_ns, pull.start_ns),
        **{p: (s[p].start_ns, s[p].end_ns) for p in PULL},
        "noticed": (pull.end_ns, load.end_ns),
        "first-tok": (load.end_ns, dec.events["first_token"]),
        "relay": (dec.events["first_token"], client_first_ns),
    }
    if "kvdisagg.serve" in s:  # the Read in flight until prefill's serving thread had it
        marks["read>serve"] = (s["read"].start_ns, s["kvdisagg.serve"].start_ns)
    out = {k: (b - a) / 1e6 for k, (a, b) in marks.items()}
    if "kvdisagg.serve" in s:
        out["pin-wait"] = s["kvdisagg.serve"].attributes.get("kvdisagg.pin_wait_ms", 0.0)
    out["pull"] = sum(out[p] for p in PULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 2000, 8000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--out", type=Path, help="write every measurement here (JSON)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/kvdisagg-handoff-bench"))
    args = ap.parse_args()
    if max(args.lengths) >= MAX_LEN:
        raise SystemExit(f"--lengths must be < {MAX_LEN}")
    rng = random.Random(0)
    results: dict[int, list[dict[str, float]]] = {}
    with OtlpSink() as sink:
        extra = {"transport": args.transport, "otlp_traces_endpoint": sink.url}
        if args.transport == "mooncake":
            extra["mooncake_protocol"] = "tcp"
        long_ctx = ["--max-model-len", str(MAX_LEN)]  # the tiny model says 2048; RoPE stretches
        fleet = Fleet(ensure_tiny_model(), args.log_dir, prefill_extra=extra,
                      decode_extra=extra, prefill_args=long_ctx, decode_args=long_ctx,
                      proxy_args=["--otlp-traces-endpoint", sink.url],
                      env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
        with fleet:
            print(f"fleet up: {args.transport}, logs in {args.log_dir}", file=sys.stderr)
            prefill, proxy = Client(fleet.prefill.base_url), Client(fleet.proxy_url)
            for n in args.lengths:
                gen = {"model": "tiny", "temperature": 0, "ignore_eos": True}
                for client in (prefill, proxy):  # the first of a length pays one-off costs
                    client.first_token_s({**gen, "prompt": prompt(n, rng), "max_tokens": 1},
                                         f"warm{n}-{time.monotonic_ns()}")
                rows = []
                for i in range(args.rounds):
                    alone = prefill.first_token_s(
                        {**gen, "prompt": prompt(n, rng), "max_tokens": 1}, f"a{n}-{i}")
                    rid = f"pd{n}-{i}-{time.monotonic_ns()}"
                    sent_ns = time.time_ns()
                    pd = proxy.first_token_s({**gen, "prompt": prompt(n, rng), "max_tokens": 2,
                                              "stream": True}, rid)
                    rows.append({"rid": rid, "alone": alone * 1e3, "pd": pd * 1e3,
                                 "sent_ns": sent_ns, "client_first_ns": sent_ns + int(pd * 1e9)})
                    print(f"{n:5d} tokens round {i + 1}/{args.rounds}: alone "
                          f"{alone * 1e3:7.1f} ms, P/D {pd * 1e3:7.1f} ms", file=sys.stderr)
                results[n] = rows
            want = {r["rid"] for rows in results.values() for r in rows}
            spans = sink.wait_for(lambda sp: want <= _complete(sp), timeout_s=30)
    traces = by_request(spans)
    table = []
    for n, rows in results.items():
        for r in rows:
            trace = traces.get(r["rid"], [])
            if _complete_trace(trace):
                r.update(phases_of(trace, r["sent_ns"], r["client_first_ns"]))
        traced = [r for r in rows if "pull" in r]
        med = {k: statistics.median(r[k] for r in traced if k in r) for k in [*PHASES, "pull"]
               if any(k in r for r in traced)}
        alone = statistics.median(r["alone"] for r in rows)
        pd = statistics.median(r["pd"] for r in rows)
        overhead = statistics.median(r["pd"] - r["alone"] for r in rows)
        table.append({"tokens": n, "rounds": len(rows), "traced": len(traced), "alone": alone,
                      "pd": pd, "overhead": overhead, **med})
    _print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"table": table, "rows": results}, indent=1))


def _complete_trace(trace: list[SpanRecord]) -> bool:
    names = {s.name for s in trace}
    return {"kvdisagg.request", "prefill_leg", "decode_leg", "kvdisagg.load", "kvdisagg.pull",
            *PULL} <= names


def _complete(spans: list[SpanRecord]) -> set[str]:
    """Request ids whose trace has every span the breakdown needs."""
    return {rid for rid, trace in by_request(spans).items() if _complete_trace(trace)}


def _print(table: list[dict[str, Any]]) -> None:
    cols = ["alone", "pd", "overhead", "pull", *PHASES]
    print("| tokens | " + " | ".join(cols) + " | goal met |")
    print("|---:|" + "---:|" * (len(cols) + 1))
    for row in table:
        met = ("yes" if row["overhead"] <= row["pull"] + 8 else "no") if "pull" in row else "?"
        cells = [f"{row[c]:.1f}" if c in row else "-" for c in cols]
        print(f"| {row['tokens']} | " + " | ".join(cells) + f" | {met} |")
    print("(p50 over rounds, ms; overhead = P/D TTFT - prefill alone; goal: overhead <= pull + 8)")


if __name__ == "__main__":
    main()
