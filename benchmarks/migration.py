"""A decode killed under load, as a user would try it: streams migrate, none is lost.

    .venv/bin/python benchmarks/migration.py [--streams 20] [--tokens 1500] [--out out/migration]

1P2D behind the proxy plus a plain vLLM instance. ``--streams`` concurrent greedy streams of
``--tokens`` output tokens each (prompts of 100-460 tokens) go through the proxy; once every
stream has delivered tokens and a third of all tokens are out, one of the two decodes is killed
(SIGKILL). Every stream must complete, token for token the plain instance's answer to the same
prompt. Prints each stream's outcome and the totals (the proxy's migration counts, the killed
decode's streams at the kill); writes them as JSON to ``--out``/migration.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import metric_value
from kvdisagg.local.tiny_model import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.conftest import post, prompt_ids

P = "kvdisagg_proxy_"


class Stream:
    """One streamed request through the proxy: its token ids as they arrive, and how it ended."""

    def __init__(self, i: int, body: dict[str, Any]) -> None:
        self.i, self.body = i, body
        self.ids: list[int] = []
        self.outcome = "running"
        self.error = ""
        self.first_s: float | None = None
        self.end_s: float | None = None
        self.max_gap_s = 0.0

    def run(self, url: str, t0: float) -> Stream:
        req = urllib.request.Request(url + "/v1/completions", json.dumps(self.body).encode(),
                                     {"Content-Type": "application/json"})
        last = None
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                done = False
                for line in r:
                    line = line.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.outcome, self.error = "error", str(event["error"])[:200]
                            return self
                        now = time.monotonic()
                        for choice in event.get("choices", ()):
                            self.ids += choice.get("token_ids") or []
                        if self.first_s is None:
                            self.first_s = now - t0
                        if last is not None:
                            self.max_gap_s = max(self.max_gap_s, now - last)
                        last = now
                self.outcome = "ok" if done else "cut"
        except Exception as exc:  # an outcome to report, not a crash
            self.outcome, self.error = "error", repr(exc)[:200]
        finally:
            self.end_s = time.monotonic() - t0
        return self


def plain_answers(url: str, bodies: list[dict[str, Any]]) -> list[list[int]]:
    def one(b: dict[str, Any]) -> list[int]:
        status, reply = post(url + "/v1/completions", {**b, "stream": False}, timeout=1800)
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def proxy_counts(url: str) -> dict[str, float]:
    out = {f"migrations_{o}": metric_value(url, P + "migrations_total", outcome=o)
           for o in ("ok", "failed", "exhausted", "impossible")}
    out["decode_retries"] = metric_value(url, P + "instance_retries_total", side="decode")
    out["requests_ok"] = metric_value(url, P + "requests_total", outcome="ok")
    out["requests_error"] = metric_value(url, P + "requests_total", outcome="error")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--kill-at", type=float, default=1 / 3,
                    help="kill once this share of all tokens is out (and every stream started)")
    ap.add_argument("--out", type=Path, default=Path("out/migration"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bodies = [{"model": "tiny", "prompt": prompt_ids(100 + 40 * (i % 10), seed=4000 + i),
               "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True, "stream": True} for i in range(args.streams)]
    fleet = Fleet(ensure_tiny_model(), args.out / "logs", decodes=2, reference=True,
                  binds={"prefill": "0", "decode": "1", "decode1": "0", "reference": "nobind"})
    with fleet:
        t = time.monotonic()
        want = plain_answers(fleet.reference.base_url, bodies)
        print(f"plain instance: {len(bodies)} answers of {args.tokens} tokens in "
              f"{time.monotonic() - t:.1f}s", flush=True)
        victim = fleet.decodes[1]
        before = proxy_counts(fleet.proxy_url)
        streams = [Stream(i, b) for i, b in enumerate(bodies)]
        threshold = args.kill_at * args.streams * args.tokens
        killed: dict[str, Any] = {}

        def killer(t0: float) -> None:
            while True:
                out = sum(len(s.ids) for s in streams)
                if all(s.ids for s in streams) and out >= threshold:
                    break
                if all(s.outcome != "running" for s in streams):
                    return
                time.sleep(0.05)
            held = metric_value(fleet.proxy_url, P + "instance_in_flight", side="decode",
                                instance=victim.base_url)
            victim.kill()
            killed.update(at_s=round(time.monotonic() - t0, 2), tokens_out=out,
                          streams_on_victim=held, victim=victim.base_url)
            print(f"killed {victim.base_url} (SIGKILL) at {killed['at_s']}s: {int(held)} "
                  f"streams on it, {out} tokens delivered", flush=True)

        t0 = time.monotonic()
        watcher = threading.Thread(target=killer, args=(t0,), daemon=True)
        watcher.start()
        with ThreadPoolExecutor(len(streams)) as pool:
            list(pool.map(lambda s: s.run(fleet.proxy_url, t0), streams))
        makespan = time.monotonic() - t0
        watcher.join(5)
        after = proxy_counts(fleet.proxy_url)
    rows = []
    print(f"\n{'stream':>6} {'outcome':>8} {'tokens':>6} {'identical':>9} {'ttft_s':>7} "
          f"{'end_s':>6} {'max_gap_s':>9}")
    for s, w in zip(streams, want):
        same = s.ids == w
        rows.append({"stream": s.i, "outcome": s.outcome, "tokens": len(s.ids),
                     "identical": same, "ttft_s": s.first_s, "end_s": s.end_s,
                     "max_gap_s": round(s.max_gap_s, 3), "error": s.error})
        print(f"{s.i:>6} {s.outcome:>8} {len(s.ids):>6} {str(same):>9} "
              f"{(s.first_s or 0):>7.2f} {(s.end_s or 0):>6.1f} {s.max_gap_s:>9.2f}"
              + (f"  {s.error}" if s.error else ""))
    delta = {k: after[k] - before[k] for k in after}
    totals = {"streams": len(streams), "tokens_each": args.tokens,
              "completed": sum(r["outcome"] == "ok" for r in rows),
              "identical": sum(r["identical"] for r in rows),
              "makespan_s": round(makespan, 1), "killed": killed, "proxy": delta}
    print(f"\ncompleted {totals['completed']}/{len(rows)}, greedy-identical "
          f"{totals['identical']}/{len(rows)}, makespan {makespan:.1f}s")
    print("proxy: " + ", ".join(f"{k} {v:g}" for k, v in delta.items()))
    (args.out / "migration.json").write_text(json.dumps({"totals": totals, "streams": rows},
                                                        indent=1))
    ok = totals["completed"] == totals["identical"] == len(rows) and bool(killed)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
