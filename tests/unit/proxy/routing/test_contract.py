"""The request-semantics contract (proxy/routing/contract.py): which paths serve a request exactly
as a plain vLLM instance does, decided from the request alone. The differential suite
(tests/e2e/test_conformance.py) holds the table against real vLLM instances."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.contract import Path, limit_key, multimodal, paths

STREAM = {"model": "tiny", "max_tokens": 8, "stream": True}


def parsed(fields: dict[str, Any], chat: bool = False) -> bodies.ClientBody:
    base = {**STREAM, **({"messages": [{"role": "user", "content": "hi"}]} if chat
                         else {"prompt": "hi"})}
    return bodies.parse(json.dumps({**base, **fields}).encode(), chat, 256)


@pytest.mark.parametrize("fields, chat, handoff, first, migration", [
    ({}, False, None, None, None),
    ({}, True, None, None, None),
    ({"stream": False}, False, None, "not_one_stream", "not_one_stream"),
    ({"n": 2}, False, None, "not_one_stream", "not_one_stream"),
    ({"logprobs": 0}, False, None, "field:logprobs", None),  # 0: the sampled token's
    ({"logprobs": True, "top_logprobs": 2}, True, None, "field:logprobs", None),
    ({"echo": True}, False, None, "field:echo", "field:echo"),
    ({"echo": True, "logprobs": 1}, False, "prompt_logprobs", "prompt_logprobs",
     "prompt_logprobs"),
    ({"prompt_logprobs": 1}, False, "prompt_logprobs", "prompt_logprobs", "prompt_logprobs"),
    ({"use_beam_search": True}, False, "beam_search", "beam_search", "beam_search"),
    ({"min_tokens": 9}, False, "invalid_min_tokens", "invalid_min_tokens",
     "invalid_min_tokens"),
    ({"min_tokens": -1}, False, "invalid_min_tokens", "invalid_min_tokens",
     "invalid_min_tokens"),
    ({"min_tokens": 2.5}, False, "invalid_min_tokens", "invalid_min_tokens",
     "invalid_min_tokens"),
    ({"min_tokens": 8}, False, None, None, None),
    ({"max_tokens": None, "min_tokens": 2}, False, None, "min_tokens_without_limit",
     "min_tokens_without_limit"),
    ({"max_tokens": 8.0}, False, None, "limit_not_integer", "limit_not_integer"),
    ({"max_tokens": 1}, False, None, "one_token", None),
    ({"seed": 5}, False, None, "field:seed", "field:seed"),
    ({"seed": 5, "temperature": 0}, False, None, None, None),  # greedy: the seed is inert
    ({"stop": ["x"]}, False, None, "field:stop", "field:stop"),
    ({"presence_penalty": 0.5}, False, None, "field:presence_penalty",
     "field:presence_penalty"),
    ({"frequency_penalty": 0.5}, False, None, "field:frequency_penalty",
     "field:frequency_penalty"),
    ({"repetition_penalty": 1.3}, False, None, None, None),  # prompt and output alike
    ({"bad_words": ["x"]}, False, None, "field:bad_words", "field:bad_words"),
    ({"structured_outputs": {"choice": ["a"]}}, False, None, "field:structured_outputs",
     "field:structured_outputs"),
    ({"response_format": {"type": "json_object"}}, True, None, "field:response_format",
     "field:response_format"),
    ({"tools": []}, True, None, "field:tools", "field:tools"),
    ({"truncate_prompt_tokens": 4}, False, None, "field:truncate_prompt_tokens",
     "field:truncate_prompt_tokens"),
    ({"stream_options": {"include_usage": True}}, False, None, None, None),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, False,
     None, "field:stream_options", None),
    ({"add_generation_prompt": False}, True, None, "field:add_generation_prompt",
     "field:add_generation_prompt"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     True, None, "multimodal", "multimodal"),
    ({"a_field_from_a_later_vllm": 1}, False, None, "field:a_field_from_a_later_vllm",
     "field:a_field_from_a_later_vllm"),
])
def test_the_table(fields: dict[str, Any], chat: bool, handoff: str | None,
                   first: str | None, migration: str | None) -> None:
    p = parsed(fields, chat).paths
    assert (p.handoff, p.first_token, p.migration) == (handoff, first, migration)
    assert p.declines(Path.MIGRATION) == migration


@pytest.mark.parametrize("fields, key, limit", [
    ({"max_tokens": 5}, "max_tokens", 5),
    ({"max_completion_tokens": 4, "max_tokens": 5}, "max_completion_tokens", 4),
    # vLLM: max_completion_tokens unless it is null, then max_tokens
    ({"max_completion_tokens": None, "max_tokens": 5}, "max_tokens", 5),
    ({}, "max_tokens", None),
])
def test_the_limit_is_the_one_vllm_reads(fields: dict[str, Any], key: str,
                                         limit: int | None) -> None:
    assert limit_key(fields, True) == key
    assert paths({"messages": [], **fields}, True, True, 1).limit == limit
    # completions has no max_completion_tokens: vLLM ignores it
    assert limit_key(fields, False) == "max_tokens"


def test_null_max_completion_tokens_is_reduced_where_vllm_reads_the_limit() -> None:
    """(issue 26 #2) a chat continuation reduces max_tokens when max_completion_tokens is
    null, and the decode-alone route uses the same limit."""
    body = parsed({"max_completion_tokens": None, "max_tokens": 3}, chat=True)
    assert body.paths.limit == 3 and body.route.max_tokens == 3


def test_text_parts_alone_are_not_multimodal() -> None:
    assert not multimodal({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}]})
    assert multimodal({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]})


def test_the_docs_table_is_this_modules_table() -> None:
    """docs/proxy.md lists the continuable fields: exactly contract._CONTINUABLE (and the seed,
    which greedy sampling makes inert)."""
    import re
    from pathlib import Path

    from kvdisagg.proxy.routing.contract import _CONTINUABLE

    docs = (Path(__file__).resolve().parents[4] / "docs" / "proxy.md").read_text()
    para = docs.split("**Continuable fields**", 1)[1].split("Any other field", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", para)) == _CONTINUABLE | {"seed"}
