"""Prefill and decode sharded differently, on real vLLM: TP1 -> TP2, TP2 -> TP1, TP1 -> decode
PP2, prefill PP2 -> TP1, each token-identical to a plain instance's answer (the session's, no
DisaggConnector), and each pull counted on decode for every rank (KV moved; a silent recompute
would count none).

One fleet for all four pairs: three ``kv_both`` instances (TP1, TP2, PP2; cores bound per rank,
``--distributed-executor-backend mp``), each the prefill of one pair and the decode of another.
The handoff is the protocol itself (what any proxy does): prefill with ``do_remote_decode``, then
decode with the kv_transfer_params prefill returned. Five ranks share two cores: slow, so a
handful of prompts and short answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.local.fleet import kv_transfer_args
from kvdisagg.local.servers import VllmServer, stop_all

from .conftest import KV_CACHE_GIB, LOG_DIR, metric, post, prompt_ids, wait_kv_usage_zero

pytestmark = pytest.mark.e2e

MP = ["--distributed-executor-backend", "mp"]
SHAPES = {  # name: (vLLM flags, VLLM_CPU_OMP_THREADS_BIND: one core list per rank)
    "tp1": ([], "1"),
    "tp2": (["--tensor-parallel-size", "2", *MP], "0|1"),
    "pp2": (["--pipeline-parallel-size", "2", *MP], "0|1"),
}
RANKS = {"tp1": 1, "tp2": 2, "pp2": 2}
PAIRS = [("tp1", "tp2"), ("tp2", "tp1"), ("tp1", "pp2"), ("pp2", "tp1")]  # (prefill, decode)
PROMPTS = [1, 129, 700]  # one block, a block and a bit, several blocks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def instances(model):
    log_dir = LOG_DIR / "shapes"
    servers = {
        name: VllmServer(model, log_path=log_dir / f"{name}.log", omp_threads_bind=bind,
                         kv_cache_gib=KV_CACHE_GIB,
                         extra_args=[*kv_transfer_args("kv_both"),
                                     *flags])
        for name, (flags, bind) in SHAPES.items()}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(1200)
        yield servers
    finally:
        stop_all(servers.values())


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    status, body = post(url + "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                         "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                         **extra}, timeout=900)
    assert status == 200, body
    return body


def disaggregated(prefill: str, decode: str, prompt: list[int]) -> list[int]:
    """The handoff as any proxy does it: prefill computes the prompt and hands its KV over,
    decode pulls it and generates."""
    handoff = complete(prefill, prompt, max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert handoff and handoff["do_remote_prefill"], handoff
    return complete(decode, prompt, kv_transfer_params=handoff)["choices"][0]["token_ids"]


@pytest.mark.timeout(1800)
def test_every_pair_of_shapes_is_token_identical_and_pulls_from_every_rank(instances, plain):
    """The answer is the session's plain instance's (TP1, no DisaggConnector); each shape
    gives it on its own too, so a difference below is the handoff's."""
    urls = {name: server.base_url for name, server in instances.items()}
    prompts = [prompt_ids(n, seed=n) for n in PROMPTS]
    expected = [complete(plain, p)["choices"][0]["token_ids"] for p in prompts]
    for name in SHAPES:
        assert [complete(urls[name], p)["choices"][0]["token_ids"] for p in prompts] == expected

    def run(pair: tuple[str, str]) -> list[list[int]]:
        prefill, decode = pair
        return [disaggregated(urls[prefill], urls[decode], p) for p in prompts]

    pulls = {name: metric(url, "vllm:kvdisagg_pulls_total") for name, url in urls.items()}
    with ThreadPoolExecutor(len(PAIRS)) as pool:  # every instance prefill and decode at once
        got = dict(zip(PAIRS, pool.map(run, PAIRS)))
    for pair in PAIRS:
        assert got[pair] == expected, pair
    # Every decode rank pulled each prompt (its heads or layers): a pull per rank per prompt.
    for decode in {d for _, d in PAIRS}:
        pairs = sum(1 for _, d in PAIRS if d == decode)
        moved = metric(urls[decode], "vllm:kvdisagg_pulls_total") - pulls[decode]
        assert moved >= RANKS[decode] * pairs * len(prompts), (decode, moved)
        assert metric(urls[decode], "vllm:kvdisagg_pull_failures_total") == 0
    for url in urls.values():
        assert wait_kv_usage_zero(url, timeout=60) == 0
