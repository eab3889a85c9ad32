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

    .venv/bin/python benchmarks/multiturn.py [--conversations 4] [--turns 4]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvdisagg.local.fleet import Fleet  # noqa: E402
from kvdisagg.local.servers import VllmServer, metric_value  # noqa: E402
from kvdisagg.local.tiny_model import ensure_tiny_model  # noqa: E402

WORDS = ("the sea keeps singing to a lazy dog while quick brown foxes jump over cache blocks "
         "and tokens of every model layer where prefill meets decode under a bright moon").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Conversation:
    def __init__(self, system: str, rng: random.Random, turns: int, user_words: int) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.users = [text(rng, user_words) for _ in range(turns)]


def stream_chat(base: str, messages: list[dict[str, str]], max_tokens: int
                ) -> tuple[float, str, str]:
    """(TTFT s, answer, the proxy's route header) of one streamed chat request."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base}: {resp.status} {resp.read()[:300]!r}")
    route = resp.getheader("X-Kvdisagg-Handoff") or "plain"
    ttft, parts, buf = None, [], b""
    while chunk := resp.read1(65536):
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for e in events:
            if not e.startswith(b"data: {"):
                continue
            for c in json.loads(e[6:]).get("choices") or []:
                content = (c.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(content)
    conn.close()
    return ttft if ttft is not None else float("nan"), "".join(parts), route


def run_mode(base: str, convs: list[Conversation], concurrent: bool,
             max_tokens: int) -> list[dict[str, Any]]:
    def converse(ci: int) -> list[dict[str, Any]]:
        conv, rows = convs[ci], []
        messages = list(conv.messages)
        for turn, user in enumerate(conv.users):
            messages.append({"role": "user", "content": user})
            ttft, answer, route = stream_chat(base, messages, max_tokens)
            messages.append({"role": "assistant", "content": answer})
            rows.append({"conversation": ci, "turn": turn, "ttft_ms": ttft * 1e3,
                         "answer": answer, "route": route})
        return rows
    if not concurrent:
        return [r for ci in range(len(convs)) for r in converse(ci)]
    with ThreadPoolExecutor(len(convs)) as pool:
        return [r for rows in pool.map(converse, range(len(convs))) for r in rows]


def workloads(args: argparse.Namespace) -> dict[str, list[Conversation]]:
    """The same conversations for every setup; each mode its own system prompt."""
    out = {}
    for i, mode in enumerate(args.modes):
        rng = random.Random(1000 + i)
        system = text(rng, args.system_words)
        out[mode] = [Conversation(system, rng, args.turns, args.user_words)
                     for _ in range(args.conversations)]
    return out


def setups(model: Path, log_dir: Path) -> dict[str, Callable[[], Iterator[str]]]:
    """Each setup as a context that yields the URL to send requests to."""
    from contextlib import contextmanager

    @contextmanager
    def plain() -> Iterator[str]:
        server = VllmServer(model, log_path=log_dir / "plain.log", omp_threads_bind="0")
        server.start()
        try:
            server.wait_ready(900)
            yield server.base_url
        finally:
            server.stop()

    def pd(prefills: int) -> Callable[[], Iterator[str]]:
        @contextmanager
        def run() -> Iterator[str]:
            fleet = Fleet(model, log_dir / f"{prefills}p1d", prefills=prefills,
                          always_disaggregate=False, kv_events=True)
            with fleet:
                yield fleet.proxy_url
                print(routed(fleet.proxy_url), file=sys.stderr)
        return run

    return {"plain": plain, "1p1d": pd(1), "2p1d": pd(2)}


def routed(proxy: str) -> dict[str, float]:
    out = {}
    for route in ("pd", "decode_only"):
        out[route] = metric_value(proxy, "kvdisagg_proxy_routed_total", route=route)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=450)
    ap.add_argument("--user-words", type=int, default=110)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--setups", nargs="+", default=["plain", "1p1d", "2p1d"],
                    choices=["plain", "1p1d", "2p1d"])
    ap.add_argument("--modes", nargs="+", default=["sequential", "concurrent"],
                    choices=["sequential", "concurrent"])
    ap.add_argument("--log-dir", type=Path, default=Path("out/multiturn-logs"))
    ap.add_argument("--out", type=Path, default=Path("out/multiturn.json"))
    args = ap.parse_args()
    model = ensure_tiny_model()
    work = workloads(args)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in args.setups:
        with setups(model, args.log_dir)[name]() as url:
            print(f"{name}: up at {url}", file=sys.stderr)
            results[name] = {}
            for mode in args.modes:
                rows = run_mode(url, work[mode], mode == "concurrent", args.max_tokens)
                results[name][mode] = rows
                print(f"{name} {mode}: {summary(rows)}", file=sys.stderr)
    table = report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"log_dir": str(args.log_dir),
                                                          "out": str(args.out)},
                                    "table": table, "rows": results}, indent=1))


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    first = [r["ttft_ms"] for r in rows if r["turn"] == 0]
    later = [r["ttft_ms"] for r in rows if r["turn"] > 0]
    return {"first_p50_ms": statistics.median(first) if first else float("nan"),
            "later_p50_ms": statistics.median(later) if later else float("nan")}


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    plain = results.get("plain", {})
    table = []
    print("| setup | mode | first-turn TTFT p50 ms | x plain | later-turn TTFT p50 ms | x plain "
          "| answers identical | routes |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for name, modes in results.items():
        for mode, rows in modes.items():
            s = summary(rows)
            base = summary(plain[mode]) if mode in plain else None
            ref = {(r["conversation"], r["turn"]): r["answer"] for r in plain.get(mode, [])}
            same = sum(ref.get((r["conversation"], r["turn"])) == r["answer"] for r in rows)
            routes: dict[str, int] = {}
            for r in rows:
                routes[r["route"]] = routes.get(r["route"], 0) + 1
            row = {"setup": name, "mode": mode, **s,
                   "first_x": s["first_p50_ms"] / base["first_p50_ms"] if base else None,
                   "later_x": s["later_p50_ms"] / base["later_p50_ms"] if base else None,
                   "identical": f"{same}/{len(rows)}" if ref else "-", "routes": routes}
            table.append(row)
            fx = f"{row['first_x']:.2f}" if row["first_x"] else "-"
            lx = f"{row['later_x']:.2f}" if row["later_x"] else "-"
            print(f"| {name} | {mode} | {s['first_p50_ms']:.1f} | {fx} | "
                  f"{s['later_p50_ms']:.1f} | {lx} | {row['identical']} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(routes.items()))} |")
    return table


if __name__ == "__main__":
    main()
