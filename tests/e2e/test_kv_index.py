"""One plain vLLM instance (no DisaggConnector) for two concerns (issue 27 merged the former
test_vllm_cpu_fixes.py here: one start-up less): the tiny model with ``--kv-events-config``
(publisher and replay on loopback ports), every prompt past 64 tokens prefilled in chunks
(``--max-num-batched-tokens 64``: a chunked prefill's events are what the index must follow
under load).

The cache index on it (issue 15, point 2): completions and chats whose prompts span several
128-token blocks: the proxy's token ids (in process) equal vLLM's own (/tokenize and the
request's prompt_token_ids), the index built from the instance's real events predicts exactly
the prefix it caches, a follow-up sharing the prefix is predicted the hit vLLM then reports
(vllm:prefix_cache_hits / queries), and an index started later learns the same from the replay
buffer. Then (last) the CPU worker's seeded chunks (below).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.local.fleet import kv_events_args
from kvdisagg.local.servers import VllmServer
from kvdisagg.local.tiny_model import _WORDS
from kvdisagg.proxy.config import CacheIndexConfig, TokenizerConfig, TokenizerMode
from kvdisagg.proxy.fleet.upstream import Pool
from kvdisagg.proxy.routing.cache_index import CacheIndex, IndexState
from kvdisagg.proxy.routing.tokens import RequestTokenizer
from tests.e2e.conftest import BLOCK, LOG_DIR, completion_tokens, metric, post, prompt_ids

pytestmark = pytest.mark.e2e

WAIT_S = 60.0
BUDGET = 64  # vLLM's step budget: every prompt past it is prefilled in chunks


@pytest.fixture(scope="module")
def instance(model: Path):
    server = VllmServer(model, log_path=LOG_DIR / "kv-index.log", worker_in_engine=True,
                        extra_args=[*kv_events_args("kv-index"),  # loopback and a socket file
                                    "--max-num-batched-tokens", str(BUDGET)])
    with server:
        server.wait_ready(900)
        yield server


def words(n_tokens: int, seed: int) -> str:
    """Fresh text of about ``n_tokens`` tiny-model tokens (random words: no accidental hit)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(int(n_tokens / 1.2)))


def shared_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * BLOCK <= min(len(a), len(b)) and a[n * BLOCK:(n + 1) * BLOCK] == b[
            n * BLOCK:(n + 1) * BLOCK]:
        n += 1
    return n


class Counters:
    """vLLM's own prefix-cache counters (tokens), read before and after a request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queries, self.hits = self.read()

    def read(self) -> tuple[float, float]:
        return (metric(self.url, "vllm:prefix_cache_queries"),
                metric(self.url, "vllm:prefix_cache_hits"))

    def delta(self, queries: int) -> tuple[int, int]:
        """(queries, hits) since the last call, once ``queries`` more tokens were counted."""
        deadline = time.monotonic() + 30
        while True:
            q, h = self.read()
            if q - self.queries >= queries or time.monotonic() > deadline:
                out = (int(q - self.queries), int(h - self.hits))
                self.queries, self.hits = q, h
                return out
            time.sleep(0.2)


async def until_held(index: CacheIndex, url: str, ids: list[int], tokens: int) -> int:
    """What the index says ``url`` holds of ``ids`` once it says ``tokens`` (or the time is up)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = index.cached_tokens(ids + [0]).get(url, -1)  # + a token: the whole of ids counts
        if got == tokens or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def setup(server: VllmServer) -> tuple[CacheIndex, RequestTokenizer, Pool]:
    index = CacheIndex(CacheIndexConfig(connect_timeout_s=10))
    tok = RequestTokenizer(TokenizerConfig(model=server.model))
    await tok.start()
    await index.watch(server.base_url, "decode")
    assert await index.wait_live(server.base_url, WAIT_S), index.status()
    return index, tok, Pool(server.base_url)


async def same_ids(
    tok: RequestTokenizer, pool: Pool, body: dict[str, Any], chat: bool
) -> list[int]:
    """The local ids of ``body``, checked against vLLM's /tokenize."""
    local = tok.local(body, chat)
    assert local is not None and len(local) == 1
    assert await tok.remote(body, chat, pool) == local
    return local[0]


def generate(url: str, body: dict[str, Any], chat: bool) -> list[int]:
    """Send one request (1 token, greedy); the prompt token ids vLLM ran."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, out = post(url + path, dict(body, max_tokens=1, temperature=0, return_token_ids=True))
    assert status == 200, out
    return out["prompt_token_ids"] if chat else out["choices"][0]["prompt_token_ids"]


def check_prefix_hits(server: VllmServer, first: dict[str, Any], follow: dict[str, Any],
                      chat: bool) -> None:
    async def go() -> None:
        url = server.base_url
        index, tok, pool = await setup(server)
        try:
            ids = await same_ids(tok, pool, first, chat)
            assert len(ids) >= 3 * BLOCK + 10
            counters = Counters(url)
            assert index.cached_tokens(ids) == {url: 0}  # fresh words
            assert await asyncio.to_thread(generate, url, first, chat) == ids
            assert counters.delta(len(ids)) == (len(ids), 0)
            held = len(ids) // BLOCK * BLOCK  # full blocks of the prompt (1 token: no decode)
            assert await until_held(index, url, ids, held) == held, index.status()

            ids2 = await same_ids(tok, pool, follow, chat)
            predicted = index.cached_tokens(ids2)[url]
            expect = min(shared_blocks(ids, ids2), len(ids) // BLOCK,
                         (len(ids2) - 1) // BLOCK) * BLOCK
            assert predicted == expect and predicted >= 2 * BLOCK
            assert await asyncio.to_thread(generate, url, follow, chat) == ids2
            assert counters.delta(len(ids2)) == (len(ids2), predicted)  # vLLM agrees
            s = next(s for s in index.status() if s.url == url)
            assert s.state is IndexState.LIVE and s.block_size == BLOCK
            c = s.counters
            assert (c.gaps, c.drops, c.invalid, c.orphans, c.ignored) == (0, 0, 0, 0, 0)
        finally:
            await index.close()
            pool.close()

    asyncio.run(go())


def test_completion_hits_are_predicted(instance: VllmServer) -> None:
    prompt = words(3 * BLOCK + 60, seed=1)
    check_prefix_hits(instance, {"model": "tiny", "prompt": prompt},
                      {"model": "tiny", "prompt": prompt + " " + words(200, seed=2)}, chat=False)


def test_chat_hits_are_predicted(instance: VllmServer) -> None:
    system = words(3 * BLOCK + 40, seed=3)
    first = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": words(40, seed=4)}]}
    follow = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": words(300, seed=5)}]}
    check_prefix_hits(instance, first, follow, chat=True)


def test_a_late_index_learns_from_the_replay(instance: VllmServer) -> None:
    """The state before the proxy listened comes from vLLM's replay buffer."""
    body = {"model": "tiny", "prompt": words(2 * BLOCK + 50, seed=6)}
    ids = generate(instance.base_url, body, chat=False)

    async def go() -> None:
        index, tok, pool = await setup(instance)
        try:
            assert tok.local(body, False) == [ids]
            assert index.cached_tokens(ids + [0]) == {instance.base_url: 2 * BLOCK}
            s = index.status()[0]
            assert s.counters.replays >= 1 and s.blocks >= 2 and s.counters.drops == 0
        finally:
            await index.close()
            pool.close()

    asyncio.run(go())


def test_local_tokens_equal_tokenize_for_body_variants(instance: VllmServer) -> None:
    """The local way against vLLM's /tokenize on the shapes it accepts (exact or refused)."""
    text = words(150, seed=7)
    bodies: list[tuple[dict[str, Any], bool]] = [
        ({"prompt": text}, False), ({"prompt": [text, "hello world"]}, False),
        ({"prompt": text, "add_special_tokens": False}, False),
        ({"messages": [{"role": "user", "content": text}]}, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a b"},
                                                    {"type": "text", "text": text}]}]}, True),
        ({"messages": [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": text, "name": "ann"},
                       {"role": "assistant", "content": "ok", "tool_calls": None},
                       {"role": "user", "content": "and?"}]}, True),
        ({"messages": [{"role": "user", "content": text}], "add_generation_prompt": False}, True),
        ({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "so"}],
          "add_generation_prompt": False, "continue_final_message": True}, True),
        ({"messages": [{"role": "user", "content": text}], "add_special_tokens": True}, True),
        ({"messages": [{"role": "user", "content": text}],
          "chat_template_kwargs": {"unused": 1}}, True),
    ]

    async def go() -> None:
        tok = RequestTokenizer(TokenizerConfig(model=instance.model))
        await tok.start()
        remote = RequestTokenizer(TokenizerConfig(mode=TokenizerMode.REMOTE))
        pool = Pool(instance.base_url)
        try:
            for body, chat in bodies:
                body = dict(body, model="tiny")
                local = tok.local(body, chat)
                assert local is not None, body
                assert await remote.token_ids(body, chat, pool) == local, body
        finally:
            pool.close()

    asyncio.run(go())


# vLLM 0.32's CPU worker with kvdisagg's plugin (kvdisagg/plugin.py): a seeded request whose
# prompt is computed in chunks is answered as if it had been computed at once. Without the
# plugin's ``_cpu_seeded_chunks`` the first such step kills EngineCore ("CPU Generator does not
# use offset"): here every prompt past BUDGET tokens is chunked; under load the step budget left
# over does the same to any seeded prompt. Last: the index tests above see the instance's
# history from empty.


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_prompt_in_chunks_is_answered_like_one_computed_at_once(fleet, instance, stream):
    body = {"model": "tiny", "prompt": prompt_ids(5 * BUDGET + 20, seed=77), "max_tokens": 24,
            "temperature": 1.0, "seed": 4242, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}
    got = completion_tokens(instance.base_url, body)
    assert got[0] == "ok", got  # the engine survived its chunks
    # The plain instance computes the prompt in one step: same seed, same tokens, so the
    # dropped samples of the chunks left the request's random stream where it was.
    assert got == completion_tokens(fleet.reference.base_url, body)
    # Sampling, not greedy: another seed gives other tokens.
    other = completion_tokens(instance.base_url, body | {"seed": 4243})
    assert other[0] == "ok" and other[1] != got[1]
