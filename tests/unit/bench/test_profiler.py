"""kvdisagg profile's measuring side against a fake streaming server whose prefill and decode
times are known (``delay_s`` before the first token, ``token_delay_s`` per token)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvdisagg.bench.client import ClientConfig
from kvdisagg.bench.profiler import Grid, Profiler, kv_bytes_per_token, steady_gaps
from kvdisagg.bench.records import RequestRecord
from kvdisagg.planner.profile import fit_profile

from .test_client import fake, serve


def stream(sent: float, ttft: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(endpoint="p", run="p", index=0, rate=None, scheduled_at_s=0.0,
                         sent_at_s=sent, prompt_len=1, output_len=len(gaps) + 1, ok=True,
                         ttft_s=ttft, itl_s=gaps, done_at_s=sent + ttft + sum(gaps))


def test_steady_gaps_keep_only_the_all_active_window() -> None:
    a = stream(0.0, 1.0, [1.0, 1.0, 1.0, 1.0])  # tokens at 1, 2, 3, 4, 5
    b = stream(0.0, 2.5, [0.5, 0.5, 5.0])  # tokens at 2.5, 3, 3.5, 8.5
    # window (2.5, 5]: a's tokens at 3, 4, 5 and b's at 3, 3.5
    assert sorted(steady_gaps([a, b])) == [0.5, 0.5, 1.0, 1.0, 1.0]
    assert steady_gaps([]) == []
    # Streams that never all overlap: every gap but the first of each stream.
    late = stream(20.0, 1.0, [2.0, 3.0])
    assert sorted(steady_gaps([a, late])) == [1.0, 1.0, 1.0, 3.0]


def test_profiler_measures_known_times_and_fit_accepts_them() -> None:
    f = fake(delay_s=0.05, token_delay_s=0.02)

    async def go():
        async with serve(f) as url:
            p = Profiler(url, ClientConfig(model="m", total_s=10, idle_s=5))
            grid = Grid(prefill_batch=(1, 2), prefill_len=(8, 16), decode_batch=(1, 3),
                        decode_ctx=(8, 16), decode_tokens=6, repeats=1)
            return await p.measure(grid), await p.kv_capacity_tokens()
    samples, capacity = asyncio.run(go())
    pre = [s for s in samples if s.phase == "prefill"]
    dec = [s for s in samples if s.phase == "decode"]
    assert len(pre) == 4 and len(dec) == 4
    assert {(s.batch_size, s.num_tokens) for s in pre} == {(1, 8), (1, 16), (2, 16), (2, 32)}
    assert all(0.06 <= s.seconds < 0.4 for s in pre)  # 50 ms + first token's 20 ms
    assert all(0.015 <= s.seconds < 0.1 for s in dec)  # one 20 ms step
    assert {(s.batch_size, s.num_tokens) for s in dec} == {(1, 12), (1, 20), (3, 36), (3, 60)}
    assert capacity is None  # the fake has no cache_config_info
    prof = fit_profile(samples, model="m")
    assert prof.configs[0].prefill[0] > 0  # a constant-time fake fits the intercept
    # Every distinct request had a distinct prompt: no prefix-cache hits would be measured.
    prompts = [json.dumps(s["body"]["prompt"]) for s in f.seen]
    assert len(set(prompts)) == len(prompts)


def test_kv_bytes_per_token_from_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "hidden_size": 256, "num_hidden_layers": 2, "torch_dtype": "float32"}))
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 2 * 2 * 64 * 4


def test_profile_cli_refuses_a_grid_too_small_to_fit() -> None:
    from kvdisagg.cli import main

    with pytest.raises(SystemExit, match=">= 3 prefill points"):
        main(["profile", "--url", "http://127.0.0.1:1", "--model", "m",
              "--prefill-batch", "1", "--prefill-len", "8", "16"])
