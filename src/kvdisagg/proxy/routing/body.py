"""Client request bodies: inspect once, build the prefill body, splice the decode body.

The decode leg produces what the client sees, so its body is the client's bytes with one
field inserted: ``"kv_transfer_params": ...`` right after the opening brace (no re-encoding,
so no float or key-order changes; vllm-router re-serializes through f32). Only when the client
itself sent ``kv_transfer_params`` (which it must not: that would let it choose the blocks
decode reads) is the body re-encoded without it; msgspec writes floats in their shortest
round-trip form, so even then no value changes. The prefill body must change several fields
and is re-encoded the same way. The one key a client may send in ``kv_transfer_params`` is its
SLO (``kvdisagg_slo``, protocol.RequestSlo): validated, it goes on to prefill, whose scheduler
plugin orders prompts by it (docs/scheduler.md).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec

from kvdisagg.connector.protocol.params import (
    EARLY_PARAMS_KEY,
    RESUME_PARAMS_KEY,
    SLO_PARAMS_KEY,
    RequestSlo,
)
from kvdisagg.errors import BodyError
from kvdisagg.proxy.routing import contract
from kvdisagg.proxy.routing.policies import NO_HITS, RouteRequest
from kvdisagg.proxy.routing.prompt_keys import prefix_key
from kvdisagg.tracing import TRACE_PARAMS_KEY

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class ClientBody(NamedTuple):
    raw: bytes  # the client's bytes (without a forged kv_transfer_params)
    fields: dict[str, Any]
    chat: bool
    stream: bool
    route: RouteRequest
    slo: dict[str, Any] | None = None  # the client's validated kvdisagg_slo, for prefill
    prompts: list[Any] | None = None
    """A completions request with several prompts: each is served as its own request (its own
    handoff) and the answers merged (fanout.py)."""
    paths: contract.Paths = contract.Paths(None, None, None, None)
    """Which paths serve this request exactly (contract.py), from the request alone."""
    one_of_many: bool = False
    """One prompt of a several-prompt request (fanout.py merges its stream: not migrated)."""
    resume_from: int | None = None
    """A continuation's: how many of its prompt tokens are the original prompt (the rest were
    delivered already); decode primes its detokenizer there (protocol.RESUME_PARAMS_KEY)."""
    forwarded_ids: list[int] | None = None
    """A chat request whose prompt the proxy already knows as token ids (a migrated stream's
    continuation): vLLM's ``kv_transfer_params.prompt_token_ids``, so its chat template is not
    applied again."""

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's token ids when the client sent them (a completions prompt of ids)."""
        p = self.fields.get("prompt")
        if (not self.chat and isinstance(p, list) and p
                and all(type(t) is int for t in p)):
            return p
        return None

    @property
    def n(self) -> int:
        return _sample_count(self.fields)


def _prompt_text(fields: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """Prompt text for prefix hashing, and the token count when the prompt is token ids."""
    if chat:
        parts: list[str] = []
        for m in fields.get("messages") or ():
            if isinstance(m, dict):
                c = m.get("content")
                if isinstance(c, str):
                    parts.append(c)
                elif isinstance(c, list):
                    parts.extend(p.get("text", "") for p in c
                                 if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts), None
    p = fields.get("prompt")
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p:
        if all(isinstance(t, int) for t in p):
            return ",".join(map(str, p[:256])), len(p)
        if isinstance(p[0], str):
            return p[0], None
        if isinstance(p[0], list):
            return ",".join(map(str, p[0][:256])), sum(len(x) for x in p if isinstance(x, list))
    return "", None


def parse(raw: bytes, chat: bool, prefix_chars: int) -> ClientBody:
    try:
        fields = _decode(raw)
    except msgspec.DecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise BodyError("request body must be a JSON object")
    slo = None
    if "kv_transfer_params" in fields:
        # A client must never choose which KV blocks decode reads: only its SLO goes on.
        slo = _client_slo(fields.pop("kv_transfer_params"))
        raw = _encode(fields)
    stream = fields.get("stream") is True
    text, n_ids = _prompt_text(fields, chat)
    tokens = n_ids if n_ids is not None else max(1, len(text) // 4)
    mt = fields.get(contract.limit_key(fields, chat))
    max_tokens = mt if isinstance(mt, int) and mt > 0 else 16
    prompt = fields.get("prompt")
    prompts = (prompt if not chat and isinstance(prompt, list) and len(prompt) > 1
               and all(isinstance(p, (str, list)) for p in prompt) else None)
    # NO_HITS given: the default's factory would be a Python call per request
    route = RouteRequest(prefix_key(text, prefix_chars), tokens, max_tokens, NO_HITS)
    return ClientBody(raw, fields, chat, stream, route, slo, prompts,
                      contract.paths(fields, chat, stream, _sample_count(fields)))


def _sample_count(fields: dict[str, Any]) -> int:
    """The request's ``n``: 1 when absent or not a positive integer (vLLM refuses those)."""
    n = fields.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def with_prompt(body: ClientBody, prompt: Any, prefix_chars: int) -> ClientBody:
    """One prompt of a several-prompt completions request, as a request of its own."""
    fields = dict(body.fields)
    fields["prompt"] = prompt
    sub = parse(_encode(fields), body.chat, prefix_chars)
    return sub._replace(slo=body.slo, one_of_many=True)


def _client_slo(params: Any) -> dict[str, Any] | None:
    raw = params.get(SLO_PARAMS_KEY) if isinstance(params, dict) else None
    if raw is None:
        return None
    try:
        return msgspec.to_builtins(msgspec.convert(raw, RequestSlo))
    except msgspec.ValidationError as exc:
        raise BodyError(f"kv_transfer_params.{SLO_PARAMS_KEY}: {exc} (e.g. "
                        f'{{"{SLO_PARAMS_KEY}": {{"ttft_s": 0.5}}}})') from None


def prefill_body(body: ClientBody, trace: str = "",
                 early: dict[str, str] | None = None, token_ids: bool = False) -> bytes:
    """One token, never streamed, with ``do_remote_decode`` so prefill keeps the KV;
    ``trace``: the prefill leg's traceparent, for the connector's spans; ``early``: the
    handoff's id and token when decode's leg went out already (early.py); ``token_ids``: ask
    for ``return_token_ids`` (the first token goes to the client, first_token.py)."""
    out = dict(body.fields)
    out["stream"] = False
    if token_ids:
        out["return_token_ids"] = True
    out["max_tokens"] = 1
    if body.chat or "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # One handoff per prompt: the n samples all continue it on decode (its connector lets the
    # siblings share one pull through decode's prefix cache).
    if "n" in out:
        out["n"] = 1
    for key in ("stream_options", "best_of"):
        out.pop(key, None)
    # Its one token is sampled as the answer's first (first_token.py): under ``min_tokens``
    # an end of sequence is masked there too. (An invalid one never gets here: contract.py.)
    if isinstance(m := out.pop("min_tokens", None), int) and m > 0:
        out["min_tokens"] = 1
    params = PREFILL_KV_PARAMS
    if body.slo is not None:
        params = {**params, SLO_PARAMS_KEY: body.slo}
    if body.forwarded_ids is not None:
        params = {**params, "prompt_token_ids": body.forwarded_ids}
    if trace:
        params = {**params, TRACE_PARAMS_KEY: trace}
    if early is not None:
        params = {**params, EARLY_PARAMS_KEY: early}
    out["kv_transfer_params"] = params
    return _encode(out)


def decode_body(body: ClientBody, kv_params: bytes | None, trace: str = "",
                token_ids: bool = False) -> bytes:
    """The client's bytes plus ``kv_transfer_params`` (``None``: decode-only, bytes as sent);
    ``trace``: the decode leg's traceparent, inserted into prefill's params; ``token_ids``:
    ask for ``return_token_ids`` (a stream the proxy may migrate)."""
    raw = body.raw
    if token_ids and "return_token_ids" not in body.fields:
        raw = _insert(raw, b'"return_token_ids":true')
    if body.forwarded_ids is not None:
        ids = b'"prompt_token_ids":' + _encode(body.forwarded_ids)
        kv_params = _insert(kv_params, ids) if kv_params is not None else b"{%s}" % ids
    if body.resume_from is not None:
        mark = b'"%s":%d' % (RESUME_PARAMS_KEY.encode(), body.resume_from)
        kv_params = _insert(kv_params, mark) if kv_params is not None else b"{%s}" % mark
    if kv_params is None:
        return raw
    if trace:
        kv_params = _insert(kv_params, b'"%s":"%s"' % (TRACE_PARAMS_KEY.encode(), trace.encode()))
    return _insert(raw, b'"kv_transfer_params":' + kv_params)


def _insert(raw: bytes, member: bytes) -> bytes:
    """A JSON object's bytes with ``member`` ("key":value) added first, the rest untouched."""
    i = raw.index(b"{") + 1
    rest = raw[i:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return b"".join((raw[:i], member, sep, raw[i:]))


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")  # Raw cannot sit in a union


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer).decode


_ABORTED = re.compile(rb'"finish_reason"\s*:\s*"abort"')


class _Event(msgspec.Struct):
    error: msgspec.Raw = msgspec.Raw(b"null")  # Raw cannot sit in a union


_event = msgspec.json.Decoder(_Event).decode


def error_of(payload: bytes) -> bytes | None:
    """The ``error`` of one SSE event's JSON (vLLM's streamed error, e.g. after a failed KV
    load, or its engine's death), or None for any other event."""
    try:
        err = bytes(_event(payload).error)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if err == b"null" else err


class StreamError(msgspec.Struct):
    """What vLLM's streamed ``error`` says (an OpenAI error object)."""

    message: str = ""
    code: int | None = None


_stream_error = msgspec.json.Decoder(StreamError, strict=False).decode  # "500" reads as 500


def stream_error(payload: bytes) -> StreamError | None:
    """The error one SSE event's JSON carries, decoded; None for any other event (or an error
    not shaped as OpenAI's)."""
    if (err := error_of(payload)) is None:
        return None
    try:
        return _stream_error(err)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def aborted(answer: bytes) -> bool:
    """vLLM finished the request as aborted (``finish_reason: abort``): an engine shutting down
    (SIGTERM) rejects every new request so."""
    return _ABORTED.search(answer) is not None


def kv_params_of(prefill_response: bytes) -> bytes | None:
    """The prefill's ``kv_transfer_params`` as raw JSON bytes (passed on untouched), or None."""
    try:
        raw = _prefill_answer(prefill_response).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    b = bytes(raw)
    if b in (b"null", b"{}") or not b.startswith(b"{"):
        return None
    return b


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer = msgspec.json.Decoder(_Answer).decode


def completion_tokens(response: bytes) -> int | None:
    try:
        u = _answer(response).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return u.completion_tokens if u is not None else None
