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

``--first-token`` (issue 15) adds a proxy with its default, the first token from prefill
(``P/D`` above is the ordinary handoff: the fleet's proxy runs with
``--no-first-token-from-prefill``, so its phases are the handoff's), and records each stream's
second token too: what the client waits for the first token, and that the second is not
later than the ordinary handoff's.

``--decision`` (issue 15) adds, per round, two more requests through two more proxies on the
same pair: *local*, decode computing the prompt itself (``--local-prefill-tokens`` past any
length: what decode alone costs), and *default*, the proxy's per-request decision with its
defaults (its route is recorded: short prompts should go to decode alone, long ones through
prefill). Where local is cheaper than P/D, and by how much decode is kept busy instead,
is what sets ``decision.local_prefill_tokens``.

    .venv/bin/python benchmarks/handoff.py [--lengths 100 1000 2000 8000] [--rounds 15]
        [--transport tcp] [--decision] [--first-token] [--out out/handoff.json]
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
from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model
from tests.support.otlp_sink import OtlpSink, SpanRecord, by_request

PHASES = ["in", "accept", "prefill", "between", "admit", "to-worker", "queue", "connect", "read",
          "transfer", "done", "noticed", "first-tok", "relay", "read>serve", "pin-wait"]
PULL = ["queue", "connect", "read", "transfer", "done"]
MAX_LEN = 8192


class Client:
    """One kept-alive connection per target, so both measurements pay the same client costs
    (no connect per request)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        self.route = ""  # the last answer's X-Kvdisagg-Handoff
        self.second_s: float | None = None  # the last stream's second token event

    def first_token_s(self, body: dict[str, Any], rid: str) -> float:
        """Seconds until the first token: a stream's first event, or a whole 1-token answer."""
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        self.conn.request("POST", "/v1/completions", payload,
                          {"Content-Type": "application/json", "X-Request-Id": rid})
        r = self.conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"{rid}: HTTP {r.status}: {r.read()[:300]!r}")
        self.route = r.getheader("X-Kvdisagg-Handoff") or ""
        if not body.get("stream"):
            r.read()
            return time.perf_counter() - start
        first = self.second_s = None
        while line := r.readline():
            if line.startswith(b"data: {"):
                if first is None:
                    first = time.perf_counter() - start
                elif self.second_s is None:
                    self.second_s = time.perf_counter() - start
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
    ap.add_argument("--decision", action="store_true",
                    help="also time decode alone and the default decision (two more proxies)")
    ap.add_argument("--early", action="store_true",
                    help="with --decision: the default proxy sends decode legs early "
                    "(--early-decode); its prefill legs and what follows them are traced too")
    ap.add_argument("--first-token", action="store_true",
                    help="add P/D with the first token from prefill (the proxy's default; P/D "
                    "above is the ordinary handoff), and both streams' second token")
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
                      proxy_args=["--otlp-traces-endpoint", sink.url,
                                  "--no-first-token-from-prefill"],
                      env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
        with fleet:
            print(f"fleet up: {args.transport}, logs in {args.log_dir}", file=sys.stderr)
            prefill, proxy = Client(fleet.prefill.base_url), Client(fleet.proxy_url)
            more: dict[str, Client] = {}
            if args.first_token:
                more["first"] = Client(fleet.extra_proxy(["--always-disaggregate"],
                                                         "proxy-first"))
            if args.decision:
                more["local"] = Client(fleet.extra_proxy(
                    ["--local-prefill-tokens", str(10 * MAX_LEN)], "proxy-local"))
                more["default"] = Client(fleet.extra_proxy(
                    ["--early-decode", "--otlp-traces-endpoint", sink.url] if args.early
                    else [], "proxy-default"))
            for n in args.lengths:
                gen = {"model": "tiny", "temperature": 0, "ignore_eos": True}
                for client in (prefill, proxy, *more.values()):  # one-off costs of a length
                    client.first_token_s({**gen, "prompt": prompt(n, rng), "max_tokens": 1},
                                         f"warm{n}-{time.monotonic_ns()}")
                rows = []
                early0 = _early(more)
                for i in range(args.rounds):
                    alone = prefill.first_token_s(
                        {**gen, "prompt": prompt(n, rng), "max_tokens": 1}, f"a{n}-{i}")
                    rid = f"pd{n}-{i}-{time.monotonic_ns()}"
                    sent_ns = time.time_ns()
                    pd = proxy.first_token_s({**gen, "prompt": prompt(n, rng), "max_tokens": 2,
                                              "stream": True}, rid)
                    row = {"rid": rid, "alone": alone * 1e3, "pd": pd * 1e3,
                           "pd_second": 1e3 * (proxy.second_s or float("nan")),
                           "sent_ns": sent_ns, "client_first_ns": sent_ns + int(pd * 1e9)}
                    for name, client in more.items():
                        row[f"{name}_rid"] = f"{name}{n}-{i}-{time.monotonic_ns()}"
                        row[f"{name}_sent_ns"] = time.time_ns()
                        row[name] = 1e3 * client.first_token_s(
                            {**gen, "prompt": prompt(n, rng), "max_tokens": 2,
                             "stream": True}, row[f"{name}_rid"])
                        row[f"{name}_route"] = client.route
                        row[f"{name}_second"] = 1e3 * (client.second_s or float("nan"))
                    rows.append(row)
                    print(f"{n:5d} tokens round {i + 1}/{args.rounds}: alone "
                          f"{alone * 1e3:7.1f} ms, P/D {pd * 1e3:7.1f} ms"
                          + "".join(f", {k} {row[k]:7.1f} ms" for k in more),
                          file=sys.stderr)
                results[n] = rows
                if more:  # how many of default's requests went out early (proxy/handoff/early.py)
                    rows[0]["default_early"] = _early(more) - early0
            want = {r["rid"] for rows in results.values() for r in rows}
            spans = sink.wait_for(lambda sp: want <= _complete(sp), timeout_s=30)
    traces = by_request(spans)
    table = []
    for n, rows in results.items():
        for r in rows:
            trace = traces.get(r["rid"], [])
            if _complete_trace(trace):
                r.update(phases_of(trace, r["sent_ns"], r["client_first_ns"]))
            if args.early and "default_rid" in r:  # its prefill leg, and what follows it
                legs = {sp.name: sp for sp in traces.get(r["default_rid"], [])}
                if "prefill_leg" in legs:
                    pre = legs["prefill_leg"]
                    r["default_prefill"] = (pre.end_ns - pre.start_ns) / 1e6
                    r["default_after"] = (r["default_sent_ns"] + r["default"] * 1e6
                                          - pre.end_ns) / 1e6
            if "prefill" in r:
                r["pd_after"] = (r["client_first_ns"] - r["sent_ns"]) / 1e6 - r["in"] - \
                    r["accept"] - r["prefill"]
        traced = [r for r in rows if "pull" in r]
        med = {k: statistics.median(r[k] for r in traced if k in r) for k in [*PHASES, "pull"]
               if any(k in r for r in traced)}
        alone = statistics.median(r["alone"] for r in rows)
        pd = statistics.median(r["pd"] for r in rows)
        overhead = statistics.median(r["pd"] - r["alone"] for r in rows)
        decision = {}
        if "first" in rows[0]:
            decision = {k: statistics.median(r[k] for r in rows)
                        for k in ("first", "first_second", "pd_second")}
            decision["first_routes"] = sorted({r["first_route"] for r in rows})
            decision["first_overhead"] = statistics.median(r["first"] - r["alone"] for r in rows)
        if "local" in rows[0]:
            routes: dict[str, int] = {}
            for r in rows:
                routes[r["default_route"]] = routes.get(r["default_route"], 0) + 1
            decision = {k: statistics.median(r[k] for r in rows) for k in ("local", "default")}
            decision["default_routes"] = routes
            decision["default_early"] = rows[0].get("default_early", 0)
            decision["default_overhead"] = statistics.median(
                r["default"] - r["alone"] for r in rows)
            for k in ("default_prefill", "default_after", "pd_after"):
                if any(k in r for r in rows):
                    decision[k] = statistics.median(r[k] for r in rows if k in r)
        table.append({"tokens": n, "rounds": len(rows), "traced": len(traced), "alone": alone,
                      "pd": pd, "overhead": overhead, **med, **decision})
    _print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"table": table, "rows": results}, indent=1))


def _early(more: dict[str, Client]) -> float:
    """The default proxy's early handoffs so far (0 without ``--decision``)."""
    if "default" not in more:
        return 0.0
    return metric_value(more["default"].url, "kvdisagg_proxy_early_handoffs_total",
                        outcome="opened")


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
    if table and "first" in table[0]:
        print("\n| tokens | prefill alone | P/D | P/D, first token from prefill | P/D - prefill "
              "alone | first from prefill - prefill alone | P/D 2nd token | first from prefill "
              "2nd token |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in table:
            print(f"| {r['tokens']} | {r['alone']:.1f} | {r['pd']:.1f} | {r['first']:.1f} | "
                  f"{r['overhead']:.1f} | {r['first_overhead']:.1f} | "
                  f"{r['pd_second']:.1f} | {r['first_second']:.1f} |")
        print("(p50 over rounds, ms from sending; differences: p50 of each round's; P/D: the "
              "ordinary handoff; 2nd token: the stream's second token event, max_tokens 2)")
    if table and "local" in table[0]:
        print("\n| tokens | prefill alone | P/D | decode alone | default decision | its routes "
              "| of which early | P/D - prefill alone | default - prefill alone "
              "| P/D - decode alone | default / prefill alone |")
        print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for r in table:
            routes = ", ".join(f"{k} {v}" for k, v in sorted(r["default_routes"].items()))
            print(f"| {r['tokens']} | {r['alone']:.1f} | {r['pd']:.1f} | {r['local']:.1f} | "
                  f"{r['default']:.1f} | {routes} | {r['default_early']:.0f} | "
                  f"{r['overhead']:.1f} | {r['default_overhead']:.1f} | "
                  f"{r['pd'] - r['local']:.1f} | {r['default'] / r['alone']:.2f} |")
        if "default_prefill" in table[0]:
            print("\n| tokens | P/D prefill leg | default prefill leg | P/D after it | "
                  "default after it |")
            print("|---:|---:|---:|---:|---:|")
            for r in table:
                print(f"| {r['tokens']} | {r.get('prefill', float('nan')):.1f} | "
                      f"{r['default_prefill']:.1f} | {r.get('pd_after', float('nan')):.1f} | "
                      f"{r['default_after']:.1f} |")
            print("(p50, ms, from the traces: the prefill leg, and from its answer to the "
                  "client's first token)")
        print("(p50 over rounds, ms; P/D: every request through prefill, the ordinary handoff; "
              "decode alone: decode computes the prompt, through a proxy; default decision: the "
              "proxy's defaults, early dispatch included)")


if __name__ == "__main__":
    main()
