"""A conversation's later turn through the proxy vs a plain vLLM instance, interleaved (issue 15).

``benchmarks/multiturn.py`` runs its setups one after another on fresh instances, the plain
instance on core 0 and decode on core 1, so machine drift and core placement enter its later-turn
ratios. This isolates the one path later turns take (``decode_only:cached_prefix``): one fleet,
every target up at once, requests one at a time, the targets' order rotated every round:

- plain: a plain vLLM instance (no connector, no KV events) bound to ``--plain-core``;
- decode direct: the 1P1D pair's decode instance (connector and KV events on), no proxy;
- proxy: the pair behind ``kvdisagg proxy`` with its defaults;
- proxy, slow probes: the same with ``--health-interval 30`` (its load probes nearly off).

Each request is the same conversation (a 450-word system prompt, a user turn and an answer,
cached on every target before the rounds) plus a fresh 70-word user message, streamed, greedy.
``--first-turns``: each request is a conversation's first turn instead, a system prompt of its
own (450 words, ~1000 tokens: uncached, so the proxy disaggregates it, its first token from
prefill) and a 70-word user message; decode direct then computes the whole prompt itself.
Reported: TTFT p50 (and quartiles) per target and the ratio to plain's. The plain instance
shares a core with the idle prefill (``--plain-core 0``); on decode's core, decode's idle OpenMP
threads slow it (measured: 1.8x), so that placement is not a fair baseline.

    flock /tmp/kvdisagg-e2e.lock env PYTHONPATH=$PWD/src:$PWD .venv/bin/python \\
        benchmarks/later_turns.py [--rounds 40] [--plain-core 0] [--first-turns] \
        [--out out/later_turns.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multiturn import stream_chat, text, wait_index_live

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.tiny_model import ensure_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--plain-core", default="0")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/kvdisagg-later-turns"))
    ap.add_argument("--first-turns", action="store_true",
                    help="every request a fresh conversation's first turn (uncached)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(7)
    history = [{"role": "system", "content": text(rng, 450)},
               {"role": "user", "content": text(rng, 70)},
               {"role": "assistant", "content": text(rng, 40)}]

    def turn() -> list[dict[str, str]]:
        if args.first_turns:
            return [{"role": "system", "content": text(rng, 450)},
                    {"role": "user", "content": text(rng, 70)}]
        return [*history, {"role": "user", "content": text(rng, 70)}]

    fleet = Fleet(ensure_tiny_model(), args.log_dir, kv_events=True, always_disaggregate=False,
                  reference=True, binds={"reference": args.plain_core})
    with fleet:
        assert fleet.reference is not None
        wait_index_live(fleet.proxy_url, 2)
        targets = {"plain": fleet.reference.base_url, "decode direct": fleet.decode.base_url,
                   "proxy": fleet.proxy_url,
                   "proxy, slow probes": fleet.extra_proxy(["--health-interval", "30"], "slow")}
        for url in targets.values():  # every cache holds the conversation so far
            stream_chat(url, turn(), args.max_tokens)
        ttft: dict[str, list[float]] = {name: [] for name in targets}
        routes: dict[str, set[str]] = {name: set() for name in targets}
        names = list(targets)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds, _, _, route = stream_chat(targets[name], turn(), args.max_tokens)
                ttft[name].append(seconds * 1e3)
                routes[name].add(route)
            print(f"round {r + 1}/{args.rounds}", end="\r", file=sys.stderr, flush=True)
    base = statistics.median(ttft["plain"])
    print(f"\n{'target':<20} {'p50 ms':>7} {'x plain':>7} {'p25':>6} {'p75':>6}  routes")
    rows = []
    for name, values in ttft.items():
        q1, p50, q3 = statistics.quantiles(values, n=4)
        print(f"{name:<20} {p50:>7.1f} {p50 / base:>7.2f} {q1:>6.1f} {q3:>6.1f}  "
              f"{', '.join(sorted(routes[name]))}")
        rows.append({"target": name, "p50_ms": p50, "ratio": p50 / base, "p25_ms": q1,
                     "p75_ms": q3, "routes": sorted(routes[name]), "ttft_ms": values})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
