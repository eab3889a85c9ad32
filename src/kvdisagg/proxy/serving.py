"""One client request, from admission to the last byte, as named stages.

    serve:   admission (shutting down, max_in_flight), the request's span and counters
    parse:   body.parse (400 on a bad body); several prompts -> fanout.py
    decide:  decide.Decider: disaggregate, or decode alone (and which decode)
    prefill: prefill.prefill (retries, decode-only fallback)
    decode:  decode.open_decode (retries, re-prefill), then decode.relay_stream / finish_body

Turned away before any leg (``max_in_flight`` reached, slo_aware shedding, nothing routable,
shutting down): 429/503 with ``Retry-After``, counted in ``kvdisagg_proxy_rejected_total``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import re
import time
import uuid
from typing import Any

from aiohttp import web

from kvdisagg.errors import BodyError
from kvdisagg.proxy import body as bodies
from kvdisagg.proxy import early, first_token
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.decide import CacheView, Decider, Decision, Route
from kvdisagg.proxy.decode import (
    Opened,
    finish_body,
    handoff_decode,
    open_decode,
    relay_led,
    relay_stream,
)
from kvdisagg.proxy.first_token import Led
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.policies import Policy, Selection
from kvdisagg.proxy.prefill import Prefilled, choose_prefill, prefill
from kvdisagg.proxy.prefix_index import BlockExtra
from kvdisagg.proxy.registry import Instance, Registry
from kvdisagg.proxy.responses import error_response
from kvdisagg.proxy.tokens import RequestTokenizer
from kvdisagg.proxy.types import Side
from kvdisagg.tracing import Tracer, end, traceparent_of, valid_traceparent

log = logging.getLogger("kvdisagg.proxy")
PENDING_GRACE_S = 2.0
"""How long a prompt stays noted as computed on an instance after its leg answered: vLLM
publishes the blocks after the step that computed them, and the KV events take a moment."""
_RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_now = time.perf_counter


class RequestCtx:
    """What every stage of one request reads."""

    __slots__ = ("rid", "body", "path", "headers", "t0", "root", "hits")

    def __init__(self, rid: str, body: bodies.ClientBody, path: str, headers: bytes, t0: float,
                 root: Any) -> None:
        self.rid, self.body, self.path, self.headers = rid, body, path, headers
        self.t0, self.root = t0, root
        self.hits: dict[str, int] = {}  # prompt tokens each instance caches (predicted)

    def leg_headers(self, span: Any) -> bytes:
        """The legs' headers, with the leg's W3C ``traceparent``: vLLM's own tracing
        (``--otlp-traces-endpoint``) then nests its request span under the leg."""
        if span is None:
            return self.headers
        return self.headers + b"traceparent: %s\r\n" % traceparent_of(span).encode()

    def with_body(self, body: bodies.ClientBody) -> RequestCtx:
        return RequestCtx(self.rid, body, self.path, self.headers, self.t0, self.root)


class Serving:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics,
                 prefill_policy: Policy, decode_policy: Policy,
                 tracer: Tracer = Tracer.disabled(), cache: CacheView | None = None,
                 tokenizer: RequestTokenizer | None = None) -> None:
        self.cfg = cfg
        self.tracer = tracer
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decider = Decider(cfg, registry, decode_policy)
        self.cache = cache  # what each instance caches (None: no index)
        self.tokenizer = tokenizer
        self.idle = asyncio.Event()
        self.idle.set()
        self.shutting_down = False
        # Unique request ids without uuid4 per request: a random per-process prefix + a counter.
        self._rid_prefix = f"kvd-{uuid.uuid4().hex[:12]}-"
        self._rid_seq = itertools.count(1)
        self._tasks: set[asyncio.Future[Any]] = set()

    def request_id(self, request: web.Request) -> str:
        """The client's ``X-Request-Id`` when it is sane, else a new unique one."""
        rid = request.headers.get("X-Request-Id", "")
        return rid if _RID.fullmatch(rid) else f"{self._rid_prefix}{next(self._rid_seq):x}"

    def headers_for(self, request: web.Request, rid: str) -> bytes:
        """The upstream legs' headers: content type, request id, the client's (or the
        configured) Authorization."""
        auth = (f"Bearer {self.cfg.api_key}" if self.cfg.api_key
                else request.headers.get("Authorization"))
        h = f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
        if auth:
            h += f"Authorization: {auth}\r\n"
        return h.encode("latin-1", "replace")

    async def serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        m = self.metrics
        endpoint = "chat" if chat else "completions"
        if self.shutting_down:  # a kept-alive client after the listener closed: go elsewhere
            m.request_done(endpoint, "shed")
            resp: web.StreamResponse = self.reject(503, "shutting_down", "proxy is shutting down")
            resp.headers["Connection"] = "close"
            return resp
        limit = self.cfg.max_in_flight
        if limit and m.in_flight >= limit:
            m.request_done(endpoint, "shed")
            return self.reject(503, "max_in_flight", f"proxy is serving its max_in_flight "
                               f"({limit}) requests; retry shortly")
        t0 = _now()
        m.in_flight += 1
        self.idle.clear()
        outcome = "error"
        # The request's trace: joins the client's (W3C traceparent header) when it sent one.
        root = self.tracer.start("kvdisagg.request", valid_traceparent(
            request.headers.get("traceparent")), server=True,
            attributes={"http.route": request.path}) if self.tracer.enabled else None
        try:
            resp, outcome = await self._serve(request, chat, t0, root)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "client_disconnect"
            raise
        finally:
            end(root, outcome=outcome)
            m.in_flight -= 1
            m.request_done(endpoint, outcome)
            if not m.in_flight:
                self.idle.set()

    def reject(self, status: int, reason: str, message: str,
               type_: str = "service_unavailable", retry_after_s: float = 1.0) -> web.Response:
        """Turned away before any leg: counted by reason, with a Retry-After to come back."""
        self.metrics.rejected(reason)
        return error_response(status, message, type_,
                              {"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    async def _serve(self, request: web.Request, chat: bool, t0: float,
                     root: Any) -> tuple[web.StreamResponse, str]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {self.cfg.max_body_bytes} bytes"), \
                "error"
        try:
            body = bodies.parse(raw, chat, self.cfg.policy.prefix_block_chars)
        except BodyError as exc:
            return error_response(400, str(exc)), "error"
        rid = self.request_id(request)
        if root is not None:
            root.set_attribute("kvdisagg.request_id", rid)
        ctx = RequestCtx(rid, body, request.path, self.headers_for(request, rid), t0, root)
        if body.prompts is not None:
            from kvdisagg.proxy.fanout import serve_prompts

            return await serve_prompts(self, request, ctx)
        opened = await self.start(ctx, lead=True)
        if isinstance(opened, web.Response):
            return opened, ("shed" if opened.status == 429 else "error")
        if isinstance(opened, Led):
            return await relay_led(self, request, ctx, opened)
        if ctx.body.stream and 200 <= opened.resp.status < 300:
            return await relay_stream(self, request, ctx, opened)
        return finish_body(self, ctx, opened)

    async def open(self, ctx: RequestCtx, avoid: tuple[Instance, ...] = ()
                   ) -> Opened | web.Response:
        """Decide, prefill if disaggregated, and open a decode leg that answered. ``avoid``:
        decode instances to use only when no other is left (a migrated stream's)."""
        opened = await self.start(ctx, avoid)
        assert not isinstance(opened, Led)  # only when asked for
        return opened

    async def start(self, ctx: RequestCtx, avoid: tuple[Instance, ...] = (),
                    lead: bool = False) -> Opened | Led | web.Response:
        """``open``; ``lead``: a stream may start with prefill's first token instead
        (first_token.py), its decode leg then opened by the relay."""
        ids = await self.token_ids(ctx.body)
        if ids is not None and len(ids) != ctx.body.route.prompt_tokens:
            # The exact length replaces the estimate for every stage: the decision, and the
            # prompt tokens a prefill leg queues (what ``prefill_backlogged`` weighs).
            ctx.body = ctx.body._replace(route=dataclasses.replace(ctx.body.route,
                                                                   prompt_tokens=len(ids)))
        found = None
        if ids is not None and self.cache is not None:
            try:
                found = self.cache.lookup(ids, BlockExtra(
                    lora_name=None, cache_salt=_str(ctx.body.fields.get("cache_salt"))))
                ctx.hits = found.hits
            except ValueError:  # ids the index cannot hold: no prediction
                ctx.hits = {}
        decision = self.decider.decide(ctx.body, ctx.hits, avoid)
        first = (choose_prefill(self, ctx, decode=decision.decode.instance)
                 if decision.route is Route.PD else None)
        # The prompt is being computed where it goes (prefill, or decode alone): until then
        # the index counts it there, so the same prefix arriving meanwhile follows it.
        computing = first.instance if first is not None else decision.decode.instance
        cache = self.cache
        if cache is None or found is None or not isinstance(computing, Instance):
            return await self._open(ctx, decision, first, avoid, lead)
        pending = cache.note_pending(computing.url, found)
        try:
            return await self._open(ctx, decision, first, avoid, lead)
        finally:
            asyncio.get_running_loop().call_later(PENDING_GRACE_S, cache.drop_pending, pending)

    async def _open(self, ctx: RequestCtx, decision: Decision, first: Selection | None,
                    avoid: tuple[Instance, ...], lead: bool) -> Opened | Led | web.Response:
        log.debug("request %s: %s:%s, %d prompt tokens, %d cached on decode %s (threshold %d)",
                  ctx.rid, decision.route.value, decision.reason, ctx.body.route.prompt_tokens,
                  decision.cached_tokens,
                  decision.decode.instance.url if decision.decode.instance else None,
                  decision.threshold)
        if ctx.root is not None:
            ctx.root.set_attributes({"kvdisagg.route": decision.route.value,
                                     "kvdisagg.reason": decision.reason,
                                     "kvdisagg.cached_tokens": decision.cached_tokens,
                                     "kvdisagg.uncached_tokens": decision.uncached_tokens})
        decode = decision.decode
        if first is not None:
            opened = (await early.open_early(self, ctx, decision, first)
                      if not avoid and early.may_open_early(self, ctx) else None)
            if isinstance(opened, Opened):
                self._count(decision, opened.pre)
            if isinstance(opened, Opened | web.Response):
                return opened
            pre = await prefill(self, ctx, first, opened,
                                lead=lead and first_token.wanted(self, ctx.body),
                                decode=decision.decode.instance)
            if isinstance(pre, web.Response):
                return pre
            pre, decode = handoff_decode(self, ctx, pre, decode, avoid)
            if pre.answer:
                led = first_token.lead(self, ctx, pre, decode, avoid)
                if led is not None:
                    self._count(decision, pre)
                    return led
                pre = pre._replace(answer=b"")
        else:
            pre = Prefilled(None, decision.reason, decision.uncached_tokens)
        self._count(decision, pre)
        return await open_decode(self, ctx, pre, decode, avoid)

    def _count(self, decision: Decision, pre: Prefilled) -> None:
        self.metrics.routed("pd" if pre.kv is not None else "decode_only",
                            decision.reason if pre.kv is not None else pre.local_reason)
        if decision.cached_tokens and isinstance(decision.decode.instance, Instance):
            self.metrics.predicted_hit(decision.decode.instance.url, decision.cached_tokens)

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a leg left to finish on its own (an early handoff's prefill leg) until done:
        the loop keeps only weak references to tasks."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def token_ids(self, body: bodies.ClientBody) -> list[int] | None:
        """The prompt's token ids when they matter: sent by the client, or worked out (the
        tokenizer: in process, or vLLM's /tokenize) when the cache index answers for some
        instance; else None (the decision then counts an estimate)."""
        if body.token_ids is not None:
            return body.token_ids
        if body.forwarded_ids is not None:
            return body.forwarded_ids
        if self.cache is None or self.tokenizer is None or not self.cache.answering():
            return None
        decode = self.registry.candidates(Side.DECODE)
        prompts = await self.tokenizer.token_ids(body.fields, body.chat,
                                                 decode[0].pool if decode else None)
        return prompts[0] if prompts is not None and len(prompts) == 1 else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
