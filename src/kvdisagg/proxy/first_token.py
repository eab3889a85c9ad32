"""The first token from prefill: a disaggregated stream starts the moment prefill answers.

Prefill computes the whole prompt and samples the first token (its leg's ``max_tokens`` is 1).
The ordinary handoff throws that token away: decode pulls the KV, recomputes the last prompt
token and samples the first token again, so the client's first token waits for the pull,
decode's intake and one decode step (docs/benchmarks.md: 15-30 ms on these machines). Here the
proxy sends prefill's token to the client at once, as the events a vLLM stream starts with,
and decode continues the answer after it: a continuation (migrate.py) whose prompt is the prompt
plus that token, carrying prefill's handoff. Decode loads the prompt's KV and computes the
token's own KV where it would have recomputed the last prompt token: the same work, and the
same answer. TTFT is then prefill's; the handoff moves into the gap before the second token.

Taken only where the continuation gives the answer a plain instance gives:
- a stream of one answer (``n`` 1), more than one token long, every field on ``_FIELDS``: no
  logprobs (decode would return the first token's), no stop strings (one may span the first
  token; vLLM holds back text that could begin one), no seed (decode's generator would restart
  after the first token), no presence or frequency penalty (they count output tokens; the first
  token would be prompt on decode), no structured output or tools (the grammar would restart);
- prefill's answer an ordinary first token: ``finish_reason`` length, one token id, plain
  content (not a reasoning or tool parser's output; not empty: a special token, or bytes of a
  character the next token ends, which vLLM's detokenizer holds back and decode, given them
  as prompt, would not).
Otherwise the request is served the ordinary way, counted (``ordinary``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from kvdisagg.proxy import body as bodies
from kvdisagg.proxy.migrate import Tap, continuation, wants_token_ids
from kvdisagg.proxy.policies import InstanceView, Selection
from kvdisagg.proxy.prefill import Prefilled
from kvdisagg.proxy.registry import Instance

if TYPE_CHECKING:
    from kvdisagg.proxy.serving import RequestCtx, Serving

_FIELDS = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "return_token_ids", "user", "cache_salt", "priority", "n",
    "add_generation_prompt", "chat_template_kwargs",
})
"""Fields whose meaning is the same for the continuation as for the whole answer."""


def wanted(s: Serving, body: bodies.ClientBody) -> bool:
    """Whether ``body``'s first token may come from prefill (before its prefill leg)."""
    f = body.fields
    if not (s.cfg.decision.first_token_from_prefill and body.stream and body.n == 1
            and not body.one_of_many and body.forwarded_ids is None
            and body.local_reason is None and f.keys() <= _FIELDS):
        return False
    if f.get("add_generation_prompt", True) is not True:
        return False  # the role would be the last message's
    options = f.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or options.keys() - {"include_usage"}):
        return False  # continuous_usage_stats: every event would need the whole answer's
    key = "max_completion_tokens" if "max_completion_tokens" in f else "max_tokens"
    limit = f.get(key)
    return limit is None or (isinstance(limit, int) and limit > 1)


class _Message(msgspec.Struct):
    content: Any = None
    reasoning: Any = None
    reasoning_content: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    finish_reason: Any = None
    token_ids: Any = None
    text: Any = None  # completions
    message: _Message | None = None  # chat
    prompt_token_ids: Any = None  # completions: per choice


class _Answer(msgspec.Struct):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[_Choice] = []
    prompt_token_ids: Any = None  # chat: beside the choices


_answer = msgspec.json.Decoder(_Answer).decode
_encode = msgspec.json.Encoder().encode


def first_events(chat: bool, answer: bytes) -> bytes | None:
    """The events a vLLM stream (with ``return_token_ids``) starts with, made of prefill's
    whole answer; None when that answer is not an ordinary first token."""
    try:
        a = _answer(answer)
    except msgspec.DecodeError:
        return None
    if len(a.choices) != 1:
        return None
    c = a.choices[0]
    ids = c.token_ids
    prompt = a.prompt_token_ids if chat else c.prompt_token_ids
    if (c.finish_reason != "length" or not isinstance(ids, list) or len(ids) != 1
            or not isinstance(prompt, list) or not prompt):
        return None
    if chat:
        m = c.message
        if (m is None or m.reasoning is not None or m.reasoning_content is not None
                or m.tool_calls):
            return None
        text = m.content
    else:
        text = c.text
    # No text: a special token, or part of a character the next token ends (vLLM's
    # detokenizer holds such bytes back). Decode, given that token as prompt, would not.
    if not isinstance(text, str) or not text or text.endswith("\ufffd"):
        return None
    head = {"id": a.id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": a.created, "model": a.model}
    if chat:
        events: list[dict[str, Any]] = [
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}],
             "prompt_token_ids": prompt, "prompt_text": None},
            {**head, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": None, "token_ids": ids}]}]
    else:
        events = [{**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": None, "stop_reason": None,
                                        "prompt_token_ids": prompt, "token_ids": ids}]}]
    return b"".join(b"data: " + _encode(e) + b"\n\n" for e in events)


class Led(NamedTuple):
    """A stream whose first token prefill gave: its events for the client, and what the
    decode leg that continues it carries."""

    events: bytes  # as the client gets them
    tap: Tap  # what they delivered (the continuation's Tap resumes it)
    body: bodies.ClientBody  # the continuation
    pre: Prefilled  # prefill's handoff
    decode: Selection  # the decision's decode
    avoid: tuple[Instance, ...]


def _fits(body: bodies.ClientBody, prompt_tokens: int, decode: InstanceView | None
          ) -> bool:
    """Whether decode accepts the continuation exactly when a plain instance accepts the
    request: both check prompt + ``max_tokens`` against ``max_model_len``, which the client
    must see as a 400 before any token, not as an error event after the first."""
    limit = body.fields.get("max_completion_tokens" if "max_completion_tokens" in body.fields
                            else "max_tokens")
    max_len = decode.max_model_len if isinstance(decode, Instance) else None
    return max_len is not None and prompt_tokens + max(limit or 2, 2) <= max_len


def lead(s: Serving, ctx: RequestCtx, pre: Prefilled, decode: Selection,
         avoid: tuple[Instance, ...]) -> Led | None:
    """The stream's start from prefill's answer, or None: serve it the ordinary way."""
    events = first_events(ctx.body.chat, pre.answer) if pre.answer else None
    if events is None:
        s.metrics.first_token("ordinary")
        return None
    tap = Tap(ctx.body.chat, strip=not wants_token_ids(ctx.body.fields))
    out = tap.feed(events)
    nxt = continuation(ctx.body, tap, s.cfg.policy.prefix_block_chars)
    if nxt is None or not _fits(ctx.body, len(tap.prompt_ids or ()), decode.instance):
        s.metrics.first_token("ordinary")
        return None
    s.metrics.first_token("sent")
    return Led(out, tap, nxt, pre._replace(answer=b""), decode, avoid)
