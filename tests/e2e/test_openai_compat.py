"""The OpenAI surface through P/D, side by side with a plain vLLM instance (issue 16).

The official ``openai`` SDK (sync and async, streamed and not) sends the same request to the
proxy (1P1D, every prompt disaggregated) and to the session's plain instance; choices (text or
message, tool calls, token ids, logprobs), finish reasons, usage and errors (status and body)
must be equal field by field. Greedy and seeded sampling are both reproducible, so equality is
exact; logprobs are compared to 1e-4 (the first token's are computed from pulled KV). Usage's
``prompt_tokens_details`` is left out: P/D reports prefill's cached tokens, a plain instance
its own (vLLM's behaviour, not the proxy's).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import LOG_DIR, metric

pytestmark = pytest.mark.e2e

SEA = "the sea keeps singing to the lazy dog while the quick brown fox " * 12
MESSAGES = [{"role": "system", "content": "You answer about the sea. " * 10},
            {"role": "user", "content": "What does the sea sing?"},
            {"role": "assistant", "content": "It sings of foxes and dogs."},
            {"role": "user", "content": "And then? " + SEA}]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8}
SAMPLED = {"model": "tiny", "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8}
TOOL = {"type": "function", "function": {
    "name": "get_tide", "description": "tide at a place",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}},
                   "required": ["place"]}}}

COMPLETIONS: dict[str, dict[str, Any]] = {
    "greedy": {**GREEDY, "prompt": SEA},
    "n2-seeded": {**SAMPLED, "prompt": SEA, "n": 2},
    "n3-greedy": {**GREEDY, "prompt": SEA, "n": 3},
    "prompt-list": {**GREEDY, "prompt": [SEA, "a short one", SEA[::-1]]},
    "prompt-list-n2-seeded": {**SAMPLED, "prompt": [SEA, "the fox"], "n": 2},
    "token-id-lists": {**GREEDY, "prompt": [[5, 6, 7] * 50, [9, 10] * 70]},
    "token-ids": {**GREEDY, "prompt": [11, 12, 13] * 60},
    "logprobs": {**GREEDY, "prompt": SEA, "logprobs": 2},
    "echo": {**GREEDY, "prompt": SEA, "echo": True},
    "echo-logprobs": {**GREEDY, "prompt": SEA, "echo": True, "logprobs": 1},
    "prompt-logprobs": {**GREEDY, "prompt": SEA, "extra_body": {"prompt_logprobs": 1}},
    "stop": {**GREEDY, "prompt": SEA, "stop": ["the", "sea"], "max_tokens": 16},
    "penalties": {**SAMPLED, "prompt": SEA, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                  "user": "someone", "logit_bias": {"5": 3.0},
                  "extra_body": {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2}},
    "min-tokens": {**GREEDY, "prompt": SEA, "max_tokens": 12,
                   "extra_body": {"min_tokens": 10, "ignore_eos": True}},
    "return-token-ids": {**GREEDY, "prompt": SEA, "extra_body": {"return_token_ids": True}},
    "structured-choice": {**GREEDY, "prompt": SEA,
                          "extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
    "suffix": {**GREEDY, "prompt": SEA, "suffix": "the end"},
    "too-long": {**GREEDY, "prompt": SEA, "max_tokens": 100000},
    "unknown-model": {**GREEDY, "prompt": SEA, "model": "no-such-model"},
    "bad-n": {**GREEDY, "prompt": SEA, "n": 0},
}
CHAT: dict[str, dict[str, Any]] = {
    "greedy": {**GREEDY, "messages": MESSAGES},
    "n2-seeded": {**SAMPLED, "messages": MESSAGES, "n": 2},
    "logprobs": {**GREEDY, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2},
    "max-completion-tokens": {"model": "tiny", "temperature": 0, "messages": MESSAGES,
                              "max_completion_tokens": 6},
    "json-schema": {**GREEDY, "messages": MESSAGES, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "t", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
    "tool-named": {**GREEDY, "messages": MESSAGES, "max_tokens": 24, "tools": [TOOL],
                   "tool_choice": {"type": "function", "function": {"name": "get_tide"}}},
    "bad-role": {**GREEDY, "messages": [{"role": "nobody", "content": "hi"}]},
}
STREAMED = ("greedy", "n2-seeded", "prompt-list", "prompt-list-n2-seeded", "logprobs",
            "echo", "stop", "min-tokens", "return-token-ids")
CHAT_STREAMED = ("greedy", "n2-seeded", "logprobs", "tool-named")


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where two normalized answers differ: every field equal, floats (logprobs) to 1e-4."""
    if isinstance(want, float) and isinstance(got, float):
        return [] if abs(got - want) <= 1e-4 else [f"{path}: {got!r} != {want!r}"]
    if type(got) is not type(want):
        return [f"{path}: {got!r:.200} != {want!r:.200}"]
    if isinstance(want, dict):
        return [d for k in sorted(set(got) | set(want), key=str)
                for d in differences(got.get(k), want.get(k), f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r:.200} != {want!r:.200}"]


def _usage(u: Any) -> dict[str, Any] | None:
    if u is None:
        return None
    d = u.model_dump() if hasattr(u, "model_dump") else dict(u)
    return {k: d.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _choice(c: dict[str, Any]) -> dict[str, Any]:
    keep = ("index", "text", "finish_reason", "stop_reason", "logprobs", "token_ids",
            "prompt_token_ids", "prompt_logprobs")
    out = {k: c.get(k) for k in keep if k in c}
    if "message" in c:
        m = c["message"]
        out["message"] = {"role": m.get("role"), "content": m.get("content"),
                          "tool_calls": [(t["function"]["name"], t["function"]["arguments"])
                                         for t in m.get("tool_calls") or []]}
    return out


def normalize(resp: Any) -> dict[str, Any]:
    d = resp.model_dump()
    return {"object": d.get("object"), "model": d.get("model"),
            "choices": [_choice(c) for c in d["choices"]], "usage": _usage(d.get("usage"))}


def normalize_stream(chunks: list[Any]) -> dict[str, Any]:
    """A stream as the whole it adds up to: per choice index, the text (or content and tool
    call arguments) in order, token ids, the last finish reason; the usage chunk; the order in
    which indexes first appeared is not compared (vLLM interleaves them as they come)."""
    per: dict[int, dict[str, Any]] = {}
    usage = None
    for ch in chunks:
        d = ch.model_dump()
        if d.get("usage"):
            usage = _usage(d["usage"])
        for c in d.get("choices") or []:
            acc = per.setdefault(c["index"], {"text": "", "finish_reason": None,
                                              "token_ids": [], "tool_args": "", "logprobs": []})
            delta = c.get("delta")
            if delta is not None:
                acc["text"] += delta.get("content") or ""
                for t in delta.get("tool_calls") or []:
                    acc["tool_args"] += (t.get("function") or {}).get("arguments") or ""
                lp = (c.get("logprobs") or {}).get("content") or []
                acc["logprobs"] += [(x["token"], x["logprob"]) for x in lp]
            else:
                acc["text"] += c.get("text") or ""
                lp = c.get("logprobs") or {}
                acc["logprobs"] += lp.get("token_logprobs") or []
            acc["token_ids"] += c.get("token_ids") or []
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    return {"choices": dict(sorted(per.items())), "usage": usage}


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body if isinstance(exc.body, dict) else {}
    err = body.get("error", body)
    return {"status": exc.status_code, "type": err.get("type"), "message": err.get("message")}


def call(client: openai.OpenAI, endpoint: str, kw: dict[str, Any],
         stream: bool = False) -> dict[str, Any]:
    api = client.chat.completions if endpoint == "chat" else client.completions
    try:
        if not stream:
            return normalize(api.create(**kw))
        extra = {"stream_options": {"include_usage": True}}
        return normalize_stream(list(api.create(**kw, stream=True, **extra)))
    except openai.APIStatusError as exc:
        return error_of(exc)


async def acall(client: openai.AsyncOpenAI, endpoint: str, kw: dict[str, Any],
                stream: bool = False) -> dict[str, Any]:
    api = client.chat.completions if endpoint == "chat" else client.completions
    try:
        if not stream:
            return normalize(await api.create(**kw))
        extra = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        return normalize_stream([c async for c in await api.create(**kw, stream=True, **extra)])
    except openai.APIStatusError as exc:
        return error_of(exc)


def pair(fleet: Any, cls: type) -> tuple[Any, Any]:
    """A client of the plain instance and one of the proxy."""
    return tuple(cls(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
                 for url in (fleet.reference.base_url, fleet.proxy_url))


FALLBACKS = ("prefill_failed", "no_healthy_prefill")


def _fallbacks(fleet: Any) -> float:
    return sum(metric(fleet.proxy_url, "kvdisagg_proxy_routed_total", route="decode_only",
                      reason=r) for r in FALLBACKS)


@pytest.fixture(scope="module")
def clients(fleet):
    """The clients; on the way out, that no answer of the module came from the decode-only
    fallback (it recomputes the prompt on decode: equal answers with no KV moved)."""
    before = _fallbacks(fleet)
    yield pair(fleet, openai.OpenAI), None  # async clients belong to their test's loop
    assert _fallbacks(fleet) == before, "a request fell back to decode alone"


CASES = ([("completions", k, False) for k in COMPLETIONS] +
         [("completions", k, True) for k in STREAMED] +
         [("chat", k, False) for k in CHAT] + [("chat", k, True) for k in CHAT_STREAMED])


@pytest.mark.parametrize("endpoint,case,stream", CASES,
                         ids=[f"{e}-{c}{'-stream' if s else ''}" for e, c, s in CASES])
def test_same_answer_as_a_plain_instance(clients, endpoint, case, stream):
    kw = (COMPLETIONS if endpoint == "completions" else CHAT)[case]
    (plain, pd), _ = clients
    want = call(plain, endpoint, kw, stream)
    got = call(pd, endpoint, kw, stream)
    assert not differences(got, want), differences(got, want)[:20]
    if "status" not in want:  # an answer, not an error: it has content
        assert want["choices"], want


@pytest.mark.parametrize("endpoint,case,stream", [
    ("completions", "n2-seeded", True), ("completions", "prompt-list", True),
    ("completions", "prompt-list-n2-seeded", False), ("chat", "n2-seeded", True),
    ("chat", "greedy", False), ("completions", "bad-n", False)])
def test_async_client_concurrently(fleet, endpoint, case, stream):
    """The async SDK, several requests at once (P/D under a little load)."""
    kw = (COMPLETIONS if endpoint == "completions" else CHAT)[case]

    async def both() -> tuple[list[Any], list[Any]]:
        plain, pd = pair(fleet, openai.AsyncOpenAI)
        want = await asyncio.gather(*(acall(plain, endpoint, kw, stream) for _ in range(3)))
        got = await asyncio.gather(*(acall(pd, endpoint, kw, stream) for _ in range(3)))
        return list(want), list(got)
    want, got = asyncio.run(both())
    assert not differences(got, want), differences(got, want)[:20]


def _pulls(fleet) -> float:
    return metric(fleet.decode.base_url, "vllm:kvdisagg_pulls_total")


def _wait_pulls(fleet, expected: float, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s  # vLLM publishes engine stats on an interval
    while _pulls(fleet) < expected and time.monotonic() < deadline:
        time.sleep(0.25)
    time.sleep(1.5)
    return _pulls(fleet)


def test_n_samples_pull_once_and_several_prompts_once_each(clients, fleet):
    """KV really moved, once per prompt: n siblings share one pull, each of several prompts
    has its own (identical tokens alone would also come from a silent recompute)."""
    (plain, pd), _ = clients
    before = _pulls(fleet)
    kw = {**SAMPLED, "prompt": SEA + " once more", "n": 3}
    assert not differences(call(pd, "completions", kw), call(plain, "completions", kw))
    assert _wait_pulls(fleet, before + 1) - before == 1
    before = _pulls(fleet)
    kw = {**GREEDY, "prompt": [SEA + " one", SEA + " two", SEA + " three"]}
    assert not differences(call(pd, "completions", kw), call(plain, "completions", kw))
    assert _wait_pulls(fleet, before + 3) - before == 3


def test_other_routes_and_request_id(clients, fleet):
    (plain, pd), _ = clients
    assert [m.id for m in pd.models.list().data] == [m.id for m in plain.models.list().data]
    for path, body in (("/tokenize", {"model": "tiny", "prompt": SEA}),
                       ("/tokenize", {"model": "tiny", "messages": MESSAGES}),
                       ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7, 8]})):
        want = httpx.post(fleet.reference.base_url + path, json=body, timeout=60)
        got = httpx.post(fleet.proxy_url + path, json=body, timeout=60)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path
    raw = pd.completions.with_raw_response.create(
        **GREEDY, prompt=SEA, extra_headers={"X-Request-Id": "compat-42"})
    assert raw.headers["x-request-id"] == "compat-42"
    want = plain.responses.create(model="tiny", input="the sea", max_output_tokens=8,
                                  temperature=0)
    got = pd.responses.create(model="tiny", input="the sea", max_output_tokens=8, temperature=0)
    assert got.output_text == want.output_text and got.status == want.status


@pytest.fixture(scope="module", autouse=True)
def log_marks(fleet) -> dict[Path, int]:
    """Where each of the session's logs stood when this module began: other modules abort
    requests on purpose (a client gone while its load runs is refused its released handoff)."""
    return {log: log.stat().st_size for log in LOG_DIR.glob("*.log")}


def test_no_handoff_was_released_twice(log_marks):
    """No instance refused a read of a handoff another request had already released (while
    this module's requests ran)."""
    for log in sorted(LOG_DIR.glob("*.log")):
        with open(log, "rb") as f:
            f.seek(log_marks.get(log, 0))
            text = f.read().decode(errors="replace")
        assert "already released" not in text, log
