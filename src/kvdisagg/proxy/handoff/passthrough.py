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

from aiohttp import web

from kvdisagg.errors import UpstreamError
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.fleet.registry import Outcome, Registry
from kvdisagg.proxy.handoff.exchange import RequestIds
from kvdisagg.proxy.handoff.legs import LegFailure, LegScope, kind_of, outcome_of
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.responses import Refusal, error_event
from kvdisagg.proxy.routing.policies import Policy, RouteRequest
from kvdisagg.proxy.types import Side

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


class Passthrough:
    """Forwards the ``ROUTES`` to a decode instance (its decode policy's pick)."""

    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics,
                 decode_policy: Policy, ids: RequestIds) -> None:
        self.cfg, self.registry, self.metrics = cfg, registry, metrics
        self.decode_policy, self.ids = decode_policy, ids

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """``request`` as decode answers it. No decode, or one that fails before answering:
        raises ``Refusal``."""
        reg = self.registry
        cands = reg.candidates(Side.DECODE) or reg.members(Side.DECODE)
        inst = self.decode_policy.select(_ANY, cands, Side.DECODE).instance if cands else None
        if inst is None:
            self.metrics.rejected("no_healthy_decode")
            raise Refusal.retry_later(503, "no decode instance")
        t = self.cfg.timeouts
        body = await request.read() if request.can_read_body else b""
        rid = self.ids.request_id(request)
        leg = LegScope(inst, Side.DECODE, 1, self.metrics)
        start = _now()
        out: web.StreamResponse | None = None
        try:
            resp = await inst.pool.request(request.method.encode(), request.path_qs, body,
                                           self.ids.headers_for(request, rid),
                                           connect_s=t.decode_connect_s,
                                           headers_s=t.decode_total_s)
            ctype = (resp.header(b"content-type") or b"application/json").decode("latin-1")
            out_headers = {"Content-Type": ctype, "X-Request-Id": rid}
            if not ctype.startswith("text/event-stream"):
                data = await resp.read(max(0.001, t.decode_total_s - (_now() - start)))
                leg.close(Outcome.OK if resp.status < 500 else Outcome.BROKEN)
                return web.Response(body=data, status=resp.status, headers=out_headers)
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            await out.prepare(request)
            async for chunk in resp.iter_chunks(t.decode_idle_s,
                                                max(0.001, t.decode_total_s - (_now() - start))):
                await out.write(chunk)
        except UpstreamError as exc:
            leg.fail(kind_of(exc), outcome_of(exc))
            failure = LegFailure.of(exc, f"decode {inst.url}: {exc}")
            if out is None:
                raise Refusal.error(failure.status, failure.message, "upstream_error") from None
            await out.write(error_event(failure.status, failure.message))
        except (asyncio.CancelledError, ConnectionResetError):
            leg.close(Outcome.CANCELLED, "cancelled")
            raise
        else:
            leg.close(Outcome.OK)
        await out.write_eof()
        return out
