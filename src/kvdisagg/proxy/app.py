"""P/D handoff proxy, wire-compatible with vLLM's NixlConnector toy proxy.

A client request is sent twice: first to a prefill server with ``max_tokens=1`` and
``do_remote_decode=true`` (so prefill keeps the KV blocks and tells us where they are), then
to a decode server with the prefill's ``kv_transfer_params`` (so decode pulls those blocks
instead of recomputing them). Every upstream failure becomes an OpenAI-style error that
names the upstream, and every upstream call is bounded by a timeout so the proxy never hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

_SESSION = web.AppKey("session", aiohttp.ClientSession)
_CFG = web.AppKey("cfg", dict)

_PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _error(status: int, message: str, type_: str = "invalid_request_error") -> web.Response:
    """OpenAI-style error body, so OpenAI clients surface the message instead of a parse error."""
    return web.json_response(
        {"error": {"message": message, "type": type_, "code": status}}, status=status
    )


def _error_sse(status: int, message: str) -> bytes:
    """An error as one SSE event; used once streaming headers are already sent."""
    body = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    """Same X-Request-Id on both legs so the two engines' logs can be joined."""
    headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
    auth = request.headers.get("Authorization")
    if auth:
        headers["Authorization"] = auth
    return headers


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Prefill only needs to compute the prompt's KV; one token, never streamed."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = dict(_PREFILL_KV_PARAMS)
    return out


def _conn_error(url: str, exc: BaseException) -> web.Response:
    """Timeouts are 504, anything else that kept us from an answer is 502."""
    if isinstance(exc, asyncio.TimeoutError):
        return _error(504, f"upstream {url} timed out", "upstream_timeout")
    return _error(502, f"upstream {url} unreachable: {exc!r}", "upstream_error")


async def _handle(request: web.Request) -> web.StreamResponse:
    """Run the two-leg handoff for /v1/completions and /v1/chat/completions."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return _error(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    # A client must never choose which KV blocks decode reads.
    body.pop("kv_transfer_params", None)

    cfg = request.app[_CFG]
    session = request.app[_SESSION]
    timeout = aiohttp.ClientTimeout(total=cfg["timeout_s"])
    path = request.path
    chat = path.endswith("/chat/completions")
    prefill = cfg["prefill_urls"][next(cfg["prefill_rr"]) % len(cfg["prefill_urls"])]
    decode = cfg["decode_urls"][next(cfg["decode_rr"]) % len(cfg["decode_urls"])]
    headers = _upstream_headers(request, uuid.uuid4().hex)

    # Leg 1: prefill.
    purl = prefill + path
    try:
        async with session.post(
            purl, json=_prefill_body(body, chat), headers=headers, timeout=timeout
        ) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _conn_error(purl, exc)
    if not 200 <= status < 300:
        return _error(status, f"prefill {prefill} returned {status}: {text[:500]}", "upstream_error")
    try:
        presp = json.loads(text)
    except ValueError:
        return _error(502, f"prefill {prefill} returned invalid JSON", "upstream_error")
    kv = presp.get("kv_transfer_params") if isinstance(presp, dict) else None
    if not kv:
        # Silently decoding without params would re-prefill on decode and hide the fault.
        return _error(502, f"prefill {prefill} returned no kv_transfer_params", "upstream_error")

    # Leg 2: decode, with the client's own fields untouched.
    dbody = dict(body)
    dbody["kv_transfer_params"] = kv
    durl = decode + path
    if not body.get("stream"):
        try:
            async with session.post(durl, json=dbody, headers=headers, timeout=timeout) as resp:
                data = await resp.read()
                return web.Response(
                    body=data,
                    status=resp.status,
                    content_type=resp.content_type or "application/json",
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _conn_error(durl, exc)

    out: web.StreamResponse | None = None
    try:
        async with session.post(durl, json=dbody, headers=headers, timeout=timeout) as resp:
            if not 200 <= resp.status < 300:
                text = await resp.text()
                return _error(
                    resp.status, f"decode {decode} returned {resp.status}: {text[:500]}",
                    "upstream_error",
                )
            out = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
            out.content_type = "text/event-stream"
            await out.prepare(request)
            # Relay bytes as they arrive; re-encoding would add latency and risk altering events.
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if out is None:
            return _conn_error(durl, exc)
        code = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        await out.write(_error_sse(code, f"decode {decode} failed mid-stream: {exc!r}"))
    await out.write_eof()
    return out


async def _models(request: web.Request) -> web.Response:
    """Model listing comes from decode: it is the engine that serves the tokens."""
    cfg = request.app[_CFG]
    url = cfg["decode_urls"][0] + "/v1/models"
    headers = {}
    if auth := request.headers.get("Authorization"):
        headers["Authorization"] = auth
    try:
        async with request.app[_SESSION].get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=cfg["timeout_s"])
        ) as resp:
            data = await resp.read()
            return web.Response(
                body=data, status=resp.status, content_type=resp.content_type or "application/json"
            )
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _conn_error(url, exc)


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _on_startup(app: web.Application) -> None:
    app[_SESSION] = aiohttp.ClientSession()


async def _on_cleanup(app: web.Application) -> None:
    await app[_SESSION].close()


def make_app(
    prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 60.0
) -> web.Application:
    """Build the proxy app; prefill and decode are picked round robin with separate counters."""
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill and one decode URL")
    app = web.Application()
    app[_CFG] = {
        "prefill_urls": [u.rstrip("/") for u in prefill_urls],
        "decode_urls": [u.rstrip("/") for u in decode_urls],
        "timeout_s": float(timeout_s),
        "prefill_rr": itertools.count(),
        "decode_rr": itertools.count(),
    }
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    app.router.add_post("/v1/completions", _handle)
    app.router.add_post("/v1/chat/completions", _handle)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


def run_proxy(
    prefill: list[str], decode: list[str], host: str = "127.0.0.1", port: int = 8000,
    timeout_s: float = 60.0,
) -> None:
    """Serve until interrupted, bound to ``host`` only."""
    web.run_app(make_app(prefill, decode, timeout_s), host=host, port=port)
