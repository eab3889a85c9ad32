"""What a cache-hit prediction costs the proxy per request: a body's token ids in process
(``tokenizer.mode: local``) vs vLLM's ``POST /tokenize`` (``remote``), then the index lookup.

One vLLM instance (tiny model, its own core, KV events on) and this process, side by side in one
run, one call at a time. For each body kind (completion text, chat with a system prompt) and
length (about 100, 1000, 2000 prompt tokens; fresh random words each round; *conversation*: turn
N of a chat, whose system prompt and earlier turns are the same every round and whose last
answer and new user message, ~150 tokens, are fresh):

    local       RequestTokenizer.local(): transformers tokenizer + chat template in process,
                with the memo of text between special tokens (token_memo.py)
    whole       the same without the memo (``memo_tokens: 0``): every prompt tokenized whole
    token_ids   RequestTokenizer.token_ids() in local mode: the same, in a worker thread for
                bodies of tokenizer.thread_min_chars or more (what a request waits)
    remote      RequestTokenizer.remote(): POST /tokenize over a kept-alive connection
    lookup      CacheIndex.cached_tokens() on those ids, the instance's prefix cached

Each local result is checked against /tokenize's (exact or the run fails). p50 and p99 wall
time in microseconds, and for the in-process parts the p50 CPU time of this thread (``cpu``: what
they cost without contention from the instance and other processes on the machine); the proxy's
per-request overhead budget is about 1 ms.

    .venv/bin/python benchmarks/tokenizer.py [--rounds 200] [--out out/tokenize.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvdisagg.local.servers import VllmServer, free_port
from kvdisagg.local.tiny_model import _WORDS, ensure_tiny_model
from kvdisagg.proxy.config import CacheIndexConfig, TokenizerConfig
from kvdisagg.proxy.fleet.upstream import Pool
from kvdisagg.proxy.routing.cache_index import CacheIndex
from kvdisagg.proxy.routing.tokens import RequestTokenizer

LENGTHS = (100, 1000, 2000)
CHARS_PER_TOKEN = 4.5  # the tiny tokenizer on these words (checked against the real counts)


def text(n_tokens: int, rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_tokens * CHARS_PER_TOKEN:
        words.append(rng.choice(_WORDS))
    return " ".join(words)


_HISTORY: dict[int, str] = {}


def body(kind: str, n: int, rng: random.Random) -> dict[str, Any]:
    if kind == "completion":
        return {"model": "tiny", "prompt": text(n, rng)}
    if kind == "chat":
        return {"model": "tiny", "messages": [{"role": "system", "content": text(n - 20, rng)},
                                              {"role": "user", "content": text(15, rng)}]}
    # turn N of a conversation: what came before is the same every round, the last answer
    # (48 tokens) and the new user message (100) are new
    history = _HISTORY.setdefault(n, text(n - 160, random.Random(n)))
    return {"model": "tiny", "messages": [
        {"role": "system", "content": history}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": text(48, rng)},
        {"role": "user", "content": text(100, rng)}]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(server: VllmServer, rounds: int) -> dict[str, Any]:
    tok = RequestTokenizer(TokenizerConfig(model=server.model))
    whole = RequestTokenizer(TokenizerConfig(model=server.model, memo_tokens=0))
    await tok.start()
    await whole.start()
    pool = Pool(server.base_url)
    index = CacheIndex(CacheIndexConfig())
    await index.watch(server.base_url)
    if not await index.wait_live(server.base_url, 60):
        raise SystemExit(f"no KV events from {server.base_url}: {index.status()}")
    rng = random.Random(0)
    out: dict[str, Any] = {}
    try:
        for kind in ("completion", "chat", "conversation"):
            for n in LENGTHS:
                if kind == "conversation" and n < 500:
                    continue
                local_us: list[float] = []
                whole_us: list[float] = []
                async_us: list[float] = []
                remote_us: list[float] = []
                lookup_us: list[float] = []
                local_cpu: list[float] = []
                lookup_cpu: list[float] = []
                counts: list[int] = []
                chat = kind != "completion"
                # the prefix cached: the lookup walks every block of a real prompt
                warm = body(kind, n, rng)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                resp = await pool.request(b"POST", path, json.dumps(
                    dict(warm, max_tokens=1)).encode(), b"Content-Type: application/json\r\n",
                    connect_s=10, headers_s=300)
                await resp.read(300)
                ids_warm = tok.local(warm, chat)
                assert ids_warm is not None
                deadline = time.monotonic() + 30
                held = len(ids_warm[0]) // 128 * 128  # its full blocks (a short one has none)
                while index.cached_tokens(ids_warm[0] + [1]).get(server.base_url) != held:
                    if time.monotonic() > deadline:
                        raise SystemExit("the index never saw the warm-up prompt")
                    await asyncio.sleep(0.05)
                for r in range(rounds + 5):
                    b = body(kind, n, rng)
                    c0, t0 = time.thread_time(), time.perf_counter()
                    local = tok.local(b, chat)
                    t1, c1 = time.perf_counter(), time.thread_time()
                    remote = await tok.remote(b, chat, pool)
                    t2 = time.perf_counter()
                    if local != remote or local is None:
                        raise SystemExit(f"{kind} {n}: local ids differ from /tokenize's")
                    c3, t3 = time.thread_time(), time.perf_counter()
                    index.cached_tokens(ids_warm[0])
                    t4, c4 = time.perf_counter(), time.thread_time()
                    assert await tok.token_ids(b, chat) == local
                    t5 = time.perf_counter()
                    assert whole.local(b, chat) == local
                    t6 = time.perf_counter()
                    if r >= 5:  # warm-up rounds
                        local_us.append((t1 - t0) * 1e6)
                        whole_us.append((t6 - t5) * 1e6)
                        remote_us.append((t2 - t1) * 1e6)
                        lookup_us.append((t4 - t3) * 1e6)
                        async_us.append((t5 - t4) * 1e6)
                        local_cpu.append((c1 - c0) * 1e6)
                        lookup_cpu.append((c4 - c3) * 1e6)
                        counts.append(len(local[0]))
                row = {"tokens": round(statistics.mean(counts)), "local_p50": pct(local_us, .5),
                       "local_p99": pct(local_us, .99), "whole_p50": pct(whole_us, .5),
                       "token_ids_p50": pct(async_us, .5),
                       "token_ids_p99": pct(async_us, .99), "local_cpu_p50": pct(local_cpu, .5),
                       "lookup_cpu_p50": pct(lookup_cpu, .5), "remote_p50": pct(remote_us, .5),
                       "remote_p99": pct(remote_us, .99), "lookup_p50": pct(lookup_us, .5),
                       "lookup_p99": pct(lookup_us, .99)}
                out[f"{kind}-{n}"] = row
                print(f"{kind:12s} {row['tokens']:5d} tok  local {row['local_p50']:6.0f} /"
                      f"{row['local_p99']:6.0f} (cpu {row['local_cpu_p50']:5.0f}, whole "
                      f"{row['whole_p50']:6.0f})  token_ids {row['token_ids_p50']:6.0f} /"
                      f"{row['token_ids_p99']:6.0f}  /tokenize {row['remote_p50']:6.0f} /"
                      f"{row['remote_p99']:6.0f}  lookup {row['lookup_p50']:4.0f} /"
                      f"{row['lookup_p99']:4.0f} (cpu {row['lookup_cpu_p50']:3.0f})   (us, p50 / p99)",
                      flush=True)
    finally:
        await index.close()
        pool.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log", type=Path, default=Path("/tmp/kvdisagg-tokenize-bench.log"))
    args = ap.parse_args()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}"}
    server = VllmServer(ensure_tiny_model(), log_path=args.log, omp_threads_bind="1",
                        extra_args=["--kv-events-config", json.dumps(events)])
    with server:
        server.wait_ready(900)
        print(f"vLLM up at {server.base_url} (core 1); this process runs unpinned",
              file=sys.stderr)
        result = asyncio.run(measure(server, args.rounds))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
