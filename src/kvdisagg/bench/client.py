"""One streamed request to an OpenAI-compatible endpoint, timed at the client.

Every wait is bounded: connect, each silence between two stream lines (``idle_s``) and the
whole request (``total_s``). The answer is never trusted to be well formed: a non-200 status,
an ``error`` event in the stream, a malformed line, a stream without ``[DONE]`` or a timeout all
end as a failed record with the reason, never as an exception out of ``send``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import aiohttp
import msgspec

from kvdisagg.bench.records import RequestRecord
from kvdisagg.bench.workload import RequestSpec

Api = Literal["completions", "chat"]
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
MAX_ERROR_CHARS = 300


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    api: Api = "completions"
    connect_s: float = 10.0
    idle_s: float = 60.0
    total_s: float = 300.0
    ignore_eos: bool = True  # vLLM extension: generate exactly max_tokens
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)
    api_key: str | None = None


def request_body(spec: RequestSpec, cfg: ClientConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "stream": True, "temperature": 0.0,
                            "max_tokens": spec.output_len}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.api == "chat":
        text = spec.prompt if isinstance(spec.prompt, str) else " ".join(map(str, spec.prompt))
        body["messages"] = [{"role": "user", "content": text}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
    body.update(cfg.extra_body)
    return body


def _tokens_in(event: Any) -> int:
    """Tokens an event carries: ``len(token_ids)`` when the server sends them (vLLM with
    ``return_token_ids``), else 1 per event with a choice. vLLM sends several tokens in one
    event when its API server falls behind the engine, and holds back a token that ends
    mid-UTF-8 sequence, so only ids count exactly. A chat stream's first event only names
    the role (``delta: {"role": "assistant", "content": ""}``): no token."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return 0
    ids = choices[0].get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choices[0].get("delta")
    if isinstance(delta, dict) and "role" in delta and not delta.get("content") \
            and not delta.get("tool_calls"):
        return 0
    return 1


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec, cfg: ClientConfig,
               rec: RequestRecord, t0: float) -> RequestRecord:
    """Send ``spec`` to ``url`` (the endpoint's base URL), filling ``rec``; ``t0`` is the run's
    start on ``time.perf_counter``."""
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    timeout = aiohttp.ClientTimeout(total=cfg.total_s, sock_connect=cfg.connect_s,
                                    sock_read=cfg.idle_s)
    start = time.perf_counter()
    rec.sent_at_s = start - t0
    stamps: list[float] = []  # one per token: an event carrying k tokens stamps k times
    done = False
    try:
        async with session.post(url.rstrip("/") + path, data=_encode(request_body(spec, cfg)),
                                headers=headers, timeout=timeout) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = (await resp.content.read(4096)).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status}: {text[:MAX_ERROR_CHARS]}"
                return rec
            async for raw in resp.content:
                if done:
                    continue
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    # Read on to the end of the body (no break): closing the connection under
                    # the server's final chunk makes a proxy count the request as aborted.
                    done = True
                    continue
                now = time.perf_counter()
                try:
                    event = _decode(payload)
                except msgspec.DecodeError:
                    rec.error = f"malformed stream event: {payload[:100]!r}"
                    return rec
                if isinstance(event, dict) and event.get("error"):
                    rec.error = f"error event: {str(event['error'])[:MAX_ERROR_CHARS]}"
                    return rec
                k = _tokens_in(event)
                if k:
                    stamps.extend([now] * k)
                    rec.output_events += 1
            end = time.perf_counter()  # the body's end, after [DONE]
    except TimeoutError:
        rec.error = (f"timeout after {time.perf_counter() - start:.1f}s (connect "
                     f"{cfg.connect_s}s, idle {cfg.idle_s}s, total {cfg.total_s}s)")
        return rec
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: an over-long stream line
        rec.error = f"{type(exc).__name__}: {str(exc)[:MAX_ERROR_CHARS]}"
        return rec
    if not done:
        rec.error = "stream ended without [DONE]"
        return rec
    if not stamps:
        rec.error = "no token in the stream"
        return rec
    rec.ok = True
    rec.output_tokens = len(stamps)
    rec.ttft_s = stamps[0] - start
    rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]  # 0 inside a coalesced event
    if len(stamps) >= 2:
        rec.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    rec.e2e_s = end - start
    rec.done_at_s = end - t0
    return rec
