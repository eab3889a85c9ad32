"""What ``kvdisagg bench`` asks an endpoint before loading it: the model it serves, that model's
``max_model_len`` (``GET /v1/models``) and how far its vocabulary goes (``POST /detokenize``).

Prompts are random token ids, and vLLM answers 400 ("Token id N is out of vocabulary") to an id
past both the tokenizer's and the model's vocabulary; a request longer than ``max_model_len`` is
refused too. Asking first turns a run of identical failures into one line before any load.

vLLM's ``/detokenize`` (which kvdisagg's proxy passes through to an instance) decodes an id the
tokenizer does not know to ``""`` and every known id to some text, so the vocabulary's end is
found by bisection in about ``log2(HI)`` small requests. An endpoint without the route (or any
other answer) cannot say: ``vocabulary_end`` returns None and bench keeps the range it has.

Every call is bounded by ``timeout_s``. Must not import ``vllm``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, NamedTuple

from kvdisagg.errors import EndpointError


class ModelCard(NamedTuple):
    """An endpoint's first model in ``/v1/models``."""

    id: str
    max_model_len: int | None  # vLLM lists it; other servers may not


def _call(url: str, body: dict[str, Any] | None, api_key: str | None,
          timeout_s: float) -> Any:
    """GET (``body`` None) or POST JSON; the decoded answer. OSError / ValueError on failure
    (an HTTP error status is an ``urllib.error.HTTPError``, an OSError)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read(1 << 20))


def model_card(url: str, api_key: str | None, timeout_s: float) -> ModelCard:
    """The first model ``url`` serves; EndpointError if it cannot be listed."""
    try:
        card = _call(url + "/v1/models", None, api_key, timeout_s)["data"][0]
        max_len = card.get("max_model_len")
        return ModelCard(str(card["id"]), int(max_len) if isinstance(max_len, int) else None)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise EndpointError(f"cannot list models at {url}/v1/models ({exc})") from None


def detokenizes(url: str, model: str, token_id: int, api_key: str | None,
                timeout_s: float) -> bool | None:
    """Whether ``url``'s tokenizer knows ``token_id`` (its ``/detokenize`` gives it text); None
    if the endpoint does not answer that question (no such route, an error, another shape)."""
    try:
        answer = _call(url + "/detokenize", {"model": model, "tokens": [token_id]}, api_key,
                       timeout_s)
    except (OSError, ValueError):
        return None
    prompt = answer.get("prompt") if isinstance(answer, dict) else None
    return bool(prompt) if isinstance(prompt, str) else None


def vocabulary_end(url: str, model: str, lo: int, hi: int, api_key: str | None,
                   timeout_s: float) -> int | None:
    """The first token id in ``[lo, hi)`` that ``url``'s tokenizer does not know, if any (ids
    from there on are past its vocabulary); None when all of ``[lo, hi)`` is known or the
    endpoint cannot say. ``lo`` itself when even it is unknown.

    ::

        ids   lo ............ end-1 | end ............ hi-1
              known (text)          | unknown ("")
                                    ^ returned: the bisection keeps lo known, hi-1 unknown
    """
    top = detokenizes(url, model, hi - 1, api_key, timeout_s)
    if top is None or top:
        return None
    first = detokenizes(url, model, lo, api_key, timeout_s)
    if first is None:
        return None
    if not first:
        return lo
    known, unknown = lo, hi - 1
    while unknown - known > 1:
        mid = (known + unknown) // 2
        if detokenizes(url, model, mid, api_key, timeout_s):
            known = mid
        else:  # unknown, or no answer this time: the lower end is the safe one
            unknown = mid
    return unknown
