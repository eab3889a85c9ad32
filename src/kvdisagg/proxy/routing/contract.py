"""The request-semantics contract: which of the proxy's paths answer a request exactly as a
plain vLLM instance does, decided from the request alone, before any token is seen.

Every path asks this module (``Paths``, computed once per request body); none keeps an
allow-list of its own. docs/proxy.md's contract table is this module's table.

The paths, each compared with one plain vLLM instance serving the whole request:

- **decode alone**: a plain vLLM instance (decode, with no handoff) serves the request as sent.
  It serves every form, so every other path's decline falls back to it or to the handoff.
- **handoff**: prefill computes the prompt (one token, not streamed), decode loads that KV and
  generates the answer from the client's own request. Declined where vLLM recomputes the prompt
  whatever KV it is given (prompt logprobs, echo with logprobs), runs in its server (beam
  search), or would refuse the request anyway (an invalid ``min_tokens``: decode alone answers
  vLLM's own 400 without a wasted prefill).
- **early dispatch**: the handoff with decode's leg sent at once; the same answer.
- **first token from prefill**: a stream's first token is prefill's, decode continues after it.
- **migration**: a stream whose decode fails goes on on another decode after the tokens
  already delivered.

The last two run a *continuation*: the prompt plus delivered tokens as the prompt, the limits
reduced by what was delivered. A field keeps its meaning there only if it treats prompt and
output tokens alike or does not look at them (``_CONTINUABLE``). Declined, with the field named:
penalties over output tokens (presence, frequency: the delivered tokens would count as prompt),
``bad_words`` and stop strings (a match may span the break; vLLM holds back text that could
begin a stop string), a seed with sampling (the generator would restart), structured output and
tools (the grammar and the parser would restart), prompt truncation (the longer prompt would
be cut elsewhere), multimodal content parts (vLLM returns no prompt token ids for them), and any
field this table does not know. Limits must be vLLM's own: ``max_tokens`` (chat:
``max_completion_tokens`` unless it is null) an integer or absent, ``min_tokens`` an integer
within it.

The first token from prefill also needs a stream of one answer without logprobs (decode would
give the second token's) and without ``continuous_usage_stats``; its answer is taken whatever
the token is: an end of sequence finishes the stream there, as the plain instance's does.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple


class Path(str, Enum):
    HANDOFF = "handoff"
    FIRST_TOKEN = "first_token"
    MIGRATION = "migration"


_CONTINUABLE = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "return_token_ids", "user",
    "cache_salt", "priority", "n", "add_generation_prompt", "chat_template_kwargs",
    "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs", "echo", "request_id",
})
"""Fields whose meaning is the same for a continuation as for the whole answer (with the
conditions ``_continuable`` checks: ``echo`` false, a seed only without sampling...)."""

_NOT_FIRST_TOKEN = frozenset({"logprobs", "top_logprobs"})
"""Continuable, but prefill's answer would need them as the first token's stream event."""

_SEED_NEUTRAL_TEMPERATURE = 0
"""A seed changes nothing when the request samples greedily (temperature 0)."""


class Paths(NamedTuple):
    """For one request: the reason each path declines it (None: it serves it exactly)."""

    handoff: str | None
    first_token: str | None
    migration: str | None
    limit: int | None
    """The request's output limit as vLLM reads it (None: absent, vLLM's default)."""

    def declines(self, path: Path) -> str | None:
        return {Path.HANDOFF: self.handoff, Path.FIRST_TOKEN: self.first_token,
                Path.MIGRATION: self.migration}[path]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def limit_key(fields: dict[str, Any], chat: bool) -> str:
    """The field vLLM takes the output limit from: chat's ``max_completion_tokens`` unless it
    is absent or null (vLLM: ``max_completion_tokens or max_tokens``), else ``max_tokens``."""
    if chat and fields.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def multimodal(fields: dict[str, Any]) -> bool:
    """A chat message with a content part that is not text (image, audio, video, file...)."""
    for m in fields.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
                not isinstance(p, dict) or p.get("type") != "text" for p in content):
            return True
    return False


def _invalid(fields: dict[str, Any], limit: Any) -> str | None:
    """A form vLLM refuses (400) that a handoff's prefill leg would accept: the prefill leg
    drops ``min_tokens`` and asks for one token, so only decode would see it."""
    m = fields.get("min_tokens")
    if m is None:
        return None
    if not _is_int(m) or m < 0 or (_is_int(limit) and m > limit):
        return "invalid_min_tokens"
    return None


def _continuable(fields: dict[str, Any], chat: bool, limit: Any) -> str | None:
    """Why a continuation would not give the whole answer's tokens, or None."""
    unknown = sorted(fields.keys() - _CONTINUABLE)
    if unknown:
        return f"field:{unknown[0]}"
    if fields.get("echo") not in (None, False):
        return "field:echo"
    if limit is not None and not _is_int(limit):
        return "limit_not_integer"
    m = fields.get("min_tokens")
    if m is not None and limit is None:
        return "min_tokens_without_limit"
    if multimodal(fields):
        return "multimodal"
    if chat and fields.get("add_generation_prompt", True) is not True:
        return "field:add_generation_prompt"  # the role would be the last message's
    return None


def paths(fields: dict[str, Any], chat: bool, stream: bool, n: int) -> Paths:
    """The contract for one request body (its decoded JSON object)."""
    raw_limit = fields.get(limit_key(fields, chat))
    limit = raw_limit if _is_int(raw_limit) else None
    handoff = _handoff(fields, raw_limit)
    if handoff is not None:
        return Paths(handoff, handoff, handoff, limit)
    # A seed with greedy sampling changes nothing: judge the rest without it.
    greedy = fields.get("temperature") == _SEED_NEUTRAL_TEMPERATURE
    judged = {k: v for k, v in fields.items() if not (k == "seed" and greedy)}
    migration = _continuable(judged, chat, raw_limit)
    if migration is None and (not stream or n != 1):
        migration = "not_one_stream"
    first = migration if migration is not None else _first_token(fields, raw_limit)
    return Paths(None, first, migration, limit)


def _handoff(fields: dict[str, Any], limit: Any) -> str | None:
    if fields.get("prompt_logprobs") is not None or (
            fields.get("echo") is True and fields.get("logprobs") not in (None, False)):
        return "prompt_logprobs"
    if fields.get("use_beam_search") is True:
        return "beam_search"
    if fields.get("prompt_embeds") is not None:
        return "prompt_embeds"
    return _invalid(fields, limit)


def _first_token(fields: dict[str, Any], limit: Any) -> str | None:
    # ``is`` tests: a completions ``logprobs`` of 0 asks for the sampled token's.
    if present := sorted(k for k in _NOT_FIRST_TOKEN
                         if fields.get(k) is not None and fields.get(k) is not False):
        return f"field:{present[0]}"
    options = fields.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or options.keys() - {"include_usage"}):
        return "field:stream_options"  # continuous_usage_stats: every event the whole answer's
    if limit is not None and limit < 2:
        return "one_token"  # prefill's answer is the whole answer: the handoff serves it
    return None
