"""Measure a live instance's prefill and decode batch latency over HTTP, as ``LatencySample``s
for ``kvdisagg.planner.profile.fit_profile``.

Measured from the client, so any OpenAI-compatible vLLM works and nothing is imported from it:

* **prefill (B, L)**: ``B`` requests of ``L`` distinct random tokens sent at once with
  ``max_tokens=1``; the sample is the burst's wall time (first send to last answer), the median
  over ``repeats``. It includes the API server's path (a few ms), which a request also pays in
  serving; when B*L exceeds the engine's token budget the burst spans several steps, so the grid
  is capped by ``max_batch_tokens``.
* **decode (B, ctx)**: ``B`` streams of ``N`` tokens after a ``ctx``-token prompt; the sample is
  the median inter-token gap while all ``B`` streams are generating (the engine's step period),
  at the mean context ``ctx + N/2``.

Prompts never repeat (a prefix-cache hit would measure nothing), and one warm-up request runs
first. The KV capacity comes from vLLM's ``vllm:cache_config_info`` (blocks x block size).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import aiohttp

from kvdisagg.bench import scrape
from kvdisagg.bench.client import ClientConfig, send
from kvdisagg.bench.records import RequestRecord
from kvdisagg.bench.workload import RequestSpec
from kvdisagg.planner.profile import LatencySample


class Grid(NamedTuple):
    prefill_batch: Sequence[int] = (1, 2, 4)
    prefill_len: Sequence[int] = (32, 128, 256, 512)
    decode_batch: Sequence[int] = (1, 4, 8, 16)
    decode_ctx: Sequence[int] = (64, 512)
    decode_tokens: int = 24
    repeats: int = 2
    max_batch_tokens: int = 2048

    def prefill_points(self) -> list[tuple[int, int]]:
        return [(b, n) for b in self.prefill_batch for n in self.prefill_len
                if b * n <= self.max_batch_tokens]

    def decode_points(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batch for c in self.decode_ctx]


class MeasureError(RuntimeError):
    pass


OnStep = Callable[[str], None]


class Profiler:
    def __init__(self, url: str, cfg: ClientConfig, *, tp: int = 1, pp: int = 1,
                 seed: int = 0, token_ids: tuple[int, int] = (10, 500)) -> None:
        self.url, self.cfg, self.tp, self.pp = url.rstrip("/"), cfg, tp, pp
        self.rng = random.Random(seed)
        self.token_ids = token_ids
        self.repeats = 2  # per grid point; set from the Grid by measure()

    def _spec(self, i: int, prompt_len: int, output_len: int) -> RequestSpec:
        lo, hi = self.token_ids
        return RequestSpec(i, 0.0, prompt_len, output_len,
                           [self.rng.randrange(lo, hi) for _ in range(prompt_len)])

    async def _burst(self, session: aiohttp.ClientSession, batch: int, prompt_len: int,
                     output_len: int) -> list[RequestRecord]:
        specs = [self._spec(i, prompt_len, output_len) for i in range(batch)]
        recs = [RequestRecord(endpoint="profile", run="profile", index=s.index, rate=None,
                              scheduled_at_s=0.0, sent_at_s=0.0, prompt_len=prompt_len,
                              output_len=output_len) for s in specs]
        t0 = time.perf_counter()
        await asyncio.gather(*(send(session, self.url, s, self.cfg, r, t0)
                               for s, r in zip(specs, recs)))
        bad = [r for r in recs if not r.ok]
        if bad:
            raise MeasureError(f"{self.url}: request failed while profiling "
                               f"(batch {batch}, prompt {prompt_len}): {bad[0].error}")
        return recs

    async def prefill(self, session: aiohttp.ClientSession, batch: int, length: int) -> float:
        times = []
        for _ in range(max(1, self.repeats)):
            recs = await self._burst(session, batch, length, 1)
            times.append(max(r.done_at_s or 0.0 for r in recs) - min(r.sent_at_s for r in recs))
        return statistics.median(times)

    async def decode(self, session: aiohttp.ClientSession, batch: int, ctx: int,
                     tokens: int) -> float:
        gaps_all: list[float] = []
        for _ in range(max(1, self.repeats)):
            recs = await self._burst(session, batch, ctx, tokens)
            gaps_all += steady_gaps(recs)
        if not gaps_all:
            raise MeasureError(f"no inter-token gap measured at batch {batch}, context {ctx}")
        return statistics.median(gaps_all)

    async def measure(self, grid: Grid, on_step: OnStep | None = None) -> list[LatencySample]:
        self.repeats = grid.repeats
        samples: list[LatencySample] = []
        say = on_step or (lambda _msg: None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await self._burst(session, 1, 16, 4)  # warm-up
            for b, n in grid.prefill_points():
                s = await self.prefill(session, b, n)
                samples.append(LatencySample.uniform("prefill", b, n, s, tp=self.tp, pp=self.pp))
                say(f"prefill batch {b:3d} x {n:5d} tokens: {s * 1000:8.2f} ms")
            for b, c in grid.decode_points():
                s = await self.decode(session, b, c, grid.decode_tokens)
                ctx = c + grid.decode_tokens // 2
                samples.append(LatencySample.uniform("decode", b, ctx, s, tp=self.tp, pp=self.pp))
                say(f"decode  batch {b:3d} at ctx {ctx:5d}:     {s * 1000:8.2f} ms/step")
        return samples

    async def kv_capacity_tokens(self, attempts: int = 3, timeout_s: float = 30.0) -> int | None:
        """``num_gpu_blocks * block_size`` from vLLM's cache_config_info, None if not exposed.

        A busy instance can be slow to answer /metrics right after the last burst (fetch tries
        again); one that answers without the gauge is final."""
        async with aiohttp.ClientSession() as session:
            samples = await scrape.fetch(session, self.url, timeout_s=timeout_s,
                                         attempts=attempts)
        for s in samples or ():
            if s.name == "vllm:cache_config_info":
                try:
                    return int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
                except (KeyError, ValueError):
                    return None
        return None


def steady_gaps(recs: Sequence[RequestRecord]) -> list[float]:
    """Inter-token gaps of tokens that arrived while *every* stream of the burst was generating
    (after the last first token, up to the first last token): the full batch's step period."""
    spans = []
    for r in recs:
        if r.ttft_s is None or r.done_at_s is None:
            continue
        first = r.sent_at_s + r.ttft_s
        stamps = [first]
        for g in r.itl_s:
            stamps.append(stamps[-1] + g)
        spans.append(stamps)
    if not spans:
        return []
    start = max(s[0] for s in spans)
    end = min(s[-1] for s in spans)
    gaps = [b - a for s in spans for a, b in zip(s, s[1:]) if start < b <= end]
    if not gaps:  # the streams never all overlapped (prefill spread over several steps)
        gaps = [b - a for s in spans for a, b in zip(s[1:], s[2:])]
    return gaps


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer for one token, from a Hugging Face ``config.json``."""
    import json
    from pathlib import Path

    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "float16")
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}.get(dtype, 2)
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * size
