"""Request migration: a stream whose decode fails mid-way goes on on another decode (issue 18).

The proxy holds what it needs to finish such a request elsewhere: the request, the prompt's
token ids and the token ids already delivered. So every streamed decode leg asks vLLM for token
ids (``return_token_ids``); ``Tap`` reads them off the events as they pass, and takes them out
again when the client did not ask for them (the bytes the client gets are then those of a plain
vLLM stream). When the leg fails mid-stream, ``continuation`` builds the request that finishes
the answer: the prompt plus the delivered tokens as its prompt (completions: the token ids;
chat: vLLM's forwarded ``kv_transfer_params.prompt_token_ids``, so the chat template is not
applied twice), ``max_tokens`` (and ``min_tokens``) reduced by what was delivered. That request
runs through the usual stages (decide, prefill, decode) on another instance; its events reach
the client under the original id, without a second role chunk, and its usage is rewritten to
cover the whole answer. Greedy answers are identical to an uninterrupted run; seeded sampling
restarts its generator at the break (docs/proxy.md says what is and is not reproduced).

A leg fails mid-stream when its connection breaks or goes silent, and also when vLLM itself
ends the stream with an error event of a server error (its engine died: ``EngineDeadError``,
e.g. a decode killed at its ``--shutdown-timeout``), with ``finish_reason: abort`` (an engine
shutting down aborts what it still runs), or with its usage event or ``[DONE]`` before the
answer's finish_reason (an engine shut down under a request it had not started), or when the
stream just ends, cleanly, before that finish_reason (an API server shutting down: ``Tap.end``):
``Tap`` holds such an event back (and the ``[DONE]`` after it) and the relay migrates the rest
of the answer as for a broken connection.

Only ``n == 1`` streams migrate (a break in one of n interleaved samples cannot be resumed
alone); non-streamed requests need no migration: nothing was delivered, the decode stage
retries them whole.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing import contract

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

_TOKEN_IDS = re.compile(rb'"token_ids":(\[[0-9, ]*\])')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":(\[[0-9, ]*\])')
_CREATED = re.compile(rb'"created":([0-9]+)')
_MODEL = re.compile(rb'"model":("(?:[^"\\]|\\.)*")')
# An answer's end (the client got its last token); not "abort": an engine shutting down aborts
# its requests, and the rest of such an answer is migrated.
_FINISHED = re.compile(rb'"finish_reason":"(?!abort"|error")')
_ABORTED = b'"finish_reason":"abort"'
_USAGE_EVENT = re.compile(rb'"choices":\[\],')
_DONE = b"data: [DONE]"


def wants_token_ids(fields: dict[str, Any]) -> bool:
    return fields.get("return_token_ids") is True


def include_usage(fields: dict[str, Any]) -> bool:
    """The client asked for the stream's usage event."""
    options = fields.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class Tap:
    """One streamed leg seen event by event: the token ids it delivered, its id, and its
    bytes as the client should get them. ``feed`` returns whole events only (a partial one
    waits for the rest)."""

    __slots__ = ("chat", "strip", "carry", "prompt_ids", "ids", "id", "resumed", "skip_role",
                 "base", "failure", "created", "model", "finished", "usage_sent", "refused")

    def __init__(self, chat: bool, strip: bool, resumed: Tap | None = None) -> None:
        self.chat, self.strip = chat, strip
        self.carry = b""
        self.prompt_ids: list[int] | None = resumed.prompt_ids if resumed else None
        self.ids: list[int] = list(resumed.ids) if resumed else []
        self.base = len(self.ids)  # tokens delivered before this leg (its prompt's tail)
        self.id: bytes = resumed.id if resumed else b""
        self.created: bytes = resumed.created if resumed else b""
        self.model: bytes = resumed.model if resumed else b""
        # The client has the answer's finish_reason (the last token), and its usage event.
        self.finished: bool = resumed.finished if resumed else False
        self.usage_sent: bool = resumed.usage_sent if resumed else False
        self.resumed = resumed is not None
        self.skip_role = self.resumed and chat  # the client already has the role chunk
        # The server error vLLM ended the stream with (its engine died): the leg failed.
        self.failure: str | None = None
        self.refused = False  # vLLM ended the stream with the request's own error event

    def feed(self, data: bytes) -> bytes:
        if self.failure is not None:
            return b""  # after the error event: vLLM's [DONE], not for the client
        data = self.carry + data
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self.carry = data
            return b""
        self.carry, data = data[cut:], data[:cut]
        if (b'"error"' in data or _ABORTED in data
                or (not self.finished and not self.refused
                    and (_DONE in data or _USAGE_EVENT.search(data)))):
            data = self._cut_at_failure(data)
        if self.prompt_ids is None and (m := _PROMPT_IDS.search(data)):
            self.prompt_ids = _decode(m.group(1))  # a continuation keeps the original's
        for m in _TOKEN_IDS.finditer(data):
            self.ids += _decode(m.group(1))
        if not self.id and (m := re.search(rb'"id":"([^"]*)"', data)):
            self.id = m.group(1)
        if not self.created and (m := _CREATED.search(data)):
            self.created = m.group(1)
        if not self.model and (m := _MODEL.search(data)):
            self.model = m.group(1)
        if _FINISHED.search(data):
            self.finished = True
        if _USAGE_EVENT.search(data):
            self.usage_sent = True
        if self.resumed:
            data = self._as_original(data)
        if self.strip:  # as a plain vLLM 0.32 stream has them, chat and completions alike
            data = _PROMPT_IDS.sub(b'"prompt_token_ids":null',
                                   _TOKEN_IDS.sub(b'"token_ids":null', data))
        return data

    def end(self) -> None:
        """The leg's stream ended (its connection closed cleanly): without the answer's
        finish_reason, the leg failed (an API server shutting down may end its streams so)."""
        if self.failure is None and not self.finished and not self.refused:
            self.failure = "its stream ended before the answer's finish_reason"

    def _cut_at_failure(self, data: bytes) -> bytes:
        """``data`` up to an event that ends the leg, not the answer: a server error (code >=
        500), vLLM's ``finish_reason: abort`` (an engine shutting down aborts what it still
        runs), or the stream's end (its usage event or ``[DONE]``) before the answer's
        finish_reason (an engine shut down under a request it had not started: vLLM's output
        stream just ends). That event is kept back and recorded in ``failure``; other errors
        (the request's own) pass through, and so does the ``[DONE]`` after them."""
        events = data.split(b"\n\n")
        finished = self.finished
        for i, event in enumerate(events):
            if event.startswith(b"data: [DONE]") or _USAGE_EVENT.search(event):
                if finished or self.refused:
                    continue
                why = "its stream ended before the answer's finish_reason (shutting down?)"
            elif not event.startswith(b"data: {"):
                continue
            elif _ABORTED in event:
                why = "its engine aborted the request (shutting down?)"
            elif b'"error"' in event:
                error = bodies.stream_error(event[6:])
                if error is None or (error.code or 0) < 500:
                    self.refused = True  # the request's own error: vLLM's [DONE] follows
                    continue
                why = error.message[:300] or f"an error event of code {error.code}"
            else:
                finished = finished or _FINISHED.search(event) is not None
                continue
            self.failure = why
            self.carry = b""
            return b"".join(e + b"\n\n" for e in events[:i])
        return data

    def _as_original(self, data: bytes) -> bytes:
        """A continuation's events as events of the request the client sent."""
        out = []
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                out.append(event)
                continue
            if self.skip_role and b'"role":"assistant"' in event:
                self.skip_role = False
                continue
            doc = None
            if b'"usage":{' in event:  # usage: of the whole answer, not the continuation's
                doc = _decode(event[6:])
                _shift_usage(doc.get("usage"), self.base)
            m = re.search(rb'"id":"([^"]*)"', event)
            if doc is not None:
                doc["id"] = self.id.decode()
                event = b"data: " + _encode(doc)
            elif m is not None:
                event = event[:m.start(1)] + self.id + event[m.end(1):]
            # The original's creation time, and its prompt ids only in its own first event
            # (the continuation's prompt is the original's plus the delivered tokens).
            if self.created:
                event = _CREATED.sub(b'"created":' + self.created, event, count=1)
            event = _PROMPT_IDS.sub(b'"prompt_token_ids":null', event)
            out.append(event)
        return b"\n\n".join(out)


def ending(tap: Tap, include_usage: bool) -> bytes:
    """What a stream whose leg broke after its last token still owes the client: the usage
    event (when asked for and not sent yet, as vLLM writes it: null members left out) and
    ``[DONE]``; the answer itself is whole (``tap.finished``)."""
    out = b""
    if include_usage and not tap.usage_sent and tap.prompt_ids is not None:
        prompt, completion = len(tap.prompt_ids), len(tap.ids)
        out = b'data: {"id":"%s","object":"%s","created":%s,"model":%s,"choices":[],' \
              b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}\n\n' % (
                  tap.id, b"chat.completion.chunk" if tap.chat else b"text_completion",
                  tap.created or b"0", tap.model or b'""', prompt, prompt + completion,
                  completion)
    return out + b"data: [DONE]\n\n"


def _shift_usage(usage: Any, delivered: int) -> None:
    """A continuation's usage counts the delivered tokens as prompt: give them back."""
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= delivered
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += delivered


def continuation(body: bodies.ClientBody, tap: Tap, prefix_chars: int
                 ) -> bodies.ClientBody | None:
    """The request that finishes ``body``'s answer after the tokens ``tap`` delivered; None
    when it cannot be built (prompt ids unknown, nothing left to generate)."""
    if tap.prompt_ids is None or body.n != 1:
        return None
    fields = dict(body.fields)
    delivered = len(tap.ids) - tap.base  # by this leg; ``body`` already counts the earlier
    key = contract.limit_key(fields, body.chat)
    limit = body.paths.limit  # an integer or absent: contract.py declines the other forms
    if limit is not None:
        if limit - delivered <= 0:
            return None
        fields[key] = limit - delivered
    if (m := fields.get("min_tokens")) is not None:
        fields["min_tokens"] = max(0, m - delivered)
    fields["return_token_ids"] = True
    ids = [*tap.prompt_ids, *tap.ids]
    resume = len(tap.prompt_ids)  # decode's detokenizer resumes after the delivered tokens
    if body.chat:
        out = bodies.parse(_encode(fields), True, prefix_chars)
        return out._replace(forwarded_ids=ids, slo=body.slo, resume_from=resume)
    fields["prompt"], fields["echo"] = ids, False
    return bodies.parse(_encode(fields), False, prefix_chars)._replace(slo=body.slo,
                                                                      resume_from=resume)
