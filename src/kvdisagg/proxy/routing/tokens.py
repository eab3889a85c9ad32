"""The token ids vLLM would run for a client's request body, for the prefix index's lookups.

Two ways (``TokenizerMode``), measured side by side by benchmarks/tokenizer.py
(docs/benchmarks.md):

- ``local`` (default): the served model's tokenizer and chat template in the proxy process
  (transformers ``AutoTokenizer`` from the model directory), following vLLM 0.32's serving
  layer step by step: completions ``tokenizer(prompt, add_special_tokens=True)``; chat: messages
  as vLLM parses them (content format detected from the template as vLLM does:
  chat_template.py), the template rendered with vLLM's defaults (``add_generation_prompt=True``,
  ``continue_final_message=False``, the server's default kwargs, request kwargs filtered the way
  vLLM filters them), then ``tokenizer(text, add_special_tokens=False)``, the text between
  special tokens taken from a memo where it was seen before (token_memo.py: a conversation's
  earlier turns). No round trip;
- ``remote``: vLLM's own ``POST /tokenize`` on an instance: exact by construction, one HTTP round
  trip per prompt.

Exact or nothing: a body whose tokens this module cannot reproduce exactly (tools, documents,
multimodal or non-text parts, prompt embeddings, truncation, a request chat template, roles or
fields vLLM rewrites) gives None, and the caller makes no prediction (or, with
``remote_fallback``, asks /tokenize). A wrong token list would only cost latency, but a guess
that is silently wrong is worse than no hint.

Must not import vllm: the proxy runs without it. ``local`` needs transformers and jinja2
(``pip install 'kvdisagg[tokenizer]'``), imported only when it is used.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvdisagg.errors import ConfigError, UpstreamError
from kvdisagg.proxy.config import TokenizerConfig, TokenizerMode
from kvdisagg.proxy.fleet.upstream import Pool
from kvdisagg.proxy.routing.token_memo import SegmentMemo

__all__ = ["RequestTokenizer"]

log = logging.getLogger("kvdisagg.proxy.routing.tokens")

Prompts = list[list[int]]
"""One token list per prompt vLLM runs (a chat body or a single prompt: one)."""
_Job = tuple[list[str | list[int]], bool]
"""What to tokenize: each prompt's text (or its given ids), and add_special_tokens."""

_CHAT_ROLES = frozenset(("system", "user", "assistant"))
# Message keys vLLM hands to the template besides role/content/name: refused unless unset.
_MESSAGE_EXTRAS = ("reasoning", "reasoning_content", "task", "tool_call_id", "tool_calls")
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips this line from system text
# Chat fields that change vLLM's rendering in ways /tokenize and this module do not reproduce.
_CHAT_UNSUPPORTED = ("tools", "documents", "reasoning_effort", "chat_template",
                     "mm_processor_kwargs", "truncate_prompt_tokens", "prompt_embeds")
_COMPLETION_UNSUPPORTED = ("prompt_embeds", "truncate_prompt_tokens", "suffix")
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


class _TokenizeResponse(msgspec.Struct):
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]


_decode_tokenize = msgspec.json.Decoder(_TokenizeResponse).decode
_encode = msgspec.json.Encoder().encode


def _completion_prompts(fields: dict[str, Any]) -> list[str | list[int]] | None:
    """The prompts of a completions body, as vLLM splits them; None if unsupported."""
    if any(fields.get(k) is not None for k in _COMPLETION_UNSUPPORTED):
        return None
    p = fields.get("prompt")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list) or not p:
        return None
    if all(type(t) is int for t in p):
        return [p] if all(t >= 0 for t in p) else None
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, list) and x and all(type(t) is int and t >= 0 for t in x) for x in p):
        return list(p)
    return None


def _add_special_tokens(fields: dict[str, Any], default: bool) -> bool | None:
    v = fields.get("add_special_tokens", default)
    return v if isinstance(v, bool) else None


def _texts(content: Any, bare_parts: bool) -> list[str] | None:
    """A message's text parts as vLLM reads them; None for anything but text. ``bare_parts``:
    parts must carry nothing but type and text (the openai format hands extra part fields, such
    as ``cache_control``, to the template)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)
              and (not bare_parts or set(part) <= {"type", "text"})):
            out.append(part["text"])
        else:
            return None
    return out


def _conversation(messages: Any, content_format: str) -> list[dict[str, Any]] | None:
    """vLLM's ``parse_chat_messages`` for plain text chats; None for anything else."""
    if not isinstance(messages, list) or not messages:
        return None
    conv: list[dict[str, Any]] = []
    for m in messages:
        if (not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES
                or any(m.get(k) for k in _MESSAGE_EXTRAS)):
            return None
        texts = _texts(m.get("content"), bare_parts=content_format == "openai")
        if texts is None:
            return None
        if m["role"] == "system" and any(t.startswith(_BILLING_HEADER) for t in texts):
            return None
        msg: dict[str, Any] = {"role": m["role"]}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        conv.append(msg)
    return conv


class _Local:
    """The tokenizer and template, loaded once (blocking: call from a thread)."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        assert cfg.model is not None
        model = Path(cfg.model).expanduser()
        if not model.is_dir():
            raise ConfigError(f"tokenizer.model: {cfg.model} is not a directory (point it at the "
                              "model directory the instances load)")
        try:
            from transformers import AutoTokenizer

            from kvdisagg.proxy.routing import chat_template
        except ImportError as exc:
            raise ConfigError(f"tokenizer.mode local needs transformers and jinja2 ({exc}): "
                              "pip install 'kvdisagg[tokenizer]', or use tokenizer.mode "
                              "remote") from None
        self._accepted_kwargs = chat_template.accepted_kwargs
        try:
            self.tok = AutoTokenizer.from_pretrained(str(model),
                                                     trust_remote_code=cfg.trust_remote_code)
        except Exception as exc:  # transformers raises many kinds
            raise ConfigError(f"tokenizer.model: cannot load a tokenizer from {model}: "
                              f"{exc}") from None
        self.template: str | None = None
        self.why_no_chat = ""
        if cfg.chat_template is not None:
            path = Path(cfg.chat_template).expanduser()
            if not any(c in cfg.chat_template for c in "{}\n") and path.is_file():
                self.template = path.read_text()
            else:
                self.template = cfg.chat_template
        elif any((model / f).exists() for f in _PROCESSOR_FILES):
            self.why_no_chat = (f"{model} has a processor, whose chat template vLLM prefers; "
                                "set tokenizer.chat_template to the instances' template")
        else:
            try:
                self.template = self.tok.get_chat_template(None, tools=None)
            except Exception:
                self.why_no_chat = f"the tokenizer of {model} has no chat template"
        # Fast tokenizers: call the Rust tokenizer directly, as transformers' __call__ does but
        # without offsets (half the time on long prompts; same ids: tests and the benchmark
        # compare them with vLLM's). Its state is what __call__ sets for an untruncated text.
        self._rust: Any = None
        rust = getattr(self.tok, "backend_tokenizer", None)
        if getattr(self.tok, "is_fast", False) and rust is not None:
            if rust.truncation is not None:
                rust.no_truncation()
            if rust.padding is not None:
                rust.no_padding()
            rust.encode_special_tokens = bool(getattr(self.tok, "split_special_tokens", False))
            self._rust = rust
        self.memo = SegmentMemo.build(rust, cfg.memo_tokens) if self._rust is not None else None
        self.content_format = cfg.chat_template_content_format
        if self.template is not None and self.content_format == "auto":
            self.content_format = chat_template.detect_content_format(self.template)
        self.defaults = dict(cfg.default_chat_template_kwargs)
        if self.why_no_chat:
            log.warning("tokens: chat requests are tokenized by /tokenize only: %s",
                        self.why_no_chat)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer(text, add_special_tokens=...)["input_ids"]``."""
        if self.memo is not None and not add_special_tokens:
            return self.memo.encode(text)
        if self._rust is not None:
            encode = getattr(self._rust, "encode_batch_fast", self._rust.encode_batch)
            return list(encode([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def cost(self, job: _Job) -> int:
        """Characters ``run(job)`` will tokenize (what the memo does not hold)."""
        prompts, special = job
        if self.memo is not None and not special:
            return sum(self.memo.missing_chars(p) for p in prompts if isinstance(p, str))
        return sum(len(p) for p in prompts if isinstance(p, str))

    def run(self, job: _Job) -> Prompts:
        prompts, special = job
        return [self.encode(p, special) if isinstance(p, str) else list(p) for p in prompts]

    def completion(self, fields: dict[str, Any]) -> _Job | None:
        prompts = _completion_prompts(fields)
        special = _add_special_tokens(fields, True)
        if prompts is None or special is None:
            return None
        return prompts, special

    def chat(self, fields: dict[str, Any]) -> _Job | None:
        if self.template is None or any(fields.get(k) is not None for k in _CHAT_UNSUPPORTED):
            return None
        conv = _conversation(fields.get("messages"), self.content_format)
        special = _add_special_tokens(fields, False)
        req_kwargs = fields.get("chat_template_kwargs") or {}
        gen = fields.get("add_generation_prompt", True)
        cont = fields.get("continue_final_message", False)
        if (conv is None or special is None or not isinstance(req_kwargs, dict)
                or {"chat_template", "tokenize"} & req_kwargs.keys()
                or not isinstance(gen, bool) or not isinstance(cont, bool) or (gen and cont)):
            return None
        # vLLM: server defaults, then {tokenize: False}, then the request's kwargs and flags;
        # None and "auto" never override (renderers/params.py merge_kwargs).
        request = dict(req_kwargs, add_generation_prompt=gen, continue_final_message=cont)
        kwargs = dict(self.defaults, tokenize=False)
        kwargs.update((k, v) for k, v in request.items() if v is not None and v != "auto")
        kwargs = self._accepted_kwargs(self.tok, self.template, kwargs)
        kwargs["return_dict"] = False
        try:
            text = self.tok.apply_chat_template(conv, tools=None, chat_template=self.template,
                                                tokenize=False, **kwargs)
        except Exception:
            return None  # vLLM answers 400 (the template refused the request)
        if not isinstance(text, str):
            return None
        return [text], special


class RequestTokenizer:
    """Token ids of request bodies; one per proxy. ``start()`` loads the local tokenizer."""

    def __init__(self, cfg: TokenizerConfig | None = None) -> None:
        self.cfg = cfg or TokenizerConfig()
        self._local: _Local | None = None
        self.local_calls = 0
        self.remote_calls = 0
        self.unsupported = 0
        """Bodies neither way could tokenize exactly (no prediction made)."""

    async def start(self) -> None:
        """Load the local tokenizer (in a thread: it reads files). ConfigError if it cannot."""
        if self.cfg.mode is TokenizerMode.LOCAL and self.cfg.model is not None:
            self._local = await asyncio.to_thread(_Local, self.cfg)

    def _job(self, fields: dict[str, Any], chat: bool) -> _Job | None:
        if self._local is None:
            return None
        self.local_calls += 1
        return self._local.chat(fields) if chat else self._local.completion(fields)

    def local(self, fields: dict[str, Any], chat: bool) -> Prompts | None:
        """The local way only (None: not loaded, or not reproducible exactly here)."""
        job = self._job(fields, chat)
        return None if job is None or self._local is None else self._local.run(job)

    async def remote(self, fields: dict[str, Any], chat: bool, pool: Pool) -> Prompts | None:
        """vLLM's ``POST /tokenize`` on ``pool``'s instance, one call per text prompt; None if
        the body has fields /tokenize does not take, or the call fails (logged)."""
        bodies: list[dict[str, Any] | list[int]] = []
        model = fields.get("model")
        if chat:
            if any(fields.get(k) is not None for k in _CHAT_UNSUPPORTED) or not isinstance(
                    fields.get("messages"), list):
                return None
            body: dict[str, Any] = {k: fields[k] for k in ("messages", "add_generation_prompt",
                                           "continue_final_message", "add_special_tokens",
                                           "chat_template_kwargs") if k in fields}
            bodies.append(body)
        else:
            prompts = _completion_prompts(fields)
            if prompts is None:
                return None
            for p in prompts:
                if isinstance(p, str):
                    body = {"prompt": p}
                    if "add_special_tokens" in fields:
                        body["add_special_tokens"] = fields["add_special_tokens"]
                    bodies.append(body)
                else:
                    bodies.append(p)
        out: Prompts = []
        for b in bodies:
            if isinstance(b, list):
                out.append(list(b))
                continue
            if model is not None:
                b["model"] = model
            self.remote_calls += 1
            ids = await self._tokenize(pool, b)
            if ids is None:
                return None
            out.append(ids)
        return out

    async def _tokenize(self, pool: Pool, body: dict[str, Any]) -> list[int] | None:
        t = self.cfg.timeout_s
        try:
            resp = await pool.request(b"POST", "/tokenize", _encode(body),
                                      b"Content-Type: application/json\r\n", connect_s=t,
                                      headers_s=t)
            data = await resp.read(t)
            if resp.status != 200:
                log.debug("tokens: /tokenize on %s:%d answered %d", pool.host, pool.port,
                          resp.status)
                return None
            return _decode_tokenize(data).tokens
        except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.debug("tokens: /tokenize on %s:%d failed: %s", pool.host, pool.port, exc)
            return None

    async def token_ids(self, fields: dict[str, Any], chat: bool,
                        pool: Pool | None = None) -> Prompts | None:
        """Token ids of each prompt vLLM would run for this body; None: cannot tell exactly.

        ``fields``: the decoded JSON body; ``chat``: a /v1/chat/completions body; ``pool``: an
        instance to ask /tokenize (remote mode, or local's fallback). Does not modify
        ``fields``. Local tokenization runs on the caller's loop, in a worker thread when
        there is much text the memo does not hold (benchmarks/tokenizer.py).
        """
        if self.cfg.mode is TokenizerMode.LOCAL:
            job = self._job(fields, chat)
            if job is not None and self._local is not None:
                if self._local.cost(job) >= self.cfg.thread_min_chars:
                    return await asyncio.to_thread(self._local.run, job)
                return self._local.run(job)
            if not self.cfg.remote_fallback and self._local is not None:
                self.unsupported += 1
                return None
        if pool is None:
            self.unsupported += 1
            return None
        ids = await self.remote(fields, chat, pool)
        if ids is None:
            self.unsupported += 1
        return ids
