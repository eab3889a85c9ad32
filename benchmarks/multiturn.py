"""Multi-turn chat through P/D vs a plain vLLM instance, in one run (issue 15).

Conversations share a long system prompt; each has several turns (a user message, a greedy
answer of fixed length fed into the next turn). Three setups, one after another on fresh
instances: a plain vLLM instance on one core, 1P1D (prefill on core 0, decode on core 1) and
2P1D (two prefills sharing core 0) behind ``kvdisagg proxy`` with its defaults: the
per-request decision and routing by what each instance's cache holds (vLLM's KV events). Two
modes per setup, each with its own system prompt (so caches start cold): sequential (one
request at a time, conversation after conversation) and concurrent (every conversation at once,
its turns in order). Per turn: the TTFT at the client (streamed), the answer, and the proxy's
route for it. Reported: TTFT p50 of first turns and of later turns per setup and mode, the ratio
to the plain instance's, whether every answer is identical to the plain instance's, and how the
proxy routed the requests.

Goal (issue 15): later-turn TTFT p50 through P/D <= the plain instance's; first turns <= 1.1x.

The prefill choice on a shared-prefix workload: setups ``2p1d-events``, ``2p1d-round_robin``
and ``2p1d-prefix_aware`` (2P1D, every request disaggregated, the prefill picked by the cache
index from KV events or by the policy alone), with ``--systems N`` distinct system prompts;
ratios are then to the first setup named.

    .venv/bin/python benchmarks/multiturn.py [--conversations 4] [--turns 4] [--systems 1]
        [--setups plain 1p1d 2p1d] [--modes sequential concurrent] [--out out/multiturn.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import VllmServer, metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model

WORDS = ("the sea keeps singing to a lazy dog while quick brown foxes jump over cache blocks "
         "and tokens of every model layer where prefill meets decode under a bright moon").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Conversation:
    def __init__(self, system: str, rng: random.Random, turns: int, user_words: int) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.users = [text(rng, user_words) for _ in range(turns)]


def stream_chat(base: str, messages: list[dict[str, str]], max_tokens: int
                ) -> tuple[float, str, list[int], str]:
    """(TTFT s, answer text, answer token ids, the proxy's route header) of one streamed chat
    request. TTFT is the first event carrying a token: the tiny model's greedy answers may be
    special tokens that decode to no text, so text alone would miss some (and make answers
    compare equal that are not)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base}: {resp.status} {resp.read()[:300]!r}")
    route = resp.getheader("X-Kvdisagg-Handoff") or "plain"
    ttft, parts, ids, buf = None, [], [], b""
    while chunk := resp.read1(65536):
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for e in events:
            if not e.startswith(b"data: {"):
                continue
            event = json.loads(e[6:])
            if "error" in event:
                raise RuntimeError(f"{base}: error event {event['error']}")
            for c in event.get("choices") or []:
                content = (c.get("delta") or {}).get("content")
                if c.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    ids.extend(c["token_ids"])
                if content:
                    parts.append(content)
    conn.close()
    if ttft is None or len(ids) != max_tokens:
        raise RuntimeError(f"{base}: {len(ids)} tokens streamed, {max_tokens} asked")
    return ttft, "".join(parts), ids, route


def run_mode(base: str, convs: list[Conversation], concurrent: bool,
             max_tokens: int) -> list[dict[str, Any]]:
    def converse(ci: int) -> list[dict[str, Any]]:
        conv, rows = convs[ci], []
        messages = list(conv.messages)
        for turn, user in enumerate(conv.users):
            messages.append({"role": "user", "content": user})
            ttft, answer, ids, route = stream_chat(base, messages, max_tokens)
            messages.append({"role": "assistant", "content": answer})
            rows.append({"conversation": ci, "turn": turn, "ttft_ms": ttft * 1e3,
                         "answer": answer, "token_ids": ids, "route": route})
        return rows
    if not concurrent:
        return [r for ci in range(len(convs)) for r in converse(ci)]
    with ThreadPoolExecutor(len(convs)) as pool:
        return [r for rows in pool.map(converse, range(len(convs))) for r in rows]


def warm_up(url: str, args: argparse.Namespace) -> None:
    """The first requests of a fresh instance pay one-off costs (hundreds of ms here): a short
    and a long prompt of their own words, both routes through P/D, before anything is timed."""
    rng = random.Random(7)
    for words in (20, args.system_words):
        for _ in range(2):
            stream_chat(url, [{"role": "user", "content": text(rng, words)}], args.max_tokens)


def workloads(args: argparse.Namespace) -> dict[str, list[Conversation]]:
    """The same conversations for every setup; each mode its own system prompts (``--systems``
    of them, conversation i getting prompt i mod systems)."""
    out = {}
    for i, mode in enumerate(args.modes):
        rng = random.Random(1000 + i)
        systems = [text(rng, args.system_words) for _ in range(args.systems)]
        out[mode] = [Conversation(systems[c % args.systems], rng, args.turns, args.user_words)
                     for c in range(args.conversations)]
    return out


class Running(NamedTuple):
    url: str  # where requests go
    instances: dict[str, str]  # name -> vLLM base URL (prefix-cache counters read there)


PREFILL_ROUTING = {
    # every request through prefill, so each one exercises the prefill choice
    "events": ["--always-disaggregate"],  # cache index on: longest cached prefix, with load
    "round_robin": ["--always-disaggregate", "--no-cache-index", "--prefill-policy",
                    "round_robin"],
    "prefix_aware": ["--always-disaggregate", "--no-cache-index", "--prefill-policy",
                     "prefix_aware"],
}


def setups(model: Path, log_dir: Path) -> dict[str, Callable[[], Iterator[Running]]]:
    """Each setup as a context that yields where to send requests. ``2p1d-<routing>``: 2P1D,
    every request disaggregated, prefill chosen by ``PREFILL_ROUTING[routing]``."""
    from contextlib import contextmanager

    @contextmanager
    def plain() -> Iterator[Running]:
        server = VllmServer(model, log_path=log_dir / "plain.log", omp_threads_bind="0")
        server.start()
        try:
            server.wait_ready(900)
            yield Running(server.base_url, {"plain": server.base_url})
        finally:
            server.stop()

    def pd(name: str, prefills: int, proxy_args: list[str]) -> Callable[[], Iterator[Running]]:
        @contextmanager
        def run() -> Iterator[Running]:
            fleet = Fleet(model, log_dir / name, prefills=prefills, always_disaggregate=False,
                          kv_events=True, proxy_args=proxy_args)
            with fleet:
                insts = {f"prefill{i}": p.base_url for i, p in enumerate(fleet.prefills)}
                if "--no-cache-index" not in proxy_args:
                    wait_index_live(fleet.proxy_url, len(insts) + 1)
                yield Running(fleet.proxy_url, insts | {"decode": fleet.decode.base_url})
                print(f"{name} routed: {routed(fleet.proxy_url)}", file=sys.stderr)
        return run

    return {"plain": plain, "1p1d": pd("1p1d", 1, []), "2p1d": pd("2p1d", 2, []),
            **{f"2p1d-{r}": pd(f"2p1d-{r}", 2, a) for r, a in PREFILL_ROUTING.items()}}


SETUPS = ["plain", "1p1d", "2p1d", *(f"2p1d-{r}" for r in PREFILL_ROUTING)]


def wait_index_live(proxy: str, instances: int, timeout_s: float = 120.0) -> None:
    """Until the proxy's cache index follows every instance's KV events: the proxy is ready
    as soon as the instances answer health probes, but it finds each publisher on a retry
    some seconds later, and until then it predicts no hit (requests go through prefill)."""
    deadline = time.monotonic() + timeout_s
    while (live := metric_value(proxy, "kvdisagg_proxy_cache_index_live")) < instances:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy}: cache index live for {live} of {instances} instances")
        time.sleep(0.5)


def routed(proxy: str) -> dict[str, float]:
    out = {}
    for route in ("pd", "decode_only"):
        out[route] = metric_value(proxy, "kvdisagg_proxy_routed_total", route=route)
    return out


def cache_hits(instances: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(prefix-cache hit tokens, queried tokens) per instance, vLLM's own counters."""
    return {name: (metric_value(url, "vllm:prefix_cache_hits"),
                   metric_value(url, "vllm:prefix_cache_queries"))
            for name, url in instances.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--systems", type=int, default=1,
                    help="distinct system prompts per mode (conversation i gets i mod N)")
    ap.add_argument("--system-words", type=int, default=450)
    ap.add_argument("--user-words", type=int, default=70,
                    help="70: turn 4 of the defaults is ~1900 prompt tokens, under the tiny "
                    "model's 2048 positions (past them its answers are not even repeatable)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--setups", nargs="+", default=["plain", "1p1d", "2p1d"], choices=SETUPS)
    ap.add_argument("--modes", nargs="+", default=["sequential", "concurrent"],
                    choices=["sequential", "concurrent"])
    ap.add_argument("--log-dir", type=Path, default=Path("out/multiturn-logs"))
    ap.add_argument("--out", type=Path, default=Path("out/multiturn.json"))
    args = ap.parse_args()
    model = ensure_tiny_model()
    work = workloads(args)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    hits: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name in args.setups:
        with setups(model, args.log_dir)[name]() as running:
            print(f"{name}: up at {running.url}", file=sys.stderr)
            warm_up(running.url, args)
            results[name], hits[name] = {}, {}
            for mode in args.modes:
                before = cache_hits(running.instances)
                rows = run_mode(running.url, work[mode], mode == "concurrent", args.max_tokens)
                after = cache_hits(running.instances)
                results[name][mode] = rows
                hits[name][mode] = {k: [after[k][0] - before[k][0], after[k][1] - before[k][1]]
                                    for k in after}
                print(f"{name} {mode}: {summary(rows)} prefix-cache hits/queried "
                      f"{hits[name][mode]}", file=sys.stderr)
    table = report(results, hits)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"log_dir": str(args.log_dir),
                                                          "out": str(args.out)},
                                    "table": table, "hits": hits, "rows": results}, indent=1))


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    def p50(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")
    return {"first_p50_ms": p50([r["ttft_ms"] for r in rows if r["turn"] == 0]),
            "later_p50_ms": p50([r["ttft_ms"] for r in rows if r["turn"] > 0]),
            "all_p50_ms": p50([r["ttft_ms"] for r in rows])}


def report(results: dict[str, dict[str, list[dict[str, Any]]]],
           hits: dict[str, dict[str, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """One row per setup and mode; ratios and answers against the plain instance, or the first
    setup run when there is no plain one."""
    base_name = "plain" if "plain" in results else next(iter(results))
    baseline = results[base_name]
    table = []
    print(f"(x = ratio of TTFT p50 to {base_name}'s; answers (token ids) compared with "
          f"{base_name}'s; "
          "prefill hits = prefix-cache hit tokens / queried tokens on the prefill instances)")
    print("| setup | mode | first-turn TTFT p50 ms | x | later-turn TTFT p50 ms | x "
          "| all p50 ms | x | answers identical | prefill hits | routes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, modes in results.items():
        for mode, rows in modes.items():
            s = summary(rows)
            base = summary(baseline[mode]) if mode in baseline else None
            ref = {(r["conversation"], r["turn"]): r["token_ids"]
                   for r in baseline.get(mode, [])}
            same = sum(ref.get((r["conversation"], r["turn"])) == r["token_ids"] for r in rows)
            routes: dict[str, int] = {}
            for r in rows:
                routes[r["route"]] = routes.get(r["route"], 0) + 1
            pre = [v for k, v in hits.get(name, {}).get(mode, {}).items()
                   if k.startswith("prefill")]
            row = {"setup": name, "mode": mode, **s,
                   **{f"{k}_x": s[f"{k}_p50_ms"] / base[f"{k}_p50_ms"] if base else None
                      for k in ("first", "later", "all")},
                   "identical": f"{same}/{len(rows)}" if ref else "-", "routes": routes,
                   "prefill_hits": [sum(h for h, _ in pre), sum(q for _, q in pre)]}
            table.append(row)
            x = {k: f"{row[k + '_x']:.2f}" if row[k + "_x"] else "-"
                 for k in ("first", "later", "all")}
            ph = (f"{row['prefill_hits'][0]:.0f}/{row['prefill_hits'][1]:.0f}" if pre else "-")
            print(f"| {name} | {mode} | {s['first_p50_ms']:.1f} | {x['first']} | "
                  f"{s['later_p50_ms']:.1f} | {x['later']} | {s['all_p50_ms']:.1f} | "
                  f"{x['all']} | {row['identical']} | {ph} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(routes.items()))} |")
    return table


if __name__ == "__main__":
    main()
