"""The first token from prefill (proxy/handoff/first_token.py, issue 15): which requests take it,
the events made of prefill's answer, and the continuation decode gets, against fake vLLM upstreams
(the same on real vLLM, token-identical to a plain instance: tests/e2e/test_decision.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvdisagg.proxy.app import REGISTRY
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.handoff.first_token import first_events
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.decide import takes_first_token
from kvdisagg.proxy.types import Role
from tests.support.proxy_harness import events, metric, post_stream, proxy, run, until

# prefill's answers as vLLM 0.32 writes them (max_tokens 1, return_token_ids), trimmed
CHAT = {"id": "chatcmpl-b1", "object": "chat.completion", "created": 17, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " page",
                                             "refusal": None, "reasoning": None},
                     "logprobs": None, "finish_reason": "length", "stop_reason": None,
                     "token_ids": [419]}],
        "prompt_token_ids": [1, 469, 29], "prompt_text": None, "kv_transfer_params": {}}
CMPL = {"id": "cmpl-99", "object": "text_completion", "created": 17, "model": "tiny",
        "choices": [{"index": 0, "text": "en", "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": [266], "prompt_token_ids": [273, 322]}],
        "kv_transfer_params": {}}


def parsed(data: bytes) -> list[Any]:
    assert data.endswith(b"\n\n")
    return [json.loads(e[6:]) for e in data.split(b"\n\n") if e and e != b"data: [DONE]"]


def made(chat: bool, answer: dict[str, Any], include_usage: bool = False) -> tuple[bytes, bool]:
    out = first_events(chat, json.dumps(answer).encode(), include_usage)
    assert out is not None
    return out


def test_events_are_those_vllm_streams_first() -> None:
    data, ended = made(True, CHAT)
    assert not ended and b"[DONE]" not in data
    role, token = parsed(data)
    head = {"id": "chatcmpl-b1", "object": "chat.completion.chunk", "created": 17,
            "model": "tiny"}
    assert role == {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": [1, 469, 29], "prompt_text": None}
    assert token == {**head, "choices": [{"index": 0, "delta": {"content": " page"},
                                          "logprobs": None, "finish_reason": None,
                                          "token_ids": [419]}]}
    (only,) = parsed(made(False, CMPL)[0])
    assert only == {"id": "cmpl-99", "object": "text_completion", "created": 17,
                    "model": "tiny", "choices": [{
                        "index": 0, "text": "en", "logprobs": None, "finish_reason": None,
                        "stop_reason": None, "prompt_token_ids": [273, 322],
                        "token_ids": [266]}]}


@pytest.mark.parametrize("text", ["", "caf\ufffd"])
def test_a_token_without_text_is_sent_as_vllm_sends_it(text: str) -> None:
    """A special token, or bytes of a character the next token ends: vLLM streams the token
    with the text its detokenizer gave (none, held back), and so does the proxy. Taking the
    path and then sampling again because of the token's value would bias sampling."""
    answer = json.loads(json.dumps(CMPL))
    answer["choices"][0]["text"] = text
    data, ended = made(False, answer)
    (only,) = parsed(data)
    assert not ended and only["choices"][0]["text"] == text
    answer = json.loads(json.dumps(CHAT))
    answer["choices"][0]["message"]["content"] = None if not text else text
    assert parsed(made(True, answer)[0])[1]["choices"][0]["delta"] == {"content": text}


@pytest.mark.parametrize("chat", [False, True])
def test_an_end_of_sequence_first_token_is_the_whole_answer(chat: bool) -> None:
    """Prefill's token ended the answer (EOS or a stop token): the stream ends there with
    vLLM's finish event, its usage event (when asked for: null members left out, as vLLM
    writes it) and [DONE]."""
    answer = json.loads(json.dumps(CHAT if chat else CMPL))
    answer["choices"][0] |= {"finish_reason": "stop", "stop_reason": 7}
    answer["usage"] = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1,
                       "prompt_tokens_details": None}
    data, ended = made(chat, answer, include_usage=True)
    assert ended and data.endswith(b"data: [DONE]\n\n")
    evs = parsed(data)
    last = evs[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", 7)
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == {
        "prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    data, ended = made(chat, answer, include_usage=False)
    assert ended and b'"usage"' not in data


@pytest.mark.parametrize("change", [
    {"finish_reason": "abort"},  # the leg failed: the ordinary handoff
    {"finish_reason": None},
    {"token_ids": None},
    {"token_ids": [1, 2]},
])
def test_no_events_unless_prefill_answered_one_token(change: dict) -> None:
    answer = json.loads(json.dumps(CMPL))
    answer["choices"][0] |= change
    assert first_events(False, json.dumps(answer).encode(), False) is None
    assert first_events(False, b"not json", False) is None


def test_no_events_for_a_parsers_output() -> None:
    for message in ({"content": None, "reasoning": "hm"}, {"content": "", "tool_calls": [{}]}):
        answer = json.loads(json.dumps(CHAT))
        answer["choices"][0]["message"] = {"role": "assistant", **message}
        assert first_events(True, json.dumps(answer).encode(), False) is None


@pytest.mark.parametrize("fields, want", [
    ({}, True),
    ({"stream_options": {"include_usage": True}}, True),
    ({"max_tokens": None}, True),
    ({"stream": False}, False),  # the client sees nothing before the last token
    ({"max_tokens": 1}, False),
    ({"n": 2}, False),
    ({"seed": 3}, False),
    ({"stop": ["\n"]}, False),
    ({"logprobs": 2}, False),
    ({"presence_penalty": 0.5}, False),
    ({"response_format": {"type": "json_object"}}, False),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, False),
    ({"max_tokens": 8.0}, False),  # vLLM reads 8; a continuation could not reduce it exactly
    ({"min_tokens": 3}, True),
    ({"min_tokens": 9}, False),  # above the limit: vLLM's 400, from decode alone
    ({"min_tokens": -1}, False),
    ({"bad_words": ["x"]}, False),
    ({"truncate_prompt_tokens": 5}, False),
    ({"some_new_field": 1}, False),  # a field the contract does not know
])
def test_which_requests_take_it(fields: dict, want: bool) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True, **fields}
    assert takes_first_token(ProxyConfig(),
                             bodies.parse(json.dumps(body).encode(), False, 256)) is want


def test_stream_starts_with_prefills_token_and_decode_continues_it() -> None:
    async def t(chat: bool) -> None:
        async with proxy() as env:
            env.decode[0].max_model_len = 4096
            env.decode[0].use_max_tokens = True
            await until_known(env)
            data = await post_stream(env, chat, 8)
            evs = events(data)
            texts = [(c.get("delta") or {}).get("content") if chat else c.get("text")
                     for e in evs[:-1] for c in e["choices"]]
            assert [t for t in texts if t] == ["x", *(f"t{k} " for k in range(7))]
            assert len({e["id"] for e in evs[:-1]}) == 1  # prefill's id throughout
            assert b'"token_ids":[' not in data  # the client did not ask for them
            if chat:
                assert sum(1 for e in evs[:-1] for c in e["choices"]
                           if (c.get("delta") or {}).get("role")) == 1
            assert evs[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8,
                                        "total_tokens": 13}
            (pre,) = env.prefill[0].seen
            assert pre["body"]["return_token_ids"] is True and pre["body"]["max_tokens"] == 1
            (cont,) = env.decode[0].seen  # prompt + prefill's token, with prefill's handoff
            cb = cont["body"]
            assert cb["max_tokens"] == 7
            ids = cb["kv_transfer_params"]["prompt_token_ids"] if chat else cb["prompt"]
            assert len(ids) == 6 and ids[-1] == 99
            assert cb["kv_transfer_params"]["kvdisagg_resume"] == 5
            assert cb["kv_transfer_params"]["do_remote_prefill"] is True
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_first_tokens_from_prefill_total",
                          outcome="sent") == 1
            assert metric(text, "kvdisagg_proxy_requests_total", outcome="ok") == 1
    run(t(False))
    run(t(True))


def test_a_decode_whose_length_limit_is_unknown_gets_the_ordinary_handoff() -> None:
    async def t() -> None:
        async with proxy() as env:  # the fake lists no max_model_len
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True})
            await r.read()
            (cont,) = env.decode[0].seen
            assert cont["body"]["prompt"] == "hello" and cont["body"]["max_tokens"] == 8
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_first_tokens_from_prefill_total",
                          outcome="ordinary") == 1
    run(t())


async def until_known(env: Any) -> None:
    """Until the probes have read decode's max_model_len (the proxy takes the path only then)."""
    reg = env.client.app[REGISTRY]
    await until(lambda: all(i.max_model_len for i in reg.instances.values()
                            if i.role is Role.DECODE), "decode's max_model_len read")


def test_decodes_pace_excludes_the_handoff_before_its_first_event() -> None:
    """The client's TPOT counts the wait between prefill's token and decode's first; decode's
    own TPOT (what the decision predicts from) does not."""
    async def t() -> None:
        async with proxy() as env:
            d = env.decode[0]
            d.max_model_len, d.use_max_tokens = 4096, True
            d.delay_s, d.token_delay_s = 0.4, 0.02  # a slow handoff, then 20 ms a token
            await until_known(env)
            r = await env.client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True})
            await r.read()
            (inst,) = [i for i in env.client.app[REGISTRY].instances.values()
                       if i.role is Role.DECODE]
            assert inst.tpot_s is not None and 0.015 < inst.tpot_s < 0.06
            text = await env.metrics()
            tpot_sum = metric(text, "kvdisagg_proxy_tpot_seconds_sum")
            assert tpot_sum > 0.4 / 7  # the client waited the handoff between two tokens
    run(t())
