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

Which requests may take it is the contract's to say (contract.py: decided from the request
alone, before any token exists; the decision's plan carries it, ``RoutePlan.first_token``).
Once taken, prefill's token is the answer's first token whatever its value: sampled from the
same distribution as the plain instance's (prefill gets the request's sampling fields,
``min_tokens`` as 1), it is never sampled again. An end of sequence or a stop token ends the
stream there, as the plain instance's; a token without text (a special token, bytes of a
character the next token ends) is sent as vLLM sends it, with empty text, and decode's
detokenizer, primed with the prompt and that token, gives the next token's text as the plain
instance's gives it. Prefill's answer is not an ordinary first token
only when something failed or a server-side parser rewrote it (a reasoning or tool parser,
which the request does not show): then the request is served the ordinary way, counted
(``ordinary``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvdisagg.proxy.fleet.registry import Instance
from kvdisagg.proxy.handoff.exchange import Exchange
from kvdisagg.proxy.handoff.migrate import Tap, continuation, include_usage, wants_token_ids
from kvdisagg.proxy.handoff.prefill import Handoff
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.policies import Selection


class _Message(msgspec.Struct):
    content: Any = None
    reasoning: Any = None
    reasoning_content: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    finish_reason: Any = None
    stop_reason: Any = None
    token_ids: Any = None
    text: Any = None  # completions
    message: _Message | None = None  # chat
    prompt_token_ids: Any = None  # completions: per choice


class _PrefillCompletion(msgspec.Struct):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[_Choice] = []
    prompt_token_ids: Any = None  # chat: beside the choices
    usage: Any = None


_answer = msgspec.json.Decoder(_PrefillCompletion).decode
_encode = msgspec.json.Encoder().encode


def first_events(chat: bool, answer: bytes, include_usage: bool
                 ) -> tuple[bytes, bool] | None:
    """The events a vLLM stream (with ``return_token_ids``) starts with, made of prefill's
    whole answer, and whether they end the stream (the token ended the answer: the usage event
    if asked for and ``[DONE]`` follow); None when that answer is not one token of a finished
    prefill leg."""
    try:
        a = _answer(answer)
    except msgspec.DecodeError:
        return None
    if len(a.choices) != 1:
        return None
    c = a.choices[0]
    ids = c.token_ids
    prompt = a.prompt_token_ids if chat else c.prompt_token_ids
    if (c.finish_reason not in ("length", "stop") or not isinstance(ids, list) or len(ids) != 1
            or not isinstance(prompt, list) or not prompt):
        return None
    if chat:
        m = c.message
        if (m is None or m.reasoning is not None or m.reasoning_content is not None
                or m.tool_calls):
            return None  # a server-side parser's output: not what a stream's delta carries
        text = m.content if m.content is not None else ""
    else:
        text = c.text
    if not isinstance(text, str):
        return None
    ended = c.finish_reason == "stop"  # an end of sequence or a stop token: the whole answer
    head = {"id": a.id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": a.created, "model": a.model}
    last: dict[str, Any] = {"index": 0, "logprobs": None,
                            "finish_reason": c.finish_reason if ended else None}
    if ended:
        last["stop_reason"] = c.stop_reason
    if chat:
        events: list[dict[str, Any]] = [
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}],
             "prompt_token_ids": prompt, "prompt_text": None},
            {**head, "choices": [{"delta": {"content": text}, **last, "token_ids": ids}]}]
    else:
        events = [{**head, "choices": [{"text": text, **last, "stop_reason": c.stop_reason,
                                        "prompt_token_ids": prompt, "token_ids": ids}]}]
    if ended and include_usage and isinstance(a.usage, dict):
        # vLLM leaves null members out of the usage event (exclude_none).
        usage = {k: v for k, v in a.usage.items() if v is not None}
        events.append({**head, "choices": [], "usage": usage})
    out = b"".join(b"data: " + _encode(e) + b"\n\n" for e in events)
    return (out + b"data: [DONE]\n\n" if ended else out), ended


class Led(NamedTuple):
    """A stream whose first token prefill gave: its events for the client, and what the
    decode leg that continues it carries (``body`` None: those events are the whole answer,
    prefill's token ended it; its handoff is left to its lease)."""

    events: bytes  # as the client gets them
    tap: Tap  # what they delivered (the continuation's Tap resumes it)
    body: bodies.ClientBody | None  # the continuation
    pre: Handoff  # prefill's handoff
    decode: Selection[Instance]  # the decision's decode
    avoid: tuple[Instance, ...]


def _fits(body: bodies.ClientBody, prompt_tokens: int, decode: Instance | None) -> bool:
    """Whether decode accepts the continuation exactly when a plain instance accepts the
    request: both check prompt + the limit against ``max_model_len``, which the client must
    see as a 400 before any token, not as an error event after the first."""
    limit = body.paths.limit
    max_len = decode.max_model_len if decode is not None else None
    return max_len is not None and prompt_tokens + max(limit or 2, 2) <= max_len


class FirstToken:
    """An exchange's stream started from prefill's answer (``RoutePlan.first_token``)."""

    __slots__ = ("x",)

    def __init__(self, x: Exchange) -> None:
        self.x = x

    def lead(self, pre: Handoff, decode: Selection[Instance],
             avoid: tuple[Instance, ...]) -> Led | None:
        """The stream's start from prefill's answer, or None: serve it the ordinary way."""
        x = self.x
        body = x.body
        made = (first_events(body.chat, pre.answer, include_usage(body.fields))
                if pre.answer else None)
        if made is None:
            x.metrics.first_token("ordinary")
            return None
        events, ended = made
        tap = Tap(body.chat, strip=not wants_token_ids(body.fields))
        out = tap.feed(events)
        # The plain instance refuses a prompt + limit over max_model_len before any token: so
        # must the answer, even one that prefill's token ended (decode then gives that 400).
        if not _fits(body, len(tap.prompt_ids or ()), decode.instance):
            x.metrics.first_token("ordinary")
            return None
        if ended:
            x.metrics.first_token("sent")
            return Led(out, tap, None, pre._replace(answer=b""), decode, avoid)
        nxt = continuation(body, tap, x.cfg.policy.prefix_block_chars)
        if nxt is None:
            x.metrics.first_token("ordinary")
            return None
        x.metrics.first_token("sent")
        return Led(out, tap, nxt, pre._replace(answer=b""), decode, avoid)
