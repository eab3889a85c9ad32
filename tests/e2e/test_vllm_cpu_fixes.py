"""vLLM 0.32's CPU worker with kvdisagg's plugin (kvdisagg/plugin.py) on a real instance: a seeded
request whose prompt is computed in chunks is answered, as if it had been computed at once.

Without the plugin's ``_cpu_seeded_chunks`` the first such step kills EngineCore ("CPU Generator
does not use offset"): here every prompt past 64 tokens is chunked (``--max-num-batched-tokens
64``); under load the step budget left over does the same to any seeded prompt."""

from __future__ import annotations

import pytest

from kvdisagg.local.servers import VllmServer

from .conftest import LOG_DIR, completion_tokens, prompt_ids

pytestmark = pytest.mark.e2e

BUDGET = 64


@pytest.fixture(scope="module")
def chunking(model):
    server = VllmServer(model, log_path=LOG_DIR / "chunking.log",
                        extra_args=["--max-num-batched-tokens", str(BUDGET)])
    server.start()
    try:
        server.wait_ready(900)
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_prompt_in_chunks_is_answered_like_one_computed_at_once(fleet, chunking, stream):
    body = {"model": "tiny", "prompt": prompt_ids(5 * BUDGET + 20, seed=77), "max_tokens": 24,
            "temperature": 1.0, "seed": 4242, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}
    got = completion_tokens(chunking.base_url, body)
    assert got[0] == "ok", got  # the engine survived its chunks
    # The plain instance computes the prompt in one step: same seed, same tokens, so the
    # dropped samples of the chunks left the request's random stream where it was.
    assert got == completion_tokens(fleet.reference.base_url, body)
    # Sampling, not greedy: another seed gives other tokens.
    other = completion_tokens(chunking.base_url, body | {"seed": 4243})
    assert other[0] == "ok" and other[1] != got[1]
