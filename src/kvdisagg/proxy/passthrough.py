"""Routes a plain vLLM instance serves that need no handoff: sent to a decode instance as is.

Only an allowlist goes through (``ROUTES``): vLLM also serves control routes (``/pause``,
``/sleep``, ``/reset_prefix_cache``, ``/collective_rpc``, weight updates...) that a client of the
proxy must never reach. A decode instance answers them because it is the engine that serves
tokens (and holds the same model, tokenizer and chat template as prefill). The body and the
answer go through untouched, streamed when the answer is an event stream; errors keep vLLM's
status and body.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web

from kvdisagg.errors import UpstreamError
from kvdisagg.proxy.legs import LegFailure, LegScope, kind_of, outcome_of
from kvdisagg.proxy.policies import RouteRequest
from kvdisagg.proxy.registry import Instance, Outcome
from kvdisagg.proxy.responses import error_event, error_response
from kvdisagg.proxy.types import Side

if TYPE_CHECKING:
    from kvdisagg.proxy.serving import Serving

ROUTES: tuple[tuple[str, str], ...] = (
    ("GET", "/v1/models"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/responses"),  # the Responses API, served by decode alone (docs/proxy.md)
    ("POST", "/v1/chat/completions/batch"),
    ("POST", "/v1/embeddings"),
    ("POST", "/pooling"),
    ("POST", "/classify"),
    ("POST", "/score"),
    ("POST", "/v1/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
)
_ANY = RouteRequest(b"", 1, 1)
_now = time.perf_counter


def add_routes(app: web.Application, serving: Serving) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await forward(serving, request)

    for method, path in ROUTES:
        app.router.add_route(method, path, handler)


async def forward(s: Serving, request: web.Request) -> web.StreamResponse:
    cands = s.registry.candidates(Side.DECODE) or s.registry.members(Side.DECODE)
    inst = s.decider.decode_policy.select(_ANY, cands, Side.DECODE).instance if cands else None
    if not isinstance(inst, Instance):
        return s.reject(503, "no_healthy_decode", "no decode instance")
    t = s.cfg.timeouts
    body = await request.read() if request.can_read_body else b""
    rid = s.request_id(request)
    leg = LegScope(inst, Side.DECODE, 1, s.metrics)
    start = _now()
    out: web.StreamResponse | None = None
    try:
        resp = await inst.pool.request(request.method.encode(), request.path_qs, body,
                                       s.headers_for(request, rid),
                                       connect_s=t.decode_connect_s, headers_s=t.decode_total_s)
        ctype = (resp.header(b"content-type") or b"application/json").decode("latin-1")
        headers = {"Content-Type": ctype, "X-Request-Id": rid}
        if not ctype.startswith("text/event-stream"):
            data = await resp.read(max(0.001, t.decode_total_s - (_now() - start)))
            leg.close(Outcome.OK if resp.status < 500 else Outcome.BROKEN)
            return web.Response(body=data, status=resp.status, headers=headers)
        out = web.StreamResponse(status=resp.status, headers=headers)
        await out.prepare(request)
        async for chunk in resp.iter_chunks(t.decode_idle_s,
                                            max(0.001, t.decode_total_s - (_now() - start))):
            await out.write(chunk)
    except UpstreamError as exc:
        leg.fail(kind_of(exc), outcome_of(exc))
        failure = LegFailure.of(exc, f"decode {inst.url}: {exc}")
        if out is None:
            return error_response(failure.status, failure.message, "upstream_error")
        await out.write(error_event(failure.status, failure.message))
    except (asyncio.CancelledError, ConnectionResetError):
        leg.close(Outcome.CANCELLED, "cancelled")
        raise
    else:
        leg.close(Outcome.OK)
    await out.write_eof()
    return out
