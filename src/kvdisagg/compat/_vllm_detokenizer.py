"""A continuation's detokenizer primed as the plain instance's was (vLLM 0.32's private
``FastIncrementalDetokenizer`` state: ``stream`` and ``decode_next``).

A continuation (proxy: the first token from prefill, a migrated stream) is the original prompt
plus tokens the client already got, sent as one prompt. vLLM primes its detokenizer with the
whole prompt (``tokenizers.decoders.DecodeStream(ids=prompt)``), and when the prompt ends inside
a multi-byte character, DecodeStream's first text after it is the whole prompt's text, not the
character's rest (tokenizers 0.23). A plain instance generating the same tokens had primed with
the original prompt and stepped through them one by one. So for a request whose
``kv_transfer_params`` name where the original prompt ends (``RESUME_PARAMS_KEY``), the stream is
primed with that prompt and the delivered tokens are stepped through ``decode_next``: the state,
and so every later text, is the plain instance's. Other requests are untouched; only processes
serving DisaggConnector install it (kvdisagg/plugin.py).
"""

from __future__ import annotations

from typing import Any

from kvdisagg.connector.protocol.params import RESUME_PARAMS_KEY


def resume_point(request: Any) -> int | None:
    """Where the original prompt ends in ``request``'s prompt, if it is a continuation."""
    params = request.sampling_params.extra_args if request.sampling_params else None
    kv = params.get("kv_transfer_params") if isinstance(params, dict) else None
    n = kv.get(RESUME_PARAMS_KEY) if isinstance(kv, dict) else None
    prompt = request.prompt_token_ids
    if (not isinstance(n, int) or isinstance(n, bool) or prompt is None
            or not 1 <= n <= len(prompt)):
        return None
    return n


def prime_continuations() -> None:
    """Wrap ``FastIncrementalDetokenizer.__init__`` (idempotent)."""
    import tokenizers.decoders
    from vllm.v1.engine import detokenizer

    cls = detokenizer.FastIncrementalDetokenizer
    original = cls.__init__
    if getattr(original, "kvdisagg_primes_continuations", False):
        return

    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        original(self, tokenizer, request)
        n = resume_point(request)
        if n is None or n == len(request.prompt_token_ids):
            return
        self.stream = tokenizers.decoders.DecodeStream(
            ids=request.prompt_token_ids[:n], skip_special_tokens=self.skip_special_tokens)
        for token in request.prompt_token_ids[n:]:
            self.decode_next(token)  # as the plain instance did when it generated them

    __init__.kvdisagg_primes_continuations = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
